// Blockwise FP8 grouped GEMM for Hopper, fprop and dgrad (2d x 3d): out[rows of g] = A[rows of g] x B[g]^T with
// A e4m3 [M, K] in 1x128 blocks (scales a_scale [M, K/128] E8M0, row-major: what the dispatch delivers) and B e4m3
// [G, N, K] in 128x128 blocks (b_scale [G, N/128, K/128] E8M0, any strides: dgrad passes the weight's transposed
// bytes data_t and scale.transpose(1, 2)). Recipe row: moe_ep.recipe.BLOCKWISE; reference:
// moe_ep.blockwise.reference.grouped_mm_torch; launcher: moe_ep/experts/sm90/blockwise_gemm.py.
//
//   * tile 128 x 128 (BW_BM x BW_BN), one 128-wide k block per ring stage: A 128 x 128 B + B 128 x 128 B, both
//     TMA-loaded with the 128-byte swizzle (a swizzle row = one scale block), 6 stages (BW_STAGES).
//   * block = 384 threads: warpgroups 0 and 1 are the consumers (tile rows 64 wg .. 64 wg + 63), warp 8 the
//     producer (it scans the groups; its lane 0 issues the TMA loads), warps 9-11 leave at once; registers move
//     from the producer warpgroup to the consumers (setmaxnreg 56 / 224).
//   * mainloop per consumer warpgroup and k block kb: 4 x wgmma.m64n128k32 e4m3 into a fresh accumulator tmp[64]
//     (scale-d = 0 on the first), wait for them, release the stage, then promote on the CUDA cores:
//     acc += tmp * (sa[row] * sb) in fp32 (sa the row's 1x128 scale, sb the weight block's). While one warpgroup
//     promotes, the other's MMAs keep the tensor cores busy (DeepGEMM's schedule). The consumers read their scale
//     bytes straight from global memory, 4 k blocks ahead (the a_scale matrix's rows are K/128 bytes, too narrow
//     and misaligned for TMA boxes in general).
//   * ragged groups, no padding: row tiles are per group (sum_g ceil(n_g / 128) of them, found by each warp's own
//     scan of the device group sizes, gm_scan_groups); a group's last tile is partial: the TMA box also loads rows
//     of the next group (or zeros past M), which are computed but never stored. In a last tile of <= 64 rows,
//     warpgroup 1 only keeps the ring going (waits and releases its stages), so warpgroup 0 has the tensor cores.
//   * persistent: grid = min(tiles, SMs) over (ceil(M/128) + G) x N/128 tiles in gm_raster's order (bands of
//     BW_RASTER row tiles); tiles past the groups zero-fill rows past sum(sizes) when zero_rest (there are always
//     enough of them, see kernels/grouped_gemm.cu).
//   * epilogue: bf16 from registers (quad transpose, 16-byte stores of 8 rows x 64 contiguous bytes per warp),
//     rows past the group masked; the producer meanwhile fills the ring for the next tile.
//   * -DBW_NO_PROMOTE (the rate probe only, not a correct GEMM): the same mainloop accumulating straight into acc
//     (no tmp, no promotion): the plain FP8 wgmma rate with the same loads and waits.
// Shared memory (all dynamic): 6 x 32768 ring + 2 x 6 x 8 barriers + 9 GroupInfo = 197136 B; ptxas: 168 registers
// at launch (setmaxnreg moves them: consumers 224), no spills, no wgmma serialization, in both builds.
// Measured rates, the probe, and the schedules tried and dropped (two accumulators, a deferred epilogue, 2-CTA
// clusters multicasting A; their code is at f74eaac): docs/design-kernels.md, "Blockwise FP8 grouped GEMMs".

#include "wgmma_fp8.cuh"

#define BW_BM 128
#define BW_BN 128
#define BW_STAGES 6
#define BW_STAGE_BYTES 32768  // A 128 x 128 B at 0 | B 128 x 128 B at BW_B (both SW128)
#define BW_B 16384
#define BW_RASTER 8
#define BW_BAR (BW_STAGES * BW_STAGE_BYTES)  // full[S], empty[S]
#define BW_GI (BW_BAR + 16 * BW_STAGES)      // one GroupInfo per warp (9)
#define BW_SMEM_BYTES (BW_GI + 9 * 48)       // 197136
#define BW_PF 4                              // scale prefetch distance (k blocks)

