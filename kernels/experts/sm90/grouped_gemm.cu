// Grouped MXFP8 GEMM for Hopper, fprop and dgrad (2d x 3d): out[rows of g] = A[rows of g] x B[g]^T for every group
// g. A (the activations, MXFP8 row-wise with per-group blocked scales) is TMA-loaded raw and dequantized into wgmma
// register fragments; B is the weight prepared once per weight version as exact bf16 (kernels/experts/sm90/weight_prep.cu
// mx_prepare_weight_bf16: each 64-wide k block in the permuted k order below, K padded to a multiple of 64 with
// zeros) and TMA-loaded with the 128-byte swizzle straight into the layout wgmma reads. Launcher and operand
// formats: moe_ep/experts/sm90/gemm.py grouped_mm_2d3d_out; design: docs/design-kernels.md, "Grouped GEMMs".
//
//   * k order: within each 64-wide k-step the MMA runs over a permuted k: logical k = 16 s + 8 h + 2 c + e is
//     physical column 16 c + 4 s + 2 h + e (s: k16 slice, h: fragment half, c = lane % 4, e: element of the pair).
//     A and B use the same permutation, so the dot products are the same sums; it lets a thread of lane c read its
//     A fragment for the whole k-step as one 16-byte chunk per row (one 32-block: one scale byte) and feed wgmma
//     from registers without any shuffle.
//   * block = 384 threads (WS_THREADS): warpgroups 0 and 1 are the consumers (tile rows 64 wg .. 64 wg + 63 of a
//     128 x 256 tile; 128 fp32 accumulators per thread), warpgroup 2 the producer: its warp 8 scans the groups and
//     its lane 0 issues the TMA loads; warps 9-11 leave at once. Registers move from the producer to the consumers
//     (setmaxnreg, kernels/experts/sm90/gemm_wgmma.cuh).
//   * grid = min(tiles, SMs); CTA b takes tiles b, b + gridDim.x, ... in gm_raster's order (bands of GG_RASTER;
//     (ceil(M/128) + G) * ceil(N/256) tiles, those past the groups zero-fill rows past sum(sizes) when zero_rest:
//     there are always enough of them, since the tiles of the groups T <= sum_g (n_g / 128 + 127/128) < S/128 + G
//     for S = sum(sizes), so ceil(M/128) + G - T > (M - S) / 128). Each warp scans the group sizes itself (its own
//     GroupInfo, no block barrier).
//   * ring: GG_STAGES stages of [B bf16 256 x 128 B (SW128) | A raw 128 x 64 B] plus one A scale tile (512 B) per
//     stage, two mbarriers each: full (count 1 + transaction bytes, the producer's expect_tx) and empty (count 8:
//     lane 0 of every consumer warp arrives once the MMAs that read the stage have retired). Step i of the CTA uses
//     stage i % S with phase (i / S) & 1, a counter that producer and consumers replay.
//   * mainloop per consumer warpgroup: issue M(s) (4 x wgmma.m64n256k16, A from registers), convert A(s + 1) into
//     the third of 3 fragment buffers, then wait for M(s - 1) and release its stage. The two warpgroups issue
//     their MMAs strictly in turn (named barriers 1 and 2), so that one converts while the other's MMAs run.
//   * half tiles: in a group's last tile with at most 64 rows, warpgroup 1 only keeps its MMA turns and gives its
//     empty arrivals (no conversion, MMAs or stores), so warpgroup 0 has the tensor cores alone.
//   * epilogue: a warpgroup whose 64 rows are all inside the group writes its bf16 tile into its own 32 KiB of
//     shared memory (128-byte swizzle) and one thread issues TMA stores, which drain while the next tile runs;
//     otherwise (rows past the group belong to another tile) masked 16-byte stores from registers after a quad
//     transpose. The output is bf16.
// Two builds of this file (moe_ep/experts/sm90/gemm.py ring_stages picks one from K):
//   default           4 stages, the TMA-store epilogue: 4 x 40960 ring + 65536 output tile + 4 x 512 scales +
//                     barriers + 9 GroupInfo = 231920 B of the 232448 an H100/H200 CTA may have;
//   -DGG_STAGES=5 -DGG_REG_EPI  (long reductions) 5 stages and the register epilogue only: a fifth stage fits only
//                     without the output tile (5 x 40960 + 5 x 512 + barriers + GroupInfo = 207872 B).

#include "gemm_wgmma.cuh"

