// Grouped MXFP8 GEMMs for Hopper (sm_90a): dequantize in the mainloop, bf16 tensor cores, fp32 accumulation.
// moe_ep/gemm.py is the specification; moe_ep/gemm_cuda.py documents the operand formats and launches these.
//
// Implementation "mma" (MOE_EP_GEMM_IMPL=mma, the default):
//   * one CTA (256 threads, 8 warps as 2 x 4) computes one 128 x 128 output tile; BK = 64 (two 32-blocks);
//   * each k-step every thread loads 2 x 16 e4m3 bytes per operand (and their scales) into registers one step
//     ahead, converts them to bf16 with the exact power-of-two scale (bit trick + one bf16x2 multiply, see
//     cvt_pair) and stores them to shared memory (2 stages, padded rows: ldmatrix is conflict-free);
//   * warps read fragments with ldmatrix (.trans for MN-major operands) and issue mma.m16n8k16 bf16 -> fp32.
// Every e4m3 value times 2**(s-127) is exactly representable in bf16 unless it falls below 2**-133 (bf16
// subnormals), so the products are the exact MXFP8 products and only the fp32 summation order differs from
// the reference.
//
// Kernels (OUT = bf16 | f32, the output dtype):
//   mx_gmm_2d3d_<OUT>   fprop/dgrad: out[M, N] = A[M, K] x B[g][N, K]^T per row group (K-major operands)
//   mx_gmm_wgrad_<OUT>  wgrad:       out[g][N, K] = A[rows of g, N]^T x B[rows of g, K]  (MN-major operands)
// Group sizes are an int32 device array [G]; each CTA scans them itself (warp 0, shuffles), so the host never
// reads them. Negative sizes count as 0; rows past the end of the tensor are clamped (never read/written).
// 2d3d with zero_rest != 0 also writes zeros to the output rows past the last group (rows sum(sizes) .. M-1),
// using the CTAs that have no group tile (there are always enough: see gm_2d3d_tile).

#define GM_THREADS 256
#define GM_BM 128
#define GM_BN 128
#define GM_BK 64
#define KM_LD 72    // K-major smem tile [128][64 + 8] bf16 (row stride 144 B: ldmatrix conflict-free)
#define MN_LD 136   // MN-major smem tile [64][128 + 8] bf16 (row stride 272 B)
#define GM_OPER_BYTES 18432                  // max(128 * 72, 64 * 136) * 2
#define GM_STAGE_BYTES (2 * GM_OPER_BYTES)   // A then B
#define GM_SMEM_BYTES (2 * GM_STAGE_BYTES)   // 2 stages = 73728 B (dynamic shared memory)

struct GroupInfo {
    long long row0;  // first data row of the group
    int rows;        // rows of the group (clamped to the tensor)
    int g;           // group index, -1: this CTA has no work
    int tile;        // 2d3d: this CTA's 128-row tile inside the group
    int toff;        // sum over earlier groups of ceil(n / 128): the group's first blocked scale row tile
    int boff;        // sum over earlier groups of ceil(n / 32): the group's first column-wise scale row
    int poff;        // sum over earlier groups of ceil(n / 64): the group's first 64-row chunk (wgmma wgrad)
    long long total_rows;  // sum over all groups of n (negative sizes count as 0)
    int total_tiles;       // sum over all groups of ceil(n / 128)
};

