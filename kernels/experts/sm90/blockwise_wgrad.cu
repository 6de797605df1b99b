// Blockwise FP8 grouped wgrad for Hopper: out[g] = sum over the group's 128-token blocks kb of
// (A_kb @ B_kb^T) * sa[kb, n] * sb[kb, k] -> [G, N, K] (fp32 or bf16), the reduction over each group's tokens.
// Operands in the colwise grouped transposed layout of moe_ep.blockwise.reference (quantize_colwise_grouped_torch):
// A = a_t [N, Mp] e4m3 (dy^T / da^T), a_st [Mp/128, N] E8M0; B = b_t [K, Mp] e4m3 (h^T / x^T), b_st [Mp/128, K];
// group g at padded columns P_g .. P_g + n_g - 1, P_g = 128 sum_{h<g} ceil(n_h / 128), pad columns zero bytes.
// Reference: moe_ep.blockwise.reference.grouped_wgrad_torch; launcher: moe_ep/experts/sm90/blockwise_gemm.py.
//
//   * both operands are token-major (K-major for the MMA) already: TMA boxes of 128 rows x 128 tokens (128 B,
//     128-byte swizzle) straight into the wgmma layout, plus the k step's two scale rows (a_st row kb, columns
//     n0 .. n0 + 127; b_st row kb, columns k0 .. k0 + 127: 128 B boxes each), all in one ring stage.
//   * tile 128 (rows of N) x 128 (columns of K) per group, persistent grid over G x N/128 x K/128 tiles; each warp
//     scans the device group sizes itself (gm_scan_groups by group: toff = P_g / 128, rows = n_g): no host read.
//     ceil(n_g / 128) k steps; an empty group's tiles store zeros without touching the ring.
//   * mainloop per consumer warpgroup (64 rows) as the fprop kernel's (blockwise_gemm.cu): block s's 4 x
//     m64n128k32 into t[s % 2], then wait for block s - 1's, release its stage and promote it while block s's run.
//     Both scales vary per output element here (sa per row, sb per column), so while the MMAs run each thread
//     decodes one sb byte of the stage into the warpgroup's fp32 table (4 buffers, one named barrier per step),
//     and the promotion is acc += (t * sb[col]) * sa[row]: two fp32 ops per element.
//   * -DWB_CLUSTER=2 (the launcher's multicast build, when K / 128 is even): clusters of 2 CTAs take the column
//     tiles k0, k0 + 128 of the same (group, row tile), so they share the A tile and its scale row: each producer
//     multicasts 64 of the 128 A rows to both CTAs, rank 0 also the A scales; empty barriers count the consumer
//     warps of both CTAs; the CTAs meet (barrier.cluster) after initialization and before leaving (as the fprop
//     kernel's cluster build).
//   * epilogue from registers: fp32 as 8-byte stores (a quad writes one 32-byte sector), bf16 as 16-byte stores
//     after a quad transpose.
// Shared memory (all dynamic): 6 x 33792 ring + 2 x 2048 scale tables + barriers + 9 GroupInfo = 207376 B; ptxas:
// 168 registers at launch (consumers 224 after setmaxnreg), no spills, no wgmma serialization, in every build.
//
// Measured on one H200 (8541feb, benchmarks/results/bench_gemm_blockwise.json, meta.sweep): WB_PIPE 1 (default)
// 633 TFLOP/s on a dsv3_up-like grouped problem (8 blocks per tile), WB_PIPE 2 609, the cluster builds 381 / 416;
// dense 8192^3 (64 blocks per tile) 799. The two-scale promotion (2 fp32 ops per element, the scale table, one
// named barrier per step) is the limit: the fprop kernel's one-FMA promotion on the same mainloop reaches 1136.

#include "wgmma_fp8.cuh"

#define WB_STAGES 6
#define WB_STAGE_BYTES 33792  // A 128 x 128 B | B 128 x 128 B | sa 128 B | sb 128 B, padded to 1024
#define WB_B 16384
#define WB_SA 32768
#define WB_SB 32896
#define WB_TAB (WB_STAGES * WB_STAGE_BYTES)  // per consumer warpgroup: 4 x 128 fp32 decoded sb
#define WB_BAR (WB_TAB + 4096)
#define WB_GI (WB_BAR + 16 * WB_STAGES)
#define WB_SMEM_BYTES (WB_GI + 9 * 48)  // 207376