#define GG_BM 128  // tile rows
#define GG_BN 256  // tile columns
#define GG_RASTER 8  // the band of row tiles of gm_raster
#ifndef GG_STAGES  // -DGG_STAGES=5 -DGG_REG_EPI: the long-reduction build
#define GG_STAGES 4
#endif
#define GG_STAGE_BYTES 40960  // B bf16 256 x 128 B (SW128) at 0 | A raw 128 x 64 B at GG_A
#define GG_A 32768
#define GG_EPI (GG_STAGES * GG_STAGE_BYTES)  // (163840 with 4 stages) bf16 output tile: 2 wg x 4 chunks x 64 x 128 B
#ifdef GG_REG_EPI  // every bf16 tile through the register epilogue, no shared output tile (room for a 5th stage)
#define GG_EPI_BYTES 0
#else
#define GG_EPI_BYTES 65536
#endif
#define GG_SC (GG_EPI + GG_EPI_BYTES)        // A scale tiles, 512 B per stage
#define GG_BAR (GG_SC + 512 * GG_STAGES)     // mbarriers full[S], empty[S]
#define GG_GI (GG_BAR + 16 * GG_STAGES)      // one GroupInfo per warp (9)
#define GG_SMEM_BYTES (GG_GI + 9 * 48)       // 231920 (sizeof(GroupInfo) = 48); no static shared memory

static_assert(sizeof(GroupInfo) == 48, "GG_SMEM_BYTES assumes 48-byte GroupInfo entries");
static_assert(GG_STAGES >= 2, "the half-tile skip's empty arrivals assume a ring of at least 2 stages");
static_assert(GG_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

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

// A(s) of the consumer thread into wgmma fragments f. GgA: byte offsets of the thread's two A rows ar0, ar0 + 8 in
// the raw tile (16 bytes at 16 c), the offset of its scale byte for block c / 2 in the scale tile (row ar0; + 128:
// row ar0 + 8), and slim, the number of k-steps whose k = 64 s + 16 c is inside K (only the last one can be
// outside: its data is TMA's zero fill, and the scale byte there, padding, is not read).
struct GgA {
    unsigned a0, a1, sa;
    int slim;
};
__device__ __forceinline__ void gg_convert_a(const GgA& T, unsigned a_raw, unsigned a_sc, int s, unsigned* f) {
    const bool kv = s < T.slim;
    const unsigned sc = a_sc + T.sa + 2u * ((unsigned)s & 1u);  // block (64 s + 16 c) / 32 % 4 = 2 (s % 2) + c / 2
    const uint4 r0 = lds128(a_raw + T.a0), r1 = lds128(a_raw + T.a1);
    const unsigned s0 = kv ? lds8(sc) : 127u, s1 = kv ? lds8(sc + 128u) : 127u;
    unsigned o0[8], o1[8];
    e4m3_bits16(r0, o0);
    e4m3_bits16(r1, o1);
    if ((s0 | s1) < 128u) {  // one (divergent) branch for both rows' common case instead of one per row
        scale16_fast(o0, s0);
        scale16_fast(o1, s1);
    } else {
        scale16(o0, s0);
        scale16(o1, s1);
    }
    a_frags(o0, o1, f);
}

// The tile t of the persistent schedule, computed by one warp into its own GroupInfo (no block barrier).
// Returns 1 when the tile has rows to compute (sets n0, mrows, arow0), 0 when it is a tile past the groups
// (sets r_zero: its first row past sum(sizes)), -1 when it has nothing to do.
__device__ __forceinline__ int gg_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                       int t, int& n0, int& mrows, long long& arow0, long long& r_zero) {
    const int n_tiles = (N + GG_BN - 1) / GG_BN;
    int m_t, n_t;
    gm_raster(t, (int)((M + GG_BM - 1) / GG_BM) + G, n_tiles, GG_RASTER, m_t, n_t);
    n0 = n_t * GG_BN;
    gm_scan_groups(sizes, G, M, 1, m_t, gi);
    __syncwarp();
    const int g = gi->g;
    if (g < 0) {
        r_zero = gi->total_rows + (long long)(m_t - gi->total_tiles) * GG_BM;
        __syncwarp();  // every lane has read gi before the next scan overwrites it
        return 0;
    }
    mrows = min(GG_BM, gi->rows - gi->tile * GG_BM);
    arow0 = gi->row0 + (long long)gi->tile * GG_BM;
    __syncwarp();
    return mrows > 0 ? 1 : -1;
}

