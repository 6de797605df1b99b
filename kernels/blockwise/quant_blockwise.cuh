// Device helpers of the blockwise FP8 quantizers (kernels/blockwise/quantize.cu; recipe row moe_ep.recipe.BLOCKWISE,
// byte layouts moe_ep/blockwise/reference.py): the per-block math of one 1x128 row block (bw_quant_1x128, meant to be
// included by the dispatch kernel as well), element loads and conversions, the SwiGLU forward / backward arithmetic
// (bit for bit as torch on CUDA, the formulas of kernels/mxfp8/quant_elem.cuh; the branch-free division and its
// domain are common/swiglu_div.cuh's, shared with kernels/mxfp8/quant_swiglu.cuh) and the device-side
// group lookup of the grouped column-wise layout. Everything is prefixed bw_ so that this header can sit next to the
// MXFP8 headers in one translation unit. The host fallbacks of the asm helpers exist for the CPU emulator
// (tests/blockwise_emu.py), which compiles this file as C++.
//
// The quantization rule is common.cuh's (moe_ep.mxfp8.reference.quantize_blocks_torch): the block key is the largest
// |v| as fp32 bits (a key >= 0x7F800000 means a NaN/Inf block: scale 0xFF, bytes 0x7F), E = mx_block_exp(amax)
// (RCEIL: the smallest power of two >= amax / 448, clamped to [-127, 127]), scale byte E + 127, bytes
// e4m3(v * 2**-E) with saturation.
#pragma once

#include "common.cuh"
#include "swiglu_div.cuh"

#define BW_BLOCK 128         // values per scale along the quantized axis
#define BW_BAD 0x7F800000u   // a key at or above this is NaN/Inf

// ------------------------------------------------------------------------------------------------------------
// loads and element conversions
// ------------------------------------------------------------------------------------------------------------

// 16-byte streaming load (read once: not kept in L1).
__device__ __forceinline__ uint4 bw_ld16(const unsigned char* p) {
    uint4 r;
#if defined(__CUDA_ARCH__)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#else
    memcpy(&r, p, 16);
#endif
    return r;
}

// Element e (0/1) of a word of two bf16 values as fp32 (exact).
__device__ __forceinline__ float bw_bf16(unsigned w, int e) {
    return __uint_as_float(e ? (w & 0xFFFF0000u) : (w << 16));
}

// A 16-byte chunk as fp32 values: 8 bf16 (V = 8) or 4 fp32 (V = 4), in memory order.
template <int V>
__device__ __forceinline__ void bw_chunk_vals(uint4 c, float (&f)[V]) {
    const unsigned w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = V == 8 ? bw_bf16(w[i >> 1], i & 1) : __uint_as_float(w[i & 3]);
}

// Four e4m3 bytes of a word (byte 0 first) -> fp32 (exact; 0x7F / 0xFF give NaN).
__device__ __forceinline__ void bw_e4m3x4(unsigned w, float (&f)[4]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        unsigned h2;
        const unsigned short p = (unsigned short)(w >> (16 * h));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(p));
        const unsigned short lo = (unsigned short)(h2 & 0xFFFFu), hi = (unsigned short)(h2 >> 16);
        asm("cvt.f32.f16 %0, %1;" : "=f"(f[2 * h]) : "h"(lo));
        asm("cvt.f32.f16 %0, %1;" : "=f"(f[2 * h + 1]) : "h"(hi));
    }
#else
    for (int i = 0; i < 4; ++i) f[i] = mx_e4m3_to_f32_soft((w >> (8 * i)) & 0xFFu);
#endif
}

// Dequantization multiplier of a 1x128 scale byte: 2**(s - 127) (exact, 2**-127 is an fp32 subnormal), NaN for 0xFF.
// e4m3 * this multiplier is exact in fp32 (products are 0 or >= 2**-136), so a requantized block sees exactly the
// values of moe_ep.blockwise.reference.dequantize_rowwise_torch.
__device__ __forceinline__ float bw_deq_mul(unsigned s) {
    return s == 0xFFu ? __uint_as_float(0x7FC00000u) : mx_exp2i((int)s - 127);
}

// Two fp32 -> packed bf16x2 (lo in bits 0..15), round to nearest even, subnormals kept (no flush); only finite or
// infinite inputs (a NaN block's words are written as BW_BF16_NAN by the callers, as torch's .to(bfloat16) gives).
#define BW_BF16_NAN 0x7FC0u
__device__ __forceinline__ unsigned bw_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    const float f[2] = {lo, hi};
    unsigned h[2];
    for (int i = 0; i < 2; ++i) {
        const unsigned x = __float_as_uint(f[i]);
        h[i] = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;  // RNE on the bits (Inf stays Inf: its low half is 0)
    }
    return h[0] | (h[1] << 16);
