// Blockwise FP8 quantizers (recipe row moe_ep.recipe.BLOCKWISE; the byte layouts and the specification are
// moe_ep/blockwise/reference.py; launchers moe_ep/blockwise/cuda.py). E4M3 elements, E8M0 scales (RCEIL), one scale
// per block; the per-block math is quant_blockwise.cuh's. Every kernel reads its input once and writes only what the
// recipe's GEMMs read.
//
//   bw_quant_rowwise<IN>    x [M, K] (fp32 / bf16) -> data [M, K], scale [M, K/128]: 1x128 blocks. Elementwise over
//                           16-byte chunks (a block = 16 bf16 / 32 fp32 consecutive chunks = lanes of one warp), 4
//                           chunks per thread in flight, 256 threads.
//   bw_quant_colwise<SRC>   expert-sorted rows x [M, K] (bf16, or the 1x128 e4m3 bytes + scales of the dispatch,
//                           dequantized exactly and requantized) -> data_c bf16 [64 (ceil(M/64) + G), K]: 128x1
//                           blocks along each group's rows written exactly dequantized, in the prepared layout of the
//                           bf16 wgrad kernel (64-row group padding). Persistent CTAs (2 per SM) build the group
//                           table from the device sizes once (bw_group_table) and walk the (128-row group tile,
//                           128-wide K tile) pairs with a cp.async pipeline S deep.
//   bw_quant_weight<IN>     w [G, N, K] (fp32 / bf16) -> data [G, N, K], data_t [G, K, N], scale [G, N/128, K/128]:
//                           one CTA per 128x128 tile, grid (N/128 * K/128, G).
//   bw_transpose_weight     data [G, N, K] e4m3 -> data_t [G, K, N]: the bytes transposed (no re-quantization; a
//                           128x128 block is a block of the transpose), for a weight gathered as data + scale
//                           (moe_ep/experts/fsdp_blockwise.py). One CTA per 128x128 tile, grid (N/128 * K/128, G).
//   bw_swiglu<BWD, COL, NT, STAGED>  the SwiGLU forward h = silu(gate) * up [M, F] (BWD = 0) or backward
//                           dA = swiglu_bwd(a, dh) [M, 2F] (BWD = 1) computed in registers: the forward quantized
//                           1x128 row-wise (COL = 0) or as the prepared 128x1 column operand alone (COL = 1), the
//                           backward both in the same pass (COL = 1). One CTA per 128 x 128 tile of h.
//
// The tiled kernels stage a 128 x 128 tile in shared memory by cp.async (rows past the group / M zero-filled) in
// 32-bit words, word w of row r at r W + (w ^ (r / R) (32 / S)): thread (u, q) = (word column, row segment of R
// rows) then reads its R words conflict-free (the XOR spreads the S segments of a warp over the 32 banks), and the
// 16-byte chunks stay contiguous (32 / S >= 4).
#include "quant_blockwise.cuh"

#define BW_F32 0
#define BW_BF16 1
#define BW_E4M3 3  // 1x128-quantized rows: e4m3 data [M, K] + u8 scale [M, K/128] (requantized column-wise)
#define BW_NT 256

#ifndef BW_DYN_SMEM  // the CPU emulator (tests/blockwise_emu.py) provides its own
#define BW_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
#ifndef BW_CHECK_THREADS  // the emulator checks that a launch has the CTA size the kernel was built for
#define BW_CHECK_THREADS(n)
#endif

// Tile layout of a 128 x 128 tile of ES-byte elements staged as 32-bit words (see the file comment).
template <int ES>
struct BwTile {
    static constexpr int W = BW_BLOCK * ES / 4;      // words per row
    static constexpr int S = BW_NT / W;              // row segments (threads per word column)
    static constexpr int R = BW_BLOCK / S;           // rows per segment
    static constexpr int C = 4 / ES;                 // columns per word
    static constexpr int CPR = W / 4;                // 16-byte chunks per row
    static constexpr int PER = BW_BLOCK * CPR / BW_NT;  // chunks per thread
    static_assert(S >= 2 && S <= 8 && R % 16 == 0, "tile shape");
    static __device__ __forceinline__ int word(int r, int w) { return r * W + (w ^ ((r / R) * (32 / S))); }
};

