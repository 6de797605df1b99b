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
//   * mainloop per consumer warpgroup and k block kb (BW_PIPE 0, the default): 4 x wgmma.m64n128k32 e4m3 into a
//     fresh accumulator tmp[64] (scale-d = 0 on the first), wait for them, release the stage, then promote on the
//     CUDA cores: acc += tmp * (sa[row] * sb) in fp32 (sa the row's 1x128 scale, sb the weight block's). While one
//     warpgroup promotes, the other's MMAs keep the tensor cores busy (DeepGEMM's schedule). -DBW_PIPE=1: two
//     alternating tmp accumulators, block kb's MMAs issued before block kb - 1 is promoted (each warpgroup keeps
//     MMAs queued during its own promotion; 192 fp32 accumulators per thread) -- measured slower on H200 for this
//     kernel (988 vs 1078 TFLOP/s on the dense probe). -DBW_PIPE=2: BW_PIPE 0 with each tile's epilogue deferred
//     into the next tile's first block (between its MMA issue and wait), so the stores overlap MMAs. The consumers read their scale bytes straight from global
//     memory, 4 k blocks ahead (the a_scale matrix's rows are K/128 bytes, too narrow and misaligned for TMA
//     boxes in general).
//   * ragged groups, no padding: row tiles are per group (sum_g ceil(n_g / 128) of them, found by each warp's own
//     scan of the device group sizes, gm_scan_groups); a group's last tile is partial: the TMA box also loads rows
//     of the next group (or zeros past M), which are computed but never stored. In a last tile of <= 64 rows,
//     warpgroup 1 only keeps the ring going (waits and releases its stages), so warpgroup 0 has the tensor cores.
//   * persistent: grid = min(tiles, SMs) over (ceil(M/128) + G) x N/128 tiles in gm_raster's order (bands of
//     BW_RASTER row tiles); tiles past the groups zero-fill rows past sum(sizes) when zero_rest (there are always
//     enough of them, see kernels/grouped_gemm.cu).
//   * -DBW_CLUSTER=2 (the launcher's multicast build, when N / 128 is even): clusters of 2 CTAs take the two
//     column tiles (n_t = 2 p, 2 p + 1) of the same row tile, so they share the A tile: each CTA's producer loads
//     64 of its 128 rows by TMA multicast into both CTAs' stage (box 64 x 128 B), its own B tile alone: 24 KiB of
//     L2 traffic per CTA and k block instead of 32. A stage is refilled only when the consumers of both CTAs have
//     released it (empty barriers count the 16 consumer warps of the cluster: local + remote arrivals); the
//     CTAs meet (barrier.cluster) after the barriers' initialization and before leaving.
//   * epilogue: bf16 from registers (quad transpose, 16-byte stores of 8 rows x 64 contiguous bytes per warp),
//     rows past the group masked; the producer meanwhile fills the ring for the next tile.
//   * -DBW_NO_PROMOTE (the rate probe only, not a correct GEMM): the same mainloop accumulating straight into acc
//     (no t0 / t1, no promotion): the plain FP8 wgmma rate with the same loads and waits.
// Shared memory (all dynamic): 6 x 32768 ring + 2 x 6 x 8 barriers + 9 GroupInfo = 197136 B; ptxas: 168 registers
// at launch (setmaxnreg moves them: consumers 224), no spills, no wgmma serialization, in every build.
//
// Measured on one H200 (8541feb, benchmarks/results/bench_gemm_blockwise.json, meta.sweep: the one tuning pass):
//   * dense 8192^3 probe: this schedule 1136 TFLOP/s, the same mainloop without the promotion (-DBW_NO_PROMOTE)
//     1377, torch._scaled_mm rowwise 1367, torch bf16 691: the promotion costs 17.5 % of the plain FP8 rate.
//   * BW_PIPE 0 (default) 1000 TFLOP/s on a dsv3_down-like grouped problem, BW_PIPE 1 956, BW_PIPE 2 886.
//   * the cluster build runs at about half the single-CTA rate (dense 546; 505 / 555 with the grid forced to 60 /
//     64 clusters; its no-promotion probe too: 522), so it is off by default (MOE_EP_BW_MULTICAST=1 selects it).
//     Not resolved: consistent with only half of the clusters being co-resident, not with the L2 traffic it saves.

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
#ifndef BW_PIPE  // mainloop schedule, see the header comment (0: measured faster on H200)
#define BW_PIPE 0
#endif
// BW_PIPE 2: the BW_PIPE 0 mainloop with each tile's epilogue deferred into the next tile's first block (after its
// MMAs are issued, before their wait), so that the stores overlap MMAs instead of draining the tensor pipe
#if BW_PIPE == 2 && !defined(BW_NO_PROMOTE)
#define BW_DEFER 1
#else
#define BW_DEFER 0
#endif
#ifndef BW_CLUSTER  // -DBW_CLUSTER=2: CTA pairs share the A tile (TMA multicast), see the header comment
#define BW_CLUSTER 1
#endif