#endif
}

// The exactly dequantized values of four quantized values of one 128x1 column each (the prepared bf16 wgrad operand,
// moe_ep.blockwise.reference.quantize_colwise_prepared_torch): f[i] * mul[i] rounded to e4m3 (bw_quant_vals' rule,
// finite blocks), back to fp32 (exact) times the block's 2**E (exact: the product is an e4m3 value times a power of
// two in [2**-136, 2**136): an fp32 subnormal at worst, or Inf past fp32's range, as the reference's fp32 product),
// then rounded once to bf16 (exact down to 2**-133; below, RNE as the reference's .to(bfloat16)). A bad (NaN/Inf)
// column gives BW_BF16_NAN. Returns two bf16x2 words (values 0, 1 and 2, 3).
__device__ __forceinline__ uint2 bw_deq4_bf16(const float (&f)[4], const float (&mul)[4], const float (&dm)[4],
                                             const bool (&bad)[4]) {
    const unsigned q = mx_cvt4_e4m3(mx_mul(f[0], mul[0]), mx_mul(f[1], mul[1]), mx_mul(f[2], mul[2]),
                                    mx_mul(f[3], mul[3]));
    float e[4];
    bw_e4m3x4(q, e);
    unsigned h[4];
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        const unsigned w = bw_bf16x2(mx_mul(e[i], dm[i]), mx_mul(e[i + 1], dm[i + 1]));
        h[i] = bad[i] ? BW_BF16_NAN : (w & 0xFFFFu);
        h[i + 1] = bad[i + 1] ? BW_BF16_NAN : (w >> 16);
    }
    return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// ------------------------------------------------------------------------------------------------------------
// block quantization
// ------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned bw_key(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// Scale byte of a block with key ``key`` and its multiplier 2**-E (unused for a NaN/Inf block).
__device__ __forceinline__ unsigned bw_scale_of(unsigned key, float& mul) {
    const int e = mx_block_exp(__uint_as_float(key));
    mul = mx_exp2i(-e);
    return key >= BW_BAD ? MX_SCALE_NAN : (unsigned)(e + 127);
}

// V values (V % 4 == 0) times ``mul`` -> V e4m3 bytes in V / 4 words (value 0 in the low byte); a bad block gives
// 0x7F bytes.
template <int V>
__device__ __forceinline__ void bw_quant_vals(const float (&v)[V], float mul, bool bad, unsigned (&o)[V / 4]) {
#pragma unroll
    for (int w = 0; w < V / 4; ++w)
        o[w] = bad ? 0x7F7F7F7Fu
                   : mx_cvt4_e4m3(mx_mul(v[4 * w], mul), mx_mul(v[4 * w + 1], mul), mx_mul(v[4 * w + 2], mul),
                                  mx_mul(v[4 * w + 3], mul));
}