// ------------------------------------------------------------------------------------------------------------
// 1x128 row-wise
// ------------------------------------------------------------------------------------------------------------

// x: [M, K] IN (BW_F32 / BW_BF16) as nchunks 16-byte chunks (K % 128 == 0); q: [M, K] e4m3; s: [M, K/128] u8 (flat
// block index = chunk / (chunks per block)). Grid: ceil(nchunks / (4 * 256)).
template <int IN>
__global__ void __launch_bounds__(BW_NT) bw_quant_rowwise(const unsigned char* __restrict__ x, long long nchunks,
                                                          unsigned char* __restrict__ q,
                                                          unsigned char* __restrict__ s) {
    constexpr int V = IN == BW_F32 ? 4 : 8;  // values per chunk
    constexpr int CPB = BW_BLOCK / V;        // chunks (lanes) per block
    constexpr int U = 4;                     // chunks per thread, all loads issued before use
    BW_CHECK_THREADS(BW_NT);
    const int tid = threadIdx.x, lane = tid & 31;
    const long long c0 = (long long)blockIdx.x * (U * BW_NT) + tid;
    uint4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const long long c = c0 + (long long)j * BW_NT;
        v[j] = c < nchunks ? bw_ld16(x + c * 16) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const long long c = c0 + (long long)j * BW_NT;  // whole blocks are in or out: nchunks % CPB == 0
        float f[V];
        bw_chunk_vals<V>(v[j], f);
        unsigned o[V / 4];
        const unsigned sb = bw_quant_1x128<V>(f, o);
        if (c < nchunks) {
            if (V == 8) *reinterpret_cast<uint2*>(q + c * V) = make_uint2(o[0], o[V / 4 - 1]);
            else *reinterpret_cast<unsigned*>(q + c * V) = o[0];
            if ((lane & (CPB - 1)) == 0) s[c / CPB] = (unsigned char)sb;
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// 128x1 grouped column-wise: the prepared bf16 wgrad operand
// ------------------------------------------------------------------------------------------------------------

// cp.async of 4 bytes (zero-filled when !ok): the aligned word holding a 1x128 scale byte of the requantized input.
__device__ __forceinline__ void bw_cp_async4(unsigned char* smem_dst, const unsigned char* src, bool ok) {
#if defined(__CUDA_ARCH__)
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(ok ? 4 : 0) : "memory");
#else
    if (ok) memcpy(smem_dst, src, 4);
    else memset(smem_dst, 0, 4);
#endif
}

// Pipeline depth of bw_quant_colwise (tiles in shared memory per CTA, S - 1 of them loading while one is quantized)
// and its dynamic shared memory: S tiles of 128 * 128 * ES bytes, (e4m3) S x 128 scale words, then the group table
// (16 (G + 1) bytes); the launcher computes the same (moe_ep/blockwise/cuda.py).
template <int SRC>
struct BwColCfg {
    static constexpr int ES = SRC == BW_E4M3 ? 1 : 2;
    static constexpr int S = SRC == BW_E4M3 ? 4 : 3;
    static constexpr int TILE_BYTES = BW_BLOCK * BW_BLOCK * ES;
    static constexpr int FIXED = S * TILE_BYTES + (SRC == BW_E4M3 ? S * BW_BLOCK * 4 : 0);
};

// x: [M, K] bf16 (SRC = BW_BF16) or e4m3 (BW_E4M3, with xs: [M, K/128] u8 its 1x128 scales, 16-byte aligned);
// gsizes: [G] int32; qt: bf16 [cols, K] with cols = 64 (ceil(M/64) + G) (the prepared wgrad operand). Persistent:
// grid = min(tiles, 2 per SM) CTAs walk the (128-row tile T of a group, 128-wide K tile kt) pairs, kt fastest, up to
// the groups' last tile (tstart[G]; the grid is sized from M and G alone, ceil(M/128) + G bounding the tiles), with
// S - 1 tiles in flight by cp.async while one is quantized. Tile (T, kt) writes columns kt*128 .. of the rows
// prow0 .. prow0 + ceil(nrows/64) 64 - 1 of qt (the group's rows, then zero rows up to the next multiple of 64;
// prow0: bw_table_tile), 4 (bf16) or 8 (e4m3) bytes of each row per thread; rows >= cols are never written.
template <int SRC>
__global__ void __launch_bounds__(BW_NT, 2) bw_quant_colwise(const unsigned char* __restrict__ x,
                                                             const unsigned char* __restrict__ xs, long long M, int K,
                                                             const int* __restrict__ gsizes, int G, long long cols,
                                                             unsigned char* __restrict__ qt) {
    using Cf = BwColCfg<SRC>;
    constexpr int ES = Cf::ES, S = Cf::S;
    using L = BwTile<ES>;
    constexpr int R = L::R, C = L::C, SG = L::S;
    BW_CHECK_THREADS(BW_NT);
    BW_DYN_SMEM(smem);
    __shared__ float s_mul[BW_BLOCK];  // BW_E4M3: the current tile's row multipliers (0 past its rows)
    unsigned* sw = reinterpret_cast<unsigned*>(smem + S * Cf::TILE_BYTES);  // BW_E4M3: [S][128] scale words
    long long* rstart = reinterpret_cast<long long*>(smem + Cf::FIXED);
    int* tstart = reinterpret_cast<int*>(rstart + G + 1);
    int* pstart = tstart + G + 1;
    const int tid = threadIdx.x;
    const int ktiles = K / BW_BLOCK;
    bw_group_table<BW_NT>(gsizes, G, tstart, rstart, pstart);
    const long long nt = (long long)tstart[G] * ktiles;  // valid tiles: the groups' tiles times the K tiles

    auto coords = [&](long long t, long long& T, int& kt, long long& row0, int& nrows, long long& prow0) {
        T = t / ktiles;
        kt = (int)(t - T * ktiles);
        bw_table_tile(tstart, rstart, pstart, G, M, (int)T, row0, nrows, prow0);
    };
    auto issue = [&](long long t, int b) {  // the tile's rows by cp.async (rows past the group zero-filled)
        long long T, row0, prow0;
        int kt, nrows;
        coords(t, T, kt, row0, nrows, prow0);
        const unsigned char* src = x + (row0 * K + (long long)kt * BW_BLOCK) * ES;
        unsigned char* stg = smem + b * Cf::TILE_BYTES;
#pragma unroll
        for (int j = 0; j < L::PER; ++j) {
            const int m = j * BW_NT + tid, r = m / L::CPR, cc = m % L::CPR;
            const bool ok = r < nrows;
            cp_async16(stg + 4 * L::word(r, 4 * cc), ok ? src + (long long)r * K * ES + 16 * cc : x, ok);
        }
        if (SRC == BW_E4M3 && tid < BW_BLOCK) {
            const bool ok = tid < nrows;
            // the aligned word holding the byte (xs is 16-byte aligned): at most 3 bytes past the tensor's last
            // byte, inside its 16-byte granule of the allocation
            const long long a = (row0 + tid) * ktiles + kt;
            bw_cp_async4(reinterpret_cast<unsigned char*>(sw + b * BW_BLOCK + tid), ok ? xs + (a & ~3LL) : xs, ok);
        }
    };

    const long long t0 = blockIdx.x, step = gridDim.x;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (t0 + s * step < nt) issue(t0 + s * step, s);
        cp_async_commit();  // (an empty group past the end keeps the group count uniform)
    }
    for (long long i = 0;; ++i) {
        const long long t = t0 + i * step;
        if (t >= nt) break;
        const int b = (int)(i % S);
        if (t + (S - 1) * step < nt) issue(t + (S - 1) * step, (int)((i + S - 1) % S));  // the stage freed last
        cp_async_commit();
        cp_async_wait<S - 1>();  // all but the S - 1 newest groups: tile t has landed
        __syncthreads();
        long long T, row0, prow0;
        int kt, nrows;
        coords(t, T, kt, row0, nrows, prow0);
        if (SRC == BW_E4M3) {
            if (tid < BW_BLOCK) {
                const long long a = (row0 + tid) * ktiles + kt;
                const unsigned sb = (sw[b * BW_BLOCK + tid] >> (8 * (int)(a & 3))) & 0xFFu;
                s_mul[tid] = tid < nrows ? bw_deq_mul(sb) : 0.0f;
            }
            __syncthreads();
        }
        const unsigned* tile = reinterpret_cast<const unsigned*>(smem + b * Cf::TILE_BYTES);
        const int k0 = kt * BW_BLOCK;
        // thread (u, qs): word column u (C columns), rows qs R .. qs R + R - 1; the SG segments of a column are
        // lanes tid ^ 1 .. ^ (SG - 1)
        const int u = tid / SG, qs = tid % SG;
        // the column values (exact fp32): e4m3 words are widened once and kept in registers (R x C = 64 values);
        // bf16 words are re-read in the output pass (widening them is two integer operations)
        float v[SRC == BW_E4M3 ? R : 1][C];
        auto vals = [&](int i, float (&f)[C]) {
            const int r = qs * R + i;
            const unsigned w = tile[L::word(r, u)];
            if constexpr (SRC == BW_E4M3) {
                float e[4];
                bw_e4m3x4(w, e);
#pragma unroll
                for (int c = 0; c < C; ++c) f[c] = mx_mul(e[c], s_mul[r]);
            } else {
#pragma unroll
                for (int c = 0; c < C; ++c) f[c] = bw_bf16(w, c);
            }
        };
        unsigned key[C];
#pragma unroll
        for (int c = 0; c < C; ++c) key[c] = 0u;
#pragma unroll
        for (int i = 0; i < R; ++i) {
            float f[C];
            vals(i, f);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                key[c] = max(key[c], bw_key(f[c]));
                if constexpr (SRC == BW_E4M3) v[i][c] = f[c];
            }
        }
        float mul[C], dm[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
            for (int off = 1; off < SG; off <<= 1) key[c] = max(key[c], __shfl_xor_sync(0xFFFFFFFFu, key[c], off));
            const unsigned sb = bw_scale_of(key[c], mul[c]);
            dm[c] = bw_deq_mul(sb);
        }
        // row r of the tile -> C bf16 values of row prow0 + r of qt; rows past the group up to the next multiple
        // of 64 are zero (their staged values are zero; a NaN column's too)
        const int nout = (nrows + 63) & ~63;
        unsigned short* qb = reinterpret_cast<unsigned short*>(qt);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int r = qs * R + i;
            float g[C];
            if constexpr (SRC == BW_E4M3) {
#pragma unroll
                for (int c = 0; c < C; ++c) g[c] = v[i][c];
            } else {
                vals(i, g);
            }
            unsigned w[C / 2];
#pragma unroll
            for (int c4 = 0; c4 < C; c4 += 4) {  // C = 4 (e4m3): one group of 4 columns
                float f[4], m4[4], d4[4];
                bool b4[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int cc = min(c4 + c, C - 1);  // C = 2 (bf16): columns 0, 1 and two unused copies
                    f[c] = g[cc];
                    m4[c] = mul[cc];
                    d4[c] = dm[cc];
                    b4[c] = key[cc] >= BW_BAD;
                }
                const uint2 h = bw_deq4_bf16(f, m4, d4, b4);
                w[c4 / 2] = h.x;
                if (C == 4) w[C / 2 - 1] = h.y;
            }
            if (r < nout && prow0 + r < cols) {
                unsigned short* dst = qb + (prow0 + r) * K + k0 + u * C;
                if (r >= nrows) {
#pragma unroll
                    for (int j = 0; j < C / 2; ++j) w[j] = 0u;
                }
                if (C == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[C / 2 - 1]);
                else *reinterpret_cast<unsigned*>(dst) = w[0];
            }
        }
        __syncthreads();  // stage b is refilled by the next iteration's issue
    }
}

