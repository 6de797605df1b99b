// The fused SwiGLU quantizers of kernels/blockwise/quantize.cu (included at its end): h = silu(gate) * up (forward)
// or dA = swiglu_bwd(a, dh) (backward) computed in fp32 registers, bit for bit as moe_ep.experts.reference on CUDA
// (quant_blockwise.cuh), and quantized in the same pass into what the blockwise recipe reads:
//   forward   h [M, F]:  1x128 row-wise (fprop2's A), or (COL, the backward's recomputation) its 128x1 grouped blocks
//                        alone, exactly dequantized in bf16 in the bf16 wgrad kernel's prepared layout (wgrad2's B);
//   backward  dA [M, 2F]: 1x128 row-wise (dgrad1's A) and 128x1 grouped, prepared as above (wgrad1's A).
// Nothing else is written (no bf16 copy of h or dA).
//
// One CTA per 128 x 128 tile of h (rows x h columns f0 .. f0 + 127; the backward's tile yields dA's gate tile at
// columns f0 and its up tile at F + f0). Thread (tr, tc) = (2 warp + lane / 16, lane % 16) holds RPT rows x 8
// columns (RPT = 8 with 256 threads, 4 with 512), loaded as 16-byte chunks of gate / up (/ dh) straight into
// registers (a warp reads 256 contiguous bytes of each row). A 1x128 row block is 16 lanes of one warp (shuffles
// ^1..^8); a 128x1 column block is 2 lanes of each warp (^16, then across warps through shared memory). Grouped
// tiles follow the grouped layout (bw_tile_lookup): tile T is a group's 128-row block (written from prepared row
// prow0), and in the backward the spare tiles of the grid (sized ceil(M/128) + G + 1 from M and G only) cover the
// rows past sum(sizes) row-wise, so the row-wise output is complete for all M rows.
#pragma once

// The 1x128 row-wise bytes of row r of the tile (8 values of the thread, output columns oc + 8 tc .. of an output
// of KO columns); every lane of the warp calls it.
__device__ __forceinline__ void bw_swiglu_row(const float (&v)[8], int r, long long row0, int nrows, int KO, int oc,
                                              unsigned char* __restrict__ rq, unsigned char* __restrict__ rs) {
    const int tc = threadIdx.x & 15;
    unsigned o[2];
    const unsigned sb = bw_quant_1x128<8>(v, o);
    if (r < nrows) {
        *reinterpret_cast<uint2*>(rq + (row0 + r) * KO + oc + 8 * tc) = make_uint2(o[0], o[1]);
        if (tc == 0) rs[(row0 + r) * (KO / BW_BLOCK) + oc / BW_BLOCK] = (unsigned char)sb;
    }
}

