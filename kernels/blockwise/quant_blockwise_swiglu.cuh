// The fused SwiGLU quantizers of kernels/blockwise/quantize.cu (included at its end): h = silu(gate) * up (forward)
// or dA = swiglu_bwd(a, dh) (backward) computed in fp32 registers, bit for bit as moe_ep.experts.reference on CUDA
// (quant_blockwise.cuh), and quantized in the same pass into what the blockwise recipe reads:
//   forward   h [M, F]:  1x128 row-wise (fprop2's A) and, GROUPED, 128x1 grouped column-wise (wgrad2's B);
//   backward  dA [M, 2F]: 1x128 row-wise (dgrad1's A) and 128x1 grouped column-wise (wgrad1's A).
// Nothing else is written (no bf16 copy of h or dA).
//
// One CTA per 128 x 128 tile of h (rows x h columns f0 .. f0 + 127; the backward's tile yields dA's gate tile at
// columns f0 and its up tile at F + f0). Thread (tr, tc) = (2 warp + lane / 16, lane % 16) holds RPT rows x 8
// columns (RPT = 8 with 256 threads, 4 with 512), loaded as 16-byte chunks of gate / up (/ dh) straight into
// registers (a warp reads 256 contiguous bytes of each row). A 1x128 row block is 16 lanes of one warp (shuffles
// ^1..^8); a 128x1 column block is 2 lanes of each warp (^16, then across warps through shared memory). Grouped
// tiles follow the padded grouped layout (bw_tile_lookup): tile T is a group's 128-row block (writes padded columns
// 128 T ..), and the spare tiles of the grid (sized ceil(M/128) + G + 1 from M and G only) cover the rows past
// sum(sizes) row-wise, so the row-wise output is complete for all M rows.
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

// The 1x128 row-wise and (col) 128x1 column-wise bytes of a thread's RPT x 8 values v (rows tr RPT + i of the
// tile, output columns oc + 8 tc + e of an output of KO columns).
template <int RPT, int NW>
__device__ __forceinline__ void bw_swiglu_emit(const float (&v)[RPT][8], bool col, long long row0, int nrows,
                                               long long T, int KO, int oc, long long cols,
                                               unsigned char* __restrict__ rq, unsigned char* __restrict__ rs,
                                               unsigned char* __restrict__ cq, unsigned char* __restrict__ cs,
                                               unsigned (*s_ck)[BW_BLOCK], unsigned* s_cf) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tc = lane & 15, tr = 2 * warp + (lane >> 4);
#pragma unroll
    for (int i = 0; i < RPT; ++i) bw_swiglu_row(v[i], tr * RPT + i, row0, nrows, KO, oc, rq, rs);
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
        float m;
        cs[T * KO + oc + tid] = (unsigned char)bw_scale_of(k, m);
    }
    __syncthreads();  // (s_ck / s_cf are rewritten only after the next emit's first barrier: no third one needed)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const unsigned k = s_cf[8 * tc + e];
        float mul;
        bw_scale_of(k, mul);
        float f[RPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i) f[i] = v[i][e];
        unsigned o[RPT / 4];
        const bool bad = k >= BW_BAD;
        bw_quant_vals<RPT>(f, mul, bad, o);
        if (bad) {
#pragma unroll
            for (int w = 0; w < RPT / 4; ++w) o[w] &= bw_rows_mask(tr * RPT + 4 * w, nrows);
        }
        unsigned char* dst = cq + (long long)(oc + 8 * tc + e) * cols + T * BW_BLOCK + tr * RPT;
        if (RPT == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(o[0], o[RPT / 4 - 1]);
        else *reinterpret_cast<unsigned*>(dst) = o[0];
    }
}

template <bool FAST, int RPT>
__device__ __forceinline__ void bw_swiglu_fwd_vals(const uint4 (&gv)[RPT], const uint4 (&uv)[RPT],
                                                   float (&h)[RPT][8]) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        float g[8], u[8];
        bw_chunk_vals<8>(gv[i], g);
        bw_chunk_vals<8>(uv[i], u);
#pragma unroll
        for (int e = 0; e < 8; ++e) h[i][e] = bw_swiglu<FAST>(g[e], u[e]);
    }
}

// dg = swiglu_bwd's gate half and silu = g * sig (du = dh * silu: bw_swiglu_du's operations) from one sigmoid.
template <bool FAST, int RPT>
__device__ __forceinline__ void bw_swiglu_bwd_vals(const uint4 (&gv)[RPT], const uint4 (&uv)[RPT],
                                                   const uint4 (&dv)[RPT], float (&dg)[RPT][8],
                                                   float (&silu)[RPT][8]) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        float g[8], u[8], y[8];
        bw_chunk_vals<8>(gv[i], g);
        bw_chunk_vals<8>(uv[i], u);
        bw_chunk_vals<8>(dv[i], y);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float sig = bw_sigmoid<FAST>(g[e]);
            dg[i][e] = bw_swiglu_dg(g[e], u[e], y[e], sig);
            silu[i][e] = mx_mul(g[e], sig);
        }
    }
}