// One 1x128 row block held by 128 / V consecutive lanes of a warp, V values each (V = 8: 16 lanes, e.g. a bf16
// 16-byte chunk per lane; V = 4: the whole warp). Every lane of the warp must call it (the amax is reduced with
// shuffles over the block's lanes; lanes / (128 / V) is the block). Returns the block's scale byte (in every lane)
// and the lane's V e4m3 bytes in o. Example: a bf16 row of K = 256 read by one warp as 16-byte chunks: lanes 0-15
// hold block 0 (columns 0-127), lanes 16-31 block 1; lane l writes o to bytes 8 l .. 8 l + 7 and lanes 0 and 16
// write the two scale bytes.
template <int V>
__device__ __forceinline__ unsigned bw_quant_1x128(const float (&v)[V], unsigned (&o)[V / 4]) {
    unsigned key = 0u;
#pragma unroll
    for (int i = 0; i < V; ++i) key = max(key, bw_key(v[i]));
#pragma unroll
    for (int off = 1; off < BW_BLOCK / V; off <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
    float mul;
    const unsigned sb = bw_scale_of(key, mul);
    bw_quant_vals<V>(v, mul, key >= BW_BAD, o);
    return sb;
}

// ------------------------------------------------------------------------------------------------------------
// SwiGLU arithmetic (moe_ep.experts.reference swiglu / swiglu_bwd as torch evaluates them on CUDA, each operation
// rounded to fp32; the formulas of kernels/quant_elem.cuh, whose GPU tests check them against torch bit for bit):
//   h  = (g / (1 + expf(-g))) * u
//   sig = 1 / (1 + expf(-g)),  dg = (dh * u) * (sig * (1 + g * (1 - sig))),  du = dh * (g * sig)
// ------------------------------------------------------------------------------------------------------------

// FAST: the branch-free division swd_div (swiglu_div.cuh; inside SwdDomain only), else IEEE div.rn.
template <bool FAST>
__device__ __forceinline__ float bw_div(float x, float d) {
    return FAST ? swd_div(x, d) : mx_div(x, d);
}
template <bool FAST>
__device__ __forceinline__ float bw_swiglu(float g, float u) {
    return mx_mul(bw_div<FAST>(g, mx_add(1.0f, expf(-g))), u);
}
template <bool FAST>
__device__ __forceinline__ float bw_sigmoid(float g) {
    return bw_div<FAST>(1.0f, mx_add(1.0f, expf(-g)));
}
__device__ __forceinline__ float bw_swiglu_dg(float g, float u, float dh, float sig) {
    return mx_mul(mx_mul(dh, u), mx_mul(sig, mx_add(1.0f, mx_mul(g, mx_add(1.0f, -sig)))));
}
__device__ __forceinline__ float bw_swiglu_du(float g, float dh, float sig) { return mx_mul(dh, mx_mul(g, sig)); }

// ------------------------------------------------------------------------------------------------------------
// grouped column-wise layout: which rows a padded 128-column tile holds
// ------------------------------------------------------------------------------------------------------------

// One round of a block-wide inclusive scan of three per-thread values (NT threads, every thread calls it): (t, n, p)
// -> their inclusive prefix sums over the threads (it, in, ip) and the round's totals (tot_*), by warp shuffles and
// one shared-memory pass over the warp sums. The caller synchronizes the CTA before the next round (the warp sums
// are rewritten). Used by the grouped-layout scans below (t: tiles, n: rows, p: 64-row blocks of each group).
template <int NT>
__device__ __forceinline__ void bw_block_scan3(long long t, long long n, long long p, long long& it, long long& in,
                                           long long& ip, long long& tot_t, long long& tot_n, long long& tot_p) {
    __shared__ long long s_wt[NT / 32], s_wn[NT / 32], s_wp[NT / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    it = t;
    in = n;
    ip = p;  // inclusive scans over the warp, then over the warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const long long yt = __shfl_up_sync(0xFFFFFFFFu, it, o);
        const long long yn = __shfl_up_sync(0xFFFFFFFFu, in, o);
        const long long yp = __shfl_up_sync(0xFFFFFFFFu, ip, o);
        if (lane >= o) {
            it += yt;
            in += yn;
            ip += yp;
        }
    }
    if (lane == 31) {
        s_wt[warp] = it;
        s_wn[warp] = in;
        s_wp[warp] = ip;
    }
    __syncthreads();
    tot_t = 0;
    tot_n = 0;
    tot_p = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) {
        if (w < warp) {
            it += s_wt[w];
            in += s_wn[w];
            ip += s_wp[w];
        }
        tot_t += s_wt[w];
        tot_n += s_wn[w];
        tot_p += s_wp[w];
    }
}