// The 1x128 row-wise (ROW) and (col) 128x1 column-wise values of a thread's RPT x 8 values v (rows tr RPT + i of
// the tile, output columns oc + 8 tc + e of an output of KO columns): the columns exactly dequantized in bf16 into
// cq viewed as bf16 [cols, KO], tile row r at row prow0 + r (16 bytes of a row per thread: 16 lanes write 256
// contiguous bytes), rows past the group up to the next multiple of 64 zero.
template <int RPT, int NW, bool ROW>
__device__ __forceinline__ void bw_swiglu_emit(const float (&v)[RPT][8], bool col, long long row0, int nrows,
                                               long long prow0, int KO, int oc, long long cols,
                                               unsigned char* __restrict__ rq, unsigned char* __restrict__ rs,
                                               unsigned char* __restrict__ cq, unsigned (*s_ck)[BW_BLOCK],
                                               unsigned* s_cf) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tc = lane & 15, tr = 2 * warp + (lane >> 4);
    if constexpr (ROW) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) bw_swiglu_row(v[i], tr * RPT + i, row0, nrows, KO, oc, rq, rs);
    }
    if (!col) return;  // uniform over the CTA
    unsigned ck[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        ck[e] = 0u;
#pragma unroll
        for (int i = 0; i < RPT; ++i) ck[e] = max(ck[e], bw_key(v[i][e]));
        ck[e] = max(ck[e], __shfl_xor_sync(0xFFFFFFFFu, ck[e], 16));
    }
    if (lane < 16) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_ck[warp][8 * tc + e] = ck[e];
    }
    __syncthreads();
    if (tid < BW_BLOCK) {
        unsigned k = 0u;
#pragma unroll
        for (int w = 0; w < NW; ++w) k = max(k, s_ck[w][tid]);
        s_cf[tid] = k;
    }
    __syncthreads();  // (s_ck / s_cf are rewritten only after the next emit's first barrier: no third one needed)
    float mul[8], dm[8];
    bool bad[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const unsigned k = s_cf[8 * tc + e];
        dm[e] = bw_deq_mul(bw_scale_of(k, mul[e]));
        bad[e] = k >= BW_BAD;
    }
    const int nout = (nrows + 63) & ~63;
    unsigned short* qb = reinterpret_cast<unsigned short*>(cq);
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = tr * RPT + i;
        unsigned w[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float f[4] = {v[i][4 * h], v[i][4 * h + 1], v[i][4 * h + 2], v[i][4 * h + 3]};
            const float m4[4] = {mul[4 * h], mul[4 * h + 1], mul[4 * h + 2], mul[4 * h + 3]};
            const float d4[4] = {dm[4 * h], dm[4 * h + 1], dm[4 * h + 2], dm[4 * h + 3]};
            const bool b4[4] = {bad[4 * h], bad[4 * h + 1], bad[4 * h + 2], bad[4 * h + 3]};
            const uint2 o = bw_deq4_bf16(f, m4, d4, b4);
            w[2 * h] = r < nrows ? o.x : 0u;  // past the group: zero rows (also under a NaN column)
            w[2 * h + 1] = r < nrows ? o.y : 0u;
        }
        if (r < nout && prow0 + r < cols)
            *reinterpret_cast<uint4*>(qb + (prow0 + r) * KO + oc + 8 * tc) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The thread's inputs: chunk i (row tr RPT + i, columns 8 tc ..) of stream s (0 gate, 1 up, 2 dh) as 8 fp32.
// STAGED = 0: the chunks were loaded into registers up front; 1: they landed in the CTA's shared-memory stage by
// cp.async (each thread reads back only the chunks it copied: no barrier), so bytes in flight cost no registers and
// more CTAs fit on an SM (the block scheduler overlaps one CTA's loads with another's arithmetic).
template <int STAGED, int NS, int RPT>
struct BwSwSrc {
    uint4 r[STAGED ? 1 : NS][STAGED ? 1 : RPT];
    const unsigned char* stage;  // STAGED: [NS][128 rows][16 chunks] x 16 bytes
    int tr, tc;
    __device__ __forceinline__ uint4 chunk(int s, int i) const {
        if constexpr (STAGED) {
            return *reinterpret_cast<const uint4*>(stage + ((s * BW_BLOCK + tr * RPT + i) * 16 + tc) * 16);
        } else {
            return r[s][i];
        }
    }
    __device__ __forceinline__ void vals(int s, int i, float (&f)[8]) const { bw_chunk_vals<8>(chunk(s, i), f); }
};

template <bool FAST, class Src, int RPT>
__device__ __forceinline__ void bw_swiglu_fwd_vals(const Src& src, float (&h)[RPT][8]) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        float g[8], u[8];
        src.vals(0, i, g);
        src.vals(1, i, u);
#pragma unroll
        for (int e = 0; e < 8; ++e) h[i][e] = bw_swiglu<FAST>(g[e], u[e]);
    }
}

// Row i of h (the row-wise-only forward: row by row, fewer live registers).
template <bool FAST, class Src>
__device__ __forceinline__ void bw_swiglu_fwd_row(const Src& src, int i, float (&h)[8]) {
    float g[8], u[8];
    src.vals(0, i, g);
    src.vals(1, i, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) h[e] = bw_swiglu<FAST>(g[e], u[e]);
}

