#pragma once

// Shared pieces of the grouped MXFP8 GEMM kernels (kernels/experts/sm90/grouped_gemm.cu, grouped_gemm_wgrad.cu) and of the
// weight preparation (kernels/experts/sm90/weight_prep.cu): the kernel argument list, the on-device group scan, the tile order,
// shared-memory access helpers, the exact e4m3 -> bf16 conversion with the block scale, the quad transpose and
// the zero fill of output rows past the groups. moe_ep/experts/sm90/gemm.py documents the operand formats; the design is
// in docs/design-kernels.md, "Grouped GEMMs".
//
// Every e4m3 value times 2**(s-127) is exactly representable in bf16 unless it falls below 2**-133 (bf16
// subnormals), so the kernels' products are the exact MXFP8 products and only the fp32 summation order differs
// from the reference. Group sizes are an int32 device array [G]; each warp that needs them scans them itself
// (gm_scan_groups), so the host never reads them. Negative sizes count as 0; rows past the end of the tensor are
// clamped (never read or written).

// Kernel parameters of the GEMM kernels: operand A [M, K] and its scales, B and its scales, the group sizes, the
// output, G, M, N, K and the zero-fill flag (see moe_ep/experts/sm90/gemm.py _kernel_args). Kernels that read their
// operands through TMA tensor maps take the pointers too (GM_TMA_ARGS, kernels/experts/sm90/gemm_wgmma.cuh).
#define GM_ARGS                                                                                                  \
    const unsigned char *__restrict__ A, const unsigned char *__restrict__ As, const unsigned char *__restrict__ B, \
        const unsigned char *__restrict__ Bs, const int *__restrict__ sizes, void *__restrict__ out, int G,        \
        long long M, int N, int K, int zero_rest

struct GroupInfo {
    long long row0;  // first data row of the group
    int rows;        // rows of the group (clamped to the tensor)
    int g;           // group index, -1: no group holds the target
    int tile;        // the target's index inside its group (128-row tiles; 0 by group)
    int toff;        // sum over earlier groups of ceil(n / 128): the group's first blocked scale row tile
    int boff;        // sum over earlier groups of ceil(n / 32): the group's first column-wise scale row
    int poff;        // sum over earlier groups of ceil(n / 64): the group's first 64-row chunk (wgrad operands)
    long long total_rows;  // sum over all groups of n (negative sizes count as 0)
    int total_tiles;       // sum over all groups of ceil(n / 128)
};

// One warp (its lanes scan 32 groups at a time). What `target` names, by `by_tile`:
//   GM_BY_GROUP (0)  the group index;
//   GM_BY_TILE (1)   a 128-row tile: the group whose row tiles (ceil(n / 128) per group) contain it.
// gi->tile is the target's index inside its group (tiles; 0 by group index).
#define GM_BY_GROUP 0
#define GM_BY_TILE 1
__device__ __forceinline__ void gm_scan_groups(const int* __restrict__ sizes, int G, long long M, int by_tile,
                                               int target, GroupInfo* gi) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) gi->g = -1;
    __syncwarp();
    long long crow = 0;
    int ctile = 0, cblk = 0, cchunk = 0;
    for (int base = 0; base < G; base += 32) {
        const int h = base + lane;
        int n = h < G ? sizes[h] : 0;
        n = n > 0 ? n : 0;
        // unsigned: n + 127 must not overflow for n close to INT_MAX
        const int nt = (int)(((unsigned)n + 127u) >> 7), nb = (int)(((unsigned)n + 31u) >> 5);
        const int np = (int)(((unsigned)n + 63u) >> 6);
        long long r = n;
        int t = nt, b = nb, pc = np;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long r2 = __shfl_up_sync(0xffffffffu, r, o);
            const int t2 = __shfl_up_sync(0xffffffffu, t, o);
            const int b2 = __shfl_up_sync(0xffffffffu, b, o);
            const int p2 = __shfl_up_sync(0xffffffffu, pc, o);
            if (lane >= o) {
                r += r2;
                t += t2;
                b += b2;
                pc += p2;
            }
        }
        const long long r_ex = crow + r - n;
        const int t_ex = ctile + t - nt, b_ex = cblk + b - nb, p_ex = cchunk + pc - np;
        const bool hit = h < G && (by_tile == GM_BY_TILE ? (n > 0 && target >= t_ex && target < t_ex + nt)
                                                         : h == target);
        if (hit) {
            long long avail = M - r_ex;
            avail = avail < 0 ? 0 : (avail > n ? n : avail);
            gi->row0 = r_ex;
            gi->rows = (int)avail;
            gi->g = h;
            gi->tile = by_tile == GM_BY_TILE ? target - t_ex : 0;
            gi->toff = t_ex;
            gi->boff = b_ex;
            gi->poff = p_ex;
        }
        crow += __shfl_sync(0xffffffffu, r, 31);
        ctile += __shfl_sync(0xffffffffu, t, 31);
        cblk += __shfl_sync(0xffffffffu, b, 31);
        cchunk += __shfl_sync(0xffffffffu, pc, 31);
    }
    if (lane == 0) {  // the same value in every lane
        gi->total_rows = crow;
        gi->total_tiles = ctile;
    }
}

