// Weight preparation for the fprop / dgrad GEMM (kernels/grouped_gemm.cu; launcher moe_ep/experts/operands.py
// prepare_weight_bf16, reference prepare_weight_bf16_torch): MXFP8 weight e4m3 [G, N, K] + blocked scales -> exact
// bf16 [G, N, Kp] (Kp = K rounded up to 64, zero padded), each 64-wide k block stored in the GEMM kernels' permuted
// k order: logical position 16 s + 8 h + 2 c + e holds physical column 16 c + 4 s + 2 h + e.
//
//   * one thread = one 16-byte chunk c (physical columns 16 c .. 16 c + 15 of a 64-block: one 32-block, one scale
//     byte) of one row; quads of lanes hold the 4 chunks of one (row, 64-block). cvt16 (the GEMM kernels' exact
//     conversion) gives words o[q] = physical columns 16 c + 2 q, + 1, whose logical place is byte 16 q + 4 c of
//     the 128-byte output block. So for each half (q = 4 m + i) the quad holds a 4 x 4 matrix of words w[c][i]
//     that belongs at byte 16 (4 m + i) + 4 c: after quad_transpose4, lane c holds 16 contiguous bytes at
//     16 (4 m + c). Two 16-byte stores per thread, reads of 16 bytes: the pass is memory bound.
//   * chunks past K (K % 64 == 32) are written as zeros; a warp walks whole quads, and the loop bound is uniform
//     per warp (the shuffles need all 32 lanes), stores are masked.

#include "gemm_common.cuh"

// w: [G * N, K] e4m3 rows; ws: [G, bsz] blocked scales (bsz = blocked_size(N, K / 32)); out: [G * N, Kp] bf16.
extern "C" __global__ void __launch_bounds__(256) mx_prepare_weight_bf16(const unsigned char* __restrict__ w,
                                                                          const unsigned char* __restrict__ ws,
                                                                          unsigned short* __restrict__ out, int G,
                                                                          int N, int K, long long bsz) {
    const int nblk = (K + 63) >> 6, tpr = ((K >> 5) + 3) >> 2;
    const long long total = (long long)G * N * nblk * 4;  // chunks, a multiple of 4: quads never straddle the end
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31, c = lane & 3;
    for (long long base = (long long)blockIdx.x * blockDim.x + (threadIdx.x & ~31); base < total; base += stride) {
        const long long idx = base + lane;
        const bool valid = idx < total;
        const long long rb = idx >> 2;  // (row, block)
        const long long row = rb / nblk;
        const int b = (int)(rb - row * nblk);
        const int k0 = b * 64 + 16 * c;
        unsigned o[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (valid && k0 < K) {
            const int g = (int)(row / N), n = (int)(row - (long long)g * N), kb = k0 >> 5;
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(w + row * K + k0));
            const unsigned s =
                ws[(long long)g * bsz + ((long long)(n >> 7) * tpr + (kb >> 2)) * 512 + (n & 31) * 16 +
                   ((n >> 5) & 3) * 4 + (kb & 3)];
            cvt16(raw, s, o);
        }
        quad_transpose4(o);
        quad_transpose4(o + 4);
        if (valid) {
            uint4* dst = reinterpret_cast<uint4*>(out + row * (long long)(nblk * 64) + b * 64);
            dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[4 + c] = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
}
