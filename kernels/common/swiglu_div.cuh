// The branch-free division of the SwiGLU quantizers (kernels/mxfp8/quant_swiglu.cuh mx_swiglu_dual and
// kernels/blockwise/quant_blockwise_swiglu.cuh bw_swiglu) and the input domain where it equals IEEE div.rn.
// Included by both; needs common.cuh's definitions (included before it). The host paths exist for the CPU emulators.
#pragma once

// x / d rounded as div.rn.f32, without its slow-path branch: the fast path the compiler emits for div.rn.f32
// (MUFU.RCP, one Newton step, the quotient and one fma correction; its FCHK then decides whether the slow path must
// redo it). Used only for x = g and x = 1 over d = 1 + expf(-g) with g in SwdDomain's range, where it equals
// div.rn: checked on the GPU for every bf16 g of the range (tests/test_quant_dual_cuda.py builds a check kernel beside
// kernels/mxfp8/quant_swiglu.cuh).
// Why: every IEEE division is its own branch region (FCHK, a CALL to the slow path, BSSY/BSYNC), so the 64 SwiGLU
// elements of a thread could not be interleaved and the kernel stalled on one element's chain at a time. The host
// build (the CPU emulator) divides exactly.
__device__ __forceinline__ float swd_div(float x, float d) {
#if defined(__CUDA_ARCH__)
    float r, t, q, rem, res;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    asm("fma.rn.f32 %0, %1, %2, 0f3F800000;" : "=f"(t) : "f"(-d), "f"(r));
    asm("fma.rn.f32 %0, %1, %2, %1;" : "=f"(r) : "f"(r), "f"(t));
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(x), "f"(r));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(rem) : "f"(-d), "f"(q), "f"(x));
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(res) : "f"(r), "f"(rem), "f"(q));
    return __float_as_uint(x) << 1 ? res : x;  // the correction turns -0 into +0; x / d keeps a zero's sign
#else
    return x / d;
#endif
}

// Where swd_div stands for div.rn, on bf16 |g| bits a (16-bit halves of a word, as the kernel sees them): a <= 69.0
// (0x428A; d = 1 + expf(-g) <= 2**100, so the reciprocal stays normal), and in the forward, which divides g itself,
// also g zero or |g| >= 2**-100 (0x0D80). The lower bound is a margin, not a need: the quotient is exact for every
// |g| <= 80 on the GPU, subnormals included. NaN and Inf are outside both. State per
// thread, over 2 bf16 per word: amax = max a, cmin = min of ((a | 0x8000) - 1) ^ 0x8000 per half (0xFFFF for a = 0,
// a - 1 otherwise: "a in [1, 0x0D7F]" is cmin < 0x0D7F).
struct SwdDomain {
    unsigned amax = 0u, cmin = 0xFFFFFFFFu;
    __device__ __forceinline__ void add(unsigned w) {
        const unsigned a = w & 0x7FFF7FFFu;
        amax = __vmaxu2(amax, a);
        cmin = __vminu2(cmin, ((a | 0x80008000u) - 0x00010001u) ^ 0x80008000u);
    }
    __device__ __forceinline__ void add(uint4 c) {  // a 16-byte chunk: 8 bf16
        add(c.x);
        add(c.y);
        add(c.z);
        add(c.w);
    }
    __device__ __forceinline__ bool ok(bool fwd) const {
        const bool big = max(amax & 0xFFFFu, amax >> 16) > 0x428Au;
        const bool tiny = min(cmin & 0xFFFFu, cmin >> 16) < 0x0D7Fu;
        return !big && !(fwd && tiny);
    }
};