// Tile order of the fprop / dgrad kernel: linear tile t -> (row tile m_t, column tile n_t). Row tiles go in bands
// of `band`: inside a band the row tile varies fastest, so the CTAs resident at one time share a few column slices
// of the weight (which stay in L2) instead of sweeping all of it once per row tile (band 1: the plain order
// m_t = t / n_tiles). Why: an expert weight larger than L2 would otherwise be re-read from DRAM every few row tiles.
// Example (m_tiles = 5, n_tiles = 3, band 2): t = 0..14 -> (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) (2,0) (3,0)
// (2,1) (3,1) (2,2) (3,2) (4,0) (4,1) (4,2).
__device__ __forceinline__ void gm_raster(int t, int m_tiles, int n_tiles, int band, int& m_t, int& n_t) {
    if (band <= 1) {
        m_t = t / n_tiles;
        n_t = t - m_t * n_tiles;
        return;
    }
    const int b = t / (band * n_tiles);
    const int base = b * band;
    const int rows = min(band, m_tiles - base);
    const int r = t - b * band * n_tiles;
    n_t = r / rows;
    m_t = base + (r - n_t * rows);
}

// ---------------------------------------------------------------------------------------------------------
// shared-memory access and bf16 arithmetic
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void sts32(unsigned addr, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}
__device__ __forceinline__ unsigned lds8(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ unsigned hmul2_bf16(unsigned a, unsigned b) {
    unsigned d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// ---------------------------------------------------------------------------------------------------------
// e4m3 -> bf16 with the block scale
// ---------------------------------------------------------------------------------------------------------
// Two e4m3 bytes placed as bf16 bits (sign at bit 15, exponent+mantissa bits (b & 0x7F) << 4) read as
// v * 2**-120 exactly (normals and e4m3 subnormals alike: the exponent bias moves from 7 to 127). Selector
// E4M3X2_LO takes bytes 0, 1 of w, E4M3X2_HI bytes 2, 3 (low element in the low half).
// prmt's sign-replicate mode (bit 3 of a selector nibble) makes each 16-bit half the sign-extended byte; shifted left
// by 4, its sign copy lands on bit 15 and the magnitude bits on 10..4, and one mask clears the other sign copies
// (bits 14..11) and the bits the shift carried from the low half into bits 19..16: 3 instructions per pair instead
// of the 4 of (d & 0x80008000) | ((d >> 4) & 0x07F007F0) on the plainly placed bytes (the same bits for every pair:
// tests/test_gemm_emulation.py).
#define E4M3X2_LO 0x9180u
#define E4M3X2_HI 0xB3A2u
__device__ __forceinline__ unsigned e4m3x2_bits(unsigned w, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(w), "r"(sel));  // [sext(b1) | sext(b0)]
    return (d << 4) & 0x87F087F0u;
}

// bf16x2 multiplier for scale byte s (both halves): fast path s < 128: 2**(s-7) (so v*2**-120 * 2**(s-7)).
__device__ __forceinline__ unsigned mult_fast(unsigned s) { return ((s + 120u) << 7) * 0x00010001u; }

// Slow path (s >= 128): v*2**-120 * 2**120 (exact e4m3 value) * 2**(s-127); 0xFF gives NaN.
__device__ __forceinline__ unsigned mult_slow1(unsigned s) {
    const unsigned h = s == 0xFFu ? 0x7FC0u : (s == 0u ? 0x0040u : (s << 7));
    return h;
}
#define BF16X2_2P120 0x7B807B80u

// 16 e4m3 bytes -> 8 bf16x2 words o[2 j + h] = bytes 4 j + 2 h, 4 j + 2 h + 1, unscaled (v * 2**-120).
__device__ __forceinline__ void e4m3_bits16(uint4 raw, unsigned* o) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o[2 * j] = e4m3x2_bits(w[j], E4M3X2_LO);
        o[2 * j + 1] = e4m3x2_bits(w[j], E4M3X2_HI);
    }
}
// The 8 words of e4m3_bits16 times 2**(s - 127) * 2**120, exactly: one multiply when s < 128, two otherwise.
__device__ __forceinline__ void scale16_fast(unsigned* o, unsigned s) {
    const unsigned m = mult_fast(s);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = hmul2_bf16(o[j], m);
}
__device__ __forceinline__ void scale16(unsigned* o, unsigned s) {
    if (s < 128u) {
        scale16_fast(o, s);
    } else {
        const unsigned m = mult_slow1(s) * 0x00010001u;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = hmul2_bf16(hmul2_bf16(o[j], BF16X2_2P120), m);
    }
}
// 16 e4m3 bytes sharing scale byte s -> 8 bf16x2 words o[2 j + h] = bytes 4 j + 2 h, 4 j + 2 h + 1 (scaled).
__device__ __forceinline__ void cvt16(uint4 raw, unsigned s, unsigned* o) {
    e4m3_bits16(raw, o);
    scale16(o, s);
}

