// Element-level helpers of kernels/mxfp8/quantize.cu: loads, format conversions, SwiGLU forward/backward arithmetic
// (bit for bit as torch on CUDA), block keys and chunk quantization. Included by quantize.cu only (it defines
// the IN_* codes and TILE/NTHREADS first); the host fallbacks let tests/quant_emu.py emulate it on a CPU.
#pragma once

// The asm helpers have host fallbacks only so that tests/quant_emu.py can run this file on the CPU.
__device__ __forceinline__ uint4 ld_nc16(const unsigned char* p) {
    uint4 r;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
#else
    memcpy(&r, p, 16);
#endif
    return r;
}

__device__ __forceinline__ uint2 ld_nc8(const unsigned char* p) {
    uint2 r;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
#else
    memcpy(&r, p, 8);
#endif
    return r;
}

// silu(g) * u in fp32, bit for bit what torch computes for ``F.silu(g.float()) * u.float()`` on CUDA:
// g / (1 + expf(-g)) then one multiply. The adds/divides/multiplies are PTX without .ftz (CuPy compiles with
// -ftz=true); expf's result only enters 1 + e, where a flushed subnormal changes nothing.
__device__ __forceinline__ float mx_swiglu(float g, float u) {
    return mx_mul(mx_div(g, mx_add(1.0f, expf(-g))), u);
}

// 4 gate + 4 up bf16 values (8 bytes each) -> 4 fp32 h words.
__device__ __forceinline__ uint4 swiglu4(uint2 g, uint2 u) {
    const unsigned gw[2] = {g.x, g.y}, uw[2] = {u.x, u.y};
    unsigned h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned gb = i & 1 ? (gw[i >> 1] & 0xFFFF0000u) : (gw[i >> 1] << 16);
        const unsigned ub = i & 1 ? (uw[i >> 1] & 0xFFFF0000u) : (uw[i >> 1] << 16);
        h[i] = __float_as_uint(mx_swiglu(__uint_as_float(gb), __uint_as_float(ub)));
    }
    return make_uint4(h[0], h[1], h[2], h[3]);
}

// swiglu_bwd (moe_ep.experts.reference), op by op as torch evaluates it on CUDA, each result rounded to fp32:
//   sig = 1 / (1 + expf(-g));  dg = (dh * u) * (sig * (1 + g * (1 - sig)));  du = dh * (g * sig).
__device__ __forceinline__ float mx_sigmoid(float g) {
    return mx_div(1.0f, mx_add(1.0f, expf(-g)));
}

// dA's gate value dg and up value du from g, u, dh and sig = mx_sigmoid(g) (one sigmoid serves both).
__device__ __forceinline__ float mx_swiglu_dg(float g, float u, float dh, float sig) {
    return mx_mul(mx_mul(dh, u), mx_mul(sig, mx_add(1.0f, mx_mul(g, mx_add(1.0f, -sig)))));
}
__device__ __forceinline__ float mx_swiglu_du(float g, float dh, float sig) { return mx_mul(dh, mx_mul(g, sig)); }

