// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma2" (MOE_EP_GEMM_IMPL=wgmma2): fprop / dgrad (2d x 3d).
// Same operand formats, group scan, masking and zero fill as the other 2d3d kernels (helpers shared through
// grouped_gemm_wgmma.cu -> grouped_gemm.cu). Design 2a of benchmarks/NOTES.md ("A from registers"):
//
//   * one CTA = 128 x 256 output tile, 256 threads = 2 warpgroups, 1 CTA/SM; warpgroup w owns tile rows
//     64 w .. 64 w + 63 and issues wgmma.m64n256k16 with A in REGISTERS and B from shared memory (128
//     accumulators per thread). Per FLOP this converts half the B elements of the 128 x 128 design and A never
//     touches shared memory.
//   * K order. Within each 64-wide k-step the MMA runs over a permuted k: logical k = 16 s + 8 h + 2 c + e is
//     physical column 16 c + 4 s + 2 h + e (s: k16 slice, h: fragment half, c = lane % 4, e: element of the
//     pair). A dot product does not depend on the order of its terms, and A and B use the same permutation, so
//     the result is the same sum. It lets a thread of lane c load its A fragment for the whole k-step as one
//     16-byte global load per row (physical bytes 16 c .. 16 c + 15 = block c / 2: one scale byte), convert it
//     and feed wgmma from registers without any shuffle.
//   * B: each thread loads 16 physical bytes (chunk c = tid % 4) of tile rows tid / 4 + 64 i (i < 4), converts
//     them, and stores pair (s, h) as the 4-byte word 8 s + 4 h + c of the row, i.e. in the 128-byte-swizzle
//     K-major layout: row r at r * 128, word at 16 * ((2 s + h) ^ (r % 8)) + 4 c. A warp's 32 stores of one
//     (s, h) hit 32 different banks.
//   * pipeline per k-step s (3-stage B ring, 2 A fragment buffers in registers):
//       wgmma.fence; 4 x wgmma (A regs buffer s % 2, B stage s % 3); commit; wait_group 1 (step s - 1 done:
//       its A registers and, by the barrier that ended step s - 1 on the other warpgroup, B stage (s + 1) % 3 =
//       (s - 2) % 3 are free); convert B(s + 1) into stage (s + 1) % 3; fence.proxy.async (its MEMBAR waits for
//       all loads in flight, so it comes before the next loads); convert A(s + 1) into buffer (s + 1) % 2; issue
//       the global loads of step s + 2; __syncthreads.
//     The registers of an A buffer stay pinned (wg_fence_regs) until the wait that ends the wgmma reading them.
//   * epilogue: bf16 output through a padded shared tile (16-byte coalesced row stores); fp32 output directly
//     from the accumulator fragments. Row masking as in the other kernels.
// Shared memory: 3 x 32 KiB + 1 KiB alignment = 99 KiB (the bf16 epilogue tile, 128 x 528 B, reuses it).

#define WG_NO_KERNELS
#include "grouped_gemm_wgmma.cu"

#define W2_BM 128
#define W2_BN 256
#define W2_STAGES 3
#define W2_TILE_BYTES 32768                                 // 256 rows x 128 B (64 bf16 of K)
#define W2_SMEM_BYTES (W2_STAGES * W2_TILE_BYTES + 1024)   // 99328 B
#define W2_EPI_LD 528                                       // epilogue row stride (bytes): 512 + 16 (no conflicts)

