// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma5" (MOE_EP_GEMM_IMPL=wgmma5): fprop / dgrad (2d x 3d),
// wgmma4's math (A dequantized into wgmma register fragments, B = the weight prepared once as exact bf16 and
// TMA-loaded with the 128-byte swizzle) in a warp-specialized, persistent kernel.
//
//   * why: wgmma4 (0.87-1.0x torch bf16) runs one CTA per tile. Every tile pays the TMA latency of its first stage,
//     the group scan's global loads and an epilogue during which no load is in flight, and every k-step ends in a
//     __syncthreads so the slower warpgroup sets the pace of both. Here a producer warp runs ahead across tiles:
//     while the consumers store one tile it is already filling the ring with the next tile's stages. Measured
//     (benchmarks/NOTES.md, design 3): about wgmma4's speed, 0.81-0.98x torch bf16; the A conversion in the MMA
//     warpgroups, not the per-tile overheads, is what bounds both.
//   * block = 384 threads: warpgroups 0 and 1 are the consumers (tile rows 64 wg .. 64 wg + 63, as wgmma4; 128
//     fp32 accumulators per thread), warpgroup 2 the producer: its warp 8 scans the groups and its lane 0 issues
//     the TMA loads; warps 9-11 leave at once. The kernel is compiled for 384 threads (168 registers each, which
//     would spill the accumulators), so the producer gives registers back (setmaxnreg.dec to 56) and the
//     consumers take them (setmaxnreg.inc to 224): 128 x 56 + 256 x 224 = 64512 = 384 x 168, all the CTA holds
//     (a larger inc waits forever for registers nobody frees). (A 288-thread block
//     does not help: ptxas still budgets 12 warps.)
//   * grid = min(tiles, SMs); CTA b takes tiles b, b + gridDim.x, ... in gm_raster's order (W5_RASTER bands;
//     (ceil(M/128) + G) * n_tiles tiles, those past the groups zero-fill rows past sum(sizes) when zero_rest).
//     Each warp scans the group sizes itself (its own GroupInfo, no block barrier; the sizes stay in L1 after the
//     first tile).
//   * ring: W5_STAGES stages of [B bf16 256 x 128 B (SW128) | A raw 128 x 64 B] plus one A scale tile (512 B) per
//     stage, two mbarriers each: full (count 1 + transaction bytes, the producer's expect_tx) and empty (count 8:
//     lane 0 of every consumer warp arrives once the MMAs that read the stage have retired). A step's stage and
//     phase come from one running counter replayed by producer and consumers: step i of the CTA uses stage i % S
//     with phase (i / S) & 1.
//   * mainloop per consumer warpgroup: issue M(s) (4 x wgmma.m64n256k16, A from registers), convert A(s + 1) into
//     the third of 3 fragment buffers, then wait for M(s - 1) and release its stage. The two warpgroups issue
//     their MMAs strictly in turn (named barriers 1 and 2), so that one converts while the other's MMAs run.
//   * half tiles: in a group's last tile with at most 64 rows, warpgroup 1 only keeps its MMA turns and gives its
//     empty arrivals (no loads, conversion, MMAs or stores), so warpgroup 0 has the tensor cores alone. Measured
//     (benchmarks/NOTES.md, "half tiles"): 1.8-1.9 % less time at dsv3_down fprop and a dsv3_up dgrad spec, 0-0.6 %
//     elsewhere (the static tile order gives the time saved to CTAs that then wait for the others).
//   * epilogue: a warpgroup whose 64 rows are all inside the group writes its bf16 tile into its own 32 KiB of
//     shared memory (128-byte swizzle) and one thread issues TMA stores, which drain while the next tile runs;
//     otherwise (rows past the group belong to another tile) masked 16-byte stores from registers after a quad
//     transpose. fp32 output: float2 stores (w2_epilogue).
// Timing experiments (wrong results; benchmarks/prof_gemm.py --kernel wgmma5): -DW5_HALF_B loads B on even
// k-steps only, -DW5_NO_EPI skips the output stores, -DW3_NO_CVT skips the A conversion. Variants with the same
// results: -DW5_REG_EPI (register epilogue only), -DW5_HALF_SKIP=0 (half tiles computed by both warpgroups), and
// the long-reduction build below. (The first TMA epilogue, staged through quad transposes, measured no faster and
// lives in commit 1aebbd0 as -DW5_EPI_SHFL.)
// Shared memory (all dynamic): 4 x 40960 ring + 65536 output tile + 4 x 512 scales + barriers + 9 GroupInfo =
// 231920 B of the 232448 an H100/H200 CTA may have.
// Long reductions (K >= 3072) run the build -DW5_STAGES=5 -DW5_REG_EPI (moe_ep.gemm_cuda.w5_stages): a fifth
// stage fits only without the output tile (5 x 40960 + 5 x 512 + barriers + GroupInfo = 207872 B). Measured with
// single launches alternated in one process: 1.2-2.6 % less time from K = 3072 up, 1.1 % more at K = 2048 and
// 3.6 % more at K = 1536, where the register epilogue's stores weigh more per k-step (benchmarks/NOTES.md, "a fifth
// stage for long reductions").

