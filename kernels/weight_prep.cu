// Weight preparation for the fprop / dgrad GEMM (kernels/grouped_gemm.cu; launcher moe_ep/experts/operands.py
// prepare_weight_bf16, reference prepare_weight_bf16_torch): MXFP8 weight e4m3 [G, N, K] + blocked scales -> exact bf16 [G, N, Kp] (Kp = K
// rounded up to 64, zero padded), each 64-wide k block stored in the GEMM kernels' permuted k order: logical
// position 16 s + 8 h + 2 c + e holds physical column 16 c + 4 s + 2 h + e.
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

// ---------------------------------------------------------------------------------------------------------
// Activation preparation for the wgrad kernel (kernels/grouped_gemm_wgrad.cu; launcher moe_ep/experts/operands.py
// prepare_colwise_bf16, reference prepare_colwise_bf16_torch): a wgrad operand in the grouped column-wise MXFP8 format (data [M, C] e4m3 in its
// own row order, scales [ceil(M/32) + G, C] where block j of group g is scale row boff_g + j) -> exact bf16
// [64 (ceil(M/64) + G), C] in which group g occupies rows 64 poff_g .. (poff_g = sum_{h<g} ceil(n_h / 64)), zero
// padded to a multiple of 64 rows: the GEMM reduces over whole 64-row steps of one group. Rows past the last
// group are not written (the GEMM never reads them into an MMA).
//
//   * one warp per padded 32-row block pb and 1024 columns: it finds the block's group (gm_scan_groups by padded
//     32-row block, GM_BY_PAD32; 2 ceil(n / 64) blocks per group), then converts
//     8 columns per lane: 8 data bytes per row, the 8 scale bytes of the block's scale row (per-column scales:
//     pair_mults8), one 16-byte store per row. Padding blocks are zeros. The pass is bandwidth-bound.
// ---------------------------------------------------------------------------------------------------------
struct BlockGroup {
    long long row0;  // first data row of the block; -1: the block belongs to no group
    int rows;        // valid rows of the block (0: a padding block of zeros)
    int srow;        // its scale row
};

// The group of padded 32-row block pb (gm_scan_groups by GM_BY_PAD32, one warp): its j-th block (j = gi.tile) holds
// data rows row0_g + 32 j .., as many of the group's rows (clamped to M) as remain, and has scale row boff_g + j.
__device__ __forceinline__ void colwise_block_group(const int* __restrict__ sizes, int G, long long M, int pb,
                                                    GroupInfo* gi, BlockGroup* bg) {
    gm_scan_groups(sizes, G, M, GM_BY_PAD32, pb, gi);
    __syncwarp();
    if (gi->g < 0) {
        bg->row0 = -1;
        bg->rows = 0;
        bg->srow = 0;
        return;
    }
    const int j = gi->tile;
    bg->row0 = gi->row0 + 32LL * j;
    bg->rows = max(0, min(32, gi->rows - 32 * j));
    bg->srow = gi->boff + j;
}

// data: [M, C] e4m3; scale: [>= ceil(M/32) + G, C] u8; out: [64 (ceil(M/64) + G), C] bf16. One warp per (padded
// 32-row block pb, 1024 columns) (8 warps per CTA, no block-wide barrier): the warp finds the block's group, then
// walks its columns 256 at a time (lane: 8 columns; the 8 scale bytes once per 256) and the 32 rows 4 at a time
// (4 independent 8-byte loads in flight per lane). wid: the warp's index in the operand's grid of warps.
__device__ __forceinline__ void prep_colwise_warp(const unsigned char* __restrict__ data,
                                                  const unsigned char* __restrict__ scale,
                                                  const int* __restrict__ sizes, unsigned short* __restrict__ out,
                                                  int G, long long M, int C, int nblocks, int wid, GroupInfo* gi) {
    const int lane = threadIdx.x & 31;
    const int ncc = (C + 1023) >> 10;
    const int pb = wid / ncc, c0 = (wid - pb * ncc) * 1024;
    if (pb >= nblocks) return;
    BlockGroup bg;
    colwise_block_group(sizes, G, M, pb, gi, &bg);
    if (bg.row0 < 0) return;
    unsigned short* ob = out + (long long)pb * 32 * C;
    const int c1 = C < c0 + 1024 ? C : c0 + 1024;
    for (int col = c0 + lane * 8; col < c1; col += 256) {
        unsigned m[4] = {0u, 0u, 0u, 0u};
        bool fast = true;
        if (bg.rows > 0) fast = pair_mults8(__ldg(reinterpret_cast<const uint2*>(scale + (long long)bg.srow * C + col)), m);
        for (int r0 = 0; r0 < 32; r0 += 4) {
            uint2 raw[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                raw[i] = r0 + i < bg.rows ? __ldg(reinterpret_cast<const uint2*>(data + (bg.row0 + r0 + i) * C + col))
                                          : make_uint2(0u, 0u);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint4 v = make_uint4(0u, 0u, 0u, 0u);  // rows past the group inside its last 64: zeros
                if (r0 + i < bg.rows) {
                    unsigned o[4] = {e4m3x2_bits(raw[i].x, E4M3X2_LO), e4m3x2_bits(raw[i].x, E4M3X2_HI),
                                     e4m3x2_bits(raw[i].y, E4M3X2_LO), e4m3x2_bits(raw[i].y, E4M3X2_HI)};
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        o[j] = fast ? hmul2_bf16(o[j], m[j]) : hmul2_bf16(hmul2_bf16(o[j], BF16X2_2P120), m[j]);
                    v = make_uint4(o[0], o[1], o[2], o[3]);
                }
                *reinterpret_cast<uint4*>(ob + (long long)(r0 + i) * C + col) = v;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) mx_prepare_colwise_bf16(const unsigned char* __restrict__ data,
                                                                           const unsigned char* __restrict__ scale,
                                                                           const int* __restrict__ sizes,
                                                                           unsigned short* __restrict__ out, int G,
                                                                           long long M, int C, int nblocks) {
    __shared__ GroupInfo gis[8];
    const int warp = threadIdx.x >> 5;
    prep_colwise_warp(data, scale, sizes, out, G, M, C, nblocks, blockIdx.x * 8 + warp, &gis[warp]);
}

// Both wgrad operands in one launch (same rows and groups, widths Ca and Cb): the first warps_a warps of the grid
// prepare a, the rest b. Why: one launch has one ramp and one tail instead of two.
extern "C" __global__ void __launch_bounds__(256) mx_prepare_colwise_bf16_pair(
    const unsigned char* __restrict__ data_a, const unsigned char* __restrict__ scale_a,
    unsigned short* __restrict__ out_a, int Ca, int warps_a, const unsigned char* __restrict__ data_b,
    const unsigned char* __restrict__ scale_b, unsigned short* __restrict__ out_b, int Cb,
    const int* __restrict__ sizes, int G, long long M, int nblocks) {
    __shared__ GroupInfo gis[8];
    const int warp = threadIdx.x >> 5, wid = blockIdx.x * 8 + warp;
    if (wid < warps_a)
        prep_colwise_warp(data_a, scale_a, sizes, out_a, G, M, Ca, nblocks, wid, &gis[warp]);
    else
        prep_colwise_warp(data_b, scale_b, sizes, out_b, G, M, Cb, nblocks, wid - warps_a, &gis[warp]);
}
