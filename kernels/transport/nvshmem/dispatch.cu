// FP8 quantize + dispatch (sender) and expert-sorted expansion (receiver) of the NVSHMEM transport
// (moe_ep/transport/nvshmem/buffer.py launches them; protocol and buffers: docs/design-transport.md).
//
// QB, the payload's scale block (a template parameter of every kernel here): 0 = raw rows (no quantization),
// 32 = MXFP8 (1x32 blocks), 128 = the blockwise recipe's activations (1x128 blocks). Both quantized payloads use
// the same rule (common.cuh: E4M3 elements, E8M0 scale by RCEIL, 0xFF / 0x7F bytes for a NaN/Inf block) and differ
// only in how many values share a scale: received scales are row-major [R, H/QB] u8 either way.
//
// ep_dispatch<IN, QB>: one warp per token (grid-stride). The token's bf16/fp32 row is read once; each lane owns
//   16 consecutive elements per 512-element step, QB/16 consecutive lanes own one block (a lane pair for MXFP8,
//   8 lanes for 1x128; common.cuh math, bytes identical to moe_ep.mxfp8.reference.quantize_blocks_torch with
//   blocks (1, QB)). The 16 e4m3 bytes go with one 16-byte store, the scale byte with a byte store from the
//   block's first lane, straight into every destination rank's receive buffer through its peer pointer: row
//   tok_dst[t][r] of rank r (each token at most once per rank; rows from rank 0 first, then rank 1, ...; tokens
//   ascending within a rank: the reference's receive order). With META, lanes j < K also
//   store the row's metadata [local expert | weight bits | expanded row] (3K int32) for slot j.
//   QB = 0 sends the raw row (row_bytes, any element type). Starts by waiting DISP_FREE(u-1) of every rank;
//   the last CTA signals DISP_READY(u). Used by the value dispatch (dispatch_fwd) and the combine backward.
// ep_expand<MODE, QB, OT>: waits DISP_READY(u) of every rank, then one warp per received row:
//   MODE_VAL  the row's values in OT (dequantized e4m3 * 2^(s-127), s its block's scale, rounded to OT, or the
//             raw OT row) -> out[n],
//             w_out[n], exp_row[n] = i, exp_slot[n] = j    for every slot j of the row with expanded row n.
//   MODE_BWD  combine-backward: v = values of the received dy row (rounded to OT, as the reference), then
//             out[n] = OT(v * w_in[n]) and dw[n] = sum_h v * y[n] (fp32; warp-order sum).
//   MODE_VAL records recv_pos[i][j] = n (used by combine); MODE_BWD reads it (no metadata is sent).
//   Rows n in [N, expand_cap) of every output are zeroed (data rows included). The last CTA
//   signals DISP_FREE(u).
// ep_dispatch_mx<IN, QB> (below): the quantized forward dispatch, send and expansion in one kernel.
#include "common.cuh"
#include "ep_sync.cuh"

#define IN_F32 0
#define IN_BF16 1

#define MODE_VAL 1
#define MODE_BWD 2

#define DISP_THREADS 512

// log2 of a quantized payload's scale block (32 or 128): block index of element e = e >> qb_shift(QB) (a shift, not a
// division: e is never negative, and MXFP8's code stays the shift it always was)
__host__ __device__ constexpr int qb_shift(int qb) { return qb == 128 ? 7 : 5; }


// 16 consecutive input elements of a row -> fp32
template <int IN>
__device__ __forceinline__ void load16(const unsigned char* p, float* v) {
    if (IN == IN_BF16) {
        uint4 a = ep_ld16(p), b = ep_ld16(p + 16);
        unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            uint4 a = ep_ld16(p + 16 * k);
            v[4 * k] = __uint_as_float(a.x);
            v[4 * k + 1] = __uint_as_float(a.y);
            v[4 * k + 2] = __uint_as_float(a.z);
            v[4 * k + 3] = __uint_as_float(a.w);
        }
    }
}