#define WG4_NO_KERNELS
#include "grouped_gemm_wg4.cu"

#define W5_THREADS 384
// tile order band (gm_raster in grouped_gemm_wg2.cu): 8 row tiles per band. Measured mixed against the plain order
// (1) while the consumers' instruction stream bound the kernel (NOTES, "Correction"); after the leaner k-step, 0.3 to
// 7.7 % less time in one run and 0.5 to 1.9 % in a second (NOTES, "wgmma5: fewer instructions per k-step").
#ifndef W5_RASTER  // (-DW5_RASTER=b: prof_gemm.py A/B of the band)
#define W5_RASTER 8
#endif
#define W5_CONSUMER_WARPS 8
#ifndef W5_HALF_SKIP  // (-DW5_HALF_SKIP=0: prof_gemm.py A/B of the skipped half tiles)
#define W5_HALF_SKIP 1
#endif
#ifndef W5_STAGES  // -DW5_STAGES=5 -DW5_REG_EPI: the long-reduction build (gemm_cuda.w5_stages picks it)
#define W5_STAGES 4
#endif
#define W5_STAGE_BYTES 40960  // B bf16 256 x 128 B (SW128) at 0 | A raw 128 x 64 B at W5_A
#define W5_A 32768
#define W5_EPI (W5_STAGES * W5_STAGE_BYTES)  // (163840 with 4 stages) bf16 output tile: 2 wg x 4 chunks x 64 x 128 B
#ifdef W5_REG_EPI  // every bf16 tile through the register epilogue, no shared output tile (room for a 5th stage)
#define W5_EPI_BYTES 0
#else
#define W5_EPI_BYTES 65536
#endif
#define W5_SC (W5_EPI + W5_EPI_BYTES)        // A scale tiles, 512 B per stage
#define W5_BAR (W5_SC + 512 * W5_STAGES)     // mbarriers full[S], empty[S]
#define W5_GI (W5_BAR + 16 * W5_STAGES)      // one GroupInfo per warp (9)
#define W5_SMEM_BYTES (W5_GI + 9 * 48)       // 231920 (sizeof(GroupInfo) = 48); no static shared memory

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

static_assert(sizeof(GroupInfo) == 48, "W5_SMEM_BYTES assumes 48-byte GroupInfo entries");
static_assert(W5_STAGES >= 2, "the half-tile skip's empty arrivals assume a ring of at least 2 stages");
static_assert(W5_SMEM_BYTES <= 232448, "more shared memory than an H100/H200 CTA may have");

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Consumer-side forms whose control flow is warp-uniform: the wait loop exits on a vote, the arrive is predicated
// inside the asm, so that ptxas can keep the ring counters in uniform registers.
__device__ __forceinline__ void mbar_wait_warp(unsigned bar, unsigned parity) {
    for (unsigned polls = 0; !__all_sync(0xffffffffu, mbar_try(bar, parity));)
        if (++polls > (1u << 28)) __trap();
}
__device__ __forceinline__ void mbar_arrive_if(unsigned bar, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
                 "r"((unsigned)pred)
                 : "memory");
}

