// Dispatch layout on the GPU (one CTA of LAYOUT_WARPS warps; moe_ep/comm/cuda_transport.py:build_layout).
//
// Input topk [T, K] int32 global expert ids (E experts, L = E / W per rank). Warp w owns tokens [t0, t1).
//  A  counts: per warp, (token, slot) entries per global expert (match_any + leader adds: order-free) and tokens
//     per destination rank (ballots). Invalid ids record EP_ERR_INVALID_EXPERT and are skipped.
//  B  exclusive prefix over warps (in place), totals = this rank's count row  [W rank counts | E expert counts].
//  X  exchange: wait LAYOUT_FREE(u-1) from every rank, store the row into every rank's counts_in[me], signal
//     LAYOUT_READY(u), wait LAYOUT_READY(u) from all, copy the W x (W+E) matrix out, signal LAYOUT_FREE(u).
//  C  derived offsets (all from the matrix cnt[s][.]):
//       dst_base[r]  = sum_{s<me} cnt[s][r]            first row of my rows in rank r's receive buffer
//       send_off[r]  = sum_{r'<r} cnt[me][r']          sent-row order of the reference (rows sorted by (rank, token))
//       recv_off[s]  = sum_{s'<s} cnt[s'][me]          received rows from rank s start here (R = recv_off[W])
//       ret_base[s]  = sum_{r<me} cnt[s][r]            my returned rows go here in rank s's combine buffer
//       gstart[e]    = sum_{e'<e} sum_s cnt[s][W + me*L + e']   (N = gstart[L]), tile_off[e] = sum ceil(M/128)
//       posb[g]      = gstart_r[g%L] + sum_{s<me} cnt[s][W+g]   (r = g/L): my first expanded row of expert g at r
//  D  per token / slot outputs in a second walk (same warp split, same order => deterministic):
//       tok_dst[t][r]   row in rank r's receive buffer, -1 if t does not go to r
//       send_row_of[t][r] = send_off[r] + index of t among my tokens for r, -1 if none
//       slot_pos[t][j]  expanded row at the receiver = posb[g] + rank of (t, j) among my entries of expert g
// The expanded order this produces is the reference's expand_layout: expert, then source rank, then token, slot.
#include "ep_sync.cuh"

#define LAYOUT_WARPS 32

// info[] indices (int32, written by the layout; read by the other kernels and the host)
#define I_R 0          // rows this rank receives
#define I_N 1          // expanded rows on this rank
#define I_RECV_OFF 2   // [W+1]
#define I_RET_BASE 11  // [W]
#define I_SEND_OFF 19  // [W+1]
#define I_DST_BASE 28  // [W]
#define I_GSTART 36    // [L+1]; tile offsets follow at I_GSTART + L + 1 ([L+1])