// ------------------------------------------------------------------------------------------------------------
// 128x128 weights: data, its transpose and the scales in one pass
// ------------------------------------------------------------------------------------------------------------

// w: [G, N, K] IN (BW_F32 / BW_BF16), N % 128 == K % 128 == 0; q: [G, N, K] e4m3; qt: [G, K, N] e4m3;
// s: [G, N/128, K/128] u8. Grid (N/128 * K/128, G), K tile fastest; dynamic shared memory 128 * 128 * ES bytes.
template <int IN>
__global__ void __launch_bounds__(BW_NT) bw_quant_weight(const unsigned char* __restrict__ w, int N, int K,
                                                         unsigned char* __restrict__ q,
                                                         unsigned char* __restrict__ qt,
                                                         unsigned char* __restrict__ s) {
    constexpr int ES = IN == BW_F32 ? 4 : 2;
    constexpr int V = 16 / ES;  // values per chunk
    using L = BwTile<ES>;
    constexpr int R = L::R, C = L::C, S = L::S, PER = L::PER, CPR = L::CPR;
    BW_CHECK_THREADS(BW_NT);
    BW_DYN_SMEM(smem);
    __shared__ unsigned s_key[BW_NT / 32];
    const unsigned* tile = reinterpret_cast<const unsigned*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ktl = K / BW_BLOCK, ntl = N / BW_BLOCK;
    const int tn = (int)(blockIdx.x / ktl), tk = (int)(blockIdx.x % ktl);
    const long long g = blockIdx.y;
    const long long n0 = g * N + (long long)tn * BW_BLOCK;  // first row of the tile in [G * N, K]
    const int k0 = tk * BW_BLOCK;

    const unsigned char* src = w + (n0 * K + k0) * ES;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int m = j * BW_NT + tid, r = m / CPR, cc = m % CPR;
        cp_async16(smem + 4 * L::word(r, 4 * cc), src + (long long)r * K * ES + 16 * cc, true);
    }
    cp_async_commit();
    cp_async_wait<0>();

    // amax of the tile: each thread over the chunks it copied (visible to itself after the wait), then the CTA
    unsigned key = 0u;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int m = j * BW_NT + tid, r = m / CPR, cc = m % CPR;
        const uint4 c = *reinterpret_cast<const uint4*>(smem + 4 * L::word(r, 4 * cc));
        float f[V];
        bw_chunk_vals<V>(c, f);