// A(s) of the consumer thread into wgmma fragments f (what w3_convert_a gives). W5A: byte offsets of the thread's two
// A rows in the raw tile, the offset of its scale byte for block c / 2 in the scale tile (row ar0; + 128: row
// ar0 + 8), and slim, the number of k-steps whose k = 64 s + 16 c is inside K (only the last one can be outside:
// its data is TMA's zero fill, and the scale byte there, padding, is not read).
struct W5A {
    unsigned a0, a1, sa;
    int slim;
};
__device__ __forceinline__ void w5_convert_a(const W5A& T, unsigned a_raw, unsigned a_sc, int s, unsigned* f) {
    const bool kv = s < T.slim;
    const unsigned sc = a_sc + T.sa + 2u * ((unsigned)s & 1u);  // block (64 s + 16 c) / 32 % 4 = 2 (s % 2) + c / 2
    const uint4 r0 = lds128(a_raw + T.a0), r1 = lds128(a_raw + T.a1);
    const unsigned s0 = kv ? lds8(sc) : 127u, s1 = kv ? lds8(sc + 128u) : 127u;
    unsigned o0[8], o1[8];
#ifdef W3_NO_CVT  // timing experiment only (prof_gemm.py --kernel wgmma5): the loads without the conversion
    no_cvt16(r0, s0, o0);
    no_cvt16(r1, s1, o1);
#else
    e4m3_bits16(r0, o0);
    e4m3_bits16(r1, o1);
    if ((s0 | s1) < 128u) {  // one (divergent) branch for both rows' common case instead of one per row
        scale16_fast(o0, s0);
        scale16_fast(o1, s1);
    } else {
        scale16(o0, s0);
        scale16(o1, s1);
    }
#endif
    a_frags(o0, o1, f);
}

// The two consumer warpgroups issue their MMAs strictly in turn (named barriers 1 and 2: warpgroup 0 waits on 1
// before issuing, warpgroup 1 on 2; each arrives on the other's barrier after issuing), so that one converts its A
// fragments while the other's MMAs run (measured: +4-6 % over unordered issue).
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// The full/empty mbarrier pairs of an S-stage ring (full: the producer's arrival + TMA bytes; empty: one arrival
// per consumer warp), then the kernel's only block-wide barrier: they exist before anyone uses them.
__device__ __forceinline__ void ring_init(unsigned full0, unsigned empty0, int stages) {
    if (threadIdx.x == 0) {
        for (int j = 0; j < stages; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, W5_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// The ring's running (stage, phase) counter: step i of the CTA uses stage i % S with phase (i / S) & 1.
__device__ __forceinline__ void ring_next(int& stage, unsigned& phase, int stages) {
    if (++stage == stages) {
        stage = 0;
        phase ^= 1u;
    }
}

// The tile t of the persistent schedule, computed by one warp into its own GroupInfo (no block barrier).
// Returns 1 when the tile has rows to compute (sets n0, mrows, arow0), 0 when it is a tile past the groups
// (sets r_zero: its first row past sum(sizes)), -1 when it has nothing to do.
__device__ __forceinline__ int w5_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                       int t, int& n0, int& mrows, long long& arow0, long long& r_zero) {
    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    int m_t, n_t;
    gm_raster(t, (int)((M + W2_BM - 1) / W2_BM) + G, n_tiles, W5_RASTER, m_t, n_t);
    n0 = n_t * W2_BN;
    gm_scan_groups(sizes, G, M, 1, m_t, gi);
    __syncwarp();
    const int g = gi->g;
    if (g < 0) {
        r_zero = gi->total_rows + (long long)(m_t - gi->total_tiles) * W2_BM;
        __syncwarp();  // every lane has read gi before the next scan overwrites it
        return 0;
    }
    mrows = min(W2_BM, gi->rows - gi->tile * W2_BM);
    arow0 = gi->row0 + (long long)gi->tile * W2_BM;
    __syncwarp();
    return mrows > 0 ? 1 : -1;
}

// The bf16 outputs of row half h, column group m of the 64 x 256 accumulator fragment: accumulator 4 j + 2 h + e
// of this thread is row 16 q + lane / 4 + 8 h, column 8 j + 2 c + e (c = lane % 4). For the 4 j's = 4 m + i the
// quad holds a 4 x 4 matrix of bf16x2 words w[c][i]; after quad_transpose4 lane c holds the 4 words of j = 4 m + c:
// columns 32 m + 8 c .. + 7 of its row, in order (16 bytes). Every lane of the warp must call it.
__device__ __forceinline__ void w5_bf16_words(const float* acc, int h, int m, unsigned* w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * m + i) + 2 * h;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[a + 1]), "f"(acc[a]));
    }
    quad_transpose4(w);
}