// Producer (warp 8): for every tile of this CTA, every k-step, wait for the stage to be free and load it.
// stage_bytes / a_off / sc_off: the ring layout (stage j at sbase + j * stage_bytes with B at 0 and the raw A tile
// at a_off; scale tile j at sbase + sc_off + 512 j).
__device__ __forceinline__ void gg_produce(GroupInfo* gi, const unsigned char* __restrict__ As,
                                           const int* __restrict__ sizes, int G, long long M, int N, int K,
                                           const TmaMap* tmA, const TmaMap* tmB, unsigned sbase, unsigned full0,
                                           unsigned empty0, int nstages, unsigned stage_bytes, unsigned a_off,
                                           unsigned sc_off) {
    const int lane = threadIdx.x & 31, n_tiles = (N + GG_BN - 1) / GG_BN;
    const int total = ((int)((M + GG_BM - 1) / GG_BM) + G) * n_tiles;
    const int tpr = ((K >> 5) + 3) >> 2, ksteps = (K + 63) / 64;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        if (gg_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero) != 1) continue;
        const unsigned char* a_sc = As + (long long)(gi->toff + gi->tile) * tpr * 512;
        const int brow0 = gi->g * N + n0;
        for (int s = 0; s < ksteps; ++s) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * stage_bytes, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
                mbar_expect_tx(full, 32768u + 8192u + 512u);
                tma_2d(st, tmB, s * 64, brow0, full);
                tma_2d(st + a_off, tmA, s * 64, (int)arow0, full);
                bulk_copy(sbase + sc_off + 512u * (unsigned)stage, a_sc + (long long)(s >> 1) * 512, 512u, full);
            }
            ring_next(stage, phase, nstages);
        }
    }
}

// End of a tile's mainloop: every MMA of this warpgroup retired, and the accumulators and two A fragment buffers
// pinned up to here (the compiler must not reuse their registers earlier).
__device__ __forceinline__ void gg_drain(float* acc, unsigned* fa, unsigned* fb) {
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
    wg_fence_regs<16>(fa);
    wg_fence_regs<16>(fb);
}