#pragma unroll
        for (int i = 0; i < V; ++i) key = max(key, bw_key(f[i]));
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
    if (lane == 0) s_key[warp] = key;
    __syncthreads();  // also: every thread's tile copies are visible to the CTA (the column pass reads them)
    key = s_key[0];
#pragma unroll
    for (int i = 1; i < BW_NT / 32; ++i) key = max(key, s_key[i]);
    float mul;
    const unsigned sb = bw_scale_of(key, mul);
    const bool bad = key >= BW_BAD;

    // data [G, N, K]: the thread's own chunks, row-major
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int m = j * BW_NT + tid, r = m / CPR, cc = m % CPR;
        const uint4 c = *reinterpret_cast<const uint4*>(smem + 4 * L::word(r, 4 * cc));
        float f[V];
        bw_chunk_vals<V>(c, f);
        unsigned o[V / 4];
        bw_quant_vals<V>(f, mul, bad, o);
        unsigned char* dst = q + (n0 + r) * K + k0 + cc * V;
        if (V == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(o[0], o[V / 4 - 1]);
        else *reinterpret_cast<unsigned*>(dst) = o[0];
    }

    // data_t [G, K, N]: thread (u, qs) quantizes rows qs R .. of word column u, i.e. R contiguous bytes of each of
    // its C rows of the transpose
    const int u = tid / S, qs = tid % S;
