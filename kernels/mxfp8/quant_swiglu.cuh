// Register-tiled SwiGLU quantizers of kernels/mxfp8/quantize.cu: the forward h = silu(gate) * up and the backward
// dA = swiglu_bwd(a, dh) of moe_ep.experts.reference, each computed in fp32 exactly as mx_quant's IN_SWIGLU /
// IN_SWIGLU_BWD16 (quant_elem.cuh) and quantized both ways in one pass: row-wise MXFP8 with per-group blocked scales
// (RS_GROUPED) and the per-group column-wise operand as CS_GPREP's prepared bf16 values. Same arguments, group
// table and bytes as mx_quant<IN_SWIGLU | IN_SWIGLU_BWD16, RS_GROUPED, CS_GPREP>, which runs where this kernel does
// not fit (moe_ep/mxfp8/plan.py swiglu_plan); included by quantize.cu after quant_dual.cuh.
//
// Why a second kernel: mx_quant stages SwiGLU's fp32 results in shared memory (64 KB a tile, one tile per CTA at
// a time, no prefetch) and transposes them there for the column blocks, and its backward tiles are dA's: the gate
// half and the up half of a row are separate tiles, so sigmoid(g) (an expf and an IEEE divide) is evaluated twice
// per element and g and dh are read twice (its speed: docs/performance.md). Here the thread layout is
// mx_quant_dual's (a thread holds an 8 x 8 block of a 128 x 128 tile of h; 1x32 row blocks reduce over lanes
// ^1/^2, 32x1 column blocks over lanes ^8/^16; no transpose), the fp32 values stay in registers, the bf16 inputs
// arrive by cp.async S - 1 tiles ahead, and a backward tile is one 128 x 128 tile of h: the thread computes
// sigmoid(g) once and both dA values (gate column c and up column F + c) from one read of g, u and dh, then
// quantizes the gate and the up tile of dA.
//
// Stage layout: NS streams of [8][NTHREADS] x 16 bytes (gate, up, and in the backward dh), so the 16-byte loads
// of a warp touch consecutive addresses and each thread reads back only the copies it issued itself (no barrier
// for the stages). The backward needs F % 128 == 0 (the up tile of dA then starts on a 128-column tile of the
// output's blocked scales); the launcher takes mx_quant otherwise.
#pragma once

#include "swiglu_div.cuh"

#define SWD_STREAM_BYTES (8 * NTHREADS * 16)

// silu(g) * u and sigmoid(g): the operations of mx_swiglu / mx_sigmoid, with swd_div.
__device__ __forceinline__ float swd_swiglu(float g, float u) { return mx_mul(swd_div(g, mx_add(1.0f, expf(-g))), u); }
__device__ __forceinline__ float swd_sigmoid(float g) { return swd_div(1.0f, mx_add(1.0f, expf(-g))); }

// Both quantizations of the thread's 8 x 8 fp32 block (tile rows tr0 + i, output columns oc .. oc + 7 of the [M, K]
// output), whose row i vals(i, f) writes into f[8]. rkey / ckey: |v| bit keys of the thread's 8 rows / 8 columns,
// already reduced over the 4 lanes of each 1x32 / 32x1 block. cok: the columns exist (not past F); nr: rows i < nr
// exist (0 when !cok); the warp's 32-row column block exists (idle warps do not get here: mxd_idle_warp). The row
// scale bytes go to the 512-byte shared cuBLAS tile st (0 for rows past the group or columns past K).
template <class Vals>
__device__ __forceinline__ void swd_emit(Vals&& vals, const unsigned (&rkey)[8], const unsigned (&ckey)[8],
                                         long long row0, int nrows, long long bs, int K, int oc, bool cok, int nr,
                                         int tr0, int mb, int lane, int warp, unsigned char* __restrict__ rq,
                                         unsigned char* __restrict__ cq, unsigned char* st) {
    float cmul[8], cdeq[8];
    unsigned cnan[2] = {0u, 0u};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        const bool bad = ckey[c] >= Key<IN_F32>::BAD;
        const int e = mx_block_exp(__uint_as_float(ckey[c]));
        cmul[c] = bad ? 0.0f : mx_exp2i(-e);
        cdeq[c] = mx_exp2i(e);
        cnan[c >> 2] |= (bad ? 0xFFu : 0u) << (8 * (c & 3));
    }

    const long long off0 = (row0 + tr0) * K + oc;
    unsigned char* prq = rq + off0;
    const int wrows = (nrows + 63) & ~63;  // zero rows up to the group's 64-row block
    unsigned rsb[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = tr0 + i;
        const bool ok = i < nr;
        const bool bad = rkey[i] >= Key<IN_F32>::BAD;
        const int e = mx_block_exp(__uint_as_float(rkey[i]));
        const float s = mx_exp2i(-e);
        rsb[i >> 2] |= (ok ? (bad ? MX_SCALE_NAN : (unsigned)(e + 127)) : 0u) << (8 * (i & 3));
        float f[8];
        vals(i, f);
        unsigned o[2];
        const uint2 q = mxd_quant_row(f, s, bad, cmul, cnan, o);
        mxd_store_row(prq, cq, q, o, ok, cok, r, nrows, wrows, bs, K, oc, cdeq, cnan);
    }
    mxd_row_scales_to_smem(st, rsb, tr0, mb, warp, lane);
}