// bf16 epilogue from registers: per (h, m) one 16-byte store of w5_bf16_words (a warp writes 8 rows x 64
// contiguous bytes); rows >= mrows and columns >= N - n0 are not stored (N % 8 == 0).
__device__ __forceinline__ void w5_epilogue_bf16(const float* acc, unsigned short* __restrict__ out, long long arow0,
                                                 int mrows, int n0, int N, int ar0) {
    const int c = threadIdx.x & 3;
    const int ncols = N - n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = ar0 + 8 * h;
        unsigned short* rowp = out + (arow0 + r) * N + n0;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            unsigned w[4];
            w5_bf16_words(acc, h, m, w);
            const int col = 32 * m + 8 * c;
            if (r < mrows && col < ncols) *reinterpret_cast<uint4*>(rowp + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// One round of a TMA-store epilogue. Begin: the leader waits until the previous stores (the previous round, or the
// previous tile) have read the region, then the warpgroup meets (named barrier 3 + wg: one per warpgroup; 0 is
// __syncthreads, 1-2 the MMA turns). End: the region's writes are made visible to the TMA unit, the warpgroup meets,
// and the leader stores boxes b = 0 .. n - 1 (64 rows from row, columns col0 + width b, those that start before
// ncols; columns past the tensor map's width are clipped by it; box b at region + 8192 b) as one bulk group.
__device__ __forceinline__ void epi_round_begin(bool leader, int bar) {
    if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    named_bar_sync(bar, 128);
}
__device__ __forceinline__ void epi_round_end(bool leader, int bar, const TmaMap* tmO, unsigned region, int col0,
                                              int width, int n, int ncols, int row) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_bar_sync(bar, 128);
    if (leader) {
        for (int b = 0; b < n && col0 + width * b < ncols; ++b)
            asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                             reinterpret_cast<unsigned long long>(tmO)),
                         "r"(col0 + width * b), "r"(row), "r"(region + 8192u * (unsigned)b)
                         : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}

// bf16 epilogue of one warpgroup's 64 full rows (64 x 256) through shared memory and TMA stores, so that the
// consumers go on with the next tile while the output drains to memory. The tile is 4 chunks of 64 columns, each
// 64 rows x 128 B in the 128-byte swizzle (16-byte unit u of row r at ((u ^ (r % 8)) << 4)), the layout of a 64 x 64
// TMA box; the region holds 4 / ROUNDS of them (wgmma5: 32 KiB, one round; the 4-stage wgrad: 16 KiB, two), and
// each round is written after the previous round's stores have read it (epi_round_begin / epi_round_end).
template <int ROUNDS>
__device__ __forceinline__ void w5_epilogue_tma_rounds(const float* acc, unsigned region, int wg, long long arow0,
                                                       int n0, int N, const TmaMap* tmO) {
    constexpr int J = 32 / ROUNDS;  // 8-column groups per round
    const int tid = threadIdx.x, lane = tid & 31, q = (tid >> 5) & 3, c = tid & 3;
    const bool leader = (tid & 127) == 0;
    const int bar = 3 + wg;
#pragma unroll
    for (int rd = 0; rd < ROUNDS; ++rd) {
        epi_round_begin(leader, bar);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = q * 16 + (lane >> 2) + 8 * h;  // row within the warpgroup's 64
            // each bf16 pair straight to its place: columns 8 j + 2 c, + 1 = chunk j / 8 (jj / 8 in the round's
            // region), 16-byte unit j % 8, byte 4 c; a warp's store (8 rows x 4 lanes) hits 8 distinct units x 4
            // words = 32 banks, and no shuffles are needed
#pragma unroll
            for (int jj = 0; jj < J; ++jj) {
                const int j = J * rd + jj;
                unsigned pk;
                asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(acc[4 * j + 2 * h + 1]), "f"(acc[4 * j + 2 * h]));
                const unsigned u = (unsigned)(jj & 7);
                sts32(region + (unsigned)(jj >> 3) * 8192u + (unsigned)r * 128u + ((u ^ (unsigned)(r & 7)) << 4) +
                          4u * (unsigned)c,
                      pk);
            }
        }
        epi_round_end(leader, bar, tmO, region, n0 + 8 * J * rd, 64, J / 8, N, (int)(arow0 + 64 * wg));
    }
}
__device__ __forceinline__ void w5_epilogue_tma(const float* acc, unsigned region, int wg, long long arow0, int n0,
                                                int N, const TmaMap* tmO) {
    w5_epilogue_tma_rounds<1>(acc, region, wg, arow0, n0, N, tmO);
}

