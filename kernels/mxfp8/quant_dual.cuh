// Register-tiled dual quantizer of kernels/mxfp8/quantize.cu: bf16 x [M, K] -> row-wise MXFP8 with per-group blocked
// scales (RS_GROUPED) and the per-group column-wise operand as CS_GPREP's prepared bf16 values, from one read.
// Same arguments, tile order and group table as mx_quant's grouped modes (the bytes of
// moe_ep.experts.reference.quantize_grouped_dual_torch(..., colwise="bf16")); included by quantize.cu after
// mx_quant.
//
// Why not mx_quant's column modes: they go through the tile staged in shared memory twice (phase 2: 32 word loads
// per thread for the column amax; phase 3: the tile again, with the multipliers and NaN masks read back per
// element), and that kernel was issue-bound (docs/performance.md, "Quantizer pipes, ..."). Here nothing is
// transposed: a thread holds an 8 x 8 block of the 128 x 128 tile (8 rows of one 16-byte chunk), so a
// 1x32 row block is spread over the 4 lanes lane ^ {1, 2} and a 32x1 column block over the 4 lanes lane ^ {8, 16} of
// the same warp. Both amaxes are two shuffles, each element is read once from shared memory and widened once for both
// outputs, and the stages need no CTA barrier (each thread reads back only the cp.async copies it issued itself).
//
// Thread layout: warp w covers tile rows 32 (w & 3) .. + 32 (one 32-row column block) and columns
// 64 (w >> 2) .. + 64; lane = 8 rg + cc covers rows 32 (w & 3) + 8 rg + i (i < 8) and columns 64 (w >> 2) + 8 cc
// .. + 8. Each tile arrives by cp.async in one of S shared-memory stages (S - 1 tiles in flight ahead of the one
// processed), laid out [8][NTHREADS] x 16 bytes, so the 16-byte loads of one warp touch consecutive addresses.
// The row scales go through a 512-byte shared tile (two, alternating per tile) and one CTA barrier per tile:
// every 16-byte word of the cuBLAS tile holds bytes of all four 32-row blocks, i.e. of four warps (stored from
// the lanes as 2-byte pieces instead, they were slower: docs/performance.md).
#pragma once

#define MXD_STAGE_BYTES (8 * NTHREADS * 16)

// One row of a thread's 8 x 8 block, quantized both ways (shared by mx_quant_dual and mx_swiglu_dual): f[8] the
// values, s = 2**-E of the row block (bad: NaN/Inf in it, all bytes 0x7F), cmul / cnan the 8 columns' multipliers
// and NaN byte masks. Returns the row-wise e4m3 bytes; o: the column-wise ones.
__device__ __forceinline__ uint2 mxd_quant_row(const float (&f)[8], float s, bool bad, const float (&cmul)[8],
                                               const unsigned (&cnan)[2], unsigned (&o)[2]) {
    uint2 q = make_uint2(mx_cvt4_e4m3(mx_mul(f[0], s), mx_mul(f[1], s), mx_mul(f[2], s), mx_mul(f[3], s)),
                         mx_cvt4_e4m3(mx_mul(f[4], s), mx_mul(f[5], s), mx_mul(f[6], s), mx_mul(f[7], s)));
    if (bad) q = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
#pragma unroll
    for (int h = 0; h < 2; ++h)
        o[h] = (mx_cvt4_e4m3(mx_mul(f[4 * h], cmul[4 * h]), mx_mul(f[4 * h + 1], cmul[4 * h + 1]),
                             mx_mul(f[4 * h + 2], cmul[4 * h + 2]), mx_mul(f[4 * h + 3], cmul[4 * h + 3])) &
                ~cnan[h]) |
               (0x7F7F7F7Fu & cnan[h]);
    return q;
}

// b = the exact value of each column-wise byte o (e4m3 -> fp32, exact) times 2**E (cdeq, exact), rounded
// once to bf16 as the reference's .to(bfloat16) of its fp32 dequantization; NaN blocks give bf16 NaN 0x7FC0.
__device__ __forceinline__ void mxd_prep_row(unsigned (&b)[4], const unsigned (&o)[2], const float (&cdeq)[8],
                                             const unsigned (&cnan)[2]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        float lo, hi;
        mx_e4m3x2_to_f32(o[p >> 1] >> (16 * (p & 1)), lo, hi);
        const unsigned nm = __byte_perm(cnan[p >> 1], 0u, (p & 1) ? 0x3322u : 0x1100u);
        b[p] = (mx_pack16x2<1>(mx_mul(lo, cdeq[2 * p]), mx_mul(hi, cdeq[2 * p + 1])) & ~nm) | (0x7FC07FC0u & nm);
    }
}