// 4 x 4 transpose of 32-bit words inside each quad of lanes (lane c = lane % 4 holds row c: w[i] = M[c][i]; after
// the call w[i] = M[i][c]): two xor-shuffle rounds, first the 2 x 2 blocks, then the blocks. Every lane of the
// warp must take part. Used to turn 4-byte fragments spread over a quad into 16-byte row segments per lane.
__device__ __forceinline__ void quad_transpose4(unsigned* w) {
    const unsigned c = threadIdx.x & 3u;
    const bool odd = c & 1u, hi = c & 2u;
    // round 1 (lanes c, c ^ 1): entries with (i & 1) != (c & 1) <- the partner's M[c ^ 1][i ^ 1]
    unsigned s0 = odd ? w[0] : w[1], s1 = odd ? w[2] : w[3];
    unsigned r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    if (odd) {
        w[0] = r0;
        w[2] = r1;
    } else {
        w[1] = r0;
        w[3] = r1;
    }
    // round 2 (lanes c, c ^ 2): entries with (i & 2) != (c & 2) <- the partner's M[c ^ 2][i ^ 2]
    s0 = hi ? w[0] : w[2];
    s1 = hi ? w[1] : w[3];
    r0 = __shfl_xor_sync(0xffffffffu, s0, 2);
    r1 = __shfl_xor_sync(0xffffffffu, s1, 2);
    if (hi) {
        w[0] = r0;
        w[1] = r1;
    } else {
        w[2] = r0;
        w[3] = r1;
    }
}

// ---------------------------------------------------------------------------------------------------------
// zero fill of output rows past the groups
// ---------------------------------------------------------------------------------------------------------
// Zero output rows r0 .. min(r0 + 128, M) - 1, columns n0 .. min(n0 + 128, N) - 1 of the bf16 output, by
// GM_ZERO_THREADS threads (threadIdx.x 0 .. 255; N % 8 == 0: 16-byte stores of 8 elements, aligned because out is
// 16-byte aligned and N % 8 == 0).
#define GM_ZERO_ROWS 128
#define GM_ZERO_COLS 128
#define GM_ZERO_THREADS 256
__device__ __forceinline__ void zero_rows(void* out, long long r0, long long M, int N, int n0) {
    if (r0 >= M) return;
    const int nrows = (int)(M - r0 < GM_ZERO_ROWS ? M - r0 : GM_ZERO_ROWS), ncols = min(GM_ZERO_COLS, N - n0);
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    for (int i = threadIdx.x; i < GM_ZERO_ROWS * (GM_ZERO_COLS / 8); i += GM_ZERO_THREADS) {
        const int r = i >> 4, c = (i & 15) * 8;
        if (r >= nrows || c >= ncols) continue;
        const long long e = (r0 + r) * (long long)N + n0 + c;
        *reinterpret_cast<uint4*>(static_cast<unsigned short*>(out) + e) = z;
    }
}