#ifndef WB_PIPE  // 1: per-tile pipelined mainloop (measured faster); 2: the step stream across tiles (wb_consume_stream)
#define WB_PIPE 1
#endif
#ifndef WB_CLUSTER  // -DWB_CLUSTER=2: CTA pairs share the A tile and its scales (TMA multicast)
#define WB_CLUSTER 1
#endif

static_assert(WB_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

// Tile t -> group g, row tile n0 (of N), column tile k0 (of K; with clusters t is the cluster's tile and k0 this
// CTA's column tile `rank` of it); the group's first padded block and its k steps from the warp's own scan.
__device__ __forceinline__ void wb_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                        int K, int t, int rank, int& g, int& n0, int& k0, int& nks, int& kb0) {
    const int nt = N / 128, kt = K / 128 / WB_CLUSTER;
    g = t / (nt * kt);
    const int rem = t - g * nt * kt;
    n0 = (rem / kt) * 128;
    k0 = ((rem % kt) * WB_CLUSTER + rank) * 128;
    gm_scan_groups(sizes, G, M, GM_BY_GROUP, g, gi);
    __syncwarp();
    nks = (int)(((unsigned)gi->rows + 127u) >> 7);
    kb0 = gi->toff;
    __syncwarp();
}

__device__ __forceinline__ int wb_total(int G, int N, int K) { return G * (N / 128) * (K / 128 / WB_CLUSTER); }

// Release a stage on this CTA's empty barrier and, with clusters, on the peer's (it multicasts into this CTA).
__device__ __forceinline__ void wb_release(unsigned empty, unsigned lane0) {
    mbar_arrive_if(empty, lane0);
#if WB_CLUSTER > 1
    mbar_arrive_cluster_if(mapa_shared(empty, cluster_ctarank() ^ 1u), lane0);
#endif
}

__device__ __forceinline__ void wb_produce(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                           int K, const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmSa,
                                           const TmaMap* tmSb, unsigned sbase, unsigned full0, unsigned empty0) {
    const int lane = threadIdx.x & 31;
    const int total = wb_total(G, N, K);
    const int rank = WB_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x / WB_CLUSTER; t < total; t += gridDim.x / WB_CLUSTER) {
        int g, n0, k0, nks, kb0;
        wb_tile(gi, sizes, G, M, N, K, t, rank, g, n0, k0, nks, kb0);
        for (int s = 0; s < nks; ++s) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * WB_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);
                mbar_expect_tx(full, 32768u + 256u);
                const int kb = kb0 + s;
#if WB_CLUSTER > 1
                // the shared A tile: this CTA's 64 rows into both CTAs' stage (the peer sends the other 64), and
                // rank 0 sends the A scales to both
                tma_2d_multicast(st + 8192u * (unsigned)rank, tmA, kb * 128, n0 + 64 * rank, full, 0x3);
                if (rank == 0) tma_2d_multicast(st + WB_SA, tmSa, n0, kb, full, 0x3);
#else
                tma_2d(st, tmA, kb * 128, n0, full);
                tma_2d(st + WB_SA, tmSa, n0, kb, full);
#endif
                tma_2d(st + WB_B, tmB, kb * 128, k0, full);
                tma_2d(st + WB_SB, tmSb, k0, kb, full);
            }
            ring_next(stage, phase, WB_STAGES);
        }
    }
}

// acc += (t * sb[col]) * sa[row] for the thread's 64 accumulators: sb from the warpgroup's decoded table (fp32 of
// columns 8 j + 2 c, + 1: one 8-byte load per j), sa0 / sa1 for its rows r, r + 8.
__device__ __forceinline__ void wb_promote(float* acc, const float* t, unsigned table, float sa0, float sa1, int c) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float2 sb;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                     : "=f"(sb.x), "=f"(sb.y)
                     : "r"(table + 4u * (unsigned)(8 * j + 2 * c)));
        acc[4 * j] = fmaf(t[4 * j] * sb.x, sa0, acc[4 * j]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1] * sb.y, sa0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2] * sb.x, sa1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3] * sb.y, sa1, acc[4 * j + 3]);
    }
}

