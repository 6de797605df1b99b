// Grouped MXFP8 wgrad for Hopper: dW[g] = dY_g^T X_g -> [G, N, K], the reduction over each group's rows.
// Launcher and operand formats: moe_ep/experts/sm90/gemm.py grouped_wgrad_prepared_out; design: docs/design-kernels.md,
// "Grouped GEMMs".
//
//   * both wgrad operands are activations quantized column-wise (scales along the reduction), so neither can be
//     prepared once like a weight; instead the quantizer writes them exactly dequantized to bf16 in the layout
//     below (moe_ep.mxfp8.cuda.quantize_grouped_dual(..., colwise="bf16")), and this GEMM needs no conversion at
//     all: both operands go by TMA straight into the layout wgmma reads.
//   * prepared operands: dY' [64 (ceil(M/64) + G), N], X' [same rows, K] bf16: group g at rows 64 poff_g ..
//     (poff_g = sum_{h<g} ceil(n_h / 64)), zero padded to a multiple of 64 rows, so a group's reduction is
//     ceil(n_g / 64) k-steps of 64 rows, 4 k16 slices each (whole steps keep every wgmma on a uniform path).
//   * both operands are MN-major (the N or K values of one row are contiguous): TMA boxes of 64 rows x 64
//     columns (128 bytes, 128-byte swizzle) and wgmma with both transpose flags; A = 2 boxes (tile rows n0 ..
//     n0 + 127, one per consumer warpgroup), B = 4 boxes (256 columns of K). Descriptor: the 64-wide MN atoms are
//     8192 bytes apart (leading byte offset), 8-row k groups 1024 bytes (stride byte offset).
//   * schedule as the fprop kernel (kernels/experts/sm90/grouped_gemm.cu): persistent grid over G x ceil(N/128) x ceil(K/256)
//     tiles, a producer warp, 2 consumer warpgroups (64 x 256 each, 128 fp32 accumulators), a 4-stage full/empty
//     mbarrier ring; empty groups store zeros.
//   * epilogue through shared memory and TMA stores, so that the MMAs of the next tile run while the output drains.
//     Next to 4 stages only 16 KiB per warpgroup are left for it, so a warpgroup's 64 x 256 tile leaves in rounds:
//     bf16 in 2 rounds of 128 columns (epilogue_bf16_tma), fp32 in 4 of 64 (wr_epilogue_tma_f32), each round
//     after the previous one's stores have read the region. A warpgroup whose 64 rows run past N (they would land
//     in the next group's rows) stores from registers.
// Shared memory (all dynamic): 4 x 49152 + 32768 staging + barriers + 9 GroupInfo = 229872 B.

#include "gemm_wgmma.cuh"

#define WR_STAGES 4
#define WR_REGION 16384                                // output staging per consumer warpgroup
#define WR_A_BYTES 16384                               // 2 boxes of 64 rows x 128 B
#define WR_STAGE_BYTES 49152                           // A | B (4 boxes)
#define WR_EPI (WR_STAGES * WR_STAGE_BYTES)            // output staging: WR_REGION per consumer warpgroup
#define WR_BAR (WR_EPI + 2 * WR_REGION)                // full[S], empty[S]
#define WR_GI (WR_BAR + 16 * WR_STAGES)
#define WR_SMEM_BYTES (WR_GI + 9 * 48)                 // 229872
static_assert(WR_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

// MN-major, 128-byte swizzle descriptor: start address, leading byte offset (next 64-wide MN atom), stride byte
// offset (next group of 8 k rows of 128 bytes).
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)(8192 >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// Output tiles of the grid: G groups x 128-row tiles of N x 256-column tiles of K (the producer and the consumers
// walk the same sequence).
__device__ __forceinline__ int wgr_num_tiles(int G, int N, int K) { return G * ((N + 127) / 128) * ((K + 255) / 256); }

// Tile t -> group g, row tile n0 (128 rows of N), column tile k0 (256 columns of K); the group's blocks via
// the warp's own scan (gm_scan_groups by group index: poff and rows).
__device__ __forceinline__ void wgr_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                         int K, int t, int& g, int& n0, int& k0, int& ksteps, int& prow0) {
    const int nt = (N + 127) / 128, kt = (K + 255) / 256;
    g = t / (nt * kt);
    const int rem = t - g * nt * kt;
    n0 = (rem / kt) * 128;
    k0 = (rem % kt) * 256;
    gm_scan_groups(sizes, G, M, 0, g, gi);
    __syncwarp();
    ksteps = (int)(((unsigned)gi->rows + 63u) >> 6);
    prow0 = 64 * gi->poff;
    __syncwarp();
}

