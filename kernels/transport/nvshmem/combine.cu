// Combine of the NVSHMEM transport (and the dispatch backward, which is the same data movement), one kernel:
// ep_combine<YT, BWD> (moe_ep/transport/nvshmem/buffer.py launches it; protocol: docs/design-transport.md).
//
// Expert side, per received row i (from rank s, index i - recv_off[s] among that rank's rows): acc = 0; for each
//   top-k slot j in order with expanded row n = recv_pos[i][j]:  acc += y[n] * w[n]  (forward)   or   acc += y[n]
//   (BWD: dx rows) in fp32 with separate multiply and add (no FMA contraction: the reference's slot_reduce), then
//   one YT row into rank s's combine buffer at row ret_base[s] + (i - recv_off[s]) -- the row's position in rank
//   s's sent-row order. BWD also returns the top-k weight gradients of the row ([K] fp32, 0 for other ranks' slots).
// Source side, per token t: out[t] = YT(sum over ranks r = 0..W-1 in order of row send_row_of[t][r]) in fp32 (the
//   reference's rank_reduce); BWD: d topk_w[t][j] = returned weight gradient of slot j from the row sent to
//   rank(g_tj).
// Each lane owns 8 consecutive elements per 256-element step (16-byte bf16 / 32-byte fp32 accesses).
// The sums and products are mx_add / mx_mul (PTX without .ftz): NVRTC builds with -ftz=true, which would flush
// subnormal terms and results that the reference keeps.
#include "common.cuh"
#include "ep_sync.cuh"

#define YT_F32 0
#define YT_BF16 1
#define COMB_THREADS 512
// rows whose loads are issued together (slots on the expert side, ranks on the source side), summed in order
// afterwards; sized for registers (the kernel holds both sides' state; 2 CTAs of 512 threads per SM)
#define COMB_BATCH_SEND 2
#define COMB_BATCH_RECV 4


// 8 elements as raw bits (bf16: one 16-byte load, fp32: two); widened by raw8_to_f32 when they are added, so a
// batch of rows in flight costs 4 (bf16) / 8 (fp32) registers per row
template <int YT, bool CG>
__device__ __forceinline__ void load8_raw(const unsigned char* p, uint4& a, uint4& b) {
    a = CG ? ep_ld16cg(p) : ep_ld16(p);
    if (YT != YT_BF16) b = CG ? ep_ld16cg(p + 16) : ep_ld16(p + 16);
}

template <int YT>
__device__ __forceinline__ void raw8_to_f32(const uint4& a, const uint4& b, float* v) {
    if (YT == YT_BF16) {
        unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    } else {
        v[0] = __uint_as_float(a.x);
        v[1] = __uint_as_float(a.y);
        v[2] = __uint_as_float(a.z);
        v[3] = __uint_as_float(a.w);
        v[4] = __uint_as_float(b.x);
        v[5] = __uint_as_float(b.y);
        v[6] = __uint_as_float(b.z);
        v[7] = __uint_as_float(b.w);
    }
}

template <int YT>
__device__ __forceinline__ void store8(unsigned char* p, const float* v) {
    if (YT == YT_BF16) {
        ep_st16(p, make_uint4(ep_f2bf(v[0]) | (ep_f2bf(v[1]) << 16), ep_f2bf(v[2]) | (ep_f2bf(v[3]) << 16),
                              ep_f2bf(v[4]) | (ep_f2bf(v[5]) << 16), ep_f2bf(v[6]) | (ep_f2bf(v[7]) << 16)));
    } else {
        ep_st16(p, make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                              __float_as_uint(v[3])));
        ep_st16(p + 16, make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                                   __float_as_uint(v[7])));
    }
}