template <int N>
__device__ __forceinline__ void wg_fence_regs(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// d[128] += A(64 x 16, bf16 fragments a[4] in registers) x B(256 x 16, smem desc db)^T, fp32 accumulation.
// A fragment (warp q of the warpgroup, lane l): a[0] = (row 16 q + l / 4, k 2 (l % 4) .. +1), a[1] = row + 8,
// a[2] = k + 8, a[3] = row + 8 and k + 8 (low element in the low half), as for mma.m16n8k16.
__device__ __forceinline__ void wgmma_m64n256k16_rs(float* d, const unsigned* a, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_ACC128_STR "}, "
                 "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
                 : WG_ACC128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

__device__ __forceinline__ void sts32(unsigned addr, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// This thread's share of the loads of one 128 x 256 tile: physical k columns 16 c .. 16 c + 15 of every 64-wide
// k-step (c = tid % 4, one 32-block: one scale byte per row) of A tile rows ar0 = 64 wg + 16 q + lane / 4 and
// ar0 + 8, and of B tile rows tid / 4 + 64 i (i < 4).
struct W2Load {
    const unsigned char *ap0, *ap1, *bp;  // row starts (column 0); B row i is bp + i * b64
    const unsigned char *as0, *bs;        // A scale (ar0, block 0) of the blocked tile (ar0 + 8: + 128 B); B base
    unsigned bso[4];                      // offset of B scale (row i, block 0) from bs
    long long b64;                        // 64 rows of B = 64 * K bytes
    int K, c16;
    unsigned ok;                          // valid rows: bits 0, 1 = A rows, bits 2 + i = B row i
    uint4 ra[2], rb[4];
    unsigned sa, sb;                      // scale bytes: sa = a0 | a1 << 8, sb = b0 | b1 << 8 | b2 << 16 | b3 << 24

    __device__ __forceinline__ void load(int s) {
        const int k = s * 64 + c16;
        const bool kv = k < K;  // K % 32 == 0: a 16-byte chunk is all in or all out
        const int blk = k >> 5, coff = (blk >> 2) * 512 + (blk & 3);
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        const bool a0 = kv && (ok & 1u), a1 = kv && (ok & 2u);
        ra[0] = a0 ? ldg16(ap0 + k) : z;
        ra[1] = a1 ? ldg16(ap1 + k) : z;
        sa = (a0 ? (unsigned)as0[coff] : 127u) | ((a1 ? (unsigned)as0[coff + 128] : 127u) << 8);
        sb = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool bv = kv && (ok & (4u << i));
            rb[i] = bv ? ldg16(bp + i * b64 + k) : z;
            sb |= (bv ? (unsigned)bs[bso[i] + coff] : 127u) << (8 * i);
        }
    }
};

// A fragments of one k-step (f[4 s .. 4 s + 3]: k16 slice s, see wgmma_m64n256k16_rs) from the converted words
// o0 / o1 of the thread's two rows: pair h of slice s is physical bytes 4 s + 2 h, + 1 of the row's chunk = cvt16
// word 2 s + h.
__device__ __forceinline__ void a_frags(const unsigned* o0, const unsigned* o1, unsigned* f) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        f[4 * s] = o0[2 * s];
        f[4 * s + 1] = o1[2 * s];
        f[4 * s + 2] = o0[2 * s + 1];
        f[4 * s + 3] = o1[2 * s + 1];
    }
}

__device__ __forceinline__ void w2_cvt_a(const W2Load& L, unsigned* f) {
    unsigned o0[8], o1[8];
    cvt16(L.ra[0], L.sa & 0xFFu, o0);
    cvt16(L.ra[1], L.sa >> 8, o1);
    a_frags(o0, o1, f);
}

// B rows of one k-step into the stage at smem address base (row rb = tid / 4 of the stage + 4 c bytes; sw = rb % 8):
// pair (s, h) of row rb + 64 i is logical word 8 s + 4 h + c = chunk 2 s + h, swizzled to chunk (2 s + h) ^ sw.
__device__ __forceinline__ void w2_store_b(const W2Load& L, unsigned base, unsigned sw) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned o[8];
        cvt16(L.rb[i], (L.sb >> (8 * i)) & 0xFFu, o);
#pragma unroll
        for (int j = 0; j < 8; ++j) sts32(base + (unsigned)i * 8192u + ((((unsigned)j) ^ sw) << 4), o[j]);
    }
}

// One k-step: MMAs of step s from A buffer cur and B stage `stage`; then step s + 1 converted into nxt and the
// next stage (see the pipeline in the header).
__device__ __forceinline__ void w2_step(float* acc, unsigned* cur, unsigned* nxt, W2Load& L, int s, int ksteps,
                                        int& stage, unsigned long long db0, unsigned bst, unsigned sw) {
    wg_fence();
    const unsigned long long soff = (unsigned long long)stage * (W2_TILE_BYTES >> 4);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs(acc, cur + 4 * kk, db0 + soff + 2 * kk);
    wg_commit();
    wg_wait<1>();
    wg_fence_regs<16>(nxt);  // read by the MMAs of step s - 1, which are done only now
    const int nstage = stage == W2_STAGES - 1 ? 0 : stage + 1;
    if (s + 1 < ksteps) w2_store_b(L, bst + (unsigned)nstage * W2_TILE_BYTES, sw);
    // fence.proxy.async compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, and the MEMBAR waits for every global
    // load still in flight: fence before issuing the next step's loads, never right after them.
    fence_proxy_async();
    if (s + 1 < ksteps) w2_cvt_a(L, nxt);
    if (s + 2 < ksteps) L.load(s + 2);
    __syncthreads();
    stage = nstage;
}