// dg (swiglu_bwd's gate half) and, KEEP, silu = g * sig (du = dh * silu: bw_swiglu_du's operations) from one
// sigmoid; without KEEP the up half recomputes the sigmoid (bw_swiglu_du_vals) instead of holding silu.
template <bool FAST, bool KEEP, class Src, int RPT, int RK>
__device__ __forceinline__ void bw_swiglu_dg_vals(const Src& src, float (&dg)[RPT][8], float (&silu)[RK][8]) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        // raw words, widened per element (fewer live registers than 24 fp32 values)
        const uint4 gc = src.chunk(0, i), uc = src.chunk(1, i), yc = src.chunk(2, i);
        const unsigned gw[4] = {gc.x, gc.y, gc.z, gc.w}, uw[4] = {uc.x, uc.y, uc.z, uc.w};
        const unsigned yw[4] = {yc.x, yc.y, yc.z, yc.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float g = bw_bf16(gw[e >> 1], e & 1);
            const float sig = bw_sigmoid<FAST>(g);
            dg[i][e] = bw_swiglu_dg(g, bw_bf16(uw[e >> 1], e & 1), bw_bf16(yw[e >> 1], e & 1), sig);
            if constexpr (KEEP) silu[i][e] = mx_mul(g, sig);
        }
    }
}
template <bool FAST, class Src, int RPT>
__device__ __forceinline__ void bw_swiglu_du_vals(const Src& src, float (&du)[RPT][8]) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const uint4 gc = src.chunk(0, i), yc = src.chunk(2, i);
        const unsigned gw[4] = {gc.x, gc.y, gc.z, gc.w}, yw[4] = {yc.x, yc.y, yc.z, yc.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float g = bw_bf16(gw[e >> 1], e & 1);
            du[i][e] = bw_swiglu_du(g, bw_bf16(yw[e >> 1], e & 1), bw_sigmoid<FAST>(g));
        }
    }
}

// Launch configurations (NT threads, STAGED): the launcher picks one per direction (moe_ep/blockwise/cuda.py).
template <int BWD, int NT, int STAGED>
struct BwSwCfg {
    static constexpr int RPT = BW_BLOCK * 16 / NT;  // rows per thread: 8 (256 threads) or 4 (512)
    static constexpr int NS = BWD ? 3 : 2;          // input streams
    static constexpr int MINB = NT == 512 ? 1 : 2;
    // the backward keeps silu in registers only where that fits (4 rows a thread)
    static constexpr bool KEEP = RPT == 4;
    static constexpr int SMEM = STAGED ? NS * BW_BLOCK * 256 : 0;  // dynamic shared memory bytes
};

