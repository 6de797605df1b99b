// Tile scheduling helpers of kernels/mxfp8/quantize.cu: the per-CTA group table (device-side scan of the group sizes,
// no host sync), the tile -> group lookup, and the cp.async primitives of the shared-memory stages.
// Included by quantize.cu only (after TILE and NTHREADS are defined).
#pragma once

// Grouped row layouts: per-CTA table of the groups' first output tile, first row and first 64-row block of the
// wgrad's prepared operand (exclusive prefix sums of ceil(n_g/128), n_g and ceil(n_g/64); entry G = the totals),
// built once per CTA by a block-wide scan of the device-resident group sizes; a tile then finds its group by
// binary search (mx_quant's grouped_lookup) or by walking the table with its tiles (MxdCursor,
// kernels/mxfp8/quant_dual.cuh). Negative sizes count as 0.
#define MX_PREP_ROWS 64  // rows of a block of the prepared operand (the table's third prefix sum)
__device__ __forceinline__ void grouped_table(const int* __restrict__ gsizes, int G, int* tstart,
                                              long long* rstart, int* bstart) {
    __shared__ int s_wt[NTHREADS / 32], s_wb[NTHREADS / 32];
    __shared__ long long s_wn[NTHREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    long long carry_n = 0;
    int carry_t = 0, carry_b = 0;
    for (int base = 0; base < G; base += NTHREADS) {
        const int g = base + tid;
        const int n = g < G ? max(gsizes[g], 0) : 0;
        const int t = (n + TILE - 1) / TILE, b = (n + MX_PREP_ROWS - 1) / MX_PREP_ROWS;
        long long in = n;
        int it = t, ib = b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            long long yn = __shfl_up_sync(0xFFFFFFFFu, in, o);
            int yt = __shfl_up_sync(0xFFFFFFFFu, it, o);
            int yb = __shfl_up_sync(0xFFFFFFFFu, ib, o);
            if (lane >= o) {
                in += yn;
                it += yt;
                ib += yb;
            }
        }
        if (lane == 31) {
            s_wn[warp] = in;
            s_wt[warp] = it;
            s_wb[warp] = ib;
        }
        __syncthreads();
        long long tot_n = 0;
        int tot_t = 0, tot_b = 0;
#pragma unroll
        for (int w = 0; w < NTHREADS / 32; ++w) {
            if (w < warp) {
                in += s_wn[w];
                it += s_wt[w];
                ib += s_wb[w];
            }
            tot_n += s_wn[w];
            tot_t += s_wt[w];
            tot_b += s_wb[w];
        }
        if (g < G) {
            tstart[g] = carry_t + it - t;
            rstart[g] = carry_n + in - n;
            bstart[g] = carry_b + ib - b;
        }
        carry_n += tot_n;
        carry_t += tot_t;
        carry_b += tot_b;
        __syncthreads();  // s_wn / s_wt / s_wb are rewritten by the next round
    }
    if (tid == 0) {
        tstart[G] = carry_t;
        rstart[G] = carry_n;
        bstart[G] = carry_b;
    }
    __syncthreads();
}

// The row-scale tiles of row tiles first_rt .. n_row_tiles - 1 (past the groups' tiles: the loops over tiles stop
// at the groups' last one) written as zeros, 8 tiles per CTA step (one warp each, 16-byte stores), grid-strided.
// Why: the grouped blocked layout's contract is zero tiles past the groups, and a buffer sized for the worst case
// (dropless without a host read) then costs 1/32 byte per element of its unused rows here, not a tile pass.
__device__ __forceinline__ void grouped_zero_tail(unsigned char* __restrict__ rs, int first_rt, int n_row_tiles,
                                                  int ctiles) {
    const long long t1 = (long long)n_row_tiles * ctiles;
    for (long long t = (long long)max(first_rt, 0) * ctiles + blockIdx.x * (NTHREADS / 32) + (threadIdx.x >> 5);
         t < t1; t += (long long)gridDim.x * (NTHREADS / 32))
        reinterpret_cast<uint4*>(rs + t * 512)[threadIdx.x & 31] = make_uint4(0u, 0u, 0u, 0u);
}

// Output tile T of group g (the largest g with tstart[g] <= T; g = G: past the last group): its first row, rows
// and first 64-row block, as grouped_lookup below returns them.
__device__ __forceinline__ void grouped_tile(const int* tstart, const long long* rstart, const int* bstart, int G,
                                             int g, int T, long long& row0, int& nrows, long long& bs) {
    if (g >= G) {
        row0 = rstart[G];
        nrows = 0;
        bs = bstart[G];
        return;
    }
    const int lt = T - tstart[g];
    row0 = rstart[g] + (long long)lt * TILE;
    bs = bstart[g] + (long long)(TILE / MX_PREP_ROWS) * lt;
    nrows = (int)min((long long)TILE, rstart[g + 1] - row0);
}

// Rows [row0, row0 + nrows) of output tile T under the table above (nrows = 0: a zero tile past the last group)
// and the index of its first 64-row block, counted per group and continued across groups (bs).
__device__ __forceinline__ void grouped_lookup(const int* tstart, const long long* rstart, const int* bstart,
                                               int G, int T, long long& row0, int& nrows, long long& bs) {
    int lo = 0, hi = G;  // largest g in [0, G] with tstart[g] <= T
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tstart[mid] <= T) lo = mid;
        else hi = mid - 1;
    }
    grouped_tile(tstart, rstart, bstart, G, lo, T, row0, nrows, bs);
}

// cp.async stages (mx_quant's pipes 4 and 5, mx_quant_dual, mx_swiglu_dual): a tile's bytes arrive in shared
// memory, so bytes in flight cost no registers (docs/performance.md, "Quantization"). In row-only modes
// each thread reads back only the 16-byte slots it copied itself, so the stage needs no CTA barrier
// (cp.async.wait_group orders a thread's own copies). mx_quant's modes with a column output read other threads'
// slots in phase 2 and rely on quantize.cu's __syncthreads after phase 1.
#define MX_STAGE_BYTES (TILE * TILE * 2)

// cp.async of N = 4 or 8 bytes (zero-filled when !ok; .ca: the sizes below 16 have no .cg form): mx_quant_dual's
// MXFP8-row input, whose thread chunks are 8 e4m3 bytes and 4-byte words of the scale tile.
template <int N> __device__ __forceinline__ void cp_async_small(unsigned char* smem_dst, const unsigned char* src,
                                                                bool ok) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__)
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(N), "r"(ok ? N : 0)
                 : "memory");
#else
    if (ok) memcpy(smem_dst, src, N);
    else memset(smem_dst, 0, N);
#endif
}

// cp_async_wait<n> for n in 0..7 known only after unrolling (a per-chunk wait inside an unrolled loop).
__device__ __forceinline__ void cp_async_wait_n(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}