// wb_promote of t1 (odd) or t0: the last block's accumulator, chosen per element (no write to t0 / t1: registers
// that only wgmma defines stay so, or ptxas serializes the MMAs).
__device__ __forceinline__ void wb_promote_last(float* acc, const float* t0, const float* t1, int odd, unsigned table,
                                                float sa0, float sa1, int c) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float2 sb;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                     : "=f"(sb.x), "=f"(sb.y)
                     : "r"(table + 4u * (unsigned)(8 * j + 2 * c)));
        acc[4 * j] = fmaf((odd ? t1[4 * j] : t0[4 * j]) * sb.x, sa0, acc[4 * j]);
        acc[4 * j + 1] = fmaf((odd ? t1[4 * j + 1] : t0[4 * j + 1]) * sb.y, sa0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf((odd ? t1[4 * j + 2] : t0[4 * j + 2]) * sb.x, sa1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf((odd ? t1[4 * j + 3] : t0[4 * j + 3]) * sb.y, sa1, acc[4 * j + 3]);
    }
}

// Store one warpgroup's 64 x 128 part of output tile (g, n0, k0) -- rows g N + n0 + r of the [G N, K] matrix --
// from acc, or zeros (zero: an empty group's tile). fp32: 8-byte stores (a quad writes one 32-byte sector); bf16:
// 4-byte stores.
template <int OUT_F32>
__device__ __forceinline__ void wb_store(const float* acc, bool zero, void* __restrict__ out, int g, int n0, int k0,
                                         int N, int K, int r_in, int c) {
    const long long orow = (long long)g * N + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long row = orow + r_in + 8 * h;
        if (OUT_F32) {
            float* rowp = static_cast<float*>(out) + row * K + k0;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<float2*>(rowp + 8 * j + 2 * c) =
                    zero ? make_float2(0.f, 0.f) : make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        } else {
            // 4-byte stores of bf16 pairs (a quad writes 16 contiguous bytes): no shuffles, so no extra registers
            // next to the two MMA accumulators of the stream schedule
            unsigned short* rowp = static_cast<unsigned short*>(out) + row * K + k0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                unsigned pk = 0u;
                if (!zero)
                    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(acc[4 * j + 2 * h + 1]), "f"(acc[4 * j + 2 * h]));
                *reinterpret_cast<unsigned*>(rowp + 8 * j + 2 * c) = pk;
            }
        }
    }
}

template <int OUT_F32>
__device__ __forceinline__ void wb_consume(GroupInfo* gi, const int* __restrict__ sizes, void* __restrict__ out,
                                           int G, long long M, int N, int K, unsigned sbase, unsigned full0,
                                           unsigned empty0) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2, q = warp & 3, c = tid & 3, tw = tid & 127;
    const int r_in = wg * 64 + q * 16 + (lane >> 2);
    unsigned lane0 = lane == 0;
    asm volatile("" : "+r"(lane0));
    const unsigned tab = sbase + WB_TAB + 2048u * (unsigned)wg;
    const int total = wb_total(G, N, K);
    const int rank = WB_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x / WB_CLUSTER; t < total; t += gridDim.x / WB_CLUSTER) {
        int g, n0, k0, nks, kb0;
        wb_tile(gi, sizes, G, M, N, K, t, rank, g, n0, k0, nks, kb0);
        nks = __shfl_sync(0xffffffffu, nks, 0);
        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        float t0[64], t1[64];  // block s's MMAs in flight, block s - 1's partial sum being promoted (alternating)
        float ps0 = 0.f, ps1 = 0.f;  // the pending block's sa for the thread's two rows
        int st_prev = 0;             // the pending block's stage
        for (int s0 = 0; s0 < nks; s0 += 2) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int s = s0 + u;
                if (s >= nks) break;
                float* tn = u ? t1 : t0;
                float* tp = u ? t0 : t1;
                mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                const unsigned st = sbase + (unsigned)stage * WB_STAGE_BYTES;
                {
                    const unsigned long long da = wg_desc(st + 8192u * (unsigned)wg), db = wg_desc(st + WB_B);
                    wg_fence();
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(tn, da + 2 * kk, db + 2 * kk, kk > 0);
                    wg_commit();
                }
                // while the MMAs run: block s's scales, sb through the warpgroup's table (buffer s % 4: a buffer is
                // rewritten only after every thread has passed two more barriers, i.e. finished promoting with it)
                sts32(tab + 512u * (unsigned)(s & 3) + 4u * (unsigned)tw,
                      __float_as_uint(e8m0_f32(lds8(st + WB_SB + (unsigned)tw))));
                const float ns0 = e8m0_f32(lds8(st + WB_SA + (unsigned)r_in));
                const float ns1 = e8m0_f32(lds8(st + WB_SA + (unsigned)r_in + 8u));
                const int st_cur = stage;
                ring_next(stage, phase, WB_STAGES);
                named_bar_sync(1 + wg, 128);  // block s's table is complete
                wg_wait<1>();                 // block s - 1's MMAs retired (none at s = 0)
                if (s > 0) {
                    wb_release(empty0 + 8u * (unsigned)st_prev, lane0);
                    pin_acc64(tp);
                    wb_promote(acc, tp, tab + 512u * (unsigned)((s - 1) & 3), ps0, ps1, c);
                }
                ps0 = ns0;
                ps1 = ns1;
                st_prev = st_cur;
            }
        }
        wg_wait<0>();   // the last block (nothing pending when nks = 0)
        pin_acc64(t0);
        pin_acc64(t1);
        if (nks > 0) {
            wb_release(empty0 + 8u * (unsigned)st_prev, lane0);
            wb_promote_last(acc, t0, t1, (nks - 1) & 1, tab + 512u * (unsigned)((nks - 1) & 3), ps0, ps1, c);
        }
        wb_store<OUT_F32>(acc, false, out, g, n0, k0, N, K, r_in, c);
    }
}