// End of the mainloop of the 128 x 256 kernels: every MMA of this warpgroup retired, and the accumulators and
// both A fragment buffers pinned up to here (the compiler must not reuse their registers earlier).
__device__ __forceinline__ void w2_drain(float* acc, unsigned* fa, unsigned* fb) {
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
    wg_fence_regs<16>(fa);
    wg_fence_regs<16>(fb);
}

// Epilogue of the 128 x 256 kernels (after every MMA of the CTA is complete): accumulator register 4 j + 2 h + e
// of thread tid is tile row ar0 + 8 h (ar0 = 64 wg + 16 q + lane / 4), column 8 j + 2 (tid % 4) + e. Rows
// >= mrows and columns >= N - n0 are not written.
template <int OUT_F32>
__device__ __forceinline__ void w2_epilogue(float* acc, void* __restrict__ out, long long arow0, int mrows, int n0,
                                            int N, int ar0, unsigned sbase) {
    const int tid = threadIdx.x, c = tid & 3;
    const int ncols = N - n0;
    if (OUT_F32) {
        float* obase = static_cast<float*>(out) + arow0 * N + n0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = ar0 + 8 * h;
            if (r >= mrows) continue;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int col = j * 8 + c * 2;
                if (col < ncols)
                    *reinterpret_cast<float2*>(obase + (long long)r * N + col) =
                        make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
        }
        return;
    }
    // bf16: through a [128][264] bf16 shared tile (row stride 528 B: a warp's 4-byte stores hit 32 banks), then
    // each warp stores whole 512-byte row segments. The ring is free: every warpgroup waited for its MMAs and
    // the barrier below orders those waits before any thread overwrites a stage.
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned rowa = sbase + (unsigned)(ar0 + 8 * h) * W2_EPI_LD + 4u * (unsigned)c;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            unsigned pk;
            asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(acc[4 * j + 2 * h + 1]), "f"(acc[4 * j + 2 * h]));
            sts32(rowa + 16u * (unsigned)j, pk);
        }
    }
    __syncthreads();
    unsigned short* obase = static_cast<unsigned short*>(out) + arow0 * N + n0;
#pragma unroll 4
    for (int it = 0; it < 16; ++it) {
        const int idx = tid + 256 * it, r = idx >> 5, ch = idx & 31;
        if (r >= mrows || ch * 8 >= ncols) continue;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(sbase + (unsigned)r * W2_EPI_LD + 16u * (unsigned)ch));
        *reinterpret_cast<uint4*>(obase + (long long)r * N + ch * 8) = v;
    }
}

// Tile order of the 128 x 256 kernels (wgmma2-5): linear tile t -> (row tile m_t, column tile n_t). Row tiles go
// in bands of `band`: inside a band the row tile varies fastest, so the CTAs resident at one time share a few
// column slices of the weight (which stay in L2) instead of sweeping all of it once per row tile (band 1: the plain
// order m_t = t / n_tiles). Why: at llama4's expert size (N x K = 8192 x 5120 bf16 = 84 MB, more than L2) the plain
// order re-reads the whole expert weight from DRAM for every ~4 row tiles. Measured (NOTES, "Correction", 6 rounds
// in rotating order, ratio to torch bf16): wgmma4 with bands of 8 against 1: +3.5 / +4.9 / -0.4 / +9.8 points at
// dsv3_up / dsv3_down / small / llama4. The persistent wgmma5 measured mixed with bands of 8 until its k-step got
// leaner, then as fast or faster at every shape (NOTES, "wgmma5: fewer instructions per k-step").
// GM_RASTER: the band of wgmma2-4 (default 8); W5_RASTER: wgmma5's (8).
// Example (m_tiles = 5, n_tiles = 3, band 2): t = 0..14 -> (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) (2,0) (3,0)
// (2,1) (3,1) (2,2) (3,2) (4,0) (4,1) (4,2).
#ifndef GM_RASTER
#define GM_RASTER 8
#endif
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