// Chunk of 4 dA values at column c (c % 4 == 0) of row ``ar`` (a, 2F bf16) / ``dr`` (dh, F bf16 values, widened
// exactly, so dA is that of dh.float()).
__device__ __forceinline__ uint4 swiglu_bwd4(const unsigned char* ar, const unsigned char* dr, int c, int F) {
    const bool gate = c < F;
    const int cf = gate ? c : c - F;
    const uint2 gv = ld_nc8(ar + cf * 2LL);
    const uint2 uv = gate ? ld_nc8(ar + (F + cf) * 2LL) : make_uint2(0u, 0u);
    const uint2 d16 = ld_nc8(dr + cf * 2LL);
    const uint4 dv = make_uint4(d16.x << 16, d16.x & 0xFFFF0000u, d16.y << 16, d16.y & 0xFFFF0000u);
    const unsigned gw[2] = {gv.x, gv.y}, uw[2] = {uv.x, uv.y}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
    unsigned o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float g = __uint_as_float(i & 1 ? (gw[i >> 1] & 0xFFFF0000u) : (gw[i >> 1] << 16));
        const float dh = __uint_as_float(dw[i]);
        const float sig = mx_sigmoid(g);
        float r;
        if (gate) {
            const float u = __uint_as_float(i & 1 ? (uw[i >> 1] & 0xFFFF0000u) : (uw[i >> 1] << 16));
            r = mx_swiglu_dg(g, u, dh, sig);
        } else {
            r = mx_swiglu_du(g, dh, sig);
        }
        o[i] = __float_as_uint(r);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// fp16 bits -> fp32 (exact).
__device__ __forceinline__ float mx_h2f(unsigned h) {
#if defined(__CUDA_ARCH__)
    float f;
    unsigned short hs = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(hs));
    return f;
#else
    const unsigned sign = (h & 0x8000u) << 16, ex = (h >> 10) & 31u, m = h & 1023u;
    float v;
    if (ex == 31u) v = m ? __uint_as_float(0x7FC00000u) : __uint_as_float(0x7F800000u);
    else if (ex == 0u) v = (float)m * (1.0f / 16777216.0f);
    else v = __uint_as_float(((ex + 112u) << 23) | (m << 13));
    return __uint_as_float(__float_as_uint(v) | sign);
#endif
}

// Two e4m3 bytes (lo in bits 0..7) -> two fp32 (exact).
__device__ __forceinline__ void mx_e4m3x2_to_f32(unsigned pair, float& lo, float& hi) {
#if defined(__CUDA_ARCH__)
    unsigned h2;
    const unsigned short p16 = (unsigned short)pair;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(p16));
    lo = mx_h2f(h2 & 0xFFFFu);
    hi = mx_h2f(h2 >> 16);
#else
    lo = mx_e4m3_to_f32_soft(pair & 0xFFu);
    hi = mx_e4m3_to_f32_soft((pair >> 8) & 0xFFu);
#endif
}

// Two fp32 -> packed bf16x2 (OUT=1) or f16x2 (OUT=2), round-to-nearest-even, lo in bits 0..15.
template <int OUT>
__device__ __forceinline__ unsigned mx_pack16x2(float lo, float hi) {
    unsigned r;
#if defined(__CUDA_ARCH__)
    if (OUT == 1) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    unsigned h[2];
    const float f[2] = {lo, hi};
    for (int i = 0; i < 2; ++i) {
        const unsigned x = __float_as_uint(f[i]), sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
        if (OUT == 1) {
            h[i] = a > 0x7F800000u ? (sign | 0x7FC0u) : (sign | ((a + 0x7FFFu + ((a >> 16) & 1u)) >> 16));
        } else if (a > 0x7F800000u) {
            h[i] = sign | 0x7E00u;
        } else if (a >= 0x477FF000u) {
            h[i] = sign | 0x7C00u;
        } else if (a >= 0x38800000u) {
            const unsigned t = a - (112u << 23);
            h[i] = sign | ((t + 0xFFFu + ((t >> 13) & 1u)) >> 13);
        } else {
            h[i] = sign | (unsigned)rintf(__uint_as_float(a) * 16777216.0f);
        }
    }
    r = h[0] | (h[1] << 16);
#endif
    return r;
}

// Element c (0 or 1) of a 32-bit word of 16-bit values, or the word itself for fp32, as fp32 (exact).
// Inputs whose staged 32-bit words are fp32 values (fp32 itself, and SwiGLU's h computed at load time).
template <int IN> __host__ __device__ constexpr bool mx_w32() {
    return IN == IN_F32 || IN == IN_SWIGLU || IN == IN_SWIGLU_BWD16;
}

template <int IN>
__device__ __forceinline__ float word_elem(unsigned w, int c) {
    if (mx_w32<IN>()) return __uint_as_float(w);
    if (IN == IN_BF16) return __uint_as_float(c ? (w & 0xFFFF0000u) : (w << 16));
    return mx_h2f(c ? (w >> 16) : (w & 0xFFFFu));
}