// Producer (warp 8): for every tile of this CTA, every k-step, wait for the stage to be free and load it.
// stage_bytes / a_off / sc_off: the ring layout (stage j at sbase + j * stage_bytes with B at 0 and the raw A tile
// at a_off; scale tile j at sbase + sc_off + 512 j).
__device__ __forceinline__ void w5_produce(GroupInfo* gi, const unsigned char* __restrict__ As,
                                           const int* __restrict__ sizes, int G, long long M, int N, int K,
                                           const TmaMap* tmA, const TmaMap* tmB, unsigned sbase, unsigned full0,
                                           unsigned empty0, int nstages, unsigned stage_bytes, unsigned a_off,
                                           unsigned sc_off) {
    const int lane = threadIdx.x & 31, n_tiles = (N + W2_BN - 1) / W2_BN;
    const int total = ((int)((M + W2_BM - 1) / W2_BM) + G) * n_tiles;
    const int tpr = ((K >> 5) + 3) >> 2, ksteps = (K + 63) / 64;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        if (w5_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero) != 1) continue;
        const unsigned char* a_sc = As + (long long)(gi->toff + gi->tile) * tpr * 512;
        const int brow0 = gi->g * N + n0;
        for (int s = 0; s < ksteps; ++s) {
            if (lane == 0) {
                const unsigned st = sbase + (unsigned)stage * stage_bytes, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
#ifdef W5_HALF_B  // timing experiment only (wrong results): B loaded on even k-steps only = half the B traffic
                const bool load_b = (s & 1) == 0;
#else
                const bool load_b = true;
#endif
                mbar_expect_tx(full, (load_b ? 32768u : 0u) + 8192u + 512u);
                if (load_b) tma_2d(st, tmB, s * 64, brow0, full);
                tma_2d(st + a_off, tmA, s * 64, (int)arow0, full);
                bulk_copy(sbase + sc_off + 512u * (unsigned)stage, a_sc + (long long)(s >> 1) * 512, 512u, full);
            }
            ring_next(stage, phase, nstages);
        }
    }
}

template <int OUT_F32>
__device__ __forceinline__ void w5_2d3d(const unsigned char* __restrict__ As, const int* __restrict__ sizes,
                                        void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                        const TmaMap* tmA, const TmaMap* tmB, const TmaMap* tmO) {
    // Everything lives in dynamic shared memory (no static): it then starts at the 1024-aligned base of the
    // CTA's shared window, which the 128-byte swizzle of B and of the output tile needs (checked below).
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31;
    // The warp index through a shuffle from lane 0, and kind below: ptxas then knows them warp-uniform, keeps the
    // ring counters and descriptors in uniform registers (no R2UR before every MMA) and the consumer loop's branches
    // uniform. Measured +1.7 to +4.9 points of the torch ratio in two A/B runs (benchmarks/NOTES.md).
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();
    const unsigned full0 = sbase + W5_BAR, empty0 = full0 + 8u * W5_STAGES;
    ring_init(full0, empty0, W5_STAGES);
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + W5_GI) + warp;
    if (warp >= W5_CONSUMER_WARPS) {
        setmaxnreg_dec<56>();
        if (warp == W5_CONSUMER_WARPS)
            w5_produce(gi, As, sizes, G, M, N, K, tmA, tmB, sbase, full0, empty0, W5_STAGES, W5_STAGE_BYTES, W5_A,
                       W5_SC);
        return;
    }
    setmaxnreg_inc<224>();

    const int wg = warp >> 2, q = warp & 3, c = tid & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    W5A T;
    T.a0 = (unsigned)ar0 * 64u + 16u * c;
    T.a1 = T.a0 + 512u;
    T.sa = (unsigned)((ar0 & 31) * 16 + (ar0 >> 5) * 4 + (c >> 1));
    T.slim = (K - 16 * c + 63) / 64;  // K >= 32, c <= 3: the numerator is positive
    // Made opaque (an empty asm that "may change" them), so that ptxas keeps them in registers instead of recomputing
    // them from the thread index at every k-step; the same for the lane-0 flag and the barrier ids (S2R + compare
    // and two selects per step otherwise). Pinning the A fields measured +2.3 to +5.4 points of the torch ratio
    // (NOTES, "Correction"); the k-step bound, the scale offset and these flags with the single scale branch
    // +2.0 to +4.3 % in time (NOTES, "wgmma5: fewer instructions per k-step").
    unsigned lane0 = lane == 0, bar_mine = wg == 0 ? 1u : 2u, bar_other = 3u - bar_mine;
    asm volatile("" : "+r"(T.a0), "+r"(T.a1), "+r"(T.sa), "+r"(T.slim), "+r"(lane0), "+r"(bar_mine), "+r"(bar_other));

    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    const int total = ((int)((M + W2_BM - 1) / W2_BM) + G) * n_tiles;
    const int ksteps = (K + 63) / 64;
    int stage = 0;  // stage and phase of the CTA's next k-step (the producer's counter, replayed)
    unsigned phase = 0;
    if (wg == 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        const int kind = __shfl_sync(0xffffffffu, w5_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero), 0);
        if (kind == 0) {
            if (zero_rest) {  // threads 0-255 = GM_THREADS: zero_rows' thread stride
                zero_rows<OUT_F32>(out, r_zero, M, N, n0);
                zero_rows<OUT_F32>(out, r_zero, M, N, n0 + GM_BN);
            }
            continue;
        }
        if (kind < 0) continue;
        // A group's last tile with at most 64 rows leaves warpgroup 1 without rows (bench_gemm's dsv3 sizes: 3-4 %
        // of the MMA work). It keeps its place in the MMA turns and gives its empty arrivals, so the producer and
        // warpgroup 0 run as before, but loads, converts, multiplies and stores nothing: warpgroup 0's MMAs have the
        // tensor cores to themselves.
        if (W5_HALF_SKIP && __shfl_sync(0xffffffffu, mrows, 0) <= 64 * wg) {
            for (int s = 0; s < ksteps; ++s) {
                // warpgroup 0 has issued M(s), so step s is in its stage; warpgroup 0 has arrived for steps up to
                // s - 2 >= s - S, so the stage's pending empty phase is step s's, and it completes only with warpgroup
                // 0's own arrival, after M(s) retired
                named_bar_sync(bar_mine, 256);
                named_bar_arrive(bar_other, 256);
                mbar_arrive_if(empty0 + 8u * (unsigned)stage, lane0);
                ring_next(stage, phase, W5_STAGES);
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
            const unsigned st = sbase + (unsigned)stage * W5_STAGE_BYTES;
            w5_convert_a(T, st + W5_A, sbase + W5_SC + 512u * (unsigned)stage, 0, f0);
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
                const unsigned long long db = wg_desc(sbase + (unsigned)stage * W5_STAGE_BYTES);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs(acc, cur + 4 * kk, db + 2 * kk);
                wg_commit();
                named_bar_arrive(bar_other, 256);
                const int cur_stage = stage;
                ring_next(stage, phase, W5_STAGES);
                if (ss + 1 < ksteps) {
                    mbar_wait_warp(full0 + 8u * (unsigned)stage, phase);
                    const unsigned st = sbase + (unsigned)stage * W5_STAGE_BYTES;
                    w5_convert_a(T, st + W5_A, sbase + W5_SC + 512u * (unsigned)stage, ss + 1, nxt);
                }
                wg_wait<1>();  // M(ss - 1) retired: its A buffer (old) and its stage are free
                wg_fence_regs<16>(old);
                mbar_arrive_if(empty0 + 8u * (unsigned)prev, ss >= 1 && lane0);
                prev = cur_stage;
            }
        }
        w2_drain(acc, f0, f1);
        wg_fence_regs<16>(f2);
        mbar_arrive_if(empty0 + 8u * (unsigned)prev, lane0);
