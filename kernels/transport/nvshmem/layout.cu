// Dispatch layout on the GPU: two kernels on one stream (moe_ep/transport/layout.py: build_layout).
//
// Input topk [T, K] int32 global expert ids (E experts, L = E / W per rank). Both kernels use the SAME grid of
// nb CTAs and the same split: CTA b owns tokens [b*tpc, (b+1)*tpc), its warp w the w-th contiguous sub-range.
// Every "rank among my entries" below is therefore  (sum over earlier CTAs) + (sum over earlier warps of the CTA)
// + (earlier 32-entry steps of the warp) + (lower lanes): the serial (token, slot) order, deterministic.
//
// ep_layout_count (nb CTAs):
//  A  per warp: (token, slot) entries per global expert (match_any + leader adds: order-free) and tokens per
//     destination rank (ballots). Invalid ids record EP_ERR_INVALID_EXPERT and are skipped.
//     CTA totals -> part[b][W + E] (global scratch). The last CTA to finish (atomic counter ctr[4]) turns part
//     into an exclusive prefix over CTAs (in CTA order) and the column totals = this rank's count row
//     [W rank counts | E expert counts], then
//  X  exchange: wait LAYOUT_FREE(u-1) from every rank, store the row into every rank's counts_in[me], signal
//     LAYOUT_READY(u).
// ep_layout_place (nb CTAs):
//  A' per-warp counts of its own chunk again (before waiting: overlaps the exchange), exclusive prefix over the
//     CTA's warps + part[b] = first rank of each warp's entries per expert / per destination rank.
//  X' wait LAYOUT_READY(u) from all, read what it needs of the W x (W+E) matrix cnt[s][.] (block 0 also copies
//     it to `counts`), then the grid signals LAYOUT_FREE(u) (last CTA, ctr[5]).
//  C  derived offsets (all from the matrix cnt[s][.]; block 0 writes info / group_sizes and checks overflows):
//       dst_base[r]  = sum_{s<me} cnt[s][r]            first row of my rows in rank r's receive buffer
//       send_off[r]  = sum_{r'<r} cnt[me][r']          sent-row order of the reference (rows sorted by (rank, token))
//       recv_off[s]  = sum_{s'<s} cnt[s'][me]          received rows from rank s start here (R = recv_off[W])
//       ret_base[s]  = sum_{r<me} cnt[s][r]            my returned rows go here in rank s's combine buffer
//       gstart[e]    = sum_{e'<e} sum_s cnt[s][W + me*L + e']   (unclamped; total = gstart[L])
//       posb[g]      = gstart_r[g%L] + sum_{s<me} cnt[s][W+g]   (r = g/L): my first expanded row of expert g at r
//     Capacity (cap = expand_cap, this rank's own): the receiver keeps the expanded rows < cap and no other, so
//       group_sizes[e] = min(gstart[e] + M_e, cap) - min(gstart[e], cap)   (= clamp(., 0, M_e)),
//       info gstart[e] = min(gstart[e], cap) (the prefix of the clamped sizes), N = min(total, cap),
//       tile_off[e] = sum_{e'<e} ceil(group_sizes[e']/128), dropped = total - N.
//     drop = 0 (dropless): total > cap is EP_ERR_EXPAND_OVERFLOW (every rank checks every receiver against its
//     own cap, so all ranks report it); the clamp still keeps every consumer inside the buffers. drop = 1: no
//     error, the rows past cap are the reference's dropped slots (build_layout(capacity=)).
//  D  per token / slot outputs (same warp split, same order => deterministic):
//       tok_dst[t][r]   row in rank r's receive buffer, -1 if t does not go to r
//       send_row_of[t][r] = send_off[r] + index of t among my tokens for r, -1 if none
//       slot_pos[t][j]  expanded row at the receiver = posb[g] + rank of (t, j) among my entries of expert g;
//                       drop = 0: -1 if >= this rank's cap (dropless assumes the same expand_capacity on
//                       every rank, and the overflow error is raised then);
//                       drop = 1: never clamped here (receivers' caps differ), expand_slot (dispatch.cu) drops
//                       pos >= the receiver's cap, so the slot gets no expanded row and no recv_pos entry.
// The expanded order this produces is the reference's expand_layout: expert, then source rank, then token, slot.
#include "ep_sync.cuh"

#define LAYOUT_WARPS 8
#define LAYOUT_THREADS (LAYOUT_WARPS * 32)
#define CTR_LAYOUT_COUNT 4
#define CTR_LAYOUT_PLACE 5