// 16 fp32 values -> OT (RNE like torch's .to) stored at p (32 bytes bf16, 64 bytes fp32)
template <int OT>
__device__ __forceinline__ void store16(unsigned char* p, const float* v) {
    if (OT == IN_BF16) {
        unsigned w[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = ep_f2bf(v[2 * k]) | (ep_f2bf(v[2 * k + 1]) << 16);
        ep_st16(p, make_uint4(w[0], w[1], w[2], w[3]));
        ep_st16(p + 16, make_uint4(w[4], w[5], w[6], w[7]));
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            ep_st16(p + 16 * k, make_uint4(__float_as_uint(v[4 * k]), __float_as_uint(v[4 * k + 1]),
                                           __float_as_uint(v[4 * k + 2]), __float_as_uint(v[4 * k + 3])));
    }
}

template <int OT>
__device__ __forceinline__ float round_to(float v) {
    return OT == IN_BF16 ? ep_bf2f(ep_f2bf(v)) : v;
}

// 16 e4m3 bytes -> fp32 (exact, hardware cvt through f16; 0x7F/0xFF -> NaN)
__device__ __forceinline__ void e4m3x16_to_f32(uint4 q, float* v) {
    unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int hpart = 0; hpart < 2; ++hpart) {
            unsigned short two = (unsigned short)(w[k] >> (16 * hpart));
            unsigned h2;
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
            unsigned short lo = (unsigned short)(h2 & 0xFFFFu), hi = (unsigned short)(h2 >> 16);
            float flo, fhi;
            asm("cvt.f32.f16 %0, %1;" : "=f"(flo) : "h"(lo));
            asm("cvt.f32.f16 %0, %1;" : "=f"(fhi) : "h"(hi));
            v[4 * k + 2 * hpart] = flo;
            v[4 * k + 2 * hpart + 1] = fhi;
        }
    }
}

// values of the 16 elements of a received row owned by this lane: dequantized (QB > 0: C = H / QB scales per row)
// or raw OT, rounded to OT
template <int QB, int OT>
__device__ __forceinline__ void recv_values(const unsigned char* data, const unsigned char* scale, long long i, int H,
                                            int C, int e0, float* v) {
    if (QB) {
        uint4 q = ep_ld16(data + i * H + e0);
        unsigned sb = scale[i * C + (e0 >> qb_shift(QB))];
        e4m3x16_to_f32(q, v);
        float m = sb == 0xFFu ? __uint_as_float(0x7FC00000u) : mx_exp2i((int)sb - 127);
#pragma unroll
        for (int k = 0; k < 16; ++k) v[k] = round_to<OT>(mx_mul(v[k], m));  // no ftz: 2**-127 scales
    } else {
        load16<OT>(data + (i * H + e0) * (OT == IN_BF16 ? 2 : 4), v);
    }
}