// a: [M, 2F] bf16 (gate | up), F % 128 == 0; dh (BWD): [M, F] bf16. Outputs (KO = F forward, 2F backward):
// rq [M, KO] e4m3, rs [M, KO/128] u8; GROUPED: cq [KO, cols] e4m3, cs [cols/128, KO] u8 (grouped padded layout of
// gsizes [G] int32). Grid: (GROUPED ? ceil(M/128) + G + 1 : ceil(M/128)) * (F/128), h column tile fastest; NT
// threads (256 forward, 512 backward).
template <int BWD, int GROUPED, int NT>
__global__ void __launch_bounds__(NT, BWD ? 1 : 2)
    bw_swiglu(const unsigned char* __restrict__ a, const unsigned char* __restrict__ dh, long long M, int F,
              const int* __restrict__ gsizes, int G, long long cols, unsigned char* __restrict__ rq,
              unsigned char* __restrict__ rs, unsigned char* __restrict__ cq, unsigned char* __restrict__ cs) {
    constexpr int RPT = BW_BLOCK * 16 / NT;
    constexpr int NW = NT / 32;
    static_assert(RPT == 8 || RPT == 4, "256 or 512 threads");
    BW_CHECK_THREADS(NT);
    __shared__ unsigned s_ck[NW][BW_BLOCK];  // per-warp column keys
    __shared__ unsigned s_cf[BW_BLOCK];      // the tile's column keys
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tc = lane & 15, tr = 2 * warp + (lane >> 4);
    const int ftiles = F / BW_BLOCK;
    const long long T = blockIdx.x / ftiles;
    const int ft = (int)(blockIdx.x % ftiles);
    long long row0;
    int nrows;
    bool col = false;
    if (GROUPED) {
        col = bw_tile_lookup<NT>(gsizes, G, M, T, row0, nrows) == 0 && (T + 1) * BW_BLOCK <= cols;
    } else {
        row0 = T * BW_BLOCK;
        nrows = (int)max(0LL, min((long long)BW_BLOCK, M - row0));
    }
    if (!col && nrows == 0) return;  // uniform over the CTA
    const int fc = ft * BW_BLOCK + 8 * tc;

    uint4 gv[RPT], uv[RPT], dv[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = tr * RPT + i;
        const bool ok = r < nrows;
        const unsigned char* pa = a + ((row0 + r) * (2LL * F) + fc) * 2;
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        gv[i] = ok ? bw_ld16(pa) : z;
        uv[i] = ok ? bw_ld16(pa + 2LL * F) : z;
        if (BWD) dv[i] = ok ? bw_ld16(dh + ((row0 + r) * F + fc) * 2) : z;
    }
    BwDomain dom;
#pragma unroll
    for (int i = 0; i < RPT; ++i) dom.add(gv[i]);
    const bool fast = dom.ok(!BWD);

    if (!BWD && !GROUPED) {  // row-wise only: row by row (fewer live registers)
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float g[8], u[8], h[8];
            bw_chunk_vals<8>(gv[i], g);
            bw_chunk_vals<8>(uv[i], u);
            if (fast) {
#pragma unroll
                for (int e = 0; e < 8; ++e) h[e] = bw_swiglu<true>(g[e], u[e]);
            } else {  // rare: some |g| > 69 or tiny, NaN/Inf
#pragma unroll
                for (int e = 0; e < 8; ++e) h[e] = bw_swiglu<false>(g[e], u[e]);
            }
            bw_swiglu_row(h, tr * RPT + i, row0, nrows, F, ft * BW_BLOCK, rq, rs);
        }
    } else if (!BWD) {
        float h[RPT][8];
        if (fast) bw_swiglu_fwd_vals<true, RPT>(gv, uv, h);
        else bw_swiglu_fwd_vals<false, RPT>(gv, uv, h);  // rare: some |g| > 69 or tiny, NaN/Inf
        bw_swiglu_emit<RPT, NW>(h, col, row0, nrows, T, F, ft * BW_BLOCK, cols, rq, rs, cq, cs, s_ck, s_cf);
    } else {
        // dg and silu = g * sig from one sigmoid; du = dh * silu later (keeps silu and dh live, not g, u and sig)
        float d[RPT][8], silu[RPT][8];
        if (fast) bw_swiglu_bwd_vals<true, RPT>(gv, uv, dv, d, silu);
        else bw_swiglu_bwd_vals<false, RPT>(gv, uv, dv, d, silu);  // rare: some |g| > 69, NaN/Inf
        bw_swiglu_emit<RPT, NW>(d, col, row0, nrows, T, 2 * F, ft * BW_BLOCK, cols, rq, rs, cq, cs, s_ck, s_cf);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float y[8];
            bw_chunk_vals<8>(dv[i], y);
#pragma unroll
            for (int e = 0; e < 8; ++e) d[i][e] = mx_mul(y[e], silu[i][e]);  // bw_swiglu_du: dh * (g * sig)
        }
        bw_swiglu_emit<RPT, NW>(d, col, row0, nrows, T, 2 * F, F + ft * BW_BLOCK, cols, rq, rs, cq, cs, s_ck,
                                s_cf);
    }
}