// Expert side, one received row i from rank s (one warp): slot-ordered (weighted) fp32 sum, one YT row stored into
// rank s's combine buffer at row dst (BWD and meta: also the top-k weight gradients of the row). Only the elements
// [c_begin, c_end) (multiples of 256: a column piece; piece 0 passes meta).
template <int YT, int BWD>
__device__ __forceinline__ void comb_send_row(int i, long long dst, unsigned char* orow_base, float* cmeta_s,
                                              const unsigned char* __restrict__ y, const float* __restrict__ w,
                                              const int* __restrict__ recv_pos, int H, int K, int lane, bool meta,
                                              int c_begin, int c_end) {
    const int es = YT == YT_BF16 ? 2 : 4;
    int pos = lane < K ? recv_pos[(long long)i * K + lane] : -1;
    const unsigned vm = __ballot_sync(0xFFFFFFFFu, pos >= 0);
    if (BWD && meta && lane < K) cmeta_s[dst * K + lane] = pos >= 0 ? w[pos] : 0.f;
    unsigned char* orow = orow_base + dst * H * es;
    const float wl = (!BWD && pos >= 0) ? w[pos] : 0.f;  // slot weight, loaded once per row
    for (int c0 = c_begin; c0 < min(H, c_end); c0 += 256) {
        const int e0 = c0 + 8 * lane;
        float acc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
        // slots in top-k order, COMB_BATCH_SEND rows loaded together (independent loads in flight), then added in
        // the same order: the sum is bitwise the serial one
        for (unsigned m = vm; m;) {
            long long nb[COMB_BATCH_SEND];
            float wb[COMB_BATCH_SEND];
            bool ok[COMB_BATCH_SEND];
#pragma unroll
            for (int q = 0; q < COMB_BATCH_SEND; ++q) {
                ok[q] = m != 0;  // warp-uniform
                const int j = ok[q] ? __ffs(m) - 1 : 0;
                nb[q] = __shfl_sync(0xFFFFFFFFu, pos, j);
                wb[q] = __shfl_sync(0xFFFFFFFFu, wl, j);
                if (ok[q]) m &= m - 1;
            }
            uint4 ra[COMB_BATCH_SEND], rb[COMB_BATCH_SEND];
#pragma unroll
            for (int q = 0; q < COMB_BATCH_SEND; ++q)
                if (ok[q] && e0 < H) load8_raw<YT, false>(y + (nb[q] * H + e0) * es, ra[q], rb[q]);
#pragma unroll
            for (int q = 0; q < COMB_BATCH_SEND; ++q) {
                if (ok[q] && e0 < H) {
                    float v[8];
                    raw8_to_f32<YT>(ra[q], rb[q], v);
                    if (BWD) {
#pragma unroll
                        for (int k = 0; k < 8; ++k) acc[k] = mx_add(acc[k], v[k]);
                    } else {
#pragma unroll
                        for (int k = 0; k < 8; ++k) acc[k] = mx_add(acc[k], mx_mul(v[k], wb[q]));
                    }
                }
            }
        }
        if (e0 < H) store8<YT>(orow + (long long)e0 * es, acc);
    }
}

// Received rows in an order interleaving the source ranks (= the destinations of the returned rows): v -> rank
// s = v % W, its (v / W)-th row. Rows grouped by source (i ascending) made every rank store into the same one or
// two peers at a time (incast on their NVLink ports, the others idle); interleaved, each rank's stores spread over
// all peers at once, like the dispatch's. Returns false for the holes (v / W >= rows of s).
__device__ __forceinline__ bool comb_row_of(int v, int W, const int* roff, int R, int& s, int& i) {
    s = v % W;
    i = roff[s] + v / W;
    return i < roff[s + 1] && i < R;
}