// The CTA's tile in the 128 x 256 kernels (wgmma2/3/4). Grid: (ceil(M/128) + G) * ceil(N/256) CTAs, tile
// blockIdx.x in gm_raster's order (gm_2d3d_tile's schedule and zero-fill argument with 256-wide column
// tiles). Returns false when the CTA has no rows to compute (after zero-filling its share of the rows past the
// groups when zero_rest); else sets the column origin n0, the valid rows mrows and the first row arow0.
template <int OUT_F32>
__device__ __forceinline__ bool w2_tile(GroupInfo& gi, const int* __restrict__ sizes, void* __restrict__ out,
                                        int G, long long M, int N, int zero_rest, int& n0, int& mrows,
                                        long long& arow0) {
    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    int m_t, n_t;
    gm_raster((int)blockIdx.x, (int)((M + W2_BM - 1) / W2_BM) + G, n_tiles, GM_RASTER, m_t, n_t);
    n0 = n_t * W2_BN;
    if (threadIdx.x < 32) gm_scan_groups(sizes, G, M, 1, m_t, &gi);
    __syncthreads();
    if (gi.g < 0) {
        if (zero_rest) {
            const long long r0 = gi.total_rows + (long long)(m_t - gi.total_tiles) * W2_BM;
            zero_rows<OUT_F32>(out, r0, M, N, n0);
            zero_rows<OUT_F32>(out, r0, M, N, n0 + GM_BN);
        }
        return false;
    }
    mrows = min(W2_BM, gi.rows - gi.tile * W2_BM);
    arow0 = gi.row0 + (long long)gi.tile * W2_BM;
    return mrows > 0;
}

template <int OUT_F32>
__device__ __forceinline__ void w2_2d3d(const unsigned char* __restrict__ A, const unsigned char* __restrict__ As,
                                        const unsigned char* __restrict__ B, const unsigned char* __restrict__ Bs,
                                        const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                        int N, int K, int zero_rest) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ GroupInfo gi;
    int n0, mrows;
    long long arow0;
    if (!w2_tile<OUT_F32>(gi, sizes, out, G, M, N, zero_rest, n0, mrows, arow0)) return;
    const int g = gi.g;
    const int tpr = ((K >> 5) + 3) >> 2;  // 128x4 scale tiles per 128-row tile
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, q = (tid >> 5) & 3, c = tid & 3, rb = tid >> 2;

    W2Load L;
    L.K = K;
    L.c16 = c * 16;
    L.b64 = 64LL * K;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    L.ok = (ar0 < mrows ? 1u : 0u) | (ar0 + 8 < mrows ? 2u : 0u);
    L.ap0 = A + (arow0 + (ar0 < mrows ? ar0 : 0)) * (long long)K;  // column 0: load() adds k = 64 s + 16 c
    L.ap1 = A + (arow0 + (ar0 + 8 < mrows ? ar0 + 8 : 0)) * (long long)K;
    // (ar0 % 32) + 8 < 32, so row ar0 + 8 sits 8 * 16 bytes after row ar0 in the same 128x4 scale tile
    L.as0 = As + (long long)(gi.toff + gi.tile) * tpr * 512 + (ar0 & 31) * 16 + (ar0 >> 5) * 4;
    L.bs = Bs + (long long)g * ((N + 127) >> 7) * tpr * 512;
    L.bp = B + ((long long)g * N + n0 + rb) * (long long)K;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int n = n0 + rb + 64 * i;
        L.ok |= n < N ? (4u << i) : 0u;
        L.bso[i] = (unsigned)((n >> 7) * tpr * 512 + (n & 31) * 16 + ((n >> 5) & 3) * 4);
    }

    const unsigned sbase = (smem_u32(smem) + 1023u) & ~1023u;
    const unsigned bst = sbase + (unsigned)rb * 128u + 4u * (unsigned)c, sw = (unsigned)(rb & 7);
    const unsigned long long db0 = wg_desc(sbase);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    unsigned fa[16], fb[16];

    const int ksteps = (K + 63) / 64;
    L.load(0);
    w2_cvt_a(L, fa);
    w2_store_b(L, bst, sw);
    fence_proxy_async();
    if (ksteps > 1) L.load(1);
    __syncthreads();
    int stage = 0;
    for (int s = 0; s < ksteps; s += 2) {
        w2_step(acc, fa, fb, L, s, ksteps, stage, db0, bst, sw);
        if (s + 1 < ksteps) w2_step(acc, fb, fa, L, s + 1, ksteps, stage, db0, bst, sw);
    }
    w2_drain(acc, fa, fb);

    w2_epilogue<OUT_F32>(acc, out, arow0, mrows, n0, N, ar0, sbase);
}

// kernels/grouped_gemm_wg3.cu includes this file for its helpers and defines WG2_NO_KERNELS first.
#ifndef WG2_NO_KERNELS
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg2_2d3d_bf16(GM_ARGS) {
    w2_2d3d<0>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg2_2d3d_f32(GM_ARGS) {
    w2_2d3d<1>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
#endif  // WG2_NO_KERNELS