// One token t of the sender (one warp): metadata, quantized (or raw) row to every destination rank. Returns the
// destination mask; lane r < W holds d = tok_dst[t][r] (the row at rank r, -1: not sent). QB > 0 (H % QB == 0, so a
// block is never split between active and inactive lanes): only the elements [c_begin, c_end) (multiples of 512: a
// column piece of the fused dispatch, whole blocks; default the whole row).
template <int IN, int QB>
__device__ __forceinline__ unsigned disp_send_token(
    int t, int& d, const unsigned char* __restrict__ x, const float* __restrict__ topk_w, const int* __restrict__ topk,
    const int* __restrict__ tok_dst, const int* __restrict__ slot_pos, int H, int K, int L, int W,
    const ep_u64* peers, long long data_off, long long scale_off, long long meta_off, int row_bytes, int meta,
    int lane, int c_begin = 0, int c_end = 1 << 30) {
    const int C = H >> qb_shift(QB);  // scales per row
    const int es = IN == IN_BF16 ? 2 : 4;
    d = lane < W ? tok_dst[t * W + lane] : -1;
    const unsigned dm = __ballot_sync(0xFFFFFFFFu, d >= 0);
    if (!dm) return 0u;
    long long drow[EP_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EP_MAX_RANKS; ++r) drow[r] = __shfl_sync(0xFFFFFFFFu, d, r);
    if (meta) {
        int g = -1, p = -1;
        float wt = 0.f;
        if (lane < K) {
            g = topk[t * K + lane];
            wt = topk_w[t * K + lane];
            p = slot_pos[t * K + lane];
        }
#pragma unroll
        for (int r = 0; r < EP_MAX_RANKS; ++r) {
            if (!((dm >> r) & 1u)) continue;
            if (lane < K) {
                const bool mine = g >= 0 && g / L == r;
                int* mrow = reinterpret_cast<int*>(peers[r] + meta_off) + drow[r] * 3 * K;
                mrow[lane] = mine ? g % L : -1;
                mrow[K + lane] = mine ? __float_as_int(wt) : 0;
                mrow[2 * K + lane] = mine ? p : -1;
            }
        }
    }
    if (QB) {
        const unsigned char* xr = x + (long long)t * H * es;
        for (int c0 = c_begin; c0 < min(H, c_end); c0 += 512) {
            const int e0 = c0 + 16 * lane;
            const bool act = e0 < H;
            float v[16];
            unsigned key = 0;
            if (act) {
                load16<IN>(xr + (long long)e0 * es, v);
#pragma unroll
                for (int k = 0; k < 16; ++k) key = max(key, __float_as_uint(v[k]) & 0x7FFFFFFFu);
            }
            // the block's amax over its QB / 16 lanes (aligned groups of 2 or 8 consecutive lanes)
#pragma unroll
            for (int o = 1; o < QB / 16; o <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
            uint4 q;
            unsigned sb;
            if (key >= 0x7F800000u) {
                q = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
                sb = MX_SCALE_NAN;
            } else {
                const int e = mx_block_exp(__uint_as_float(key));
                const float s = mx_exp2i(-e);
                // mx_mul, not '*': NVRTC builds with -ftz=true, and a flushed subnormal input would lose its
                // value (a block of bf16/fp32 subnormals has E = -127 and quantizes to nonzero bytes).
                q.x = mx_cvt4_e4m3(mx_mul(v[0], s), mx_mul(v[1], s), mx_mul(v[2], s), mx_mul(v[3], s));
                q.y = mx_cvt4_e4m3(mx_mul(v[4], s), mx_mul(v[5], s), mx_mul(v[6], s), mx_mul(v[7], s));
                q.z = mx_cvt4_e4m3(mx_mul(v[8], s), mx_mul(v[9], s), mx_mul(v[10], s), mx_mul(v[11], s));
                q.w = mx_cvt4_e4m3(mx_mul(v[12], s), mx_mul(v[13], s), mx_mul(v[14], s), mx_mul(v[15], s));
                sb = (unsigned)(e + 127);
            }
            if (act) {
#pragma unroll
                for (int r = 0; r < EP_MAX_RANKS; ++r) {
                    if (!((dm >> r) & 1u)) continue;
                    ep_st16(reinterpret_cast<unsigned char*>(peers[r] + data_off) + drow[r] * H + e0, q);
                    if (!(lane & (QB / 16 - 1)))  // the block's first lane
                        reinterpret_cast<unsigned char*>(peers[r] + scale_off)[drow[r] * C + (e0 >> qb_shift(QB))] =
                            (unsigned char)sb;
                }
            }
        }
    } else {
        const unsigned char* xr = x + (long long)t * row_bytes;
        for (int b0 = 16 * lane; b0 < row_bytes; b0 += 512) {
            const uint4 val = ep_ld16(xr + b0);
#pragma unroll
            for (int r = 0; r < EP_MAX_RANKS; ++r) {
                if (!((dm >> r) & 1u)) continue;
                ep_st16(reinterpret_cast<unsigned char*>(peers[r] + data_off) + drow[r] * row_bytes + b0, val);
            }
        }
    }
    return dm;
}

template <int IN, int QB>
__global__ void __launch_bounds__(DISP_THREADS) ep_dispatch(
    const unsigned char* __restrict__ x, const float* __restrict__ topk_w, const int* __restrict__ topk,
    const int* __restrict__ tok_dst, const int* __restrict__ slot_pos, int T, int H, int K, int L, int W, int me,
    const ep_u64* __restrict__ peers_g, long long data_off, long long scale_off, long long meta_off, int row_bytes,
    int meta, ep_u64* epoch_ctr, int* err, int* herr, unsigned* ctr, long long timeout_ns) {
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    __shared__ ep_u64 peers[EP_MAX_RANKS];
    if (threadIdx.x < W) peers[threadIdx.x] = peers_g[threadIdx.x];
    __syncthreads();
    ep_cta_wait_all(c, peers[me], F_DISP_FREE, epoch - 1, W, me);
    const int lane = threadIdx.x & 31;
    const int nwarps = gridDim.x * (DISP_THREADS / 32);
    for (int t = blockIdx.x * (DISP_THREADS / 32) + (threadIdx.x >> 5); t < T; t += nwarps) {
        int d;
        disp_send_token<IN, QB>(t, d, x, topk_w, topk, tok_dst, slot_pos, H, K, L, W, peers, data_off, scale_off,
                                meta_off, row_bytes, meta, lane);
    }
    ep_grid_signal(c, 0, peers, F_DISP_READY, me, W, epoch);
}

// Slot `lane` (< K) of received row i: its local expert loc and expanded row pos from the row's metadata
// (meta: [R, 3K] int32 = local experts | fp32 weights | expanded rows); pos = -1 for an empty or invalid slot.
// Records recv_pos[i, lane] and, for a valid slot, w_out / exp_row / exp_slot at pos. CG: the metadata was
// written by a peer during this kernel (fused path): L2-only loads.
template <bool CG>
__device__ __forceinline__ int expand_slot(int i, int lane, const int* meta, int K, int L, int expand_cap,
                                           int* __restrict__ recv_pos, float* __restrict__ w_out,
                                           int* __restrict__ exp_row, int* __restrict__ exp_slot, int& loc) {
    int pos;
    float wt;
    if (CG) {
        const int* m = meta + (long long)i * 3 * K;
        loc = __ldcg(m + lane);
        wt = __int_as_float(__ldcg(m + K + lane));
        pos = __ldcg(m + 2 * K + lane);
    } else {
        loc = meta[(long long)i * 3 * K + lane];
        wt = __int_as_float(meta[(long long)i * 3 * K + K + lane]);
        pos = meta[(long long)i * 3 * K + 2 * K + lane];
    }
    if (loc < 0 || loc >= L || pos < 0 || pos >= expand_cap) pos = -1;
    recv_pos[(long long)i * K + lane] = pos;
    if (pos >= 0) {
        w_out[pos] = wt;
        exp_row[pos] = i;
        exp_slot[pos] = lane;
    }
    return pos;
}

template <int MODE, int QB, int OT>
__global__ void __launch_bounds__(DISP_THREADS) ep_expand(
    const ep_u64* __restrict__ peers_g, int me, int W, long long data_off, long long scale_off, long long meta_off,
    const int* __restrict__ info, int H, int K, int L, int recv_cap, int expand_cap,
    int* __restrict__ recv_pos, unsigned char* __restrict__ out,
    float* __restrict__ w_out, int* __restrict__ exp_row, int* __restrict__ exp_slot,
    const unsigned char* __restrict__ y, const float* __restrict__ w_in, float* __restrict__ dw, ep_u64* epoch_ctr,
    int* err, int* herr, unsigned* ctr, long long timeout_ns) {
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    __shared__ ep_u64 peers[EP_MAX_RANKS];
    if (threadIdx.x < W) peers[threadIdx.x] = peers_g[threadIdx.x];
    __syncthreads();
    const ep_u64 own = peers[me];
    ep_cta_wait_all(c, own, F_DISP_READY, epoch, W, me);
    const int lane = threadIdx.x & 31;
    const int gwarp = blockIdx.x * (DISP_THREADS / 32) + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * (DISP_THREADS / 32);
    const int C = H >> qb_shift(QB);  // scales per received row (QB > 0)
    const int ob = OT == IN_BF16 ? 2 : 4;  // output bytes per element
    const int R = min(info[I_R], recv_cap);
    const int N = min(info[I_N], expand_cap);
    const unsigned char* data = reinterpret_cast<const unsigned char*>(own + data_off);
    const unsigned char* scale = reinterpret_cast<const unsigned char*>(own + scale_off);
    const int* meta = reinterpret_cast<const int*>(own + meta_off);

    for (int i = gwarp; i < R; i += nwarps) {
        int pos = -1, loc = -1;
        if (lane < K) {
            if (MODE == MODE_BWD) {
                pos = recv_pos[(long long)i * K + lane];
            } else {
                pos = expand_slot<false>(i, lane, meta, K, L, expand_cap, recv_pos, w_out, exp_row, exp_slot, loc);
            }
        }
        const unsigned vm = __ballot_sync(0xFFFFFFFFu, pos >= 0);
        if (!vm) continue;
        if constexpr (MODE == MODE_BWD) {
            for (unsigned m = vm; m; m &= m - 1) {
                const long long n = __shfl_sync(0xFFFFFFFFu, pos, __ffs(m) - 1);
                const float wn = w_in[n];
                float dot = 0.f;
                for (int e0 = 16 * lane; e0 < H; e0 += 512) {
                    float v[16], yv[16];
                    recv_values<QB, OT>(data, scale, i, H, C, e0, v);
                    load16<OT>(y + (n * H + e0) * ob, yv);
#pragma unroll
                    for (int k = 0; k < 16; ++k) {
                        dot = mx_add(dot, mx_mul(v[k], yv[k]));  // mx_*: no ftz (subnormals kept)
                        v[k] = mx_mul(v[k], wn);
                    }
                    store16<OT>(out + (n * H + e0) * ob, v);
                }
#pragma unroll
                for (int o = 16; o; o >>= 1) dot = mx_add(dot, __shfl_xor_sync(0xFFFFFFFFu, dot, o));
                if (lane == 0) dw[n] = dot;
            }
        } else {
            for (int c0 = 0; c0 < H; c0 += 512) {
                const int e0 = c0 + 16 * lane;
                const bool act = e0 < H;
                float v[16];
                if (act) recv_values<QB, OT>(data, scale, i, H, C, e0, v);
                for (unsigned m = vm; m; m &= m - 1) {
                    const long long n = __shfl_sync(0xFFFFFFFFu, pos, __ffs(m) - 1);
                    if (act) store16<OT>(out + (n * H + e0) * ob, v);
                }
            }
        }
    }
    // rows past the expanded count
    for (long long n = N + gwarp; n < expand_cap; n += nwarps) {
        if (lane == 0) {
            if (MODE == MODE_BWD) {
                dw[n] = 0.f;
            } else {
                w_out[n] = 0.f;
                exp_row[n] = -1;
                exp_slot[n] = -1;
            }
        }
        const long long rb = (long long)H * ob;
        for (long long b = 16 * lane; b < rb; b += 512) ep_st16(out + n * rb + b, make_uint4(0, 0, 0, 0));
    }
    ep_grid_signal(c, 1, peers, F_DISP_FREE, me, W, epoch, -1, -1, epoch_ctr);
}

// ---- fused quantized dispatch (the fast path: dispatch_fwd_mxfp8 / dispatch_fwd_blockwise) -------------------------
// 512-element steps per iteration of the expansion: the loads of all of them are in flight before the stores
// (more steps did not help: docs/performance.md)
#define EXP_STEPS 2

// One received quantized row i (one warp), written by a peer during this kernel: L2-only loads. The e4m3 row goes
// to out[n] (16-byte copies), and w_out[n], exp_row[n] = i, exp_slot[n] = j, for every slot j of the row with
// expanded row n. Its scales go, for QB = 32 (MXFP8), to the per-group blocked layout the MXFP8 GEMMs read
// (to_blocked_grouped "m"); for QB = 128 (blockwise), to row n of the row-major [expand_cap, H/128] scales the
// blockwise GEMMs read.
template <int QB>
__device__ __forceinline__ void expand_q_row(int i, int lane, const int* meta, const unsigned char* data,
                                             const unsigned char* scale, const int* __restrict__ info, int H,
                                             int K, int L, int expand_cap, int* __restrict__ recv_pos,
                                             unsigned char* __restrict__ out, unsigned char* __restrict__ out_scale,
                                             float* __restrict__ w_out, int* __restrict__ exp_row,
                                             int* __restrict__ exp_slot) {
    const int C = H >> qb_shift(QB), tpr = (C + 3) >> 2;
    int pos = -1, loc = -1;
    if (lane < K) pos = expand_slot<true>(i, lane, meta, K, L, expand_cap, recv_pos, w_out, exp_row, exp_slot, loc);
    const unsigned vm = __ballot_sync(0xFFFFFFFFu, pos >= 0);
    if (!vm) return;
    int srow = 0;  // MXFP8: the row's place in the blocked layout (its group's first tile, its row in the group)
    if (QB == 32 && pos >= 0) srow = info[I_GSTART + L + 1 + loc] * 128 + (pos - info[I_GSTART + loc]);
    for (int c0 = 0; c0 < H; c0 += 512 * EXP_STEPS) {
        uint4 q[EXP_STEPS];
        unsigned sb[EXP_STEPS];
        bool act[EXP_STEPS];
#pragma unroll
        for (int h = 0; h < EXP_STEPS; ++h) {
            const int e0 = c0 + 512 * h + 16 * lane;
            act[h] = e0 < H;
            q[h] = make_uint4(0, 0, 0, 0);
            sb[h] = 0;
            if (act[h]) {
                q[h] = ep_ld16cg(data + (long long)i * H + e0);
                sb[h] = __ldcg(scale + (long long)i * C + (e0 >> qb_shift(QB)));
            }
        }
        for (unsigned m = vm; m; m &= m - 1) {
            const int j = __ffs(m) - 1;
            const long long n = __shfl_sync(0xFFFFFFFFu, pos, j);
            const long long rb = __shfl_sync(0xFFFFFFFFu, srow, j);
#pragma unroll
            for (int h = 0; h < EXP_STEPS; ++h) {
                const int e0 = c0 + 512 * h + 16 * lane;
                if (act[h]) {
                    ep_st16(out + n * H + e0, q[h]);
                    if (QB == 32 && !(lane & 1)) {
                        const int cc = e0 >> 5;
                        const long long off = ((rb >> 7) * tpr + (cc >> 2)) * 512 + (rb & 31) * 16 +
                                              ((rb & 127) >> 5) * 4 + (cc & 3);
                        out_scale[off] = (unsigned char)sb[h];
                    }
                    if (QB == 128 && !(lane & 7)) out_scale[n * C + (e0 >> 7)] = (unsigned char)sb[h];
                }
            }
        }
    }
}

// ep_dispatch_mx<IN, QB>: the send of ep_dispatch<IN, QB> (with metadata) and the expansion of expand_q_row<QB> in
// ONE kernel (QB = 32: MXFP8, QB = 128: blockwise 1x128), the expansion of each received row overlapping the rest
// of the NVLink traffic (ep_sync.cuh, "per-row handoff"):
//   A  (after DISP_FREE(u-1) of every rank) the first send_warps (1..16) warps of every CTA take tokens by ticket
//      (ctr[6]) and send them as ep_dispatch, each token as `pieces` (1..4) tickets of contiguous 512-element
//      column ranges (piece 0 also stores the metadata); after a piece's stores, lane r stores
//      rflag[row at rank r][piece] = u into rank r's region (release). With every warp sending, the grid (about
//      one token per warp) sends in a single wave and rows arrive only at its end; fewer senders spread the
//      arrivals so that B overlaps A, and pieces make the last wave (the expand tail) smaller.
//   B  the other warps at once, the senders once no token is left: warps take received rows by ticket (ctr[7])
//      in an order interleaving the source ranks (v -> rank v % W, its (v / W)-th row: rows arrive from every
//      sender in token order), wait rflag[i][*] >= u, expand the row.
//   then the rows past N as ep_expand (small outputs; no data padding on this path; QB = 128 also zeroes their
//   row-major scale rows, the blocked MXFP8 scales come zeroed from the launcher), and the last CTA signals
//   DISP_FREE(u) and resets the tickets. DISP_READY is not used (per-row flags replace it). topk_w must not be
//   null: the metadata (expert, weight, expanded row) is what the receivers expand by.
template <int IN, int QB>
__global__ void __launch_bounds__(DISP_THREADS) ep_dispatch_mx(
    const unsigned char* __restrict__ x, const float* __restrict__ topk_w, const int* __restrict__ topk,
    const int* __restrict__ tok_dst, const int* __restrict__ slot_pos, int T, int H, int K, int L, int W, int me,
    const ep_u64* __restrict__ peers_g, long long data_off, long long scale_off, long long meta_off,
    long long rflag_off, const int* __restrict__ info, int recv_cap, int expand_cap, int* __restrict__ recv_pos,
    unsigned char* __restrict__ out, unsigned char* __restrict__ out_scale, float* __restrict__ w_out,
    int* __restrict__ exp_row, int* __restrict__ exp_slot, int send_warps, int pieces, ep_u64* epoch_ctr, int* err,
    int* herr, unsigned* ctr, long long timeout_ns) {
    const EpCtl c{err, herr, ctr, timeout_ns};
    const ep_u64 epoch = ep_epoch(epoch_ctr);
    __shared__ ep_u64 peers[EP_MAX_RANKS];
    __shared__ int roff[EP_MAX_RANKS + 1];
    if (threadIdx.x < W) peers[threadIdx.x] = peers_g[threadIdx.x];
    if (threadIdx.x <= W) roff[threadIdx.x] = info[I_RECV_OFF + threadIdx.x];
    __syncthreads();
    ep_cta_wait_all(c, peers[me], F_DISP_FREE, epoch - 1, W, me);
    const int lane = threadIdx.x & 31;

    // ---- A: send (warps < send_warps of each CTA; the others start on B at once) ----------------------------------
    const int steps = (H + 511) >> 9;  // 512-element steps per row, split into `pieces` column ranges
    while ((int)(threadIdx.x >> 5) < send_warps) {
        const int tk = ep_warp_ticket(c, CTR_TICKET_SEND);
        if (tk >= T * pieces) break;
        const int t = tk / pieces, p = tk % pieces;
        int d;
        const unsigned dm = disp_send_token<IN, QB>(t, d, x, topk_w, topk, tok_dst, slot_pos, H, K, L, W, peers,
                                                    data_off, scale_off, meta_off, 0, p == 0, lane,
                                                    512 * (steps * p / pieces), 512 * (steps * (p + 1) / pieces));
        if (dm) {
            ep_warp_release();
            if (d >= 0)
                ep_st_release(reinterpret_cast<ep_u64*>(peers[lane] + rflag_off) + (long long)d * pieces + p, epoch);
        }
    }

    // ---- B: expand rows as they arrive ----------------------------------------------------------------------------
    const ep_u64 own = peers[me];
    const int R = min(info[I_R], recv_cap);
    const int N = min(info[I_N], expand_cap);
    const unsigned char* data = reinterpret_cast<const unsigned char*>(own + data_off);
    const unsigned char* scale = reinterpret_cast<const unsigned char*>(own + scale_off);
    const int* meta = reinterpret_cast<const int*>(own + meta_off);
    const ep_u64* rflag = reinterpret_cast<const ep_u64*>(own + rflag_off);
    int maxc = 0;
    for (int s = 0; s < W; ++s) maxc = max(maxc, roff[s + 1] - roff[s]);
    const int V = W * maxc;
    while (true) {
        const int v = ep_warp_ticket(c, CTR_TICKET_RECV);
        if (v >= V) break;
        const int s = v % W;
        const int i = roff[s] + v / W;
        if (i >= roff[s + 1] || i >= R) continue;
        if (lane < pieces) ep_wait(c, rflag + (long long)i * pieces + lane, epoch, F_DISP_READY, s, me);
        __syncwarp();
        expand_q_row<QB>(i, lane, meta, data, scale, info, H, K, L, expand_cap, recv_pos, out, out_scale, w_out,
                         exp_row, exp_slot);
    }

    // rows past the expanded count: small outputs
    const int gwarp = blockIdx.x * (DISP_THREADS / 32) + (threadIdx.x >> 5);
    const int nwarps = gridDim.x * (DISP_THREADS / 32);
    for (long long n = N + gwarp; n < expand_cap; n += nwarps) {
        if (lane == 0) {
            w_out[n] = 0.f;
            exp_row[n] = -1;
            exp_slot[n] = -1;
        }
        if (QB == 128)
            for (int b = lane; b < (H >> 7); b += 32) out_scale[n * (H >> 7) + b] = 0;
    }
    ep_grid_signal(c, 1, peers, F_DISP_FREE, me, W, epoch, CTR_TICKET_SEND, CTR_TICKET_RECV, epoch_ctr);
}