#pragma unroll
    for (int c = 0; c < C; ++c) {
        unsigned o[R / 4];
#pragma unroll
        for (int i4 = 0; i4 < R / 4; ++i4) {
            float f[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned wd = tile[L::word(qs * R + 4 * i4 + i, u)];
                f[i] = ES == 4 ? __uint_as_float(wd) : bw_bf16(wd, c);
            }
            unsigned ow[1];
            bw_quant_vals<4>(f, mul, bad, ow);
            o[i4] = ow[0];
        }
        const long long kr = g * K + k0 + u * C + c;  // row of qt viewed as [G * K, N]
        uint4* dst = reinterpret_cast<uint4*>(qt + kr * N + (long long)tn * BW_BLOCK + qs * R);
#pragma unroll
        for (int h = 0; h < R / 16; ++h) dst[h] = make_uint4(o[4 * h], o[4 * h + 1], o[4 * h + 2], o[4 * h + 3]);
    }
    if (tid == 0) s[(g * ntl + tn) * ktl + tk] = (unsigned char)sb;
}

// ------------------------------------------------------------------------------------------------------------
// 128x128 byte transpose (an already-quantized weight's dgrad copy)
// ------------------------------------------------------------------------------------------------------------

#define BW_TP_WORDS 33  // words per staged row: 128 bytes + 4, so word column u of rows r.. spreads over the banks

