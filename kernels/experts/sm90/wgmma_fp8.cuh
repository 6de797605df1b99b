#pragma once

// FP8 (e4m3 x e4m3 -> fp32) wgmma pieces of the blockwise grouped GEMMs (kernels/experts/sm90/blockwise_gemm.cu:
// fprop / dgrad; the recipe's wgrad runs on the bf16 kernel grouped_gemm_wgrad.cu): the m64n128k32 instruction with both operands in shared memory
// (K-major, 128-byte swizzle: one 128-byte row = 128 e4m3 = exactly one scale block of K), the E8M0 scale decode,
// and the register pinning around the per-block promotion. The TMA maps, the mbarrier ring, register reallocation
// and the group scan are the MXFP8 kernels' (gemm_wgmma.cuh, gemm_common.cuh).

#include "gemm_wgmma.cuh"

// d[64] (a 64 x 128 fp32 tile, D layout of wgmma: register 4 j + 2 h + e = row 16 q + lane / 4 + 8 h, column
// 8 j + 2 (lane % 4) + e) = (acc ? d : 0) + A(64 x 32, smem desc da) x B(128 x 32, smem desc db)^T, e4m3 operands,
// both K-major. FP8 wgmma has no transpose flags: K-major only.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, unsigned long long da, unsigned long long db,
                                                      unsigned acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_ACC64_STR "}, %64, %65, p, 1, 1;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// Keeps the compiler from moving accesses of the 64 registers d across this point (an accumulator that an MMA in
// flight writes: pinned right after the wait that retires it).
__device__ __forceinline__ void pin_acc64(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// E8M0 byte -> fp32 scale 2**(s - 127), exactly: s = 1 .. 254 are normal floats (exponent field s), s = 0 is
// 2**-127, a subnormal (mantissa bit 22), s = 255 marks a block that held NaN / Inf: NaN, so that every output the
// block feeds is NaN.
__device__ __forceinline__ float e8m0_f32(unsigned s) {
    const unsigned bits = s == 0u ? 0x00400000u : (s == 255u ? 0x7FC00000u : s << 23);
    return __uint_as_float(bits);
}

// Non-coherent byte load through the read-only path (operands that no kernel of the launch writes).
__device__ __forceinline__ unsigned ldg_u8(const unsigned char* p) {
    unsigned v;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