// WB_PIPE 2: the consumers' steps (tile, block) as one stream across the CTA's tiles. Step j issues
// its MMAs into t[j % 2], then promotes step j - 1 into acc and, when that was its tile's last block, stores the
// tile and clears acc -- while step j (the next tile's first block) is on the tensor cores: the epilogue no
// longer drains the MMA pipe at every tile boundary (wgrad tiles are short: ceil(n_g / 128) blocks).
template <int OUT_F32>
__device__ __forceinline__ void wb_consume_stream(GroupInfo* gi, const int* __restrict__ sizes,
                                                  void* __restrict__ out, int G, long long M, int N, int K,
                                                  unsigned sbase, unsigned full0, unsigned empty0) {
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2, q = warp & 3, c = tid & 3, tw = tid & 127;
    const int r_in = wg * 64 + q * 16 + (lane >> 2);
    unsigned lane0 = lane == 0;
    asm volatile("" : "+r"(lane0));
    const unsigned tab = sbase + WB_TAB + 2048u * (unsigned)wg;
    const int total = wb_total(G, N, K), tstep = gridDim.x / WB_CLUSTER;
    const int rank = WB_CLUSTER > 1 ? (int)cluster_ctarank() : 0;
    int stage = 0;
    unsigned phase = 0;
    // the step iterator: tile t = (g, n0, k0) with nks blocks, block s of it; seek() moves t to the next tile
    // with blocks, storing zeros for the empty ones on the way
    int t = blockIdx.x / WB_CLUSTER, g = 0, n0 = 0, k0 = 0, nks = 0, s = 0;
    bool have = false;
    auto seek = [&]() {
        for (have = false; t < total; t += tstep) {
            int kb0;
            wb_tile(gi, sizes, G, M, N, K, t, rank, g, n0, k0, nks, kb0);
            nks = __shfl_sync(0xffffffffu, nks, 0);
            if (nks > 0) {
                have = true;
                return;
            }
            wb_store<OUT_F32>(nullptr, true, out, g, n0, k0, N, K, r_in, c);
        }
    };
    seek();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    float t0[64], t1[64];
    float ps0 = 0.f, ps1 = 0.f;  // the previous step's sa for the thread's two rows
    int st_prev = 0, pg = 0, pn0 = 0, pk0 = 0;  // its stage and tile
    bool pvalid = false, plast = false;         // there is a previous step; it was its tile's last block
    unsigned j = 0;                             // the step
    while (have) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {  // step j uses t[u] (j % 2 == u)
            if (!have) break;
            float* tn = u ? t1 : t0;
            float* tp = u ? t0 : t1;
            mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
            const unsigned st = sbase + (unsigned)stage * WB_STAGE_BYTES;
            {
                const unsigned long long da = wg_desc(st + 8192u * (unsigned)wg), db = wg_desc(st + WB_B);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3(tn, da + 2 * kk, db + 2 * kk, kk > 0);
                wg_commit();
            }
            sts32(tab + 512u * (j & 3u) + 4u * (unsigned)tw,
                  __float_as_uint(e8m0_f32(lds8(st + WB_SB + (unsigned)tw))));
            const float ns0 = e8m0_f32(lds8(st + WB_SA + (unsigned)r_in));
            const float ns1 = e8m0_f32(lds8(st + WB_SA + (unsigned)r_in + 8u));
            const int st_cur = stage;
            ring_next(stage, phase, WB_STAGES);
            named_bar_sync(1 + wg, 128);  // step j's table is complete
            wg_wait<1>();                 // step j - 1's MMAs retired
            if (pvalid) {
                wb_release(empty0 + 8u * (unsigned)st_prev, lane0);
                pin_acc64(tp);
                wb_promote(acc, tp, tab + 512u * ((j - 1u) & 3u), ps0, ps1, c);
                if (plast) {
                    wb_store<OUT_F32>(acc, false, out, pg, pn0, pk0, N, K, r_in, c);
#pragma unroll
                    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
                }
            }
            pvalid = true;
            plast = s == nks - 1;
            ps0 = ns0;
            ps1 = ns1;
            st_prev = st_cur;
            pg = g;
            pn0 = n0;
            pk0 = k0;
            ++j;
            if (++s == nks) {
                s = 0;
                t += tstep;
                seek();
            }
        }
    }
    wg_wait<0>();
    pin_acc64(t0);
    pin_acc64(t1);
    if (pvalid) {  // the last step (its tile's last block)
        wb_release(empty0 + 8u * (unsigned)st_prev, lane0);
        wb_promote_last(acc, t0, t1, (int)((j - 1u) & 1u), tab + 512u * ((j - 1u) & 3u), ps0, ps1, c);
        wb_store<OUT_F32>(acc, false, out, pg, pn0, pk0, N, K, r_in, c);
    }
}

