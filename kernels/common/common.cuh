// MXFP8 block math shared by the kernels (docs/design.md, "MXFP8 format" is the contract,
// moe_ep/mxfp8/reference.py the spec).
//
// Everything here is __host__ __device__ and header-only so that it also compiles as plain C++ (g++) for the
// CPU bit-exactness tests in tests/test_quant_hostmath.py. No host headers under NVRTC.
#pragma once

#if defined(__CUDACC__)
#define MX_HD __host__ __device__ __forceinline__
#else
#define MX_HD inline
#include <math.h>
#include <string.h>
#endif

#define MX_E4M3_MAX 448.0f
#define MX_SCALE_NAN 0xFFu
#define MX_E4M3_NAN 0x7Fu

MX_HD unsigned mx_f2u(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

MX_HD float mx_u2f(unsigned u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// Exact fp32 2**e for integer e in [-127, 127] (2**-127 is the subnormal 0x00400000).
MX_HD float mx_exp2i(int e) {
    return e >= -126 ? mx_u2f((unsigned)(e + 127) << 23) : mx_u2f(1u << 22);
}

// Device arithmetic is written as PTX without .ftz: CuPy compiles with -ftz=true, and subnormal inputs
// (fp32 and bf16 have them) must keep their value exactly as in the reference. One fp32 operation, rounded to
// nearest, on the device as the named PTX instruction and on the host (the CPU emulator) as the C operator.
#if defined(__CUDA_ARCH__)
#define MX_FP32_OP(name, ptx, op)                                       \
    MX_HD float name(float a, float b) {                                \
        float r;                                                        \
        asm(ptx " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));             \
        return r;                                                       \
    }
#else
#define MX_FP32_OP(name, ptx, op) \
    MX_HD float name(float a, float b) { return a op b; }
#endif
MX_FP32_OP(mx_mul, "mul.rn.f32", *)
MX_FP32_OP(mx_add, "add.rn.f32", +)
MX_FP32_OP(mx_div, "div.rn.f32", /)  // IEEE division (torch's sigmoid and silu on CUDA)
#undef MX_FP32_OP

// Clamp to [-448, 448] (NaN-free input).
MX_HD float mx_clamp448(float v) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("max.f32 %0, %1, 0fC3E00000;" : "=f"(r) : "f"(v));
    asm("min.f32 %0, %1, 0f43E00000;" : "=f"(r) : "f"(r));
    return r;
#else
    return fminf(fmaxf(v, -MX_E4M3_MAX), MX_E4M3_MAX);
#endif
}

// amax / 448 with one IEEE round-to-nearest-even division (never a reciprocal multiply, no flush).
MX_HD float mx_div448(float amax) { return mx_div(amax, MX_E4M3_MAX); }

// Smallest E with 2**E >= d for finite d >= 0, clamped to [-127, 127]; read off the fp32 bits (exact).
MX_HD int mx_ceil_log2(float d) {
    unsigned bits = mx_f2u(d);
    int ex = (int)((bits >> 23) & 0xFFu);
    unsigned mant = bits & 0x7FFFFFu;
    int e;
    if (ex == 0) {
        e = mant > (1u << 22) ? -126 : -127;
    } else {
        e = ex - 127 + (mant != 0 ? 1 : 0);
    }
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// The specification's block exponent, literally: E = ceil_log2(fl(amax / 448)) (one IEEE division). Kept as
// the host-side reference of mx_block_exp (tests/test_quant_hostmath.py compares them on every fp32 key).
MX_HD int mx_block_exp_div(float amax) { return mx_ceil_log2(mx_div448(amax)); }

// Block exponent E from the largest |v| of a finite block (amax >= 0). Scale byte = E + 127.
// Equal to mx_block_exp_div for every finite amax, with integer operations only (the IEEE division with its
// slow-path branch and the exponent extraction were a large share of the issue-bound row quantizer's
// instructions: docs/performance.md). Why it is exact: 448 = 1.75 * 2**8, and
// fl(amax / 448) <= 2**E holds exactly when amax <= 448 * 2**E as long as the quotient is a normal number (the
// next float above 448 * 2**E is 2**(E-15) away, i.e. its quotient is more than half an ulp of 2**E above it).
// The smallest such E is then (biased exponent of amax) - 135, plus 1 when the mantissa exceeds 1.75 (0x600000):
// adding 0x1FFFFF carries into the exponent field exactly then. Quotients below 2**-126 (subnormal, fixed ulp
// 2**-149) only decide between -127 and -126, and only one amax rounds down onto 2**-127 although it exceeds
// 448 * 2**-127: 0x04600001 (1.75 * 2**-119 + 2**-142, quotient 2**-127 + 0.875 * 2**-150).
MX_HD int mx_block_exp(float amax) {
    const unsigned k = mx_f2u(amax);
    const int e = (int)((k + 0x1FFFFFu) >> 23) - 135 - (k == 0x04600001u ? 1 : 0);
    return e < -127 ? -127 : e;  // at most 120 for a finite amax
}

// The block exponent of a bf16 amax key k (|v| bits, k < 0x7F80: finite) in the form both outputs need:
// t = max((k + 31) >> 7, 8), so that E = t - 135, the scale byte is t - 8 and 2**-E has the fp32 exponent
// field 262 - t (in [7, 254]: always normal). Equal to mx_block_exp(k as fp32): with the fp32 bits k << 16,
// ((k << 16) + 0x1FFFFF) >> 23 == (k + 31) >> 7 (the low 16 bits are zero, so 0x1FFFFF adds 31 and a carry-free
// fraction), and mx_block_exp's one exceptional key 0x04600001 is not a bf16 value. Checked on all 32640 finite
// keys (tests/test_quant_hostmath.py). Used by kernels/mxfp8/quant_dual.cuh.
MX_HD unsigned mx_bf16_block_t(unsigned k) {
    const unsigned t = (k + 31u) >> 7;
    return t < 8u ? 8u : t;
}

// Software float -> e4m3 (RNE, saturating to +-448, subnormals, signed zero). Input must not be NaN.
// Used on the host (the CPU tests and the kernel emulator); the device uses the hardware conversion.
MX_HD unsigned mx_f32_to_e4m3_soft(float q) {
    unsigned bits = mx_f2u(q);
    unsigned sign = (bits >> 24) & 0x80u;
    unsigned a = bits & 0x7FFFFFFFu;
    unsigned code;
    if (a >= 0x43E00000u) {  // |q| >= 448 (or inf): saturate
        code = 0x7Eu;
    } else if (a < 0x3C800000u) {  // |q| < 2**-6: subnormal range, value = m * 2**-9, m in [0, 8]
        float m = rintf(mx_mul(mx_u2f(a), 512.0f));  // exact scaling by 2**9, then RNE to an integer
        code = (unsigned)m;                  // m == 8 is the smallest normal, whose code is also 8
    } else {  // normal: keep 3 mantissa bits with RNE (carry may bump the exponent)
        unsigned r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
        code = r - (120u << 3);
        if (code > 0x7Eu) code = 0x7Eu;
    }
    return sign | code;
}

// e4m3 byte -> fp32 (exact). 0x7F / 0xFF are NaN.
MX_HD float mx_e4m3_to_f32_soft(unsigned b) {
    unsigned ex = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (ex == 15u && m == 7u) {
        v = mx_u2f(0x7FC00000u);
    } else if (ex == 0u) {
        v = mx_mul((float)m, 1.0f / 512.0f);
    } else {
        v = mx_mul((float)(8u + m), mx_exp2i((int)ex - 10));
    }
    return (b & 0x80u) ? -v : v;
}

// Two floats -> two e4m3 bytes packed (lo in bits 0..7), round to nearest even, saturating to +-448.
// The hardware conversion needs no clamp: .satfinite maps every finite value and +-Inf beyond 448 to +-448,
// which is what the clamp did (the quantizers' scaled values never exceed 448 anyway, since 448 * 2**E >= amax).
// Only NaN differs (clamp: -448, satfinite: NaN), and every caller overwrites NaN/Inf blocks with 0x7F bytes.
// Dropping the two min/max per value saves instructions of the issue-bound quantizers. The software conversion
// keeps the clamp: it requires a NaN-free input within +-448.
MX_HD unsigned mx_cvt2_e4m3(float lo, float hi) {
#if defined(__CUDA_ARCH__)
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (unsigned)r;
#else
    return mx_f32_to_e4m3_soft(mx_clamp448(lo)) | (mx_f32_to_e4m3_soft(mx_clamp448(hi)) << 8);
#endif
}

// Four floats -> four e4m3 bytes in one 32-bit word (a in bits 0..7).
MX_HD unsigned mx_cvt4_e4m3(float a, float b, float c, float d) {
    return mx_cvt2_e4m3(a, b) | (mx_cvt2_e4m3(c, d) << 16);
}

// Reference of one whole block, exactly as the kernels compose it: v[32] fp32 -> q[32] bytes, returns scale.
MX_HD unsigned mx_quantize_block(const float* v, unsigned char* q) {
    unsigned key = 0;  // max of |v| as integer bits: ordered like floats, NaN/Inf >= 0x7F800000
    for (int i = 0; i < 32; ++i) {
        unsigned a = mx_f2u(v[i]) & 0x7FFFFFFFu;
        key = a > key ? a : key;
    }
    if (key >= 0x7F800000u) {
        for (int i = 0; i < 32; ++i) q[i] = (unsigned char)MX_E4M3_NAN;
        return MX_SCALE_NAN;
    }
    int e = mx_block_exp(mx_u2f(key));
    float s = mx_exp2i(-e);
    for (int i = 0; i < 32; i += 2) {
        unsigned p = mx_cvt2_e4m3(mx_mul(v[i], s), mx_mul(v[i + 1], s));
        q[i] = (unsigned char)(p & 0xFFu);
        q[i + 1] = (unsigned char)(p >> 8);
    }
    return (unsigned)(e + 127);
}

// cp.async: 16-byte global -> shared copies (zero-filled when !ok), their groups and waits. The host build (the
// CPU emulation of the kernels in tests/) copies synchronously.
MX_HD void cp_async16(unsigned char* smem_dst, const unsigned char* src, bool ok) {
#if defined(__CUDA_ARCH__)
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
#else
    if (ok) memcpy(smem_dst, src, 16);
    else memset(smem_dst, 0, 16);
#endif
}

MX_HD void cp_async_commit() {
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N> MX_HD void cp_async_wait() {
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
