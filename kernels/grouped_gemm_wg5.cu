// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma5" (MOE_EP_GEMM_IMPL=wgmma5): fprop / dgrad (2d x 3d),
// wgmma4's math (A dequantized into wgmma register fragments, B = the weight prepared once as exact bf16 and
// TMA-loaded with the 128-byte swizzle) in a warp-specialized, persistent kernel.
//
//   * why: wgmma4 (0.87-1.0x torch bf16) runs one CTA per tile. Every tile pays the TMA latency of its first stage,
//     the group scan's global loads and an epilogue during which no load is in flight, and every k-step ends in a
//     __syncthreads so the slower warpgroup sets the pace of both. Here a producer warp runs ahead across tiles:
//     while the consumers store one tile it is already filling the ring with the next tile's stages.
//   * block = 384 threads: warpgroups 0 and 1 are the consumers (tile rows 64 wg .. 64 wg + 63, as wgmma4; 128
//     fp32 accumulators per thread), warpgroup 2 the producer: its warp 8 scans the groups and its lane 0 issues
//     the TMA loads; warps 9-11 leave at once. The kernel is compiled for 384 threads (168 registers each, which
//     would spill the accumulators), so the producer gives registers back (setmaxnreg.dec to 40) and the
//     consumers take them (setmaxnreg.inc to 232): 128 x 40 + 256 x 232 = 64512 <= 65536. (A 288-thread block
//     does not help: ptxas still budgets 12 warps.)
//   * grid = min(tiles, SMs); CTA b takes tiles b, b + gridDim.x, ... of the same tile order as wgmma4 (row tile
//     t / n_tiles, column tile t % n_tiles; (ceil(M/128) + G) * n_tiles tiles, those past the groups zero-fill
//     rows past sum(sizes) when zero_rest). Each warp scans the group sizes itself (its own GroupInfo, no block
//     barrier; the sizes stay in L1 after the first tile).
//   * ring: W5_STAGES stages of [B bf16 256 x 128 B | A raw 128 x 64 B | A scale tile 512 B] (wgmma4's layout),
//     two mbarriers each: full (count 1 + transaction bytes, the producer's expect_tx) and empty (count 8: lane 0
//     of every consumer warp arrives once the MMAs that read the stage have retired, i.e. after the wait_group
//     that follows the next step's MMAs, or after the drain for a tile's last step). A step's stage and phase
//     come from one running counter shared by producer and consumers: step i of the CTA uses stage i % S with
//     phase (i / S) & 1.
//   * epilogue straight from registers (the ring is busy with the next tile): bf16 pairs are transposed inside
//     each quad (quad_transpose4) so that each thread holds 8 consecutive columns of one row, stored as one
//     16-byte store (a warp writes 8 rows x 64 contiguous bytes). fp32 output as w2_epilogue (float2 stores).
// Shared memory: W5_STAGES x 41984 B + 1 KiB alignment (5 stages: 210944 B).

#define WG4_NO_KERNELS
#include "grouped_gemm_wg4.cu"

#define W5_THREADS 384
#define W5_CONSUMER_WARPS 8
#define W5_STAGES 5
#define W5_SMEM_BYTES (W5_STAGES * W4_STAGE_BYTES + 1024)  // 210944

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// The tile t of the persistent schedule, computed by one warp into its own GroupInfo (no block barrier).
// Returns 1 when the tile has rows to compute (sets n0, mrows, arow0), 0 when it is a tile past the groups
// (sets r_zero: its first row past sum(sizes)), -1 when it has nothing to do.
__device__ __forceinline__ int w5_tile(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                       int t, int& n0, int& mrows, long long& arow0, long long& r_zero) {
    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    const int m_t = t / n_tiles;
    n0 = (t % n_tiles) * W2_BN;
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

// bf16 epilogue from registers. Accumulator 4 j + 2 h + e of this thread is tile row ar0 + 8 h, column
// 8 j + 2 c + e (c = lane % 4). For each row half h and each group of 4 j's (j = 4 m + i), the quad holds a 4 x 4
// matrix of bf16x2 words w[c][i]; after quad_transpose4 thread c holds the 4 words of j = 4 m + c: columns
// 32 m + 8 c .. + 7 of its row, one 16-byte store (a warp writes 8 rows x 64 contiguous bytes). Every lane takes
// part in the shuffles; only the stores are masked (rows >= mrows, columns >= N - n0; N % 8 == 0).
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
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int a = 4 * (4 * m + i) + 2 * h;
                asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[a + 1]), "f"(acc[a]));
            }
            quad_transpose4(w);
            const int col = 32 * m + 8 * c;
            if (r < mrows && col < ncols) *reinterpret_cast<uint4*>(rowp + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// Producer (warp 8): for every tile of this CTA, every k-step, wait for the stage to be free and load it.
__device__ __forceinline__ void w5_produce(GroupInfo* gi, const unsigned char* __restrict__ As,
                                           const int* __restrict__ sizes, int G, long long M, int N, int K,
                                           const TmaMap* tmA, const TmaMap* tmB, unsigned sbase, unsigned full0,
                                           unsigned empty0) {
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
                const unsigned st = sbase + (unsigned)stage * W4_STAGE_BYTES, full = full0 + 8u * (unsigned)stage;
                mbar_wait(empty0 + 8u * (unsigned)stage, phase ^ 1u);  // a fresh barrier passes parity 1 at once
                mbar_expect_tx(full, 32768u + 8192u + 512u);
                tma_2d(st + W4_B, tmB, s * 64, brow0, full);
                tma_2d(st + W4_A, tmA, s * 64, (int)arow0, full);
                bulk_copy(st + W4_SC, a_sc + (long long)(s >> 1) * 512, 512u, full);
            }
            if (++stage == W5_STAGES) {
                stage = 0;
                phase ^= 1u;
            }
        }
    }
}