// Token range [t0, t1) of this warp (identical in both kernels: depends on T, gridDim.x, blockIdx.x, warp only).
__device__ __forceinline__ void layout_range(int T, int warp, int& t0, int& t1) {
    const int tpc = (T + gridDim.x - 1) / gridDim.x;
    const int c0 = min(T, (int)blockIdx.x * tpc), c1 = min(T, c0 + tpc);
    const int per = (c1 - c0 + LAYOUT_WARPS - 1) / LAYOUT_WARPS;
    t0 = min(c1, c0 + warp * per);
    t1 = min(c1, t0 + per);
}

// Bit mask of the destination ranks of token t (valid ids only).
__device__ __forceinline__ unsigned layout_rank_mask(const int* __restrict__ topk, int t, int K, int E, int L) {
    unsigned mask = 0;
#pragma unroll 8
    for (int j = 0; j < K; ++j) {
        int g = topk[t * K + j];
        if (g >= 0 && g < E) mask |= 1u << (g / L);
    }
    return mask;
}

// Per-warp counts of the warp's entries: h[g] += entries of expert g, rc[r] = tokens going to rank r.
template <bool REPORT>
__device__ __forceinline__ void layout_count_warp(const EpCtl& c, const int* __restrict__ topk, int t0, int t1,
                                                  int K, int E, int L, int lane, int* h, int* rc) {
    for (int base = t0 * K; base < t1 * K; base += 32) {
        int i = base + lane;
        int key = -1;
        if (i < t1 * K) {
            int g = topk[i];
            if (g < 0 || g >= E) {
                if (REPORT) ep_error(c, EP_ERR_INVALID_EXPERT, i / K, i % K, g, false);
            } else {
                key = g;
            }
        }
        unsigned m = __match_any_sync(0xFFFFFFFFu, key);
        if (key >= 0 && (__ffs(m) - 1) == lane) h[key] += __popc(m);
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < EP_MAX_RANKS; ++r) rc[r] = 0;
    for (int tb = t0; tb < t1; tb += 32) {
        int t = tb + lane;
        unsigned mask = t < t1 ? layout_rank_mask(topk, t, K, E, L) : 0u;
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) rc[r] += __popc(__ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u));
    }
}

extern "C" __global__ void __launch_bounds__(LAYOUT_THREADS)
ep_layout_count(const int* __restrict__ topk, int T, int K, int E, int W, int me, const ep_u64* __restrict__ peers,
                long long cnt_off, ep_u64* epoch_ctr, int* __restrict__ part, int* err, int* herr, unsigned* ctr,
                long long timeout_ns) {
    extern __shared__ int smem[];
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    const int L = E / W;
    const int RW = W + E;  // one count row
    int* hist = smem;                      // [LAYOUT_WARPS][E]
    int* myrow = hist + LAYOUT_WARPS * E;  // [RW]
    __shared__ int rcnt[LAYOUT_WARPS][EP_MAX_RANKS];
    __shared__ int is_last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nb = gridDim.x, b = blockIdx.x;
    int t0, t1;
    layout_range(T, warp, t0, t1);

    for (int i = tid; i < LAYOUT_WARPS * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();

    // ---- A: counts of this CTA's chunk -------------------------------------------------------------------------
    int rc[EP_MAX_RANKS];
    layout_count_warp<true>(c, topk, t0, t1, K, E, L, lane, hist + warp * E, rc);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) rcnt[warp][r] = rc[r];
    }
    __syncthreads();
    for (int col = tid; col < RW; col += blockDim.x) {
        int v = 0;
        for (int w = 0; w < LAYOUT_WARPS; ++w) v += col < W ? rcnt[w][col] : hist[w * E + col - W];
        part[(long long)b * RW + col] = v;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(ctr + CTR_LAYOUT_COUNT, 1u) == (unsigned)(nb - 1);
    __syncthreads();
    if (!is_last) return;

    // ---- last CTA: exclusive prefix over CTAs (CTA order), totals = my count row ------------------------------
    __threadfence();
    if (tid == 0) atomicExch(ctr + CTR_LAYOUT_COUNT, 0u);  // the next layout sees it by stream order
    for (int col = tid; col < RW; col += blockDim.x) {
        int run = 0;
        for (int b0 = 0; b0 < nb; b0 += 8) {
            int v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = b0 + k < nb ? __ldcg(part + (long long)(b0 + k) * RW + col) : 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (b0 + k < nb) part[(long long)(b0 + k) * RW + col] = run;
                run += v[k];
            }
        }
        myrow[col] = run;
    }
    __syncthreads();

    // ---- X: send the count row to every rank ------------------------------------------------------------------
    ep_cta_wait_all(c, peers[me], F_LAYOUT_FREE, epoch - 1, W, me);
    for (int i = tid; i < W * RW; i += blockDim.x) {
        int r = i / RW, k = i - r * RW;
        reinterpret_cast<int*>(peers[r] + cnt_off)[me * RW + k] = myrow[k];
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        ep_signal_all(peers, F_LAYOUT_READY, me, W, epoch);
    }
}