// a: [M, 2F] bf16 (gate | up), F % 128 == 0; dh (BWD): [M, F] bf16. Outputs (KO = F forward, 2F backward):
// rq [M, KO] e4m3, rs [M, KO/128] u8 (not in the column-only forward, COL && !BWD); COL: cq bf16 [cols, KO],
// cols = 64 (ceil(M/64) + G) (the prepared wgrad operand of the grouping gsizes [G] int32). The backward has COL = 1.
// Grid: ceil(M/128) * (F/128) (COL = 0), (ceil(M/128) + G) * (F/128) (the column-only forward: the groups' tiles),
// (ceil(M/128) + G + 1) * (F/128) (backward: + the rows past sum(sizes)); h column tile fastest; NT threads (256 or
// 512); dynamic shared memory BwSwCfg::SMEM.
template <int BWD, int COL, int NT, int STAGED>
__global__ void __launch_bounds__(NT, (BwSwCfg<BWD, NT, STAGED>::MINB))
    bw_swiglu(const unsigned char* __restrict__ a, const unsigned char* __restrict__ dh, long long M, int F,
              const int* __restrict__ gsizes, int G, long long cols, unsigned char* __restrict__ rq,
              unsigned char* __restrict__ rs, unsigned char* __restrict__ cq) {
    using Cfg = BwSwCfg<BWD, NT, STAGED>;
    constexpr int RPT = Cfg::RPT, NS = Cfg::NS;
    constexpr int NW = NT / 32;
    static_assert(RPT == 8 || RPT == 4, "256 or 512 threads");
    BW_CHECK_THREADS(NT);
    BW_DYN_SMEM(smem);
    __shared__ unsigned s_ck[NW][BW_BLOCK];  // per-warp column keys
    __shared__ unsigned s_cf[BW_BLOCK];      // the tile's column keys
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tc = lane & 15, tr = 2 * warp + (lane >> 4);
    constexpr bool ROW = BWD || !COL;  // the column-only forward writes no row-wise byte
    const int ftiles = F / BW_BLOCK;
    const long long T = blockIdx.x / ftiles;
    const int ft = (int)(blockIdx.x % ftiles);
    long long row0, prow0 = 0;
    int nrows;
    bool col = false;
    if (COL) {
        col = bw_tile_lookup<NT>(gsizes, G, M, T, row0, nrows, prow0) == 0;
    } else {
        row0 = T * BW_BLOCK;
        nrows = (int)max(0LL, min((long long)BW_BLOCK, M - row0));
    }
    if (!col && (nrows == 0 || !ROW)) return;  // uniform over the CTA
    const int fc = ft * BW_BLOCK + 8 * tc;

    // rows past the group / M read as zeros: h = 0 and dA = 0 there (+0: zero bytes, the reference's padding)
    BwSwSrc<STAGED, NS, RPT> src;
    src.stage = smem;
    src.tr = tr;
    src.tc = tc;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = tr * RPT + i;
        const bool ok = r < nrows;
        const unsigned char* p[3] = {a + ((row0 + r) * (2LL * F) + fc) * 2, a + ((row0 + r) * (2LL * F) + F + fc) * 2,
                                     BWD ? dh + ((row0 + r) * F + fc) * 2 : a};
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            if constexpr (STAGED) {
                cp_async16(smem + ((s * BW_BLOCK + r) * 16 + tc) * 16, ok ? p[s] : a, ok);
            } else {
                src.r[s][i] = ok ? bw_ld16(p[s]) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
    if constexpr (STAGED) {
        cp_async_commit();
        cp_async_wait<0>();
    }
    SwdDomain dom;
#pragma unroll
    for (int i = 0; i < RPT; ++i) dom.add(src.chunk(0, i));
    const bool fast = dom.ok(!BWD);  // else (rare: some |g| > 69 or tiny, NaN/Inf) the IEEE division

    if (!BWD && !COL) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float h[8];
            if (fast) bw_swiglu_fwd_row<true>(src, i, h);
            else bw_swiglu_fwd_row<false>(src, i, h);
            bw_swiglu_row(h, tr * RPT + i, row0, nrows, F, ft * BW_BLOCK, rq, rs);
        }
    } else if (!BWD) {
        float h[RPT][8];
        if (fast) bw_swiglu_fwd_vals<true>(src, h);
        else bw_swiglu_fwd_vals<false>(src, h);
        bw_swiglu_emit<RPT, NW, ROW>(h, col, row0, nrows, prow0, F, ft * BW_BLOCK, cols, rq, rs, cq, s_ck, s_cf);
    } else {
        constexpr bool KEEP = Cfg::KEEP;
        float d[RPT][8], silu[KEEP ? RPT : 1][8];
        if (fast) bw_swiglu_dg_vals<true, KEEP>(src, d, silu);
        else bw_swiglu_dg_vals<false, KEEP>(src, d, silu);
        bw_swiglu_emit<RPT, NW, true>(d, col, row0, nrows, prow0, 2 * F, ft * BW_BLOCK, cols, rq, rs, cq, s_ck, s_cf);
        if constexpr (KEEP) {
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                float y[8];
                src.vals(2, i, y);
#pragma unroll
                for (int e = 0; e < 8; ++e) d[i][e] = mx_mul(y[e], silu[i][e]);  // bw_swiglu_du: dh * (g * sig)
            }
        } else if (fast) {
            bw_swiglu_du_vals<true>(src, d);
        } else {
            bw_swiglu_du_vals<false>(src, d);
        }
        bw_swiglu_emit<RPT, NW, true>(d, col, row0, nrows, prow0, 2 * F, F + ft * BW_BLOCK, cols, rq, rs, cq, s_ck,
                                      s_cf);
    }
}