__device__ __forceinline__ void gg_2d3d(const unsigned char* __restrict__ As, const int* __restrict__ sizes,
                                        void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                        const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmO) {
    // Everything lives in dynamic shared memory (no static): it then starts at the 1024-aligned base of the
    // CTA's shared window, which the 128-byte swizzle of B and of the output tile needs (checked below).
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31;
    // The warp index through a shuffle from lane 0, and kind below: ptxas then knows them warp-uniform, keeps the
    // ring counters and descriptors in uniform registers (no R2UR before every MMA) and the consumer loop's branches
    // uniform.
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();
    const unsigned full0 = sbase + GG_BAR, empty0 = full0 + 8u * GG_STAGES;
    ring_init(full0, empty0, GG_STAGES);
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + GG_GI) + warp;
    if (warp >= WS_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == WS_CONSUMER_WARPS)
            gg_produce(gi, As, sizes, G, M, N, K, tmA, tmB, sbase, full0, empty0, GG_STAGES, GG_STAGE_BYTES, GG_A,
                       GG_SC);
        return;
    }
    setmaxnreg_inc<224>();

    const int wg = warp >> 2, q = warp & 3, c = tid & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    GgA T;
    T.a0 = (unsigned)ar0 * 64u + 16u * c;
    T.a1 = T.a0 + 512u;
    T.sa = (unsigned)((ar0 & 31) * 16 + (ar0 >> 5) * 4 + (c >> 1));
    T.slim = (K - 16 * c + 63) / 64;  // K >= 32, c <= 3: the numerator is positive
    // Made opaque (an empty asm that "may change" them), so that ptxas keeps them in registers instead of recomputing
    // them from the thread index at every k-step; the same for the lane-0 flag and the barrier ids.
    unsigned lane0 = lane == 0, bar_mine = wg == 0 ? 1u : 2u, bar_other = 3u - bar_mine;
    asm volatile("" : "+r"(T.a0), "+r"(T.a1), "+r"(T.sa), "+r"(T.slim), "+r"(lane0), "+r"(bar_mine), "+r"(bar_other));

    const int n_tiles = (N + GG_BN - 1) / GG_BN;
    const int total = ((int)((M + GG_BM - 1) / GG_BM) + G) * n_tiles;
    const int ksteps = (K + 63) / 64;
    int stage = 0;  // stage and phase of the CTA's next k-step (the producer's counter, replayed)
    unsigned phase = 0;
    if (wg == 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        const int kind = __shfl_sync(0xffffffffu, gg_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero), 0);
        if (kind == 0) {
            if (zero_rest) {  // threads 0-255 = GM_ZERO_THREADS: zero_rows' thread stride
                zero_rows(out, r_zero, M, N, n0);
                zero_rows(out, r_zero, M, N, n0 + GM_ZERO_COLS);
            }
            continue;
        }
        if (kind < 0) continue;
        // A group's last tile with at most 64 rows leaves warpgroup 1 without rows. It keeps its place in the MMA
        // turns and gives its empty arrivals, so the producer and warpgroup 0 run as before, but converts, multiplies
        // and stores nothing: warpgroup 0's MMAs have the tensor cores to themselves.
        if (__shfl_sync(0xffffffffu, mrows, 0) <= 64 * wg) {
            for (int s = 0; s < ksteps; ++s) {
                // warpgroup 0 has issued M(s), so step s is in its stage; warpgroup 0 has arrived for steps up to
                // s - 2 >= s - S, so the stage's pending empty phase is step s's, and it completes only with warpgroup
                // 0's own arrival, after M(s) retired
                named_bar_sync(bar_mine, 256);
                named_bar_arrive(bar_other, 256);
                mbar_arrive_if(empty0 + 8u * (unsigned)stage, lane0);
                ring_next(stage, phase, GG_STAGES);
            }
            continue;
        }

        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        // 3 A fragment buffers: A(s + 1) is converted right after M(s) is issued, before waiting for M(s - 1)
        // (more MMA work queued while converting); its buffer was read by M(s - 2), retired at the previous wait.
        unsigned f0[16], f1[16], f2[16];
        mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
        {
            const unsigned st = sbase + (unsigned)stage * GG_STAGE_BYTES;
            gg_convert_a(T, st + GG_A, sbase + GG_SC + 512u * (unsigned)stage, 0, f0);
        }
        int prev = 0;  // stage of the previous k-step
        for (int s = 0; s < ksteps; s += 3) {
#pragma unroll
            for (int u = 0; u < 3; ++u) {
                const int ss = s + u;
                if (ss >= ksteps) break;
                unsigned* cur = u == 0 ? f0 : (u == 1 ? f1 : f2);
                unsigned* nxt = u == 0 ? f1 : (u == 1 ? f2 : f0);
                unsigned* old = u == 0 ? f2 : (u == 1 ? f0 : f1);
                named_bar_sync(bar_mine, 256);
                wg_fence();
                const unsigned long long db = wg_desc(sbase + (unsigned)stage * GG_STAGE_BYTES);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs(acc, cur + 4 * kk, db + 2 * kk);
                wg_commit();
                named_bar_arrive(bar_other, 256);
                const int cur_stage = stage;
                ring_next(stage, phase, GG_STAGES);
                if (ss + 1 < ksteps) {
                    mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                    const unsigned st = sbase + (unsigned)stage * GG_STAGE_BYTES;
                    gg_convert_a(T, st + GG_A, sbase + GG_SC + 512u * (unsigned)stage, ss + 1, nxt);
                }
                wg_wait<1>();  // M(ss - 1) retired: its A buffer (old) and its stage are free
                wg_fence_regs<16>(old);
                mbar_arrive_if(empty0 + 8u * (unsigned)prev, ss >= 1 && lane0);
                prev = cur_stage;
            }
        }
        gg_drain(acc, f0, f1);
        wg_fence_regs<16>(f2);
        mbar_arrive_if(empty0 + 8u * (unsigned)prev, lane0);
        if (mrows >= 64 * (wg + 1) && GG_EPI_BYTES)  // the warpgroup's 64 rows are all in the group: TMA
            epilogue_bf16_tma<1>(acc, sbase + GG_EPI + 32768u * (unsigned)wg, wg, arow0, n0, N, tmO);
        else  // rows past the group belong to another tile: masked stores from registers
            epilogue_bf16(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, ar0);
    }
    if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before exit
    if (wg == 0) named_bar_sync(1, 256);  // takes warpgroup 1's arrive after its last MMAs
}

// GM_TMA_ARGS (A and B reached only through tmA / tmB: tmA over A [M, K] e4m3 in boxes of 128 rows x 64 bytes, tmB
// over the prepared bf16 weight [G N, Kp] in boxes of 256 rows x 64 columns with the 128-byte swizzle), then tmO:
// the bf16 output [M, N] in boxes of 64 rows x 64 columns with the 128-byte swizzle (unused by the GG_REG_EPI
// build).
#define GG_ARGS GM_TMA_ARGS, const __grid_constant__ TmaMap tmO
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) mx_gmm_2d3d_bf16(GG_ARGS) {
    gg_2d3d(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB, &tmO);
}