extern "C" __global__ void __launch_bounds__(LAYOUT_THREADS)
ep_layout_place(const int* __restrict__ topk, int T, int K, int E, int W, int me, const ep_u64* __restrict__ peers,
                long long cnt_off, ep_u64* epoch_ctr, int recv_cap, int expand_cap, int drop,
                const int* __restrict__ part,
                int* __restrict__ tok_dst, int* __restrict__ send_row_of, int* __restrict__ slot_pos,
                int* __restrict__ counts, int* __restrict__ info, int* __restrict__ group_sizes, int* err, int* herr,
                unsigned* ctr, long long timeout_ns) {
    extern __shared__ int smem[];
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    const int L = E / W;
    const int RW = W + E;
    int* hist = smem;                     // [LAYOUT_WARPS][E]  first rank of each warp's entries per expert
    int* tot = hist + LAYOUT_WARPS * E;   // [E]  sum_s cnt[s][W+g]
    int* posb = tot + E;                  // [E]
    __shared__ int rcnt[LAYOUT_WARPS][EP_MAX_RANKS];
    __shared__ int sm[EP_MAX_RANKS][EP_MAX_RANKS];  // cnt[s][r], r < W
    __shared__ int s_dst_base[EP_MAX_RANKS], s_send_off[EP_MAX_RANKS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x;
    const ep_u64 own = peers[me];
    int t0, t1;
    layout_range(T, warp, t0, t1);

    for (int i = tid; i < LAYOUT_WARPS * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();

    // ---- A': per-warp counts, prefix over warps from this CTA's base part[b] -----------------------------------
    {
        int rc[EP_MAX_RANKS];
        layout_count_warp<false>(c, topk, t0, t1, K, E, L, lane, hist + warp * E, rc);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < EP_MAX_RANKS; ++r) rcnt[warp][r] = rc[r];
        }
    }
    __syncthreads();
    for (int g = tid; g < E; g += blockDim.x) {
        int run = part[(long long)b * RW + W + g];
        for (int w = 0; w < LAYOUT_WARPS; ++w) {
            int v = hist[w * E + g];
            hist[w * E + g] = run;
            run += v;
        }
    }
    if (tid < W) {
        int run = part[(long long)b * RW + tid];
        for (int w = 0; w < LAYOUT_WARPS; ++w) {
            int v = rcnt[w][tid];
            rcnt[w][tid] = run;
            run += v;
        }
    }

    // ---- X': the count matrix ----------------------------------------------------------------------------------
    ep_cta_wait_all(c, own, F_LAYOUT_READY, epoch, W, me);  // (starts with the waits, ends with __syncthreads)
    const volatile int* cin = reinterpret_cast<const volatile int*>(own + cnt_off);
    for (int g = tid; g < E; g += blockDim.x) {
        int t = 0, p = 0;
        for (int s = 0; s < W; ++s) {
            int v = cin[s * RW + W + g];
            t += v;
            if (s < me) p += v;
        }
        tot[g] = t;
        posb[g] = p;
    }
    if (tid < W * W) sm[tid / W][tid % W] = cin[(tid / W) * RW + tid % W];
    if (b == 0)
        for (int i = tid; i < W * RW; i += blockDim.x) counts[i] = cin[i];
    ep_grid_signal(c, CTR_LAYOUT_PLACE, peers, F_LAYOUT_FREE, me, W, epoch, -1, -1, epoch_ctr);  // all read their part

    // ---- C: offsets ---------------------------------------------------------------------------------------------
    if (tid < W) {
        int db = 0, so = 0;
        for (int s = 0; s < me; ++s) db += sm[s][tid];
        for (int r = 0; r < tid; ++r) so += sm[me][r];
        s_dst_base[tid] = db;
        s_send_off[tid] = so;
    }
    if (b == 0 && tid == 0) {
        int run = 0;
        for (int s = 0; s < W; ++s) {
            info[I_RECV_OFF + s] = run;
            run += sm[s][me];
        }
        info[I_RECV_OFF + W] = run;
        info[I_R] = run;
        run = 0;
        for (int r = 0; r < W; ++r) {
            info[I_SEND_OFF + r] = run;
            run += sm[me][r];
        }
        info[I_SEND_OFF + W] = run;
        for (int s = 0; s < W; ++s) {
            int bs = 0;
            for (int r = 0; r < me; ++r) bs += sm[s][r];
            info[I_RET_BASE + s] = bs;
        }
        for (int r = 0; r < W; ++r) {
            int bs = 0, tt = 0;
            for (int s = 0; s < W; ++s) {
                if (s < me) bs += sm[s][r];
                tt += sm[s][r];
            }
            info[I_DST_BASE + r] = bs;
            if (tt > recv_cap) ep_error(c, EP_ERR_RECV_OVERFLOW, r, tt, recv_cap, false);
        }
    }
    __syncthreads();
    if (warp < W) {  // warp r: group starts of receiver r (exclusive scan of tot over its L experts)
        const int r = warp;
        int carry = 0, tcarry = 0;
        for (int e0 = 0; e0 < L; e0 += 32) {
            const int e = e0 + lane;
            const int m = e < L ? tot[r * L + e] : 0;
            int inc = m;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int a = __shfl_up_sync(0xFFFFFFFFu, inc, o);
                if (lane >= o) inc += a;
            }
            const int gs = carry + inc - m;  // unclamped: the rows the senders address (slot_pos)
            // kept rows (< cap; only meaningful for r == me, whose cap this is) and their 128-row scale tiles
            const int mk = min(carry + inc, expand_cap) - min(gs, expand_cap);
            const int tm = (mk + 127) / 128;
            int tinc = tm;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int ta = __shfl_up_sync(0xFFFFFFFFu, tinc, o);
                if (lane >= o) tinc += ta;
            }
            if (e < L) {
                posb[r * L + e] += gs;
                if (b == 0 && r == me) {
                    group_sizes[e] = mk;
                    info[I_GSTART + e] = min(gs, expand_cap);
                    info[I_GSTART + L + 1 + e] = tcarry + tinc - tm;
                }
            }
            carry += __shfl_sync(0xFFFFFFFFu, inc, 31);
            tcarry += __shfl_sync(0xFFFFFFFFu, tinc, 31);
        }
        if (b == 0 && lane == 0) {
            if (r == me) {
                const int n = min(carry, expand_cap);
                info[I_GSTART + L] = n;
                info[I_GSTART + L + 1 + L] = tcarry;
                info[I_N] = n;
                info[I_DROPPED(L)] = carry - n;
            }
            if (!drop && carry > expand_cap) ep_error(c, EP_ERR_EXPAND_OVERFLOW, r, carry, expand_cap, false);
        }
    }
    __syncthreads();

    // ---- D: per token / slot outputs ----------------------------------------------------------------------------
    const unsigned lt = ep_lanemask_lt();
    int* h = hist + warp * E;
    for (int base = t0 * K; base < t1 * K; base += 32) {
        int i = base + lane;
        int key = -1;
        if (i < t1 * K) {
            int g = topk[i];
            if (g >= 0 && g < E) key = g;
        }
        unsigned m = __match_any_sync(0xFFFFFFFFu, key);
        int before = key >= 0 ? h[key] : 0;
        __syncwarp();
        if (key >= 0 && (__ffs(m) - 1) == lane) h[key] = before + __popc(m);
        __syncwarp();
        if (i < t1 * K) {
            int pos = -1;
            if (key >= 0) {
                pos = posb[key] + before + __popc(m & lt);
                if (!drop && pos >= expand_cap) pos = -1;  // drop: the receiver clamps with its own cap
            }
            slot_pos[i] = pos;
        }
    }
    int run[EP_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EP_MAX_RANKS; ++r) run[r] = rcnt[warp][r];
    for (int tb = t0; tb < t1; tb += 32) {
        int t = tb + lane;
        unsigned mask = t < t1 ? layout_rank_mask(topk, t, K, E, L) : 0u;
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) {
            unsigned bl = __ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u);
            if (r < W && t < t1) {
                int d = -1, so = -1;
                if ((mask >> r) & 1u) {
                    int idx = run[r] + __popc(bl & lt);
                    so = s_send_off[r] + idx;
                    d = s_dst_base[r] + idx;
                    if (d >= recv_cap) d = -1;
                }
                tok_dst[t * W + r] = d;
                send_row_of[t * W + r] = so;
            }
            run[r] += __popc(bl);
        }
    }
}