static_assert(sizeof(GroupInfo) == 48, "BW_SMEM_BYTES assumes 48-byte GroupInfo entries");
static_assert(BW_PF % 2 == 0, "the t0 / t1 alternation follows u, so BW_PF must be even");
static_assert(BW_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

// Tile t of the persistent schedule (with clusters: the cluster's tile t, this CTA's column tile `rank` of it),
// computed by one warp into its own GroupInfo. Returns 1 when the tile has rows
// to compute (sets g, n0, mrows, arow0), 0 when it is a tile past the groups (sets r_zero: its first row past
// sum(sizes)), -1 when it has nothing to do.
__device__ __forceinline__ int bw_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N, int t,
                                       int rank, int& g, int& n0, int& mrows, long long& arow0, long long& r_zero) {
    const int n_tiles = N / BW_BN / BW_CLUSTER;  // column tiles (BW_CLUSTER > 1: column tile groups of the cluster)
    int m_t, n_t;
    gm_raster(t, (int)((M + BW_BM - 1) / BW_BM) + G, n_tiles, BW_RASTER, m_t, n_t);
    n0 = (n_t * BW_CLUSTER + rank) * BW_BN;
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

// The persistent schedule: this CTA (cluster) walks tiles bw_first(), + bw_step(), ... < bw_total() (with clusters
// the tiles are column-tile groups, one column tile per CTA of the cluster).
__device__ __forceinline__ int bw_total(long long M, int G, int N) {
    return ((int)((M + BW_BM - 1) / BW_BM) + G) * (N / BW_BN / BW_CLUSTER);
}
__device__ __forceinline__ int bw_first() { return blockIdx.x / BW_CLUSTER; }
__device__ __forceinline__ int bw_step() { return gridDim.x / BW_CLUSTER; }

// Release a stage: lane 0 of each consumer warp arrives on the stage's empty barrier, with clusters on both CTAs'
// (the peer's producer multicasts into this CTA's copy of the stage too).
__device__ __forceinline__ void bw_release(unsigned empty, unsigned lane0) {
    mbar_arrive_if(empty, lane0);
#if BW_CLUSTER > 1
    mbar_arrive_cluster_if(mapa_shared(empty, cluster_ctarank() ^ 1u), lane0);
#endif
}

// Producer (warp 8; lane 0 issues): for every tile of this CTA and every k block, wait for the stage to be free and
// load A (rows arow0 .., the group's rows and whatever follows) and B (rows g N + n0 ..).
__device__ __forceinline__ void bw_produce(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                           int K, const TmaMap* tmA, const TmaMap* tmB, unsigned sbase,
                                           unsigned full0, unsigned empty0) {
    const int lane = threadIdx.x & 31;
    const int total = bw_total(M, G, N), nk = K / 128;
    const int rank = BW_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
    int stage = 0;
    unsigned phase = 0;
    for (int t = bw_first(); t < total; t += bw_step()) {
        int g, n0, mrows;
        long long arow0, r_zero;
        if (bw_tile(gi, sizes, G, M, N, t, rank, g, n0, mrows, arow0, r_zero) != 1) continue;
        const int brow0 = g * N + n0;
        for (int kb = 0; kb < nk; ++kb) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * BW_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
                mbar_expect_tx(full, (unsigned)BW_STAGE_BYTES);
#if BW_CLUSTER > 1
                // this CTA's half of the shared A tile (64 rows) into both CTAs' stage; the peer sends the other
                tma_2d_multicast(st + 8192u * (unsigned)rank, tmA, kb * 128, (int)arow0 + 64 * rank, full, 0x3);
#else
                tma_2d(st, tmA, kb * 128, (int)arow0, full);
#endif
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
    const int rank = BW_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
    const int ks = K / 128;  // a_scale row stride
    int stage = 0;
    unsigned phase = 0;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#if BW_DEFER
    long long p_arow0 = 0;  // the tile whose epilogue is pending (acc holds it)
    int p_mrows = 0, p_n0 = 0;
    bool pending = false;
#endif
    for (int t = bw_first(); t < total; t += bw_step()) {
        int g, n0, mrows;
        long long arow0, r_zero;
        const int kind =
            __shfl_sync(0xffffffffu, bw_tile(gi, sizes, G, M, N, t, rank, g, n0, mrows, arow0, r_zero), 0);
        if (kind == 0) {
            if (zero_rest) zero_rows(out, r_zero, M, N, n0);  // threads 0-255 = GM_ZERO_THREADS
            continue;
        }
        if (kind < 0) continue;
        const bool active = __shfl_sync(0xffffffffu, mrows, 0) > 64 * wg;  // warpgroup 1 idles in tiles <= 64 rows
        if (!active) {
#if BW_DEFER
            if (pending) {  // no MMAs of this warpgroup to overlap: store now
                bw_epilogue(acc, static_cast<unsigned short*>(out), p_arow0, p_mrows, p_n0, N, r_in);
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i] = 0.f;
                pending = false;
            }
#endif
            // keep the ring: the stage is full before it is released (so that no release runs ahead of a load)
            for (int kb = 0; kb < nk; ++kb) {
                mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                bw_release(empty0 + 8u * (unsigned)stage, lane0);
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
#if !BW_DEFER
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#endif
#if BW_PIPE == 0 || BW_PIPE == 2  // one block in flight per warpgroup: issue, wait, promote
#ifndef BW_NO_PROMOTE
        float tmp[64];
#endif
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
                bw_release(empty0 + 8u * (unsigned)stage, lane0);
#else
                // k32 slice kk: + 32 bytes of the 128-byte swizzled rows = + 2 in the descriptors' start field
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(tmp, da + 2 * kk, db + 2 * kk, kk > 0);
                wg_commit();
#if BW_DEFER
                if (kb == 0 && pending) {  // the previous tile's stores while this tile's first MMAs run
                    bw_epilogue(acc, static_cast<unsigned short*>(out), p_arow0, p_mrows, p_n0, N, r_in);
#pragma unroll
                    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
                    pending = false;
                }
#endif
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
                bw_release(empty0 + 8u * (unsigned)stage, lane0);  // the stage is read: the producer may refill
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
#else  // BW_PIPE == 1: block kb's MMAs in flight while block kb - 1 is promoted
#ifndef BW_NO_PROMOTE
        float t0[64], t1[64];  // block kb's MMAs in flight, block kb - 1's partial sum being promoted (alternating)
#endif
        float pc0 = 0.f, pc1 = 0.f;  // the pending block's scale products for the thread's two rows
        int st_prev = 0;             // the pending block's stage
        // For block kb: issue its MMAs (into t[kb % 2]), wait for block kb - 1's, release that stage and promote
        // it while block kb's MMAs run: each warpgroup keeps the tensor cores fed while it promotes. The MMAs are
        // issued on every path (no wgmma under a branch: ptxas would serialize them).
        for (int kb0 = 0; kb0 < nk; kb0 += BW_PF) {
#pragma unroll
            for (int u = 0; u < BW_PF; ++u) {
                const int kb = kb0 + u;
                if (kb >= nk) break;
#ifndef BW_NO_PROMOTE
                float* tn = (u & 1) ? t1 : t0;
                float* tp = (u & 1) ? t0 : t1;
#else
                float* tn = acc;
#endif
                // block kb's scales (loaded BW_PF blocks ago), and the loads for block kb + BW_PF into their place
                const float sbf = e8m0_f32(sb[u]);
                const float nc0 = e8m0_f32(s0[u]) * sbf, nc1 = e8m0_f32(s1[u]) * sbf;
                if (kb + BW_PF < nk) {
                    s0[u] = ldg_u8(As + oa0 + (unsigned)(kb + BW_PF));
                    s1[u] = ldg_u8(As + oa1 + (unsigned)(kb + BW_PF));
                    sb[u] = ldg_u8(Bs + ob + (unsigned)(kb + BW_PF) * ostep);
                }
                mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                {
                    const unsigned st = sbase + (unsigned)stage * BW_STAGE_BYTES;
                    const unsigned long long da = wg_desc(st + 8192u * (unsigned)wg), db = wg_desc(st + BW_B);
                    wg_fence();
                    // k32 slice kk: + 32 bytes of the 128-byte swizzled rows = + 2 in the descriptors' start field
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
#ifdef BW_NO_PROMOTE
                        wgmma_m64n128k32_e4m3(tn, da + 2 * kk, db + 2 * kk, 1u);
#else
                        wgmma_m64n128k32_e4m3(tn, da + 2 * kk, db + 2 * kk, kk > 0);
#endif
                    wg_commit();
                }
                const int st_cur = stage;
                ring_next(stage, phase, BW_STAGES);
                wg_wait<1>();  // block kb - 1's MMAs retired (none at kb = 0)
                if (kb > 0) {
                    bw_release(empty0 + 8u * (unsigned)st_prev, lane0);  // its stage is read: refill it
#ifndef BW_NO_PROMOTE
                    pin_acc64(tp);
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        acc[4 * j] = fmaf(tp[4 * j], pc0, acc[4 * j]);
                        acc[4 * j + 1] = fmaf(tp[4 * j + 1], pc0, acc[4 * j + 1]);
                        acc[4 * j + 2] = fmaf(tp[4 * j + 2], pc1, acc[4 * j + 2]);
                        acc[4 * j + 3] = fmaf(tp[4 * j + 3], pc1, acc[4 * j + 3]);
                    }
#endif
                }
                pc0 = nc0;
                pc1 = nc1;
                st_prev = st_cur;
            }
        }
        wg_wait<0>();  // the last block
        bw_release(empty0 + 8u * (unsigned)st_prev, lane0);
#ifndef BW_NO_PROMOTE
        {
            pin_acc64(t0);
            pin_acc64(t1);
            const bool odd = (nk - 1) & 1;  // the last block's accumulator: t1 when nk - 1 is odd (BW_PF is even)
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float a0 = odd ? t1[4 * j] : t0[4 * j], a1 = odd ? t1[4 * j + 1] : t0[4 * j + 1];
                const float a2 = odd ? t1[4 * j + 2] : t0[4 * j + 2], a3 = odd ? t1[4 * j + 3] : t0[4 * j + 3];
                acc[4 * j] = fmaf(a0, pc0, acc[4 * j]);
                acc[4 * j + 1] = fmaf(a1, pc0, acc[4 * j + 1]);
                acc[4 * j + 2] = fmaf(a2, pc1, acc[4 * j + 2]);
                acc[4 * j + 3] = fmaf(a3, pc1, acc[4 * j + 3]);
            }
        }
#else
        pin_acc64(acc);
        (void)pc0;
        (void)pc1;
#endif
#endif
#if BW_DEFER
        pending = true;
        p_arow0 = arow0;
        p_mrows = mrows;
        p_n0 = n0;
#else
        bw_epilogue(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, r_in);
#endif
    }
#if BW_DEFER
    if (pending) bw_epilogue(acc, static_cast<unsigned short*>(out), p_arow0, p_mrows, p_n0, N, r_in);
#endif
}

// Kernel parameters: GM_TMA_ARGS (A [M, K] e4m3 via tmA: boxes 128 x 128 B, SW128; B [G N, K] e4m3 via tmB: the
// same boxes; As = a_scale [M, K/128]; Bs = b_scale with element strides bs0, bs1, bs2 over [G, N/128, K/128]),
// then those strides. N % 128 == 0, K % 128 == 0 (checked by the launcher).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
#if BW_CLUSTER > 1
    __cluster_dims__(BW_CLUSTER, 1, 1)
#endif
    bw_gmm_2d3d_bf16(GM_TMA_ARGS, long long bs0, long long bs1, long long bs2) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();  // the 128-byte swizzle needs 1024-aligned tiles (no static shared memory)
    const unsigned full0 = sbase + BW_BAR, empty0 = full0 + 8u * BW_STAGES;
    if (threadIdx.x == 0) {  // full: the producer's arrival + bytes; empty: every consumer warp of the cluster
        for (int j = 0; j < BW_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, WS_CONSUMER_WARPS * BW_CLUSTER);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if BW_CLUSTER > 1
    cluster_sync();  // the peer's barriers exist before anything is multicast or arrived on
#endif
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + BW_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS) bw_produce(gi, sizes, G, M, N, K, &tmA, &tmB, sbase, full0, empty0);
    } else {
        setmaxnreg_inc<224>();  // 128 x 56 + 256 x 224 = 64512: all the registers of the CTA
        bw_consume(gi, As, Bs, sizes, out, G, M, N, K, zero_rest, bs0, bs1, bs2, sbase, full0, empty0);
    }
#if BW_CLUSTER > 1
    cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
#endif
}