// Row keys over lanes ^1/^2 (the 4 lanes of a 1x32 row block), column keys over lanes ^8/^16 (a 32x1 block).
__device__ __forceinline__ void swd_reduce_keys(unsigned (&rkey)[8], unsigned (&ckey)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        rkey[j] = max(rkey[j], __shfl_xor_sync(0xFFFFFFFFu, rkey[j], 1));
        rkey[j] = max(rkey[j], __shfl_xor_sync(0xFFFFFFFFu, rkey[j], 2));
        ckey[j] = max(ckey[j], __shfl_xor_sync(0xFFFFFFFFu, ckey[j], 8));
        ckey[j] = max(ckey[j], __shfl_xor_sync(0xFFFFFFFFu, ckey[j], 16));
    }
}

// BWD = 0: x = a [M, 2F] bf16 (gate | up), output h [M, F] (K = F, ctiles = ceil(F / 128)). CS = CS_NONE (forward
// only): row-wise h alone, cq not read: what the forward's GEMM2 reads (the backward rebuilds h's column operand
// from a, so a column operand written here was 2 bytes per element for nobody). Without column blocks a row needs
// no other row, so h is computed, reduced and stored row by row (8 values live instead of 64: no spill).
// BWD = 1: x = a [M, 2F] bf16, x2 = dh [M, F] bf16, output dA [M, 2F] (K = 2F, ctiles = 2F / 128, F % 128 == 0).
// Grid: persistent over n_row_tiles x ceil(F / 128) tiles of h; 256 threads, 1 CTA per SM. Shared memory: S stages
// of NS x 32 KB, 2 x (1 + BWD) row-scale tiles of 512 bytes, then the group table 16 (G + 1).
template <int BWD, int CS, int S>
__global__ void __launch_bounds__(NTHREADS, 1)
    mx_swiglu_dual(MX_QUANT_PARAMS) {
    static_assert(CS == CS_GPREP || (CS == CS_NONE && !BWD),
                  "per-group column blocks as the wgrad's prepared bf16 operand, or (forward) row-wise only");
    constexpr bool COL = CS != CS_NONE;
    static_assert(S >= 2 && S <= 3, "cp.async stages of 64 KB (forward) / 96 KB (backward)");
    static_assert(!BWD || S == 2, "3 backward stages (288 KB) do not fit one SM");
    constexpr int NS = BWD ? 3 : 2;             // input streams: gate, up (, dh)
    constexpr int SB = NS * SWD_STREAM_BYTES;   // bytes of a stage
    MX_DYN_SMEM(smem);
    // Stages first, on 128 bytes (as mx_quant_dual's: kernels/mxfp8/quant_dual.cuh), then the row-scale tiles and the
    // group table.
    unsigned char* stage0 = smem;
    unsigned char* stile0 = stage0 + S * SB;  // [2][1 + BWD][512] row-scale tiles
    long long* g_rstart = reinterpret_cast<long long*>(stile0 + 2 * (1 + BWD) * 512);
    int* g_tstart = reinterpret_cast<int*>(g_rstart + G + 1);
    int* g_bstart = g_tstart + G + 1;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int mb = warp & 3;
    const int tr0 = 32 * mb + 8 * (lane >> 3);
    const int tc0 = 64 * (warp >> 2) + 8 * (lane & 7);
    const int F = BWD ? K / 2 : K;
    const int htiles = BWD ? ctiles / 2 : ctiles;  // column tiles of h
    grouped_table(gsizes, G, g_tstart, g_rstart, g_bstart);
    // only the groups' tiles (as mx_quant_dual; the scale tiles past them: grouped_zero_tail, at the end)
    const int total = min(n_row_tiles, g_tstart[G]) * htiles;
    MxdCursor cursor(g_tstart, g_rstart, g_bstart, G, M, htiles, (int)blockIdx.x, (int)gridDim.x);

    // The thread's 8 chunks of each stream; rows past the group or chunks past F are zero-filled (the source
    // address is then x itself, always valid). Zero inputs give h = 0 and dA = 0, the reference's block padding.
    auto issue = [&](unsigned char* stage, const MxdCoord& c) {
        const int col0 = c.ct * TILE;
        const int nr = col0 + tc0 < F ? c.nrows - tr0 : 0;
        const unsigned char* ga = x + ((c.row0 + tr0) * (2LL * F) + col0 + tc0) * 2;
        const unsigned char* gd = BWD ? x2 + ((c.row0 + tr0) * F + col0 + tc0) * 2 : x;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const bool ok = i < nr;
            unsigned char* d = stage + (i * NTHREADS + tid) * 16;
            cp_async16(d, ok ? ga : x, ok);
            cp_async16(d + SWD_STREAM_BYTES, ok ? ga + 2LL * F : x, ok);
            if (BWD) cp_async16(d + 2 * SWD_STREAM_BYTES, ok ? gd : x, ok);
            ga += 4LL * F;
            gd += 2LL * F;
        }
        cp_async_commit();
    };

    auto body = [&](const unsigned char* cur, const MxdCoord& tc, int par) {
        const int col0 = tc.ct * TILE;
        const bool cok = col0 + tc0 < F;
        const int nr = cok ? tc.nrows - tr0 : 0;
        unsigned char* st = stile0 + par * (512 * (1 + BWD));
        // Element (i, e) of stream s in the stage, as fp32; the thread's range check of its 64 g values.
        auto chunk = [&](int s, int i) {
            return *reinterpret_cast<const uint4*>(cur + s * SWD_STREAM_BYTES + (i * NTHREADS + tid) * 16);
        };
        auto in = [&](int s, int i, int e) {
            const uint4 v = chunk(s, i);
            const unsigned w = e < 4 ? (e < 2 ? v.x : v.y) : (e < 6 ? v.z : v.w);
            return word_elem<IN_BF16>(w, e & 1);
        };
        if (32 * mb >= tc.nrows) {  // no row of the warp's 32-row block is in the tile (mxd_idle_warp)
            const unsigned zero[2] = {0u, 0u};
            if (COL) mxd_idle_warp(cq, tc.bs, K, col0 + tc0, cok, tc.nrows, tr0, mb);
            mxd_row_scales_to_smem(st, zero, tr0, mb, warp, lane);
            if (BWD) {
                mxd_idle_warp(cq, tc.bs, K, F + col0 + tc0, cok, tc.nrows, tr0, mb);
                mxd_row_scales_to_smem(st + 512, zero, tr0, mb, warp, lane);
            }
        } else {
            SwdDomain dom;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint4 v = chunk(0, i);
                dom.add(v.x);
                dom.add(v.y);
                dom.add(v.z);
                dom.add(v.w);
            }
            const bool fast = dom.ok(!BWD);
            if (!COL) {  // row-only h (the thread's 8 values of a row; its 1x32 block over lanes ^1/^2)
                unsigned char* prq = rq + (tc.row0 + tr0) * K + col0 + tc0;
                unsigned rsb[2] = {0u, 0u};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float f[8];
                    if (fast) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) f[e] = swd_swiglu(in(0, i, e), in(1, i, e));
                    } else {  // rare (some |g| > 69 or in (0, 2**-100), NaN/Inf): the IEEE division for the thread
#pragma unroll
                        for (int e = 0; e < 8; ++e) f[e] = mx_swiglu(in(0, i, e), in(1, i, e));
                    }
                    unsigned key = 0u;