// fp32 epilogue of one warpgroup's 64 full rows: 64 x 256 fp32 = 64 KiB through its WR_REGION bytes, in rounds of
// WR_REGION / 8192 TMA boxes of 64 rows x 32 columns (128-byte rows, 128-byte swizzle: 16-byte unit u of row r at
// (u ^ (r % 8)) << 4). Accumulator 4 j + 2 h + e is column 8 j + 2 c + e: box j / 4, unit 2 (j % 4) + c / 2, byte
// 8 (c % 2) within it. Before writing a round the leader waits until the previous stores (the previous round, or
// the previous tile) have read the region.
__device__ __forceinline__ void wr_epilogue_tma_f32(const float* acc, unsigned region, int wg, long long orow, int k0,
                                                    int K, const TmaMap* tmO) {
    constexpr int BOXES = WR_REGION / 8192;  // per round
    const int tid = threadIdx.x, lane = tid & 31, c = tid & 3, q = (tid >> 5) & 3;
    const bool leader = (tid & 127) == 0;
    const int bar = 3 + wg;
#pragma unroll
    for (int rd = 0; rd < 8 / BOXES; ++rd) {
        epi_round_begin(leader, bar);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = q * 16 + (lane >> 2) + 8 * h;
#pragma unroll
            for (int jj = 0; jj < 4 * BOXES; ++jj) {
                const int j = 4 * BOXES * rd + jj;
                const unsigned u = (unsigned)(2 * (jj & 3) + (c >> 1));
                const unsigned addr = region + (unsigned)(jj >> 2) * 8192u + (unsigned)r * 128u +
                                      ((u ^ (unsigned)(r & 7)) << 4) + 8u * (unsigned)(c & 1);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(acc[4 * j + 2 * h]),
                             "f"(acc[4 * j + 2 * h + 1])
                             : "memory");
            }
        }
        epi_round_end(leader, bar, tmO, region, k0 + 32 * BOXES * rd, 32, BOXES, K, (int)(orow + 64 * wg));
    }
}


__device__ __forceinline__ void wgr_produce(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                            int K, const TmaMap* tmA, const TmaMap* tmB, unsigned sbase,
                                            unsigned full0, unsigned empty0) {
    const int lane = threadIdx.x & 31;
    const int total = wgr_num_tiles(G, N, K);
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, k0, ksteps, prow0;
        wgr_tile(gi, sizes, G, M, N, K, t, g, n0, k0, ksteps, prow0);
        for (int s = 0; s < ksteps; ++s) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * WR_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);
                mbar_expect_tx(full, (unsigned)WR_STAGE_BYTES);
                const int row = prow0 + 64 * s;
#pragma unroll
                for (int j = 0; j < 2; ++j) tma_2d(st + 8192u * j, tmA, n0 + 64 * j, row, full);
#pragma unroll
                for (int j = 0; j < 4; ++j) tma_2d(st + WR_A_BYTES + 8192u * j, tmB, k0 + 64 * j, row, full);
            }
            ring_next(stage, phase, WR_STAGES);
        }
    }
}

template <int OUT_F32>
__device__ __forceinline__ void wgr_kernel(const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                           int N, int K, const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmO) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();  // the 128-byte swizzle needs 1024-aligned tiles (no static shared memory)
    const unsigned full0 = sbase + WR_BAR, empty0 = full0 + 8u * WR_STAGES;
    ring_init(full0, empty0, WR_STAGES);
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + WR_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS) wgr_produce(gi, sizes, G, M, N, K, tmA, tmB, sbase, full0, empty0);
        return;
    }
    setmaxnreg_inc<224>();
    const int wg = tid >> 7, q = warp & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    const int total = wgr_num_tiles(G, N, K);
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, k0, ksteps, prow0;
        wgr_tile(gi, sizes, G, M, N, K, t, g, n0, k0, ksteps, prow0);
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int prev = 0;
        for (int s = 0; s < ksteps; ++s) {
            mbar_wait(full0 + 8u * (unsigned)stage, phase);
            const unsigned st = sbase + (unsigned)stage * WR_STAGE_BYTES;
            const unsigned long long da = wg_desc_mn(st + 8192u * (unsigned)wg), db = wg_desc_mn(st + WR_A_BYTES);
            wg_fence();
            // k16 slice kk: rows 16 kk .. of the 64-row stage = + 2048 bytes (128 descriptor units)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss_mn(acc, da + 128 * kk, db + 128 * kk);
            wg_commit();
            wg_wait<1>();  // M(s - 1) retired: its stage is free
            if (s >= 1 && lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
            prev = stage;
            ring_next(stage, phase, WR_STAGES);
        }
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
        if (ksteps > 0 && lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
        // out[g] is [N, K]: tile rows n0 .., columns k0 ..; as a [G * N, K] matrix its first row is g * N + n0
        const long long orow = (long long)g * N + n0;
        const unsigned region = sbase + WR_EPI + (unsigned)WR_REGION * (unsigned)wg;
        if (N - n0 < 64 * (wg + 1)) {  // rows past N: masked stores from registers
            if (OUT_F32)
                epilogue_f32(acc, out, orow, N - n0, k0, K, ar0);
            else
                epilogue_bf16(acc, static_cast<unsigned short*>(out), orow, N - n0, k0, K, ar0);
        } else if (OUT_F32) {
            wr_epilogue_tma_f32(acc, region, wg, orow, k0, K, tmO);
        } else {
            epilogue_bf16_tma<32768 / WR_REGION>(acc, region, wg, orow, k0, K, tmO);
        }
    }
    if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before exit
}

// Kernel parameters: GM_TMA_ARGS (A, B and their scales unused: the operands are reached through the tensor maps
// of the prepared bf16 copies; M = the data rows the groups cover, N, K, the group sizes), tmA over dY' [R, N], tmB
// over X' [R, K], both in boxes of 64 rows x 64 columns with the 128-byte swizzle, tmO over out as [G N, K] in
// boxes of 64 rows x 128 bytes (64 bf16 / 32 fp32 columns), 128-byte swizzle.
#define WR_ARGS GM_TMA_ARGS, const __grid_constant__ TmaMap tmO
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) mx_gmm_wgrad_f32(WR_ARGS) {
    wgr_kernel<1>(sizes, out, G, M, N, K, &tmA, &tmB, &tmO);
}
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) mx_gmm_wgrad_bf16(WR_ARGS) {
    wgr_kernel<0>(sizes, out, G, M, N, K, &tmA, &tmB, &tmO);
}