#ifdef W5_NO_EPI  // timing experiment only: no output stores
        if (mrows < 0)
#endif
        if (OUT_F32)
            w2_epilogue<1>(acc, out, arow0, mrows, n0, N, ar0, sbase);  // direct float2 stores, no shared memory
        else if (mrows >= 64 * (wg + 1) && W5_EPI_BYTES)  // the warpgroup's 64 rows are all in the group: TMA
            w5_epilogue_tma(acc, sbase + W5_EPI + 32768u * (unsigned)wg, wg, arow0, n0, N, tmO);
        else  // rows past the group belong to another tile: masked stores from registers
            w5_epilogue_bf16(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, ar0);
    }
    if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // stores done before exit
    if (wg == 0) named_bar_sync(1, 256);  // takes warpgroup 1's arrive after its last MMAs
}

// kernels/grouped_gemm_wgrad.cu includes this file for its helpers and defines WG5_NO_KERNELS first.
#ifndef WG5_NO_KERNELS
// Same parameters as the wgmma4 kernels (B = the prepared bf16 weight [G, N, Kp], reached only through tmB).
// tmO: the bf16 output [M, N] in boxes of 64 rows x 64 columns with the 128-byte swizzle (unused for fp32).
#define W5_ARGS W3_ARGS, const __grid_constant__ TmaMap tmO
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg5_2d3d_bf16(W5_ARGS) {
    w5_2d3d<0>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB, &tmO);
}
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg5_2d3d_f32(W5_ARGS) {
    w5_2d3d<1>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB, &tmO);
}
#endif  // WG5_NO_KERNELS