static_assert(sizeof(GroupInfo) == 48, "BW_SMEM_BYTES assumes 48-byte GroupInfo entries");
static_assert(BW_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

// Tile t of the persistent schedule, computed by one warp into its own GroupInfo. Returns 1 when the tile has rows
// to compute (sets g, n0, mrows, arow0), 0 when it is a tile past the groups (sets r_zero: its first row past
// sum(sizes)), -1 when it has nothing to do.
__device__ __forceinline__ int bw_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N, int t,
                                       int& g, int& n0, int& mrows, long long& arow0, long long& r_zero) {
    int m_t, n_t;
    gm_raster(t, (int)((M + BW_BM - 1) / BW_BM) + G, N / BW_BN, BW_RASTER, m_t, n_t);
    n0 = n_t * BW_BN;
    gm_scan_groups(sizes, G, M, GM_BY_TILE, m_t, gi);
    __syncwarp();
    g = gi->g;
    if (g < 0) {
        r_zero = gi->total_rows + (long long)(m_t - gi->total_tiles) * BW_BM;
        __syncwarp();  // every lane has read gi before the next scan overwrites it
        return 0;
    }
    mrows = min(BW_BM, gi->rows - gi->tile * BW_BM);
    arow0 = gi->row0 + (long long)gi->tile * BW_BM;
    __syncwarp();
    return mrows > 0 ? 1 : -1;
}

// The persistent schedule: this CTA walks tiles blockIdx.x, + gridDim.x, ... < bw_total().
__device__ __forceinline__ int bw_total(long long M, int G, int N) {
    return ((int)((M + BW_BM - 1) / BW_BM) + G) * (N / BW_BN);
}

// Producer (warp 8; lane 0 issues): for every tile of this CTA and every k block, wait for the stage to be free and
// load A (rows arow0 .., the group's rows and whatever follows) and B (rows g N + n0 ..).
__device__ __forceinline__ void bw_produce(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                           int K, const TmaMap* tmA, const TmaMap* tmB, unsigned sbase,
                                           unsigned full0, unsigned empty0) {
    const int lane = threadIdx.x & 31;
    const int total = bw_total(M, G, N), nk = K / 128;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, mrows;
        long long arow0, r_zero;
        if (bw_tile(gi, sizes, G, M, N, t, g, n0, mrows, arow0, r_zero) != 1) continue;
        const int brow0 = g * N + n0;
        for (int kb = 0; kb < nk; ++kb) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * BW_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
                mbar_expect_tx(full, (unsigned)BW_STAGE_BYTES);
                tma_2d(st, tmA, kb * 128, (int)arow0, full);
                tma_2d(st + BW_B, tmB, kb * 128, brow0, full);
            }
            ring_next(stage, phase, BW_STAGES);
        }
    }
}