// Row r = tr0 + i of the thread's block, stored: the row-wise bytes q at prq (ok: the row exists), then the
// prepared bf16 values of the column-wise bytes o at output row 64 bs + r, columns oc .. oc + 7 (rows
// nrows <= r < wrows: the zero rows up to the group's 64-row block). prq advances one row.
__device__ __forceinline__ void mxd_store_row(unsigned char*& prq, unsigned char* cq, uint2 q, const unsigned (&o)[2],
                                              bool ok, bool cok, int r, int nrows, int wrows, long long bs, int K,
                                              int oc, const float (&cdeq)[8], const unsigned (&cnan)[2]) {
    if (ok) *reinterpret_cast<uint2*>(prq) = q;
    prq += K;
    if (cok && r < wrows) {  // zero rows past the group up to the 64-row block
        unsigned b[4] = {0u, 0u, 0u, 0u};
        if (r < nrows) {
            mxd_prep_row(b, o, cdeq, cnan);
        }
        *reinterpret_cast<uint4*>(cq + ((64 * bs + r) * K + oc) * 2) = make_uint4(b[0], b[1], b[2], b[3]);
    }
}

// The thread's 8 row-scale bytes rsb into the 512-byte shared cuBLAS tile st: bytes (r % 32) * 16 + 4 mb + cb,
// cb = 2 (w >> 2) + (lane & 4) / 4 (one lane of each row block's four holds them).
__device__ __forceinline__ void mxd_row_scales_to_smem(unsigned char* st, const unsigned (&rsb)[2], int tr0, int mb,
                                                       int warp, int lane) {
    if ((lane & 3) == 0) {
        unsigned char* d = st + (tr0 & 31) * 16 + 4 * mb + 2 * (warp >> 2) + ((lane >> 2) & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) d[16 * i] = (unsigned char)(rsb[i >> 2] >> (8 * (i & 3)));
    }
}

// A warp whose 32-row block lies past the tile's rows (32 mb >= nrows: in a group's last, partial tile, or in a zero
// tile past the last group) has no element to quantize (the caller skips its arithmetic; warp-uniform, so the
// shuffles stay whole-warp). What it still owes: zero row-scale bytes (the caller's) and the zero rows that pad
// the group to its 64-row block, at output columns oc .. oc + 7. Such warps are common where groups are small
// against 128 rows: 32 random groups of 16384 rows give 16 zero and 32 partial row tiles of 160.
__device__ __forceinline__ void mxd_idle_warp(unsigned char* __restrict__ cq, long long bs, int K, int oc, bool cok,
                                              int nrows, int tr0, int mb) {
    if (cok && 32 * mb < ((nrows + 63) & ~63)) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            *reinterpret_cast<uint4*>(cq + ((64 * bs + tr0 + i) * K + oc) * 2) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// A tile of the grouped row order: row tile, column tile, first row and rows (0: a zero tile past the last group;
// rows clamped at M), and its first 64-row block (grouped_tile).
struct MxdCoord {
    int rt, ct, nrows;
    long long row0, bs;
};

// The tiles T = first + j * step (j = 0, 1, ...) of an n_row_tiles x ctiles grid (column tile fastest), in
// increasing order: the row tile, the column tile and the group advance incrementally (no division and no binary
// search per tile).
struct MxdCursor {
    const int* tstart;
    const long long* rstart;
    const int* bstart;
    int G;
    long long M;
    int ctiles, step_rt, step_ct, rt, ct, g;
    __device__ __forceinline__ MxdCursor(const int* ts, const long long* rs, const int* bs, int G_, long long M_,
                                         int ctiles_, int first, int step)
        : tstart(ts), rstart(rs), bstart(bs), G(G_), M(M_), ctiles(ctiles_), step_rt(step / ctiles_),
          step_ct(step % ctiles_), rt(first / ctiles_), ct(first % ctiles_), g(0) {}
    __device__ __forceinline__ void next(MxdCoord& c) {
        c.rt = rt;
        c.ct = ct;
        while (g < G && tstart[g + 1] <= rt) ++g;  // largest g with tstart[g] <= rt
        grouped_tile(tstart, rstart, bstart, G, g, rt, c.row0, c.nrows, c.bs);
        c.nrows = (int)max(0LL, min((long long)c.nrows, M - c.row0));
        rt += step_rt;
        ct += step_ct;
        if (ct >= ctiles) {
            ct -= ctiles;
            ++rt;
        }
    }
};

// The persistent loop: body(stage, tile, par) on the CTA's tiles T = blockIdx.x + j * gridDim.x < total, each
// copied by issue(stage, tile) (one cp.async commit group) into one of S stages of SB bytes, S - 1 tiles ahead of
// the one processed; their coordinates wait in a register ring (constant indices after unrolling). Past the last
// tile, empty commit groups keep cp.async.wait_group<S - 1> meaning "the oldest tile has landed". par alternates
// per tile (the double-buffered row-scale tiles behind one CTA barrier per tile).
template <int S, int SB, class Cursor, class Issue, class Body>
__device__ __forceinline__ void mxd_pipeline(int total, Cursor& cursor, unsigned char* stage0, Issue& issue,
                                             Body& body) {
    const int step = (int)gridDim.x;
    int T = (int)blockIdx.x;
    if (T >= total) return;
    MxdCoord pend[S - 1] = {};
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (T + s * step < total) {
            cursor.next(pend[s]);
            issue(stage0 + s * SB, pend[s]);
        } else {
            cp_async_commit();
        }
    }
    int buf = 0, par = 0;
    for (; T < total; T += step) {
        const MxdCoord tc = pend[0];
#pragma unroll
        for (int s = 0; s + 1 < S - 1; ++s) pend[s] = pend[s + 1];
        const int fbuf = buf == 0 ? S - 1 : buf - 1;  // the stage processed last (its reads are done)
        if (T + (S - 1) * step < total) {
            cursor.next(pend[S - 2]);
            issue(stage0 + fbuf * SB, pend[S - 2]);
        } else {
            cp_async_commit();
        }
        cp_async_wait<S - 1>();
        body(stage0 + buf * SB, tc, par);
        buf = buf == S - 1 ? 0 : buf + 1;
        par ^= 1;
    }
}