// Tile T of the padded grouped layout (moe_ep.blockwise.reference: group g owns the tiles t_g .. t_g + ceil(n_g/128)
// - 1, t_g = sum_{h<g} ceil(n_h/128), i.e. padded columns P_g = 128 t_g ..), found from the device-resident group
// sizes by a block-wide scan (every thread of the CTA calls it; NT threads; negative sizes count as 0). Returns
// 0: T is tile T - t_g of group g, whose rows are [row0, row0 + nrows) (nrows <= 128; cut at M);
// 1: T is past the groups' tiles (T >= t_G): row0 = sum(n) + 128 (T - t_G), nrows the rows of [row0, M) in that
//    128-row span (0 when past M): the "tail" rows that belong to no group (sum(sizes) < M).
// prow0 (kind 0): the tile's first row in the prepared bf16 layout (group g from row 64 sum_{h<g} ceil(n_h/64), tile
// j of the group at + 128 j; moe_ep.blockwise.reference.quantize_colwise_prepared_torch).
// Example: sizes [130, 0, 5], M = 200: T = 0 -> (0, rows 0-127, prow0 0), T = 1 -> (0, rows 128-129, prow0 128),
// T = 2 -> (0, rows 130-134, prow0 192), T = 3 -> (1, rows 135-199), T = 4 -> (1, nrows 0).
template <int NT>
__device__ __forceinline__ int bw_tile_lookup(const int* __restrict__ gsizes, int G, long long M, long long T,
                                              long long& row0, int& nrows, long long& prow0) {
    __shared__ long long s_res[3];
    const int tid = threadIdx.x;
    if (tid == 0) s_res[0] = -1;
    __syncthreads();
    long long carry_t = 0, carry_n = 0, carry_p = 0;
    for (int base = 0; base < G; base += NT) {
        const int g = base + tid;
        const long long n = g < G ? (long long)max(gsizes[g], 0) : 0LL;
        const long long t = (n + BW_BLOCK - 1) / BW_BLOCK, p = (n + 63) / 64;
        long long it, in, ip, tot_t, tot_n, tot_p;
        bw_block_scan3<NT>(t, n, p, it, in, ip, tot_t, tot_n, tot_p);
        const long long t0 = carry_t + it - t;  // the group's first tile
        if (g < G && T >= t0 && T < t0 + t) {
            s_res[0] = carry_n + in - n + (T - t0) * BW_BLOCK;
            s_res[1] = min((long long)BW_BLOCK, n - (T - t0) * BW_BLOCK);
            s_res[2] = 64 * (carry_p + ip - p) + (T - t0) * BW_BLOCK;
        }
        carry_t += tot_t;
        carry_n += tot_n;
        carry_p += tot_p;
        __syncthreads();  // the scan's warp sums are rewritten by the next round; s_res is complete after the last one
    }
    long long r0 = s_res[0], nr = s_res[1];
    prow0 = s_res[2];
    int kind = 0;
    if (r0 < 0) {
        kind = 1;
        r0 = carry_n + (T - carry_t) * BW_BLOCK;
        nr = BW_BLOCK;
    }
    row0 = r0;
    nrows = (int)max(0LL, min(nr, M - r0));
    return kind;
}

// The whole table of the grouped layout in shared memory, for CTAs that walk many tiles (bw_quant_colwise):
// tstart[g] = t_g (first tile of group g), rstart[g] = first row of group g, pstart[g] = sum_{h<g} ceil(n_h/64) (the
// group's first row of the prepared bf16 layout, in 64-row units), entries 0 .. G (entry G: the totals). Built by a
// block-wide scan of the device-resident sizes (every thread calls it; NT threads; negative sizes count as 0); ends
// with a barrier.
template <int NT>
__device__ __forceinline__ void bw_group_table(const int* __restrict__ gsizes, int G, int* tstart, long long* rstart,
                                               int* pstart) {
    const int tid = threadIdx.x;
    long long carry_t = 0, carry_n = 0, carry_p = 0;
    for (int base = 0; base < G; base += NT) {
        const int g = base + tid;
        const long long n = g < G ? (long long)max(gsizes[g], 0) : 0LL;
        const long long t = (n + BW_BLOCK - 1) / BW_BLOCK, p = (n + 63) / 64;
        long long it, in, ip, tot_t, tot_n, tot_p;
        bw_block_scan3<NT>(t, n, p, it, in, ip, tot_t, tot_n, tot_p);
        if (g < G) {
            tstart[g] = (int)(carry_t + it - t);
            rstart[g] = carry_n + in - n;
            pstart[g] = (int)(carry_p + ip - p);
        }
        carry_t += tot_t;
        carry_n += tot_n;
        carry_p += tot_p;
        __syncthreads();
    }
    if (tid == 0) {
        tstart[G] = (int)carry_t;
        rstart[G] = carry_n;
        pstart[G] = (int)carry_p;
    }
    __syncthreads();
}

// Tile T (< tstart[G]) of the table above -> its rows [row0, row0 + nrows) (nrows <= 128, cut at M) and its first
// row prow0 in the prepared bf16 layout: the largest g with tstart[g] <= T by binary search.
__device__ __forceinline__ void bw_table_tile(const int* tstart, const long long* rstart, const int* pstart, int G,
                                              long long M, int T, long long& row0, int& nrows, long long& prow0) {
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tstart[mid] <= T) lo = mid;
        else hi = mid - 1;
    }
    row0 = rstart[lo] + (long long)(T - tstart[lo]) * BW_BLOCK;
    prow0 = 64LL * pstart[lo] + (long long)(T - tstart[lo]) * BW_BLOCK;
    nrows = (int)max(0LL, min(min((long long)BW_BLOCK, rstart[lo + 1] - row0), M - row0));
}