// PRMT: byte i of the result is byte (s >> 4 i) & 7 of y:x (host path for the CPU emulator)
MX_HD unsigned bw_prmt(unsigned x, unsigned y, unsigned s) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(x, y, s);
#else
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0u;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
#endif
}

// q: [G, N, K] bytes, qt: [G, K, N] bytes (N, K % 128 == 0). The tile lands in shared memory as 128 rows of 33 words
// (16-byte global loads, coalesced; word stores conflict-free); thread (s = warp, u = lane) then reads word column u
// of rows 16 s .. 16 s + 15 (bank (r + u) % 32: conflict-free), transposes each 4x4 byte block with PRMT, and writes
// 16 bytes to each of the 4 rows 4 u .. 4 u + 3 of the transpose. 2 bytes moved per element.
__global__ void __launch_bounds__(BW_NT) bw_transpose_weight(const unsigned char* __restrict__ q, int N, int K,
                                                             unsigned char* __restrict__ qt) {
    BW_CHECK_THREADS(BW_NT);
    __shared__ unsigned tile[BW_BLOCK * BW_TP_WORDS];
    const int tid = threadIdx.x;
    const int ktl = K / BW_BLOCK;
    const int tn = (int)(blockIdx.x / ktl), tk = (int)(blockIdx.x % ktl);
    const long long g = blockIdx.y;
    const unsigned char* src = q + (g * N + (long long)tn * BW_BLOCK) * K + (long long)tk * BW_BLOCK;
#pragma unroll
    for (int j = 0; j < BW_BLOCK * BW_BLOCK / 16 / BW_NT; ++j) {
        const int m = j * BW_NT + tid, r = m >> 3, cc = m & 7;
        const uint4 v = *reinterpret_cast<const uint4*>(src + (long long)r * K + 16 * cc);
        unsigned* d = tile + r * BW_TP_WORDS + 4 * cc;
        d[0] = v.x;
        d[1] = v.y;
        d[2] = v.z;
        d[3] = v.w;
    }
    __syncthreads();
    const int s = tid >> 5, u = tid & 31;
    unsigned o[4][4];  // o[b][i4]: bytes 4 i4 .. 4 i4 + 3 of row 4 u + b of the transposed tile's segment s
#pragma unroll
    for (int i4 = 0; i4 < 4; ++i4) {
        const int r = 16 * s + 4 * i4;
        const unsigned w0 = tile[r * BW_TP_WORDS + u], w1 = tile[(r + 1) * BW_TP_WORDS + u];
        const unsigned w2 = tile[(r + 2) * BW_TP_WORDS + u], w3 = tile[(r + 3) * BW_TP_WORDS + u];
        const unsigned lo01 = bw_prmt(w0, w1, 0x5140u), lo23 = bw_prmt(w2, w3, 0x5140u);  // bytes 0, 1 of each
        const unsigned hi01 = bw_prmt(w0, w1, 0x7362u), hi23 = bw_prmt(w2, w3, 0x7362u);  // bytes 2, 3 of each
        o[0][i4] = bw_prmt(lo01, lo23, 0x5410u);
        o[1][i4] = bw_prmt(lo01, lo23, 0x7632u);
        o[2][i4] = bw_prmt(hi01, hi23, 0x5410u);
        o[3][i4] = bw_prmt(hi01, hi23, 0x7632u);
    }
    unsigned char* dst = qt + (g * K + (long long)tk * BW_BLOCK + 4 * u) * N + (long long)tn * BW_BLOCK + 16 * s;
#pragma unroll
    for (int b = 0; b < 4; ++b)
        *reinterpret_cast<uint4*>(dst + (long long)b * N) = make_uint4(o[b][0], o[b][1], o[b][2], o[b][3]);
}

#include "quant_blockwise_swiglu.cuh"