// Kernel parameters: GM_TMA_ARGS (A = a_t [N, Mp] via tmA and B = b_t [K, Mp] via tmB, boxes of 128 rows x 128 B
// with the 128-byte swizzle; M = Mp, the padded token columns: an upper bound of the rows the groups cover), then
// tmSa over a_st [Mp/128, N] and tmSb over b_st [Mp/128, K], boxes of 1 row x 128 B. N, K, Mp multiples of 128.
#define WB_ARGS GM_TMA_ARGS, const __grid_constant__ TmaMap tmSa, const __grid_constant__ TmaMap tmSb
template <int OUT_F32>
__device__ __forceinline__ void wb_kernel(const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                          int N, int K, const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmSa,
                                          const TmaMap* tmSb) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int warp = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 5, 0);
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();
    const unsigned full0 = sbase + WB_BAR, empty0 = full0 + 8u * WB_STAGES;
    if (threadIdx.x == 0) {  // full: the producer's arrival + bytes; empty: every consumer warp of the cluster
        for (int j = 0; j < WB_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, WS_CONSUMER_WARPS * WB_CLUSTER);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#if WB_CLUSTER > 1
    cluster_sync();  // the peer's barriers exist before anything is multicast or arrived on
#endif
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + WB_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS)
            wb_produce(gi, sizes, G, M, N, K, tmA, tmB, tmSa, tmSb, sbase, full0, empty0);
    } else {
        setmaxnreg_inc<224>();
#if WB_PIPE == 2
        wb_consume_stream<OUT_F32>(gi, sizes, out, G, M, N, K, sbase, full0, empty0);
#else
        wb_consume<OUT_F32>(gi, sizes, out, G, M, N, K, sbase, full0, empty0);
#endif
    }
#if WB_CLUSTER > 1
    cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
#endif
}

#if WB_CLUSTER > 1
#define WB_ATTR __launch_bounds__(WS_THREADS, 1) __cluster_dims__(WB_CLUSTER, 1, 1)
#else
#define WB_ATTR __launch_bounds__(WS_THREADS, 1)
#endif
extern "C" __global__ void WB_ATTR bw_gmm_wgrad_f32(WB_ARGS) {
    wb_kernel<1>(sizes, out, G, M, N, K, &tmA, &tmB, &tmSa, &tmSb);
}
extern "C" __global__ void WB_ATTR bw_gmm_wgrad_bf16(WB_ARGS) {
    wb_kernel<0>(sizes, out, G, M, N, K, &tmA, &tmB, &tmSa, &tmSb);
}