// One warp (its lanes scan 32 groups at a time). What `target` names, by `by_tile`:
//   GM_BY_GROUP (0)  the group index;
//   GM_BY_TILE (1)   a 128-row tile: the group whose row tiles (ceil(n / 128) per group) contain it;
//   GM_BY_PAD32 (2)  a 32-row block of the 64-row-aligned layout of the wgmma wgrad's prepared operands (2 ceil(n /
//                    64) blocks per group): the group that holds it.
// gi->tile is the target's index inside its group (tiles or blocks; 0 by group index).
#define GM_BY_GROUP 0
#define GM_BY_TILE 1
#define GM_BY_PAD32 2
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
        const bool hit = h < G && (by_tile == GM_BY_TILE    ? (n > 0 && target >= t_ex && target < t_ex + nt)
                                   : by_tile == GM_BY_PAD32 ? (n > 0 && target >= 2 * p_ex && target < 2 * (p_ex + np))
                                                            : h == target);
        if (hit) {
            long long avail = M - r_ex;
            avail = avail < 0 ? 0 : (avail > n ? n : avail);
            gi->row0 = r_ex;
            gi->rows = (int)avail;
            gi->g = h;
            gi->tile = by_tile == GM_BY_TILE ? target - t_ex : (by_tile == GM_BY_PAD32 ? target - 2 * p_ex : 0);
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

// ---------------------------------------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ uint4 ldg16(const unsigned char* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ void sts128(unsigned addr, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
// (bits 14..11) and the bits the shift carried from the low half into bits 19..16. 3 instructions per pair instead
// of the 4 of (d & 0x80008000) | ((d >> 4) & 0x07F007F0) on the plainly placed bytes (same bits for every pair:
// tests/test_gemm_emulation.py); measured +4.0 to +7.8 points of the torch ratio in wgmma5 (benchmarks/NOTES.md).
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

// The same, stored: words 0-3 (bytes 0-7) at smem address addr0, words 4-7 at addr1 (addr0 + 16 in the mma
// kernel's padded tiles; the swizzled chunk c + 1 in the wgmma kernel's tiles).
__device__ __forceinline__ void cvt_store16_2(uint4 raw, unsigned s, unsigned addr0, unsigned addr1) {
    unsigned o[8];
    cvt16(raw, s, o);
    sts128(addr0, o[0], o[1], o[2], o[3]);
    sts128(addr1, o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ void cvt_store16_1s(uint4 raw, unsigned s, unsigned addr) {
    cvt_store16_2(raw, s, addr, addr + 16);
}

// Per-pair bf16x2 multipliers m[4] for 8 per-column scale bytes (MN-major operands); returns the fast-path flag.
__device__ __forceinline__ bool pair_mults8(uint2 sv, unsigned* m) {
    const unsigned w[2] = {sv.x, sv.y};
    const bool fast = ((sv.x | sv.y) & 0x80808080u) == 0u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const unsigned lo = __byte_perm(w[j], 0u, 0x4140u);  // s0 | s1 << 16
        const unsigned hi = __byte_perm(w[j], 0u, 0x4342u);  // s2 | s3 << 16
        if (fast) {
            m[2 * j] = (lo + 0x00780078u) << 7;
            m[2 * j + 1] = (hi + 0x00780078u) << 7;
        } else {
            m[2 * j] = mult_slow1(lo & 0xFFu) | (mult_slow1(lo >> 16) << 16);
            m[2 * j + 1] = mult_slow1(hi & 0xFFu) | (mult_slow1(hi >> 16) << 16);
        }
    }
    return fast;
}

// 8 e4m3 bytes with per-element-pair multipliers m[4] -> 4 bf16x2 words (16 bytes) at smem address addr.
__device__ __forceinline__ void cvt_store8_ps(uint2 raw, const unsigned* m, bool fast, unsigned addr) {
    unsigned o[4] = {e4m3x2_bits(raw.x, E4M3X2_LO), e4m3x2_bits(raw.x, E4M3X2_HI), e4m3x2_bits(raw.y, E4M3X2_LO),
                     e4m3x2_bits(raw.y, E4M3X2_HI)};
    if (fast) {
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = hmul2_bf16(o[j], m[j]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = hmul2_bf16(hmul2_bf16(o[j], BF16X2_2P120), m[j]);
    }
    sts128(addr, o[0], o[1], o[2], o[3]);
}

// ---------------------------------------------------------------------------------------------------------
// Tile compute: one BK = 64 stage of smem (bf16) -> acc[4][4][4] of this warp's 64 x 32 sub-tile
// ---------------------------------------------------------------------------------------------------------
// Warp w: wm = w >> 2 owns tile rows wm*64 .. +63, wn = w & 3 owns tile columns wn*32 .. +31.
// K-major tiles are [row][k] (KM_LD), MN-major tiles are [k][row] (MN_LD) and use ldmatrix.trans.
template <bool MN>
__device__ __forceinline__ void compute_stage(unsigned sa, unsigned sb, float (*acc)[4][4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int wm = w >> 2, wn = w & 3;
    const int i8 = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned af[4][4], bfr[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if (MN) {
                const int k = kk * 16 + r8 + (i8 >> 1) * 8, m = wm * 64 + mi * 16 + (i8 & 1) * 8;
                ldsm_x4_t(sa + (k * MN_LD + m) * 2, af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            } else {
                const int m = wm * 64 + mi * 16 + (lane & 15), k = kk * 16 + (lane >> 4) * 8;
                ldsm_x4(sa + (m * KM_LD + k) * 2, af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
        }
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            if (MN) {
                const int k = kk * 16 + r8 + (i8 & 1) * 8, n = wn * 32 + np * 16 + (i8 >> 1) * 8;
                ldsm_x4_t(sb + (k * MN_LD + n) * 2, bfr[2 * np][0], bfr[2 * np][1], bfr[2 * np + 1][0],
                          bfr[2 * np + 1][1]);
            } else {
                const int n = wn * 32 + np * 16 + r8 + (i8 >> 1) * 8, k = kk * 16 + (i8 & 1) * 8;
                ldsm_x4(sb + (n * KM_LD + k) * 2, bfr[2 * np][0], bfr[2 * np][1], bfr[2 * np + 1][0],
                        bfr[2 * np + 1][1]);
            }
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
    }
}

// Store acc to out (row-major, leading dimension ld elements); tile row r valid if r < nrows, tile column c
// valid if c < ncols. c0,c1 of fragment (mi, ni) sit at (gid, 2*tig .. +1), c2,c3 at (gid + 8, ...).
template <int OUT_F32>
__device__ __forceinline__ void store_tile(void* out, long long ld, int nrows, int ncols, float (*acc)[4][4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int wm = w >> 2, wn = w & 3, gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 64 + mi * 16 + gid + 8 * h;
            if (r >= nrows) continue;
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int c = wn * 32 + ni * 8 + tig * 2;
                if (c >= ncols) continue;
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (OUT_F32) {
                    float2* p = reinterpret_cast<float2*>(static_cast<float*>(out) + r * ld + c);
                    *p = make_float2(v0, v1);
                } else {
                    unsigned pk;
                    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(v1), "f"(v0));
                    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + r * ld + c) = pk;
                }
            }
        }
}

// Zero output rows r0 .. min(r0 + 128, M) - 1, columns n0 .. min(n0 + 128, N) - 1 (N % 8 == 0: 16-byte bf16 /
// 2 x 16-byte fp32 stores of 8 elements, aligned because out is 16-byte aligned and N % 8 == 0).
template <int OUT_F32>
__device__ __forceinline__ void zero_rows(void* out, long long r0, long long M, int N, int n0) {
    if (r0 >= M) return;
    const int nrows = (int)(M - r0 < GM_BM ? M - r0 : GM_BM), ncols = min(GM_BN, N - n0);
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    for (int i = threadIdx.x; i < GM_BM * (GM_BN / 8); i += GM_THREADS) {
        const int r = i >> 4, c = (i & 15) * 8;
        if (r >= nrows || c >= ncols) continue;
        const long long e = (r0 + r) * (long long)N + n0 + c;
        if (OUT_F32) {
            uint4* p = reinterpret_cast<uint4*>(static_cast<float*>(out) + e);
            p[0] = z;
            p[1] = z;
        } else {
            *reinterpret_cast<uint4*>(static_cast<unsigned short*>(out) + e) = z;
        }
    }
}

// The operands of one 2d3d output tile and this thread's share of its loads, shared by gmm_2d3d (mma) and
// wg_2d3d (kernels/grouped_gemm_wgmma.cu): rows crow and crow + 64 of the A and B tiles, k columns ck .. ck + 15
// of each 64-wide k-step, and the one scale byte of each 16-byte chunk.
struct Gm2d3dLoad {
    // ap / bp point at column 0 of the thread's first row; load() adds the column k = s * 64 + ck (which already
    // contains ck: adding ck to the pointers too read columns 2 ck .., i.e. wrong data and, on the last rows of the
    // tensor, up to 48 bytes past its end). Rows crow and crow + 64 differ by 64 * K bytes and 8 scale bytes.
    const unsigned char *ap, *bp, *a_so, *b_so;
    long long step64;
    int K, crow, ck;
    bool aok0, aok1, bok0, bok1;
    uint4 ra[2], rb[2];
    unsigned sc;  // the four scale bytes packed: a0 | a1 << 8 | b0 << 16 | b1 << 24

    __device__ __forceinline__ void load(int s) {
        const int k = s * GM_BK + ck;
        const bool kv = k < K;
        const int c = k >> 5, coff = (c >> 2) * 512 + (c & 3);
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        ra[0] = (aok0 && kv) ? ldg16(ap + k) : z;
        ra[1] = (aok1 && kv) ? ldg16(ap + step64 + k) : z;
        rb[0] = (bok0 && kv) ? ldg16(bp + k) : z;
        rb[1] = (bok1 && kv) ? ldg16(bp + step64 + k) : z;
        const unsigned a0 = (aok0 && kv) ? (unsigned)a_so[coff] : 127u;
        const unsigned a1 = (aok1 && kv) ? (unsigned)a_so[coff + 8] : 127u;
        const unsigned b0 = (bok0 && kv) ? (unsigned)b_so[coff] : 127u;
        const unsigned b1 = (bok1 && kv) ? (unsigned)b_so[coff + 8] : 127u;
        sc = a0 | (a1 << 8) | (b0 << 16) | (b1 << 24);
    }
};

// Prologue of both 2d3d kernels. A: e4m3 [M, K] row-major; As: to_blocked_grouped(scale [M, K/32], sizes, "m")
// (>= (ceil(M/128)+G) row tiles); B: e4m3 [G, N, K]; Bs: [G, blocked_size(N, K/32)] (to_blocked per group).
// Grid: (ceil(M/128) + G) * ceil(N/128) CTAs; CTA b takes row tile b / n_tiles (in the concatenation of all
// groups' tiles) and column tile b % n_tiles. Returns false when the CTA has no group tile; it then zero-fills
// output rows sum(sizes) .. M-1 of its share if zero_rest (else those rows are untouched): spare row tile
// j = m_t - T (T = total tiles) covers rows S + 128 j .. (S = total rows). There are enough spare tiles:
// T <= sum_g (n_g / 128 + 127/128) < S/128 + G, so ceil(M/128) + G - T > (M - S) / 128.
template <int OUT_F32>
__device__ __forceinline__ bool gm_2d3d_tile(GroupInfo& gi, const unsigned char* __restrict__ A,
                                             const unsigned char* __restrict__ As,
                                             const unsigned char* __restrict__ B,
                                             const unsigned char* __restrict__ Bs, const int* __restrict__ sizes,
                                             void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                             int& mrows, long long& arow0, int& n0, Gm2d3dLoad& L) {
    const int n_tiles = (N + GM_BN - 1) / GM_BN;
    const int m_t = blockIdx.x / n_tiles, n_t = blockIdx.x % n_tiles;
    if (threadIdx.x < 32) gm_scan_groups(sizes, G, M, 1, m_t, &gi);
    __syncthreads();
    if (gi.g < 0) {
        if (zero_rest) zero_rows<OUT_F32>(out, gi.total_rows + (long long)(m_t - gi.total_tiles) * GM_BM, M, N,
                                          n_t * GM_BN);
        return false;
    }
    const int g = gi.g;
    mrows = min(GM_BM, gi.rows - gi.tile * GM_BM);
    if (mrows <= 0) return false;
    arow0 = gi.row0 + (long long)gi.tile * GM_BM;
    const int tpr = ((K >> 5) + 3) >> 2;  // 128x4 scale tiles per 128-row tile
    const unsigned char* a_sc = As + (long long)(gi.toff + gi.tile) * tpr * 512;
    const long long bstride = (long long)((N + 127) >> 7) * tpr * 512;
    const unsigned char* b_sc = Bs + g * bstride + (long long)n_t * tpr * 512;
    n0 = n_t * GM_BN;
    const int tid = threadIdx.x, crow = tid >> 2;
    L.K = K;
    L.crow = crow;
    L.ck = (tid & 3) * 16;
    L.aok0 = crow < mrows;
    L.aok1 = crow + 64 < mrows;
    L.bok0 = n0 + crow < N;
    L.bok1 = n0 + crow + 64 < N;
    L.ap = A + (arow0 + (L.aok0 ? crow : 0)) * (long long)K;
    L.bp = B + ((long long)g * N + (L.bok0 ? n0 + crow : 0)) * (long long)K;
    L.step64 = 64LL * K;
    L.a_so = a_sc + (crow & 31) * 16 + (crow >> 5) * 4;  // scale (crow, 0) of the tile
    L.b_so = b_sc + (crow & 31) * 16 + (crow >> 5) * 4;
    return true;
}

// ---------------------------------------------------------------------------------------------------------
// fprop / dgrad (mma): out[M, N] = A[M, K] x B[g][N, K]^T for the rows of each group g (operands: gm_2d3d_tile)
// ---------------------------------------------------------------------------------------------------------
template <int OUT_F32>
__device__ __forceinline__ void gmm_2d3d(const unsigned char* __restrict__ A, const unsigned char* __restrict__ As,
                                         const unsigned char* __restrict__ B, const unsigned char* __restrict__ Bs,
                                         const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                         int N, int K, int zero_rest) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ GroupInfo gi;
    int mrows, n0;
    long long arow0;
    Gm2d3dLoad L;
    if (!gm_2d3d_tile<OUT_F32>(gi, A, As, B, Bs, sizes, out, G, M, N, K, zero_rest, mrows, arow0, n0, L)) return;
    const unsigned sbase = smem_u32(smem);
    const unsigned st0 = (unsigned)((L.crow * KM_LD + L.ck) * 2), st1 = st0 + 64 * KM_LD * 2;

    float acc[4][4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    const int ksteps = (K + GM_BK - 1) / GM_BK;
    auto store = [&](int stage) {
        const unsigned base = sbase + stage * GM_STAGE_BYTES;
        cvt_store16_1s(L.ra[0], L.sc & 0xFFu, base + st0);
        cvt_store16_1s(L.ra[1], (L.sc >> 8) & 0xFFu, base + st1);
        cvt_store16_1s(L.rb[0], (L.sc >> 16) & 0xFFu, base + GM_OPER_BYTES + st0);
        cvt_store16_1s(L.rb[1], L.sc >> 24, base + GM_OPER_BYTES + st1);
    };
    L.load(0);
    store(0);
    __syncthreads();
    for (int s = 0; s < ksteps; ++s) {
        if (s + 1 < ksteps) L.load(s + 1);
        const unsigned base = sbase + (s & 1) * GM_STAGE_BYTES;
        compute_stage<false>(base, base + GM_OPER_BYTES, acc);
        if (s + 1 < ksteps) store((s + 1) & 1);
        __syncthreads();
    }
    void* obase = OUT_F32 ? (void*)(static_cast<float*>(out) + arow0 * N + n0)
                          : (void*)(static_cast<unsigned short*>(out) + arow0 * N + n0);
    store_tile<OUT_F32>(obase, N, mrows, N - n0, acc);
}

// ---------------------------------------------------------------------------------------------------------
// wgrad: out[g][N, K] = A[rows of g, N]^T x B[rows of g, K], reduction over the group's rows
// ---------------------------------------------------------------------------------------------------------
// A: e4m3 [M, N], B: e4m3 [M, K] (the tensors' own layouts, quantized column-wise in 32-row blocks that start
// at each group's first row). As: [>= ceil(M/32) + G, N] u8, Bs: [>= ceil(M/32) + G, K] u8: block j of group g
// is scale row boff[g] + j, boff[g] = sum over h < g of ceil(n_h / 32). Grid: G * ceil(N/128) * ceil(K/128).
template <int OUT_F32>
__device__ __forceinline__ void gmm_wgrad(const unsigned char* __restrict__ A, const unsigned char* __restrict__ As,
                                          const unsigned char* __restrict__ B, const unsigned char* __restrict__ Bs,
                                          const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                          int N, int K) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ GroupInfo gi;
    const int nt = (N + GM_BM - 1) / GM_BM, kt = (K + GM_BN - 1) / GM_BN;
    const int g = blockIdx.x / (nt * kt), rem = blockIdx.x % (nt * kt);
    const int i0 = (rem / kt) * GM_BM, j0 = (rem % kt) * GM_BN;
    if (threadIdx.x < 32) gm_scan_groups(sizes, G, M, 0, g, &gi);
    __syncthreads();
    const long long row0 = gi.row0;
    const int rows = gi.rows, boff = gi.boff;

    // this thread: rows 4q .. 4q+3 of each k-step (one 32-block), columns c8 .. c8 + 7 of the tile
    const int tid = threadIdx.x, q = tid >> 4, c8 = (tid & 15) * 8;
    const bool aok = i0 + c8 < N, bok = j0 + c8 < K;
    const int ca = i0 + (aok ? c8 : 0), cb = j0 + (bok ? c8 : 0);  // addresses come from the kernel parameters
    const unsigned sbase = smem_u32(smem);
    const unsigned st0 = (unsigned)(((4 * q) * MN_LD + c8) * 2);

    float acc[4][4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    uint2 ra[4], rb[4], sva, svb;
    const uint2 zero = make_uint2(0u, 0u), one = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
    const int ksteps = (rows + GM_BK - 1) / GM_BK;
    auto load = [&](int s) {
        const int lr = s * GM_BK + 4 * q;  // group-local row of this thread's first row
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool rv = lr + i < rows;
            const long long r = row0 + lr + i;
            ra[i] = (aok && rv) ? __ldg(reinterpret_cast<const uint2*>(A + r * N + ca)) : zero;
            rb[i] = (bok && rv) ? __ldg(reinterpret_cast<const uint2*>(B + r * K + cb)) : zero;
        }
        const bool rv = lr < rows;
        const long long sr = boff + (lr >> 5);
        sva = (aok && rv) ? __ldg(reinterpret_cast<const uint2*>(As + sr * N + ca)) : one;
        svb = (bok && rv) ? __ldg(reinterpret_cast<const uint2*>(Bs + sr * K + cb)) : one;
    };
    auto store = [&](int stage) {
        const unsigned base = sbase + stage * GM_STAGE_BYTES;
        unsigned m[4];
        bool fast = pair_mults8(sva, m);
#pragma unroll
        for (int i = 0; i < 4; ++i) cvt_store8_ps(ra[i], m, fast, base + st0 + i * MN_LD * 2);
        fast = pair_mults8(svb, m);
#pragma unroll
        for (int i = 0; i < 4; ++i) cvt_store8_ps(rb[i], m, fast, base + GM_OPER_BYTES + st0 + i * MN_LD * 2);
    };
    if (ksteps > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    for (int s = 0; s < ksteps; ++s) {
        if (s + 1 < ksteps) load(s + 1);
        const unsigned base = sbase + (s & 1) * GM_STAGE_BYTES;
        compute_stage<true>(base, base + GM_OPER_BYTES, acc);
        if (s + 1 < ksteps) store((s + 1) & 1);
        __syncthreads();
    }
    // recompute the tile coordinates from blockIdx (keeps them out of registers during the mainloop)
    const int g2 = blockIdx.x / (nt * kt), rem2 = blockIdx.x % (nt * kt);
    const int i2 = (rem2 / kt) * GM_BM, j2 = (rem2 % kt) * GM_BN;
    const long long obase = ((long long)g2 * N + i2) * K + j2;
    void* op = OUT_F32 ? (void*)(static_cast<float*>(out) + obase) : (void*)(static_cast<unsigned short*>(out) + obase);
    store_tile<OUT_F32>(op, K, N - i2, K - j2, acc);
}

#define GM_ARGS                                                                                                  \
    const unsigned char *__restrict__ A, const unsigned char *__restrict__ As, const unsigned char *__restrict__ B, \
        const unsigned char *__restrict__ Bs, const int *__restrict__ sizes, void *__restrict__ out, int G,        \
        long long M, int N, int K, int zero_rest

// kernels/grouped_gemm_wgmma.cu includes this file for its helpers and defines GM_NO_MMA_KERNELS first.
#ifndef GM_NO_MMA_KERNELS
// zero_rest: 2d3d only (see gm_2d3d_tile); the wgrad kernels write every element of out and ignore it.
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_2d3d_bf16(GM_ARGS) {
    gmm_2d3d<0>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_2d3d_f32(GM_ARGS) {
    gmm_2d3d<1>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_wgrad_bf16(GM_ARGS) {
    gmm_wgrad<0>(A, As, B, Bs, sizes, out, G, M, N, K);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_wgrad_f32(GM_ARGS) {
    gmm_wgrad<1>(A, As, B, Bs, sizes, out, G, M, N, K);
}
#endif  // GM_NO_MMA_KERNELS