extern "C" __global__ void __launch_bounds__(LAYOUT_WARPS * 32, 1)
ep_layout(const int* __restrict__ topk, int T, int K, int E, int W, int me, const ep_u64* __restrict__ peers,
          long long cnt_off, ep_u64 epoch, int recv_cap, int expand_cap, int* __restrict__ tok_dst,
          int* __restrict__ send_row_of, int* __restrict__ slot_pos, int* __restrict__ counts,
          int* __restrict__ info, int* __restrict__ group_sizes, int* err, int* herr, unsigned* ctr,
          long long timeout_ns) {
    extern __shared__ int smem[];
    const EpCtl c{err, herr, ctr, timeout_ns};
    const int L = E / W;
    const int RW = W + E;  // one count row
    int* hist = smem;                          // [LAYOUT_WARPS][E]
    int* myrow = hist + LAYOUT_WARPS * E;      // [RW]
    int* posb = myrow + RW;                    // [E]
    __shared__ int rcnt[LAYOUT_WARPS][EP_MAX_RANKS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (T + LAYOUT_WARPS - 1) / LAYOUT_WARPS;
    const int t0 = min(T, warp * per), t1 = min(T, t0 + per);
    const ep_u64 own = peers[me];

    for (int i = tid; i < LAYOUT_WARPS * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();

    // ---- A: counts -------------------------------------------------------------------------------------------
    int* h = hist + warp * E;
    for (int base = t0 * K; base < t1 * K; base += 32) {
        int i = base + lane;
        int key = -1;
        if (i < t1 * K) {
            int g = topk[i];
            if (g < 0 || g >= E) {
                ep_error(c, EP_ERR_INVALID_EXPERT, i / K, i % K, g, false);
            } else {
                key = g;
            }
        }
        unsigned m = __match_any_sync(0xFFFFFFFFu, key);
        if (key >= 0 && (__ffs(m) - 1) == lane) h[key] += __popc(m);
        __syncwarp();
    }
    int rc[EP_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EP_MAX_RANKS; ++r) rc[r] = 0;
    for (int tb = t0; tb < t1; tb += 32) {
        int t = tb + lane;
        unsigned mask = 0;
        if (t < t1) {
            for (int j = 0; j < K; ++j) {
                int g = topk[t * K + j];
                if (g >= 0 && g < E) mask |= 1u << (g / L);
            }
        }
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) rc[r] += __popc(__ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u));
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) rcnt[warp][r] = rc[r];
    }
    __syncthreads();

    // ---- B: exclusive prefix over warps; totals into myrow -----------------------------------------------------
    for (int g = tid; g < E; g += blockDim.x) {
        int run = 0;
        for (int w = 0; w < LAYOUT_WARPS; ++w) {
            int v = hist[w * E + g];
            hist[w * E + g] = run;
            run += v;
        }
        myrow[W + g] = run;
    }
    if (tid < W) {
        int run = 0;
        for (int w = 0; w < LAYOUT_WARPS; ++w) {
            int v = rcnt[w][tid];
            rcnt[w][tid] = run;
            run += v;
        }
        myrow[tid] = run;
    }
    __syncthreads();

    // ---- X: exchange the count rows ---------------------------------------------------------------------------
    ep_cta_wait_all(c, own, F_LAYOUT_FREE, epoch - 1, W, me);
    for (int i = tid; i < W * RW; i += blockDim.x) {
        int r = i / RW, k = i - r * RW;
        reinterpret_cast<int*>(peers[r] + cnt_off)[me * RW + k] = myrow[k];
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        ep_signal_all(peers, F_LAYOUT_READY, me, W, epoch);
    }
    ep_cta_wait_all(c, own, F_LAYOUT_READY, epoch, W, me);
    const volatile int* cin = reinterpret_cast<const volatile int*>(own + cnt_off);
    for (int i = tid; i < W * RW; i += blockDim.x) counts[i] = cin[i];
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        ep_signal_all(peers, F_LAYOUT_FREE, me, W, epoch);
    }

    // ---- C: offsets ---------------------------------------------------------------------------------------------
    if (tid == 0) {
        int run = 0;
        for (int s = 0; s < W; ++s) {
            info[I_RECV_OFF + s] = run;
            run += counts[s * RW + me];
        }
        info[I_RECV_OFF + W] = run;
        info[I_R] = run;
        run = 0;
        for (int r = 0; r < W; ++r) {
            info[I_SEND_OFF + r] = run;
            run += counts[me * RW + r];
        }
        info[I_SEND_OFF + W] = run;
        for (int s = 0; s < W; ++s) {
            int b = 0;
            for (int r = 0; r < me; ++r) b += counts[s * RW + r];
            info[I_RET_BASE + s] = b;
        }
        for (int r = 0; r < W; ++r) {
            int b = 0, tot = 0;
            for (int s = 0; s < W; ++s) {
                if (s < me) b += counts[s * RW + r];
                tot += counts[s * RW + r];
            }
            info[I_DST_BASE + r] = b;
            if (tot > recv_cap) ep_error(c, EP_ERR_RECV_OVERFLOW, r, tot, recv_cap, false);
        }
        int gs = 0, ts = 0;
        for (int e = 0; e < L; ++e) {
            int m = 0;
            for (int s = 0; s < W; ++s) m += counts[s * RW + W + me * L + e];
            group_sizes[e] = m;
            info[I_GSTART + e] = gs;
            info[I_GSTART + L + 1 + e] = ts;
            gs += m;
            ts += (m + 127) / 128;
        }
        info[I_GSTART + L] = gs;
        info[I_GSTART + L + 1 + L] = ts;
        info[I_N] = gs;
    }
    for (int g = tid; g < E; g += blockDim.x) {  // posb[g] for every receiver r = g / L
        int r = g / L, e0 = r * L;
        int start = 0;
        for (int e = e0; e < g; ++e)
            for (int s = 0; s < W; ++s) start += counts[s * RW + W + e];
        for (int s = 0; s < me; ++s) start += counts[s * RW + W + g];
        posb[g] = start;
    }
    if (tid < W) {  // expanded rows at each receiver
        int n = 0;
        for (int g = tid * L; g < (tid + 1) * L; ++g)
            for (int s = 0; s < W; ++s) n += counts[s * RW + W + g];
        if (n > expand_cap) ep_error(c, EP_ERR_EXPAND_OVERFLOW, tid, n, expand_cap, false);
    }
    __syncthreads();

    // ---- D: per token / slot outputs ----------------------------------------------------------------------------
    const unsigned lt = ep_lanemask_lt();
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
                if (pos >= expand_cap) pos = -1;
            }
            slot_pos[i] = pos;
        }
    }
    int run[EP_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EP_MAX_RANKS; ++r) run[r] = rcnt[warp][r];
    for (int tb = t0; tb < t1; tb += 32) {
        int t = tb + lane;
        unsigned mask = 0;
        if (t < t1) {
            for (int j = 0; j < K; ++j) {
                int g = topk[t * K + j];
                if (g >= 0 && g < E) mask |= 1u << (g / L);
            }
        }
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) {
            unsigned b = __ballot_sync(0xFFFFFFFFu, (mask >> r) & 1u);
            if (r < W && t < t1) {
                int d = -1, so = -1;
                if ((mask >> r) & 1u) {
                    int idx = run[r] + __popc(b & lt);
                    so = info[I_SEND_OFF + r] + idx;
                    d = info[I_DST_BASE + r] + idx;
                    if (d >= recv_cap) d = -1;
                }
                tok_dst[t * W + r] = d;
                send_row_of[t * W + r] = so;
            }
            run[r] += __popc(b);
        }
    }
}