template <int OUT_F32>
__device__ __forceinline__ void w5_2d3d(const unsigned char* __restrict__ As, const int* __restrict__ sizes,
                                        void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                        const TmaMap* tmA, const TmaMap* tmB) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ GroupInfo gis[W5_CONSUMER_WARPS + 1];
    __shared__ __align__(8) unsigned long long bars[2 * W5_STAGES];  // full[S], empty[S]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned sbase = (smem_u32(smem) + 1023u) & ~1023u;
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8u * W5_STAGES;
    if (tid == 0) {
        for (int j = 0; j < W5_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, W5_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the only block-wide barrier: the mbarriers exist before anyone uses them
    GroupInfo* gi = &gis[warp];
    if (warp >= W5_CONSUMER_WARPS) {
        setmaxnreg_dec<40>();
        if (warp == W5_CONSUMER_WARPS) w5_produce(gi, As, sizes, G, M, N, K, tmA, tmB, sbase, full0, empty0);
        return;
    }
    setmaxnreg_inc<232>();

    const int wg = tid >> 7, q = warp & 3, c = tid & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    W3Thread T;  // only the A fields (w3_convert_a with the raw A tile at W4_A and the scale tile at W4_SC)
    T.c16 = c * 16;
    T.K = K;
    T.a0 = (unsigned)ar0 * 64u + 16u * c;
    T.a1 = T.a0 + 512u;
    T.sa = (unsigned)((ar0 & 31) * 16 + (ar0 >> 5) * 4);

    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    const int total = ((int)((M + W2_BM - 1) / W2_BM) + G) * n_tiles;
    const int ksteps = (K + 63) / 64;
    int stage = 0;  // stage and phase of the CTA's next k-step (the producer's counter, replayed)
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        const int kind = w5_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero);
        if (kind == 0) {
            if (zero_rest) {  // threads 0-255 = GM_THREADS: zero_rows' thread stride
                zero_rows<OUT_F32>(out, r_zero, M, N, n0);
                zero_rows<OUT_F32>(out, r_zero, M, N, n0 + GM_BN);
            }
            continue;
        }
        if (kind < 0) continue;

        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        unsigned fa[16], fb[16];
        mbar_wait(full0 + 8u * (unsigned)stage, phase);
        {
            const unsigned st = sbase + (unsigned)stage * W4_STAGE_BYTES;
            w3_convert_a(T, st + W4_A, st + W4_SC, 0, fa);
        }
        int prev = 0;  // stage of the previous k-step
        for (int s = 0; s < ksteps; s += 2) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int ss = s + u;
                if (ss >= ksteps) break;
                unsigned* cur = u == 0 ? fa : fb;
                unsigned* nxt = u == 0 ? fb : fa;
                wg_fence();
                const unsigned long long db = wg_desc(sbase + (unsigned)stage * W4_STAGE_BYTES + W4_B);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs(acc, cur + 4 * kk, db + 2 * kk);
                wg_commit();
                wg_wait<1>();  // step ss - 1 retired: its A registers (nxt) and its stage are free
                wg_fence_regs<16>(nxt);
                if (ss >= 1 && lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
                prev = stage;
                if (++stage == W5_STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
                if (ss + 1 < ksteps) {
                    mbar_wait(full0 + 8u * (unsigned)stage, phase);
                    const unsigned st = sbase + (unsigned)stage * W4_STAGE_BYTES;
                    w3_convert_a(T, st + W4_A, st + W4_SC, ss + 1, nxt);
                }
            }
        }
        w2_drain(acc, fa, fb);
        if (lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
        if (OUT_F32)
            w2_epilogue<1>(acc, out, arow0, mrows, n0, N, ar0, sbase);  // direct float2 stores, no shared memory
        else
            w5_epilogue_bf16(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, ar0);
    }
}

// Same parameters as the wgmma4 kernels (B = the prepared bf16 weight [G, N, Kp], reached only through tmB).
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg5_2d3d_bf16(W3_ARGS) {
    w5_2d3d<0>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg5_2d3d_f32(W3_ARGS) {
    w5_2d3d<1>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