// Prologue of ep_combine: peers, received-row offsets per source rank and the return bases into shared memory, then wait until every peer freed its combine buffer (epoch - 1).
// Returns the work items V = W * (most rows from one rank) of comb_row_of, and R (rows received, capped).
__device__ __forceinline__ int comb_send_setup(const EpCtl& c, const ep_u64* __restrict__ peers_g,
                                               const int* __restrict__ info, int W, int me, int recv_cap,
                                               ep_u64 epoch, ep_u64* peers, int* roff, int* rbase, int& R) {
    if (threadIdx.x < W) {
        peers[threadIdx.x] = peers_g[threadIdx.x];
        rbase[threadIdx.x] = info[I_RET_BASE + threadIdx.x];
    }
    if (threadIdx.x <= W) roff[threadIdx.x] = info[I_RECV_OFF + threadIdx.x];
    __syncthreads();
    ep_cta_wait_all(c, peers[me], F_COMB_FREE, epoch - 1, W, me);
    R = min(info[I_R], recv_cap);
    int maxc = 0;
    for (int s = 0; s < W; ++s) maxc = max(maxc, roff[s + 1] - roff[s]);
    return W * maxc;
}

// Source side, one token t (one warp): rank-ordered fp32 sum of its returned rows (BWD: top-k weight gradients).
// The rows were written by peers during this kernel: L2-only loads.
template <int YT, int BWD>
__device__ __forceinline__ void comb_recv_token(int t, int sr, unsigned char* __restrict__ out,
                                                float* __restrict__ dtw, const int* __restrict__ send_row_of,
                                                const int* __restrict__ topk, const unsigned char* comb,
                                                const float* cmeta, int H, int K, int L, int W, int lane) {
    const int es = YT == YT_BF16 ? 2 : 4;
    // fewer fp32 rows in flight (the kernel also holds the expert side's registers: no spills)
    constexpr int NB = YT != YT_BF16 ? 2 : COMB_BATCH_RECV;
    const unsigned hm = __ballot_sync(0xFFFFFFFFu, sr >= 0);
    if (BWD && lane < K) {
        const int g = topk[(long long)t * K + lane];
        float gw = 0.f;
        if (g >= 0 && g < L * W) {
            const int row = send_row_of[(long long)t * W + g / L];
            if (row >= 0) gw = __ldcg(cmeta + (long long)row * K + lane);
        }
        dtw[(long long)t * K + lane] = gw;
    }
    for (int c0 = 0; c0 < H; c0 += 256) {
        const int e0 = c0 + 8 * lane;
        float acc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
        // ranks in order, NB rows loaded together, added in the same order (bitwise the serial sum)
        for (unsigned m = hm; m;) {
            long long rw[NB];
            bool ok[NB];
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                ok[q] = m != 0;  // warp-uniform
                rw[q] = __shfl_sync(0xFFFFFFFFu, sr, ok[q] ? __ffs(m) - 1 : 0);
                if (ok[q]) m &= m - 1;
            }
            uint4 ra[NB], rb[NB];
#pragma unroll
            for (int q = 0; q < NB; ++q)
                if (ok[q] && e0 < H) load8_raw<YT, true>(comb + (rw[q] * H + e0) * es, ra[q], rb[q]);
#pragma unroll
            for (int q = 0; q < NB; ++q)
                if (ok[q] && e0 < H) {
                    float v[8];
                    raw8_to_f32<YT>(ra[q], rb[q], v);
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[k] = mx_add(acc[k], v[k]);
                }
        }
        if (e0 < H) store8<YT>(out + ((long long)t * H + e0) * es, acc);
    }
}

