// Tensor-core rate probe for the fp8 question of DESIGN 5.3 (not used by the library; benchmarks/prof_wgmma_rate.py).
// Operands sit in shared memory (their values do not matter for the rate); each CTA = 2 warpgroups, each issuing
// m64n128 MMAs over ITERS k32 steps against its own 64-row A tile and a shared 128-row B tile:
//   MODE 0  bf16: 2 x wgmma.m64n128k16 per k32 into one accumulator (what the bf16 kernels run)
//   MODE 1  fp8, exact MXFP8 promotion per 32: wgmma.m64n128k32.e4m3 into a fresh partial (2 buffers, the MMA of
//           step s overlaps the promotion of step s - 1), then acc += partial * 2^(ea[row] + eb[col]) per element
//           (the row and column scale exponents of the step read from shared memory, the power of two built with
//           an integer add and a shift: 3 instructions per element)
//   MODE 2  fp8 accumulating straight into one accumulator (no promotion): the fp8 upper bound
//   MODE 3  hybrid: warpgroup 0 runs MODE 1, warpgroup 1 runs MODE 0 (the "mix" of DESIGN 5.3)
// out receives the accumulators (so nothing is optimized away); cycles[blockIdx.x] the clock64 span of the loop.

#define WG_NO_KERNELS
#include "grouped_gemm_wgmma.cu"

__device__ __forceinline__ void mma_bf16_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_STR "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void mma_fp8_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_ACC64_STR "}, %64, %65, p, 1, 1;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// MODE 1 promotion of one partial: 64 values of rows r0, r0 + 8 (h = (i / 2) % 2), columns 8 j + 2 c + e (i = 4 j +
// 2 h + e); exponent bytes: ea[2] for the two rows, eb[32] for the thread's columns (j, e).
__device__ __forceinline__ void promote(float* acc, const float* part, const int* ea, const unsigned char* eb) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int j = i >> 2, h = (i >> 1) & 1, e = i & 1;
        const float s = __int_as_float((ea[h] + (int)eb[2 * j + e]) << 23);
        acc[i] = fmaf(part[i], s, acc[i]);
    }
}

__device__ __forceinline__ void pin64(float* r) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// the 32 column exponents of lane c for step parity j (two 16-byte shared loads)
__device__ __forceinline__ void load_eb(const unsigned char* ebt, int c, int j, unsigned char* eb) {
    *reinterpret_cast<uint4*>(eb) = *reinterpret_cast<const uint4*>(ebt + 128 * j + 32 * c);
    *reinterpret_cast<uint4*>(eb + 16) = *reinterpret_cast<const uint4*>(ebt + 128 * j + 32 * c + 16);
}

template <int MODE>
__device__ __forceinline__ void rate_loop(float* out, long long* cycles, int iters) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned sbase = smem_u32(smem);
    const int tid = threadIdx.x, wg = tid >> 7, c = tid & 3;
    // A: 2 tiles of 64 rows x 128 B, B: 128 rows x 128 B (SW128 K-major); exponent tables after them
    const unsigned long long da = wg_desc(sbase + 8192u * (unsigned)wg), db = wg_desc(sbase + 16384u);
    unsigned char* ebt = smem + 32768;  // [2 steps][4 lanes c][32] column exponents
    for (int i = tid; i < 32768 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(smem)[i] = 0x3C3C3C3Cu ^ i;
    for (int i = tid; i < 256; i += blockDim.x) ebt[i] = (unsigned char)(i & 7);
    __syncthreads();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    const long long t0 = clock64();
    const bool fp8_promoted = MODE == 1 || (MODE == 3 && wg == 0);
    unsigned char eb_r[32];
    if (fp8_promoted) {
        float p0[64], p1[64];
        int ea[2] = {1, 2};
        // step 0 into p0; then per pair: issue s + 1 into p1, promote p0 (step s); issue s + 2 into p0, promote p1
        wg_fence();
        mma_fp8_n128(p0, da, db, 0);
        wg_commit();
        for (int s = 0; s < iters; s += 2) {
            wg_fence();
            mma_fp8_n128(p1, da + 2 * ((s + 1) & 3), db + 2 * ((s + 1) & 3), 0);
            wg_commit();
            wg_wait<1>();  // step s (p0) done
            pin64(p0);
            load_eb(ebt, c, 0, eb_r);
            promote(acc, p0, ea, eb_r);
            wg_fence();
            mma_fp8_n128(p0, da + 2 * ((s + 2) & 3), db + 2 * ((s + 2) & 3), 0);
            wg_commit();
            wg_wait<1>();  // step s + 1 (p1) done
            pin64(p1);
            load_eb(ebt, c, 1, eb_r);
            promote(acc, p1, ea, eb_r);
            ea[0] ^= 1;
        }
        wg_wait<0>();  // the extra step issued last is not counted (its promotion is skipped)
        pin64(p0);
    } else if (MODE == 2) {
        for (int s = 0; s < iters; ++s) {
            wg_fence();
            mma_fp8_n128(acc, da + 2 * (s & 3), db + 2 * (s & 3), 1);
            wg_commit();
            wg_wait<1>();
        }
        wg_wait<0>();
    } else {  // bf16 (MODE 0, or warpgroup 1 of MODE 3)
        for (int s = 0; s < iters; ++s) {
            wg_fence();
            mma_bf16_n128(acc, da + 4 * (s & 1), db + 4 * (s & 1), 1);
            mma_bf16_n128(acc, da + 4 * (s & 1) + 2, db + 4 * (s & 1) + 2, 1);
            wg_commit();
            wg_wait<1>();
        }
        wg_wait<0>();
    }
    const long long t1 = clock64();
#pragma unroll
    for (int i = 0; i < 64; ++i) out[((long long)blockIdx.x * blockDim.x + tid) * 64 + i] = acc[i];
    if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

extern "C" __global__ void __launch_bounds__(256, 1) rate_bf16(float* out, long long* cycles, int iters) {
    rate_loop<0>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_fp8_promoted(float* out, long long* cycles, int iters) {
    rate_loop<1>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_fp8_plain(float* out, long long* cycles, int iters) {
    rate_loop<2>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_hybrid(float* out, long long* cycles, int iters) {
    rate_loop<3>(out, cycles, iters);
}