// IN = IN_BF16: x bf16 [M, K], both outputs. IN = IN_MXROWS: x e4m3 [M, K] and x2 its per-group blocked scales
// (RS_GROUPED's layout, so tile (rt, ct) of the grid reads scale tile rt * ctiles + ct), column output only (rq, rs
// not touched): the thread's 8 rows arrive as 8 e4m3 bytes each plus the 4-byte word of its 32-row block in each
// row's 16-byte line of the scale tile, and become the bf16 words of mx_dequant<1, 0> (exact e4m3 value times
// 2**(s - 127), rounded once; scale 0xFF: NaN), after which the column path is the bf16 one. Why: the backward's
// x column operand from the saved MXFP8 rows in one pass, instead of dequantizing to a bf16 copy (write 2 bytes,
// read them again) and quantizing that.
template <int IN, int CS, int S>
__global__ void __launch_bounds__(NTHREADS, S == 2 ? 3 : (S == 3 ? 2 : 1))
    mx_quant_dual(MX_QUANT_PARAMS) {
    static_assert(IN == IN_BF16 || IN == IN_MXROWS, "the register-tiled dual quantizer reads bf16 or MXFP8 rows");
    static_assert(CS == CS_GPREP, "per-group column blocks as the wgrad's prepared bf16 operand");
    static_assert(S >= 2 && S <= 4, "cp.async stages of 32 KB (moe_ep/mxfp8/plan.py dual_plan)");
    constexpr bool MXIN = IN == IN_MXROWS;
    constexpr bool ROWS = !MXIN;  // row-wise output
    // MXIN stage: [8][NTHREADS] x 8 data bytes, then [8][NTHREADS] x 4 scale bytes (24 KB of the 32 KB stage)
    constexpr int MX_SOFF = 8 * NTHREADS * 8;
    MX_DYN_SMEM(smem);
    // S cp.async stages, two 512-byte row-scale tiles, then the group table (16 (G + 1) bytes). The stages come
    // first so that they start on 128 bytes: after the table (528 bytes at G = 32) each warp's 512-byte cp.async
    // spanned five 128-byte rows of shared memory, and L2 served every line of x twice (docs/performance.md).
    unsigned char* stage0 = smem;
    unsigned char* stile0 = stage0 + S * MXD_STAGE_BYTES;  // [2][512] row-scale tiles
    long long* g_rstart = reinterpret_cast<long long*>(stile0 + 2 * 512);
    int* g_tstart = reinterpret_cast<int*>(g_rstart + G + 1);
    int* g_bstart = g_tstart + G + 1;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int mb = warp & 3;                             // the warp's 32-row block in the tile
    const int tr0 = 32 * mb + 8 * (lane >> 3);           // first tile row of this thread
    const int tc0 = 64 * (warp >> 2) + 8 * (lane & 7);   // first tile column
    grouped_table(gsizes, G, g_tstart, g_rstart, g_bstart);
    // Only the groups' tiles: a buffer sized for the worst case (dropless without a host read of the row count)
    // costs no tile pass over its rows past the groups (their scale tiles: grouped_zero_tail, at the end).
    const int total = min(n_row_tiles, g_tstart[G]) * ctiles;

    MxdCursor cursor(g_tstart, g_rstart, g_bstart, G, M, ctiles, (int)blockIdx.x, (int)gridDim.x);
    // The thread's 8 chunks of tile c into a stage; rows past the group or chunks past K are zero-filled (no
    // global read; the source address is then x itself, always valid).
    auto issue = [&](unsigned char* stage, const MxdCoord& c) {
        const int col0 = c.ct * TILE;
        const int nr = col0 + tc0 < K ? c.nrows - tr0 : 0;  // chunks i < nr exist
        if (MXIN) {
            const unsigned char* src = x + (c.row0 + tr0) * K + col0 + tc0;
            // the word of block mb in the 16-byte line of tile row (tr0 & 31) + i of scale tile (rt, ct)
            const unsigned char* ssrc = x2 + ((long long)c.rt * ctiles + c.ct) * 512 + (tr0 & 31) * 16 + 4 * mb;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                cp_async_small<8>(stage + (i * NTHREADS + tid) * 8, i < nr ? src : x, i < nr);
                cp_async_small<4>(stage + MX_SOFF + (i * NTHREADS + tid) * 4, i < nr ? ssrc : x2, i < nr);
                src += K;
                ssrc += 16;
            }
        } else {
            const unsigned char* src = x + ((c.row0 + tr0) * K + col0 + tc0) * 2;
            const long long rstride = 2LL * K;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                cp_async16(stage + (i * NTHREADS + tid) * 16, i < nr ? src : x, i < nr);
                src += rstride;
            }
        }
        cp_async_commit();
    };

    auto body = [&](const unsigned char* cur, const MxdCoord& tc, int par) {
        const int rt = tc.rt, ct = tc.ct, nrows = tc.nrows;
        const long long row0 = tc.row0, bs = tc.bs;
        const int col0 = ct * TILE;
        const bool cok = col0 + tc0 < K;
        unsigned rsb[2] = {0u, 0u};  // the 8 rows' scale bytes (0 past the group or past K: tile padding)

        if (32 * mb >= nrows) {  // no row of the warp's 32-row block is in the tile (mxd_idle_warp)
            mxd_idle_warp(cq, bs, K, col0 + tc0, cok, nrows, tr0, mb);
        } else {
            // ---- amax keys: rows (packed u16x2: rows 2j / 2j + 1) and word columns (columns 2c / 2c + 1) ----
            // The thread's row i as 4 bf16x2 words: staged (bf16), or (MXIN) dequantized exactly as mx_dequant<1, 0>
            // (bf16 out) from its 8 e4m3 bytes and scale byte, rows past the group zero-filled. MXIN computes it at
            // each of its two uses (the keys, then the row) from the stage rather than keeping 8 rows live (a spill
            // at 3 CTAs per SM).
            uint4 v[8];
            if (!MXIN) {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = *reinterpret_cast<const uint4*>(cur + (i * NTHREADS + tid) * 16);
            }
            auto row_words = [&](int i) {
                if (!MXIN) return v[i];
                // volatile: read again at each use (not kept in registers by the compiler)
                const volatile unsigned* dp = reinterpret_cast<const volatile unsigned*>(cur + (i * NTHREADS + tid) * 8);
                const uint2 d = make_uint2(dp[0], dp[1]);
                const unsigned sw = *reinterpret_cast<const volatile unsigned*>(cur + MX_SOFF + (i * NTHREADS + tid) * 4);
                const unsigned sb = (sw >> (8 * (tc0 >> 5))) & 0xFFu;  // the thread's 32-column block of the tile
                const float m = sb == MX_SCALE_NAN ? __uint_as_float(0x7FC00000u) : mx_exp2i((int)sb - 127);
                const unsigned dw[2] = {d.x, d.y};
                unsigned b[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    float lo, hi;
                    mx_e4m3x2_to_f32(dw[p >> 1] >> (16 * (p & 1)), lo, hi);
                    b[p] = mx_pack16x2<1>(mx_mul(lo, m), mx_mul(hi, m));
                }
                return make_uint4(b[0], b[1], b[2], b[3]);
            };
            unsigned rkey[4], ckey[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned m[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 a = row_words(2 * j + h);
                    const unsigned w0 = a.x & 0x7FFF7FFFu, w1 = a.y & 0x7FFF7FFFu, w2 = a.z & 0x7FFF7FFFu,
                                   w3 = a.w & 0x7FFF7FFFu;
                    ckey[0] = __vmaxu2(ckey[0], w0);
                    ckey[1] = __vmaxu2(ckey[1], w1);
                    ckey[2] = __vmaxu2(ckey[2], w2);
                    ckey[3] = __vmaxu2(ckey[3], w3);
                    m[h] = __vmaxu2(__vmaxu2(w0, w1), __vmaxu2(w2, w3));
                }
                rkey[j] = __vmaxu2(__byte_perm(m[0], m[1], 0x5410u), __byte_perm(m[0], m[1], 0x7632u));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (ROWS) {
                    rkey[j] = __vmaxu2(rkey[j], __shfl_xor_sync(0xFFFFFFFFu, rkey[j], 1));
                    rkey[j] = __vmaxu2(rkey[j], __shfl_xor_sync(0xFFFFFFFFu, rkey[j], 2));
                }
                ckey[j] = __vmaxu2(ckey[j], __shfl_xor_sync(0xFFFFFFFFu, ckey[j], 8));
                ckey[j] = __vmaxu2(ckey[j], __shfl_xor_sync(0xFFFFFFFFu, ckey[j], 16));
            }

            // ---- column blocks: multipliers 2**-E, NaN byte masks, 2**E ----
            float cmul[8], cdeq[8];
            unsigned cnan[2] = {0u, 0u};
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                const unsigned k = c & 1 ? ckey[c >> 1] >> 16 : ckey[c >> 1] & 0xFFFFu;
                const bool bad = k >= Key<IN_BF16>::BAD;
                const unsigned t = mx_bf16_block_t(k);
                cmul[c] = bad ? 0.0f : __uint_as_float((262u - t) << 23);
                cdeq[c] = t > 8u ? __uint_as_float((t - 8u) << 23) : __uint_as_float(1u << 22);  // 2**-127: subnormal
                cnan[c >> 2] |= (bad ? 0xFFu : 0u) << (8 * (c & 3));
            }

            // ---- per row: row-wise bytes, the column-wise bytes' prepared bf16 values ----
            const long long off0 = (row0 + tr0) * K + col0 + tc0;
            const int nr = cok ? nrows - tr0 : 0;  // rows i < nr of this thread exist
            unsigned char* prq = rq + off0;
            const int wrows = (nrows + 63) & ~63;  // zero rows up to the group's 64-row block
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = tr0 + i;
                const bool ok = i < nr;
                const unsigned k = i & 1 ? rkey[i >> 1] >> 16 : rkey[i >> 1] & 0xFFFFu;
                const bool bad = k >= Key<IN_BF16>::BAD;
                const unsigned t = mx_bf16_block_t(k);
                const float s = __uint_as_float((262u - t) << 23);
                rsb[i >> 2] |= (ok ? (bad ? MX_SCALE_NAN : t - 8u) : 0u) << (8 * (i & 3));
                const uint4 vi = row_words(i);
                const unsigned vw[4] = {vi.x, vi.y, vi.z, vi.w};
                float f[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = word_elem<IN_BF16>(vw[e >> 1], e & 1);
                unsigned o[2];
                const uint2 q = mxd_quant_row(f, s, bad, cmul, cnan, o);  // (!ROWS: q is dead code)
                mxd_store_row(prq, cq, q, o, ROWS && ok, cok, r, nrows, wrows, bs, K, col0 + tc0, cdeq, cnan);
            }
        }
        if (!ROWS) return;  // no row-scale tile: no barrier either (each thread reads only its own copies)

        unsigned char* st = stile0 + par * 512;
        mxd_row_scales_to_smem(st, rsb, tr0, mb, warp, lane);
        __syncthreads();  // the tile is complete; the other buffer is refilled only after the next barrier
        if (tid < 32)
            reinterpret_cast<uint4*>(rs + ((long long)rt * ctiles + ct) * 512)[tid] =
                reinterpret_cast<const uint4*>(st)[tid];
    };
    mxd_pipeline<S, MXD_STAGE_BYTES>(total, cursor, stage0, issue, body);
    if (ROWS) grouped_zero_tail(rs, g_tstart[G], n_row_tiles, ctiles);
}
