// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma4" (MOE_EP_GEMM_IMPL=wgmma4): fprop / dgrad (2d x 3d) with
// the weight operand prepared once per weight version as exact bf16 (moe_ep.gemm_cuda.prepare_weight_bf16).
//
//   * why: the wgmma3 phase profile (benchmarks/NOTES.md) showed the B conversion (e4m3 -> bf16 + 4-byte
//     swizzled stores + proxy fence) taking ~55 % of every k-step. The weights change only at an optimizer
//     step, so their exact dequantization (e4m3 * 2^(s-127), exact in bf16) is done once per weight version,
//     stored with each 64-wide k block in the kernel's permuted k order (logical k = 16 s + 8 h + 2 c + e holds
//     physical column 16 c + 4 s + 2 h + e) and K padded to a multiple of 64 with zeros. The kernel TMA-loads it
//     with the 128-byte swizzle straight into the layout wgmma reads: no conversion, no shared stores, no proxy
//     fence for B. The products are the same exact MXFP8 products as the other kernels.
//   * A (the activations, MXFP8 row-wise with per-group blocked scales) is TMA-loaded raw and dequantized into
//     wgmma register fragments exactly as in wgmma3.
//   * ring: 4 stages of [B bf16 256 rows x 128 B (SW128) | A raw 128 x 64 B | A scale tile 512 B], one mbarrier
//     each. Stage s % 4 is read by the MMAs of step s (both warpgroups); they retire at the wait_group 1 of
//     step s + 1, so after the barrier ending step s + 1 thread 0 refills stage (s + 4) % 4 = s % 4 with step
//     s + 4 (A raw of step s + 1 was converted in step s, before that barrier).
// Shared memory: 4 x 41984 B + 1 KiB alignment = 168960 B; the bf16 epilogue tile (67584 B) reuses stage 0-1.

#define WG3_NO_KERNELS
#include "grouped_gemm_wg3.cu"

#define W4_STAGES 4
#define W4_B 0         // bf16 B tile, 1024-aligned (SW128)
#define W4_A 32768     // raw A tile
#define W4_SC 40960    // A scale tile (512 B)
#define W4_STAGE_BYTES 41984
#define W4_SMEM_BYTES (W4_STAGES * W4_STAGE_BYTES + 1024)  // 168960

__device__ __forceinline__ void w4_issue(int s, unsigned st0, unsigned bar0, const TmaMap* tmA, const TmaMap* tmB,
                                         int arow0, int brow0, const unsigned char* a_sc) {
    const int j = s & (W4_STAGES - 1);
    const unsigned st = st0 + (unsigned)j * W4_STAGE_BYTES, bar = bar0 + 8u * (unsigned)j;
    mbar_expect_tx(bar, 32768u + 8192u + 512u);
    tma_2d(st + W4_B, tmB, s * 64, brow0, bar);  // 64 bf16 of k = 128 bytes per row
    tma_2d(st + W4_A, tmA, s * 64, arow0, bar);
    bulk_copy(st + W4_SC, a_sc + (long long)(s >> 1) * 512, 512u, bar);
}

template <int OUT_F32>
__device__ __forceinline__ void w4_2d3d(const unsigned char* __restrict__ As, const int* __restrict__ sizes,
                                        void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                        const TmaMap* tmA, const TmaMap* tmB) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ GroupInfo gi;
    __shared__ __align__(8) unsigned long long full[W4_STAGES];
    int n0, mrows;
    long long arow0;
    if (!w2_tile<OUT_F32>(gi, sizes, out, G, M, N, zero_rest, n0, mrows, arow0)) return;
    const int g = gi.g;
    const int tpr = ((K >> 5) + 3) >> 2;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, q = (tid >> 5) & 3, c = tid & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);

    W3Thread T;  // only the A fields (w3_convert_a with the raw A tile at W4_A and the scale tile at W4_SC)
    T.c16 = c * 16;
    T.K = K;
    T.a0 = (unsigned)ar0 * 64u + 16u * c;
    T.a1 = T.a0 + 512u;
    T.sa = (unsigned)((ar0 & 31) * 16 + (ar0 >> 5) * 4);  // (not pinned as wgmma5's W5A: measured slower here once)
    const unsigned char* a_sc = As + (long long)(gi.toff + gi.tile) * tpr * 512;
    const int brow0 = g * N + n0;

    const unsigned sbase = (smem_u32(smem) + 1023u) & ~1023u, bar0 = smem_u32(full);
    const int ksteps = (K + 63) / 64;
    if (tid == 0) {
        for (int j = 0; j < W4_STAGES; ++j) mbar_init(bar0 + 8u * j, 1u);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < W4_STAGES && s < ksteps; ++s) w4_issue(s, sbase, bar0, tmA, tmB, (int)arow0, brow0, a_sc);
    }
    __syncthreads();

    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    unsigned fa[16], fb[16];
    mbar_wait(bar0, 0u);
    w3_convert_a(T, sbase + W4_A, sbase + W4_SC, 0, fa);
    int stage = 0;
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
            wg_wait<1>();  // step ss - 1 retired: its A registers (nxt) and, after the barrier below, its stage
            wg_fence_regs<16>(nxt);
            const int nstage = (stage + 1) & (W4_STAGES - 1);
            if (ss + 1 < ksteps) {
                mbar_wait(bar0 + 8u * (unsigned)nstage, (unsigned)((ss + 1) / W4_STAGES) & 1u);
                const unsigned st = sbase + (unsigned)nstage * W4_STAGE_BYTES;
                w3_convert_a(T, st + W4_A, st + W4_SC, ss + 1, nxt);
            }
            __syncthreads();
            // both warpgroups retired step ss - 1: its stage (ss + 3) % 4 takes step ss + 3
            if (tid == 0 && ss >= 1 && ss + 3 < ksteps)
                w4_issue(ss + 3, sbase, bar0, tmA, tmB, (int)arow0, brow0, a_sc);
            stage = nstage;
        }
    }
    w2_drain(acc, fa, fb);
    w2_epilogue<OUT_F32>(acc, out, arow0, mrows, n0, N, ar0, sbase);
}

// kernels/grouped_gemm_wg5.cu includes this file for its helpers and defines WG4_NO_KERNELS first.
#ifndef WG4_NO_KERNELS
// B is the prepared bf16 weight [G, N, Kp] (Kp = K rounded up to 64), reached only through tmB; A through tmA.
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg4_2d3d_bf16(W3_ARGS) {
    w4_2d3d<0>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg4_2d3d_f32(W3_ARGS) {
    w4_2d3d<1>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
#endif  // WG4_NO_KERNELS