// |v| as an integer key ordered like floats; a key >= BAD means NaN/Inf.
template <int IN> struct Key;
template <> struct Key<IN_F32> {
    static constexpr unsigned BAD = 0x7F800000u;
    static __device__ __forceinline__ unsigned of_word(unsigned acc, unsigned w) { return max(acc, w & 0x7FFFFFFFu); }
    static __device__ __forceinline__ unsigned lane(unsigned acc, int) { return acc; }
    static __device__ __forceinline__ float to_float(unsigned k) { return __uint_as_float(k); }
};
template <> struct Key<IN_BF16> {
    static constexpr unsigned BAD = 0x7F80u;
    static __device__ __forceinline__ unsigned of_word(unsigned acc, unsigned w) { return __vmaxu2(acc, w & 0x7FFF7FFFu); }
    static __device__ __forceinline__ unsigned lane(unsigned acc, int c) { return c ? (acc >> 16) : (acc & 0xFFFFu); }
    static __device__ __forceinline__ float to_float(unsigned k) { return __uint_as_float(k << 16); }
};
template <> struct Key<IN_SWIGLU> : Key<IN_F32> {};
template <> struct Key<IN_SWIGLU_BWD16> : Key<IN_F32> {};
template <> struct Key<IN_F16> {
    static constexpr unsigned BAD = 0x7C00u;
    static __device__ __forceinline__ unsigned of_word(unsigned acc, unsigned w) { return __vmaxu2(acc, w & 0x7FFF7FFFu); }
    static __device__ __forceinline__ unsigned lane(unsigned acc, int c) { return c ? (acc >> 16) : (acc & 0xFFFFu); }
    static __device__ __forceinline__ float to_float(unsigned k) { return mx_h2f(k); }
};

// Key of a 16-byte chunk (all its elements).
template <int IN>
__device__ __forceinline__ unsigned chunk_key(uint4 v) {
    unsigned a = Key<IN>::of_word(0u, v.x);
    a = Key<IN>::of_word(a, v.y);
    a = Key<IN>::of_word(a, v.z);
    a = Key<IN>::of_word(a, v.w);
    if (mx_w32<IN>()) return a;
    return max(a & 0xFFFFu, a >> 16);
}

// Quantize the 4 words of a chunk with multiplier s: 8 bytes (16-bit inputs) in .x/.y or 4 bytes (fp32) in .x.
template <int IN>
__device__ __forceinline__ uint2 quant_chunk(uint4 v, float s) {
    uint2 o;
    if (mx_w32<IN>()) {
        o.x = mx_cvt4_e4m3(mx_mul(__uint_as_float(v.x), s), mx_mul(__uint_as_float(v.y), s),
                           mx_mul(__uint_as_float(v.z), s), mx_mul(__uint_as_float(v.w), s));
        o.y = 0u;
    } else {
        o.x = mx_cvt4_e4m3(mx_mul(word_elem<IN>(v.x, 0), s), mx_mul(word_elem<IN>(v.x, 1), s),
                           mx_mul(word_elem<IN>(v.y, 0), s), mx_mul(word_elem<IN>(v.y, 1), s));
        o.y = mx_cvt4_e4m3(mx_mul(word_elem<IN>(v.z, 0), s), mx_mul(word_elem<IN>(v.z, 1), s),
                           mx_mul(word_elem<IN>(v.w, 0), s), mx_mul(word_elem<IN>(v.w, 1), s));
    }
    return o;
}

// Column c (< words' elements) of a 32-row block of staged words v[0..31] (one word per row), quantized with
// multiplier s: 8 words of 4 e4m3 bytes, rows in order (bad: the e4m3 NaN pattern).
template <int IN>
__device__ __forceinline__ void quant_col32(const unsigned* v, int c, float s, bool bad, unsigned* q) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        q[j] = bad ? 0x7F7F7F7Fu
                   : mx_cvt4_e4m3(mx_mul(word_elem<IN>(v[4 * j], c), s), mx_mul(word_elem<IN>(v[4 * j + 1], c), s),
                                  mx_mul(word_elem<IN>(v[4 * j + 2], c), s), mx_mul(word_elem<IN>(v[4 * j + 3], c), s));
    }
}

// Offset of scale (r, c) inside one 128x4 tile.
__device__ __forceinline__ int tile_off(int r, int c) { return (r & 31) * 16 + (r >> 5) * 4 + c; }
