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
//   * mainloop per consumer warpgroup (64 rows), pipelined within each tile: block s's 4 x m64n128k32 into
//     t[s % 2] (two alternating accumulators: acc, t0, t1 = 192 fp32 per thread), then wait for block s - 1's,
//     release its stage and promote it while block s's MMAs run; the tile's last block is promoted after a full
//     wait, then the epilogue (the MMA pipe drains at every tile boundary).
//     Both scales vary per output element here (sa per row, sb per column), so while the MMAs run each thread
//     decodes one sb byte of the stage into the warpgroup's fp32 table (4 buffers, one named barrier per step),
//     and the promotion is acc += (t * sb[col]) * sa[row]: two fp32 ops per element.
//   * epilogue from registers: fp32 as 8-byte stores (a quad writes one 32-byte sector), bf16 as 4-byte stores
//     of bf16 pairs (a quad writes 16 contiguous bytes).
// Shared memory (all dynamic): 6 x 33792 ring + 2 x 2048 scale tables + barriers + 9 GroupInfo = 207376 B; ptxas:
// 168 registers at launch (consumers 224 after setmaxnreg), no spills, no wgmma serialization.
// The two-scale promotion (2 fp32 ops per element, the scale table, one named barrier per step) is what limits
// this kernel below the fprop one on the same mainloop. Measured rates and the schedules tried and dropped (one step
// stream across tiles, 2-CTA clusters multicasting A; their code is at f74eaac): docs/design-kernels.md,
// "Blockwise FP8 grouped GEMMs".

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

static_assert(WB_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

// Tile t -> group g, row tile n0 (of N), column tile k0 (of K); the group's first padded block and its k steps
// from the warp's own scan.
__device__ __forceinline__ void wb_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                        int K, int t, int& g, int& n0, int& k0, int& nks, int& kb0) {
    const int nt = N / 128, kt = K / 128;
    g = t / (nt * kt);
    const int rem = t - g * nt * kt;
    n0 = (rem / kt) * 128;
    k0 = (rem % kt) * 128;
    gm_scan_groups(sizes, G, M, GM_BY_GROUP, g, gi);
    __syncwarp();
    nks = (int)(((unsigned)gi->rows + 127u) >> 7);
    kb0 = gi->toff;
    __syncwarp();
}

__device__ __forceinline__ int wb_total(int G, int N, int K) { return G * (N / 128) * (K / 128); }

__device__ __forceinline__ void wb_produce(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                           int K, const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmSa,
                                           const TmaMap* tmSb, unsigned sbase, unsigned full0, unsigned empty0) {
    const int lane = threadIdx.x & 31;
    const int total = wb_total(G, N, K);
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, k0, nks, kb0;
        wb_tile(gi, sizes, G, M, N, K, t, g, n0, k0, nks, kb0);
        for (int s = 0; s < nks; ++s) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * WB_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);
                mbar_expect_tx(full, 32768u + 256u);
                const int kb = kb0 + s;
                tma_2d(st, tmA, kb * 128, n0, full);
                tma_2d(st + WB_SA, tmSa, n0, kb, full);
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
// from acc (an empty group's tile: acc is zeros). fp32: 8-byte stores (a quad writes one 32-byte sector); bf16:
// 4-byte stores.
template <int OUT_F32>
__device__ __forceinline__ void wb_store(const float* acc, void* __restrict__ out, int g, int n0, int k0, int N,
                                         int K, int r_in, int c) {
    const long long orow = (long long)g * N + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long row = orow + r_in + 8 * h;
        if (OUT_F32) {
            float* rowp = static_cast<float*>(out) + row * K + k0;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *reinterpret_cast<float2*>(rowp + 8 * j + 2 * c) =
                    make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        } else {
            // 4-byte stores of bf16 pairs (a quad writes 16 contiguous bytes): no shuffles
            unsigned short* rowp = static_cast<unsigned short*>(out) + row * K + k0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                unsigned pk;
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
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int g, n0, k0, nks, kb0;
        wb_tile(gi, sizes, G, M, N, K, t, g, n0, k0, nks, kb0);
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
                    mbar_arrive_if(empty0 + 8u * (unsigned)st_prev, lane0);
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
            mbar_arrive_if(empty0 + 8u * (unsigned)st_prev, lane0);
            wb_promote_last(acc, t0, t1, (nks - 1) & 1, tab + 512u * (unsigned)((nks - 1) & 3), ps0, ps1, c);
        }
        wb_store<OUT_F32>(acc, out, g, n0, k0, N, K, r_in, c);
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
    if (threadIdx.x == 0) {  // full: the producer's arrival + bytes; empty: every consumer warp
        for (int j = 0; j < WB_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, WS_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + WB_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS)
            wb_produce(gi, sizes, G, M, N, K, tmA, tmB, tmSa, tmSb, sbase, full0, empty0);
    } else {
        setmaxnreg_inc<224>();
        wb_consume<OUT_F32>(gi, sizes, out, G, M, N, K, sbase, full0, empty0);
    }
}

#define WB_ATTR __launch_bounds__(WS_THREADS, 1)
extern "C" __global__ void WB_ATTR bw_gmm_wgrad_f32(WB_ARGS) {
    wb_kernel<1>(sizes, out, G, M, N, K, &tmA, &tmB, &tmSa, &tmSb);
}
extern "C" __global__ void WB_ATTR bw_gmm_wgrad_bf16(WB_ARGS) {
    wb_kernel<0>(sizes, out, G, M, N, K, &tmA, &tmB, &tmSa, &tmSb);
}