// bf16 epilogue of one warpgroup's 64 x 128 accumulator tile from registers: per (h, m) one 16-byte store of
// bf16_words_quad (columns 32 m + 8 c .. + 7 of row r); rows >= mrows are not stored.
__device__ __forceinline__ void bw_epilogue(const float* acc, unsigned short* __restrict__ out, long long arow0,
                                            int mrows, int n0, int N, int r_in) {
    const int c = threadIdx.x & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r_in + 8 * h;
        unsigned short* rowp = out + (arow0 + r) * N + n0;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            unsigned w[4];
            bf16_words_quad(acc, h, m, w);
            if (r < mrows) *reinterpret_cast<uint4*>(rowp + 32 * m + 8 * c) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// The consumer warpgroups' side: every tile of this CTA (see the header comment).
__device__ __forceinline__ void bw_consume(GroupInfo* gi, const unsigned char* __restrict__ As,
                                           const unsigned char* __restrict__ Bs, const int* __restrict__ sizes,
                                           void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                           long long bs0, long long bs1, long long bs2, unsigned sbase,
                                           unsigned full0, unsigned empty0) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2, q = warp & 3;
    const int r_in = wg * 64 + q * 16 + (lane >> 2);  // tile row of accumulator half h = 0 (h = 1: + 8)
    unsigned lane0 = lane == 0;
    asm volatile("" : "+r"(lane0));
    const int total = bw_total(M, G, N), nk = K / 128;
    const int ks = K / 128;  // a_scale row stride
    int stage = 0;
    unsigned phase = 0;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, mrows;
        long long arow0, r_zero;
        const int kind = __shfl_sync(0xffffffffu, bw_tile(gi, sizes, G, M, N, t, g, n0, mrows, arow0, r_zero), 0);
        if (kind == 0) {
            if (zero_rest) zero_rows(out, r_zero, M, N, n0);  // threads 0-255 = GM_ZERO_THREADS
            continue;
        }
        if (kind < 0) continue;
        const bool active = __shfl_sync(0xffffffffu, mrows, 0) > 64 * wg;  // warpgroup 1 idles in tiles <= 64 rows
        if (!active) {
            // keep the ring: the stage is full before it is released (so that no release runs ahead of a load)
            for (int kb = 0; kb < nk; ++kb) {
                mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                mbar_arrive_if(empty0 + 8u * (unsigned)stage, lane0);
                ring_next(stage, phase, BW_STAGES);
            }
            continue;
        }
        // the thread's two rows (clamped to the tensor: rows past M are TMA zeros, never stored) and scale rows
        long long ra = arow0 + r_in;
        ra = ra < M ? ra : M - 1;
        long long rb = arow0 + r_in + 8;
        rb = rb < M ? rb : M - 1;
        // 32-bit offsets (the launcher checks M K / 128 and the scale view's extent < 2**31): the base pointers
        // stay kernel parameters, not registers
        const unsigned oa0 = (unsigned)(ra * ks), oa1 = (unsigned)(rb * ks);
        const unsigned ob = (unsigned)((long long)g * bs0 + (long long)(n0 / 128) * bs1), ostep = (unsigned)bs2;
        unsigned s0[BW_PF] = {}, s1[BW_PF] = {}, sb[BW_PF] = {};
#pragma unroll
        for (int u = 0; u < BW_PF; ++u) {
            if (u < nk) {
                s0[u] = ldg_u8(As + oa0 + u);
                s1[u] = ldg_u8(As + oa1 + u);
                sb[u] = ldg_u8(Bs + ob + u * ostep);
            }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#ifndef BW_NO_PROMOTE
        float tmp[64];
#endif
        // one block in flight per warpgroup: issue, wait, promote
        for (int kb0 = 0; kb0 < nk; kb0 += BW_PF) {
#pragma unroll
            for (int u = 0; u < BW_PF; ++u) {
                const int kb = kb0 + u;
                if (kb >= nk) break;
                mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                const unsigned st = sbase + (unsigned)stage * BW_STAGE_BYTES;
                const unsigned long long da = wg_desc(st + 8192u * (unsigned)wg), db = wg_desc(st + BW_B);
                wg_fence();
#ifdef BW_NO_PROMOTE
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(acc, da + 2 * kk, db + 2 * kk, 1u);
                wg_commit();
                wg_wait<0>();
                pin_acc64(acc);
                mbar_arrive_if(empty0 + 8u * (unsigned)stage, lane0);
#else
                // k32 slice kk: + 32 bytes of the 128-byte swizzled rows = + 2 in the descriptors' start field
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(tmp, da + 2 * kk, db + 2 * kk, kk > 0);
                wg_commit();
                // the block's scales (loaded BW_PF blocks ago), and the load for block kb + BW_PF into their place
                const float sbf = e8m0_f32(sb[u]);
                const float sc0 = e8m0_f32(s0[u]) * sbf, sc1 = e8m0_f32(s1[u]) * sbf;
                if (kb + BW_PF < nk) {
                    s0[u] = ldg_u8(As + oa0 + (unsigned)(kb + BW_PF));
                    s1[u] = ldg_u8(As + oa1 + (unsigned)(kb + BW_PF));
                    sb[u] = ldg_u8(Bs + ob + (unsigned)(kb + BW_PF) * ostep);
                }
                wg_wait<0>();
                pin_acc64(tmp);
                mbar_arrive_if(empty0 + 8u * (unsigned)stage, lane0);  // the stage is read: the producer may refill
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    acc[4 * j] = fmaf(tmp[4 * j], sc0, acc[4 * j]);
                    acc[4 * j + 1] = fmaf(tmp[4 * j + 1], sc0, acc[4 * j + 1]);
                    acc[4 * j + 2] = fmaf(tmp[4 * j + 2], sc1, acc[4 * j + 2]);
                    acc[4 * j + 3] = fmaf(tmp[4 * j + 3], sc1, acc[4 * j + 3]);
                }
#endif
                ring_next(stage, phase, BW_STAGES);
            }
        }
        bw_epilogue(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, r_in);
    }
}

// Kernel parameters: GM_TMA_ARGS (A [M, K] e4m3 via tmA: boxes 128 x 128 B, SW128; B [G N, K] e4m3 via tmB: the
// same boxes; As = a_scale [M, K/128]; Bs = b_scale with element strides bs0, bs1, bs2 over [G, N/128, K/128]),
// then those strides. N % 128 == 0, K % 128 == 0 (checked by the launcher).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    bw_gmm_2d3d_bf16(GM_TMA_ARGS, long long bs0, long long bs1, long long bs2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();  // the 128-byte swizzle needs 1024-aligned tiles (no static shared memory)
    const unsigned full0 = sbase + BW_BAR, empty0 = full0 + 8u * BW_STAGES;
    if (threadIdx.x == 0) {  // full: the producer's arrival + bytes; empty: every consumer warp
        for (int j = 0; j < BW_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, WS_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + BW_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS) bw_produce(gi, sizes, G, M, N, K, &tmA, &tmB, sbase, full0, empty0);
    } else {
        setmaxnreg_inc<224>();  // 128 x 56 + 256 x 224 = 64512: all the registers of the CTA
        bw_consume(gi, As, Bs, sizes, out, G, M, N, K, zero_rest, bs0, bs1, bs2, sbase, full0, empty0);
    }
}
