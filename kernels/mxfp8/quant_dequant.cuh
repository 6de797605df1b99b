// mx_dequant of kernels/mxfp8/quantize.cu (included there after NTHREADS and the e4m3 helpers are defined): the inverse
// of the row-wise / column-wise quantizers, moe_ep/mxfp8/reference.py dequantize_torch is its specification.
#pragma once

// Dequantization. q: [M, K] e4m3 bytes; rowwise (COLW=0) s: [M, K/32]; columnwise (COLW=1) s: [M/32, K].
// out: [M, K] fp32 (OUT=0) / bf16 (1) / fp16 (2). Each thread handles 16-byte chunks (grid-stride).
template <int OUT, int COLW>
__global__ void __launch_bounds__(NTHREADS) mx_dequant(const unsigned char* __restrict__ q,
                                                        const unsigned char* __restrict__ s,
                                                        unsigned char* __restrict__ out, long long nchunks, int K) {
    for (long long c = blockIdx.x * (long long)NTHREADS + threadIdx.x; c < nchunks;
         c += (long long)gridDim.x * NTHREADS) {
        const long long e0 = c * 16;
        const uint4 d = ld_nc16(q + e0);
        unsigned char sb[16];
        if (COLW) {
            const long long m = e0 / K, k = e0 - m * K;
            const uint4 sv = ld_nc16(s + (m >> 5) * K + k);
            const unsigned sw[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
            for (int i = 0; i < 16; ++i) sb[i] = (unsigned char)(sw[i >> 2] >> (8 * (i & 3)));
        } else {
            const unsigned char b = s[e0 >> 5];
#pragma unroll
            for (int i = 0; i < 16; ++i) sb[i] = b;
        }
        const unsigned dw[4] = {d.x, d.y, d.z, d.w};
        float f[16];
#pragma unroll
        for (int i = 0; i < 8; ++i) mx_e4m3x2_to_f32(dw[i >> 1] >> (16 * (i & 1)), f[2 * i], f[2 * i + 1]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float m = sb[i] == MX_SCALE_NAN ? __uint_as_float(0x7FC00000u) : mx_exp2i((int)sb[i] - 127);
            f[i] = mx_mul(f[i], m);
        }
        if (OUT == 0) {
            uint4* dst = reinterpret_cast<uint4*>(out + e0 * 4);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                dst[i] = make_uint4(__float_as_uint(f[4 * i]), __float_as_uint(f[4 * i + 1]),
                                    __float_as_uint(f[4 * i + 2]), __float_as_uint(f[4 * i + 3]));
        } else {
            unsigned o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = mx_pack16x2<OUT>(f[2 * i], f[2 * i + 1]);
            uint4* dst = reinterpret_cast<uint4*>(out + e0 * 2);
            dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
}