// ep_combine<YT, BWD>: both sides in ONE kernel with the per-row handoff of ep_sync.cuh:
//   A  (after COMB_FREE(u-1) of every rank) the first send_warps (1..16) warps of every CTA take received rows by
//      ticket (ctr[6]) in the interleaved order of comb_row_of, each row as `pieces` (1..4) tickets of contiguous
//      256-element column ranges, and store each piece (comb_send_row); then lane 0 stores
//      rflag[dst][piece] = u into the destination rank's region (release, after every lane fenced its stores).
//   B  the other warps at once, the senders when no row is left: warps take tokens by ticket (ctr[7]) in ascending
//      order (the order the expert sides return them: each processes a source's rows in token order); lane r < W
//      waits rflag[send_row_of[t][r]][*] >= u (rows rank r received: tok_dst[t][r] >= 0), then the rank-ordered
//      sum (comb_recv_token, L2-only loads).
//   The last CTA signals COMB_FREE(u) and resets the tickets. COMB_READY is not used (per-row flags replace it).
// The pieces split only the columns: every element's sum has the same terms in the same order whatever the schedule.
template <int YT, int BWD>
__global__ void __launch_bounds__(COMB_THREADS) ep_combine(
    const unsigned char* __restrict__ y, const float* __restrict__ w, const int* __restrict__ recv_pos,
    const int* __restrict__ info, int recv_cap, unsigned char* __restrict__ out, float* __restrict__ dtw,
    const int* __restrict__ send_row_of, const int* __restrict__ tok_dst, const int* __restrict__ topk, int T, int H,
    int K, int L, int W, int me, const ep_u64* __restrict__ peers_g, long long comb_off, long long cmeta_off,
    long long rflag_off, int send_warps, int pieces, ep_u64* epoch_ctr, int* err, int* herr, unsigned* ctr,
    long long timeout_ns) {
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    __shared__ ep_u64 peers[EP_MAX_RANKS];
    __shared__ int roff[EP_MAX_RANKS + 1], rbase[EP_MAX_RANKS];
    int R;
    const int V = comb_send_setup(c, peers_g, info, W, me, recv_cap, epoch, peers, roff, rbase, R);
    const int lane = threadIdx.x & 31;

    // ---- A: expert side (warps < send_warps of each CTA; the others start on B at once) ----------------------------
    const int steps = (H + 255) >> 8;  // 256-element steps per row, split into `pieces` column ranges
    while ((int)(threadIdx.x >> 5) < send_warps) {
        const int tk = ep_warp_ticket(c, CTR_TICKET_SEND);
        if (tk >= V * pieces) break;
        const int v = tk / pieces, p = tk % pieces;
        int s, i;
        if (!comb_row_of(v, W, roff, R, s, i)) continue;
        const long long dst = rbase[s] + (i - roff[s]);
        comb_send_row<YT, BWD>(i, dst, reinterpret_cast<unsigned char*>(peers[s] + comb_off),
                               reinterpret_cast<float*>(peers[s] + cmeta_off), y, w, recv_pos, H, K, lane, p == 0,
                               256 * (steps * p / pieces), 256 * (steps * (p + 1) / pieces));
        ep_warp_release();
        if (lane == 0) ep_st_release(reinterpret_cast<ep_u64*>(peers[s] + rflag_off) + dst * pieces + p, epoch);
    }

    // ---- B: source side -------------------------------------------------------------------------------------------
    const ep_u64 own = peers[me];
    const unsigned char* comb = reinterpret_cast<const unsigned char*>(own + comb_off);
    const float* cmeta = reinterpret_cast<const float*>(own + cmeta_off);
    const ep_u64* rflag = reinterpret_cast<const ep_u64*>(own + rflag_off);
    while (true) {
        const int t = ep_warp_ticket(c, CTR_TICKET_RECV);
        if (t >= T) break;
        const int sr = lane < W ? send_row_of[(long long)t * W + lane] : -1;
        // wait for the rows rank `lane` returns: those it received (tok_dst >= 0; a row dropped by a receive
        // overflow -- reported -- is summed unwritten instead of waited for, which would time out)
        if (sr >= 0 && tok_dst[(long long)t * W + lane] >= 0)
            for (int p = 0; p < pieces; ++p)
                if (!ep_wait(c, rflag + (long long)sr * pieces + p, epoch, F_COMB_READY, lane, me)) break;
        __syncwarp();
        comb_recv_token<YT, BWD>(t, sr, out, dtw, send_row_of, topk, comb, cmeta, H, K, L, W, lane);
    }
    ep_grid_signal(c, 3, peers, F_COMB_FREE, me, W, epoch, CTR_TICKET_SEND, CTR_TICKET_RECV, epoch_ctr);
}