#pragma unroll
                    for (int e = 0; e < 8; ++e) key = max(key, __float_as_uint(f[e]) & 0x7FFFFFFFu);
                    key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 1));
                    key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 2));
                    const bool ok = i < nr;
                    const bool bad = key >= Key<IN_F32>::BAD;
                    const int ex = mx_block_exp(__uint_as_float(key));
                    const float sc = mx_exp2i(-ex);
                    rsb[i >> 2] |= (ok ? (bad ? MX_SCALE_NAN : (unsigned)(ex + 127)) : 0u) << (8 * (i & 3));
                    uint2 q = make_uint2(
                        mx_cvt4_e4m3(mx_mul(f[0], sc), mx_mul(f[1], sc), mx_mul(f[2], sc), mx_mul(f[3], sc)),
                        mx_cvt4_e4m3(mx_mul(f[4], sc), mx_mul(f[5], sc), mx_mul(f[6], sc), mx_mul(f[7], sc)));
                    if (bad) q = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
                    if (ok) *reinterpret_cast<uint2*>(prq) = q;
                    prq += K;
                }
                mxd_row_scales_to_smem(st, rsb, tr0, mb, warp, lane);
            } else if (!BWD) {
                float h[8][8];
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int e = 0; e < 8; ++e) h[i][e] = swd_swiglu(in(0, i, e), in(1, i, e));
                if (!fast) {  // rare (some |g| > 69 or in (0, 2**-100), NaN/Inf): the IEEE division for the thread
#pragma unroll
                    for (int i = 0; i < 8; ++i)
#pragma unroll
                        for (int e = 0; e < 8; ++e) h[i][e] = mx_swiglu(in(0, i, e), in(1, i, e));
                }
                unsigned rkey[8], ckey[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    rkey[i] = 0u;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const unsigned k = __float_as_uint(h[i][e]) & 0x7FFFFFFFu;
                        rkey[i] = max(rkey[i], k);
                        ckey[e] = max(ckey[e], k);
                    }
                }
                swd_reduce_keys(rkey, ckey);
                auto vals = [&](int i, float(&f)[8]) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) f[e] = h[i][e];
                };
                swd_emit(vals, rkey, ckey, tc.row0, tc.nrows, tc.bs, K, col0 + tc0, cok, nr, tr0, mb, lane, warp,
                         rq, cq, st);
            } else {
                // sigmoid(g) stays in registers (64), dA is recomputed from it at each use (6 and 2 fp32 operations):
                // keeping both halves of dA (128 registers) spilled.
                float sig[8][8];
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int e = 0; e < 8; ++e) sig[i][e] = swd_sigmoid(in(0, i, e));
                if (!fast) {  // rare (some |g| > 69, NaN/Inf): the IEEE division for the thread
#pragma unroll
                    for (int i = 0; i < 8; ++i)
#pragma unroll
                        for (int e = 0; e < 8; ++e) sig[i][e] = mx_sigmoid(in(0, i, e));
                }
                auto gate = [&](int i, float(&f)[8]) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) f[e] = mx_swiglu_dg(in(0, i, e), in(1, i, e), in(2, i, e), sig[i][e]);
                };
                auto up = [&](int i, float(&f)[8]) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) f[e] = mx_swiglu_du(in(0, i, e), in(2, i, e), sig[i][e]);
                };
                unsigned rg[8], ru[8], cg[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
                unsigned cu[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float fg[8], fu[8];
                    gate(i, fg);
                    up(i, fu);
                    rg[i] = 0u;
                    ru[i] = 0u;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        const unsigned kg = __float_as_uint(fg[e]) & 0x7FFFFFFFu;
                        const unsigned ku = __float_as_uint(fu[e]) & 0x7FFFFFFFu;
                        rg[i] = max(rg[i], kg);
                        ru[i] = max(ru[i], ku);
                        cg[e] = max(cg[e], kg);
                        cu[e] = max(cu[e], ku);
                    }
                }
                swd_reduce_keys(rg, cg);
                swd_reduce_keys(ru, cu);
                swd_emit(gate, rg, cg, tc.row0, tc.nrows, tc.bs, K, col0 + tc0, cok, nr, tr0, mb, lane, warp, rq,
                         cq, st);
                swd_emit(up, ru, cu, tc.row0, tc.nrows, tc.bs, K, F + col0 + tc0, cok, nr, tr0, mb, lane, warp, rq,
                         cq, st + 512);
            }
        }
        __syncthreads();  // the scale tiles are complete; the other parity is refilled only after the next barrier
        if (tid < 32 * (1 + BWD)) {
            const int ot = tc.rt * ctiles + tc.ct + (tid >= 32 ? htiles : 0);  // output tile (the up half: + F/128)
            reinterpret_cast<uint4*>(rs + (long long)ot * 512)[tid & 31] =
                reinterpret_cast<const uint4*>(st + (tid >= 32 ? 512 : 0))[tid & 31];
        }
    };
    mxd_pipeline<S, SB>(total, cursor, stage0, issue, body);
    grouped_zero_tail(rs, g_tstart[G], n_row_tiles, ctiles);  // ctiles: the output's column tiles (2F / 128 BWD)
}
