// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma3" (MOE_EP_GEMM_IMPL=wgmma3): fprop / dgrad (2d x 3d).
// The wgmma2 kernel (grouped_gemm_wg2.cu: 128 x 256 tiles, k permutation, A dequantized into wgmma register
// fragments, B into a 3-stage bf16 ring, the same epilogue) with its operands brought in by TMA instead of
// per-thread global loads:
//
//   * why: wgmma2 loads each k-step's raw bytes into registers one step ahead. When the MMAs are not the
//     bottleneck, the wait for the previous step's MMAs returns at once, so the loads have almost no time to
//     land and every step pays the global-memory latency (measured: wgmma2 = wgmma = 0.42-0.49x bf16).
//   * raw ring: 4 stages of [A 128 rows x 64 B | B 256 rows x 64 B | scales: A's 128x4 tile, B's two 128x4
//     tiles] = 26112 B each, filled by thread 0 with cp.async.bulk.tensor (A, B; tensor maps passed as
//     __grid_constant__ parameters, boxes of 64 x 128 and 64 x 256 bytes, no swizzle, out-of-range rows and k
//     zero-filled) and cp.async.bulk (the 512-byte scale tiles), completing on one mbarrier per stage. The
//     scale tile of 4 k-blocks serves 2 k-steps; it is simply loaded with each.
//   * step s waits on stage s % 4's mbarrier (phase (s / 4) & 1) before converting it; once the barrier that
//     ends step s - 1 shows every thread has converted step s, thread 0 refills that stage with step s + 4.
//     So 3 steps of loads are in flight while a step is converted and multiplied.
//   * consumers read their raw bytes from shared memory (A: rows ar0, ar0 + 8, 16 bytes at 16 c; B: rows
//     tid / 4 + 64 i, 16 bytes at 16 c: a warp reads 512 contiguous bytes, conflict-free) and convert exactly as
//     wgmma2. Data of k >= K is zero (TMA fill); its scale is taken as 127 so padding scale bytes never matter.
// Shared memory: bf16 B ring 3 x 32 KiB | raw ring 4 x 26112 B | 1 KiB alignment = 203776 B, 1 CTA/SM.

#define WG2_NO_KERNELS
#include "grouped_gemm_wg2.cu"

#define W3_RAW_STAGES 4
#define W3_RAW_A 0
#define W3_RAW_B 8192
#define W3_RAW_SC 24576                                      // A scale tile, B scale tiles (rows 0-127, 128-255)
#define W3_RAW_BYTES 26112                                   // 8192 + 16384 + 3 * 512
#define W3_RING_BYTES (W2_STAGES * W2_TILE_BYTES)            // 98304
#define W3_SMEM_BYTES (W3_RING_BYTES + W3_RAW_STAGES * W3_RAW_BYTES + 1024)  // 203776

// A CUtensorMap (128 opaque bytes, 64-byte aligned), encoded on the host by cuTensorMapEncodeTiled.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};

// Optional phase profile (compile with -DW3_PROF, e.g. MOE_EP_NVRTC_OPTIONS=-DW3_PROF; benchmarks/prof_gemm.py):
// threads 0 and 128 add up the clock64 cycles of each phase of every k-step and store them per CTA (first
// W3_PROF_CTAS CTAs) in w3_prof[(cta * 2 + warpgroup) * 8 + phase]; phase 7 is the whole CTA.
#ifdef W3_PROF
#define W3_PROF_CTAS 8192
__device__ unsigned long long w3_prof[W3_PROF_CTAS * 16];
#define W3_STAMP(i)                                    \
    do {                                               \
        const long long now_ = clock64();              \
        prof[i] += (unsigned long long)(now_ - last_); \
        last_ = now_;                                  \
    } while (0)
#else
#define W3_STAMP(i) \
    do {            \
    } while (0)
#endif

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// 1 once phase `parity` of the mbarrier has completed (one try_wait; it may suspend the thread for a while).
__device__ __forceinline__ unsigned mbar_try(unsigned bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return done;
}
// Waits for phase `parity` of the mbarrier; traps (an error, not a hang) if it does not complete in ~2^28 polls.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    for (unsigned polls = 0; !mbar_try(bar, parity);)
        if (++polls > (1u << 28)) __trap();
}
__device__ __forceinline__ void tma_2d(unsigned dst, const TmaMap* map, int c0, int c1, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Thread 0: issue the loads of k-step s into raw stage s % 4. The B scale tile of rows 128-255 exists only when
// the column tile has them (n0 + 128 < N); otherwise it is not loaded, and the stale scale bytes those rows then
// read only reach output columns >= N, which are never stored (likewise A rows past the group: rows not stored).
__device__ __forceinline__ void w3_issue(int s, unsigned raw0, unsigned bar0, const TmaMap* tmA, const TmaMap* tmB,
                                         int arow0, int brow0, const unsigned char* a_sc, const unsigned char* b_sc,
                                         int tpr, bool b_hi) {
    const int j = s & (W3_RAW_STAGES - 1);
    const unsigned raw = raw0 + (unsigned)j * W3_RAW_BYTES, bar = bar0 + 8u * (unsigned)j;
    mbar_expect_tx(bar, 8192u + 16384u + (b_hi ? 1536u : 1024u));
    tma_2d(raw + W3_RAW_A, tmA, s * 64, arow0, bar);
    tma_2d(raw + W3_RAW_B, tmB, s * 64, brow0, bar);
    const long long t = s >> 1;  // the 128x4 scale tile of k-blocks 2 s, 2 s + 1
    bulk_copy(raw + W3_RAW_SC, a_sc + t * 512, 512u, bar);
    bulk_copy(raw + W3_RAW_SC + 512u, b_sc + t * 512, 512u, bar);
    if (b_hi) bulk_copy(raw + W3_RAW_SC + 1024u, b_sc + (long long)tpr * 512 + t * 512, 512u, bar);
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

// Per-thread constant offsets into a raw stage (see the header) and the step's k validity.
struct W3Thread {
    unsigned a0, a1, sa;  // A rows ar0, ar0 + 8 (bytes 16 c); A scale byte (ar0, block 0) in the scale tile
    unsigned b, sb[4];    // B row rb (bytes 16 c; row rb + 64 i at + 4096 i); B scale byte (row i, block 0)
    int c16, K;
};

// Timing experiment only (-DW3_NO_CVT, wrong results): the 16 raw bytes and the scale byte passed on as 8 words
// without the conversion, so that the loads stay live.
__device__ __forceinline__ void no_cvt16(uint4 r, unsigned s, unsigned* o) {
    o[0] = r.x ^ s, o[1] = r.y, o[2] = r.z, o[3] = r.w, o[4] = r.x, o[5] = r.y, o[6] = r.z, o[7] = r.w;
}
// Convert step s from raw stage `raw`: B into the bf16 stage at bst (as w2_store_b), A into fragments f.
__device__ __forceinline__ void w3_convert_b(const W3Thread& T, unsigned raw, int s, unsigned bst, unsigned sw) {
    const int k = s * 64 + T.c16;
    const bool kv = k < T.K;
    const unsigned blk = (unsigned)(k >> 5) & 3u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 r = lds128(raw + W3_RAW_B + T.b + 4096u * i);
        const unsigned sc = kv ? lds8(raw + W3_RAW_SC + T.sb[i] + blk) : 127u;
        unsigned o[8];
#ifdef W3_NO_CVT  // timing experiment only (wrong results): the MMA / load / sync skeleton without the conversion
        no_cvt16(r, sc, o);
#else
        cvt16(r, sc, o);
#endif
#pragma unroll
        for (int j = 0; j < 8; ++j) sts32(bst + (unsigned)i * 8192u + ((((unsigned)j) ^ sw) << 4), o[j]);
    }
}
// a_raw: the stage's raw A tile (128 rows x 64 B), a_sc: its A scale tile (512 B).
__device__ __forceinline__ void w3_convert_a(const W3Thread& T, unsigned a_raw, unsigned a_sc, int s, unsigned* f) {
    const int k = s * 64 + T.c16;
    const bool kv = k < T.K;
    const unsigned blk = (unsigned)(k >> 5) & 3u;
    const uint4 r0 = lds128(a_raw + T.a0), r1 = lds128(a_raw + T.a1);
    const unsigned s0 = kv ? lds8(a_sc + T.sa + blk) : 127u;
    const unsigned s1 = kv ? lds8(a_sc + T.sa + 128u + blk) : 127u;
    unsigned o0[8], o1[8];
#ifdef W3_NO_CVT
    no_cvt16(r0, s0, o0);
    no_cvt16(r1, s1, o1);
#else
    cvt16(r0, s0, o0);
    cvt16(r1, s1, o1);
#endif
    a_frags(o0, o1, f);
}

struct W3Issue {  // what thread 0 needs to refill a stage
    const TmaMap *tmA, *tmB;
    const unsigned char *a_sc, *b_sc;
    int arow0, brow0, tpr;
    bool b_hi;
};

__device__ __forceinline__ void w3_step(float* acc, unsigned* cur, unsigned* nxt, const W3Thread& T,
                                        const W3Issue& I, int s, int ksteps, int& stage, unsigned long long db0,
                                        unsigned bst, unsigned sw, unsigned raw0, unsigned bar0,
                                        unsigned long long* prof, long long& last_) {
    wg_fence();
    const unsigned long long soff = (unsigned long long)stage * (W2_TILE_BYTES >> 4);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs(acc, cur + 4 * kk, db0 + soff + 2 * kk);
    wg_commit();
    W3_STAMP(0);
    wg_wait<1>();
    wg_fence_regs<16>(nxt);
    W3_STAMP(1);
    const int nstage = stage == W2_STAGES - 1 ? 0 : stage + 1;
    if (s + 1 < ksteps) {
        const int j = (s + 1) & (W3_RAW_STAGES - 1);
        const unsigned raw = raw0 + (unsigned)j * W3_RAW_BYTES;
        mbar_wait(bar0 + 8u * (unsigned)j, (unsigned)((s + 1) / W3_RAW_STAGES) & 1u);
        W3_STAMP(2);
        w3_convert_b(T, raw, s + 1, bst + (unsigned)nstage * W2_TILE_BYTES, sw);
        W3_STAMP(3);
        w3_convert_a(T, raw + W3_RAW_A, raw + W3_RAW_SC, s + 1, nxt);
        W3_STAMP(4);
    }
    fence_proxy_async();
    W3_STAMP(5);
    __syncthreads();
    W3_STAMP(6);
    // every thread has converted step s + 1: its raw stage takes step s + 5
    if (threadIdx.x == 0 && s + 5 < ksteps)
        w3_issue(s + 5, raw0, bar0, I.tmA, I.tmB, I.arow0, I.brow0, I.a_sc, I.b_sc, I.tpr, I.b_hi);
    stage = nstage;
}

template <int OUT_F32>
__device__ __forceinline__ void w3_2d3d(const unsigned char* __restrict__ As, const unsigned char* __restrict__ Bs,
                                        const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                        int N, int K, int zero_rest, const TmaMap* tmA, const TmaMap* tmB) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ GroupInfo gi;
    __shared__ __align__(8) unsigned long long full[W3_RAW_STAGES];
    unsigned long long prof[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long long last_ = clock64();
    const long long t_start = last_;
    int n0, mrows;
    long long arow0;
    if (!w2_tile<OUT_F32>(gi, sizes, out, G, M, N, zero_rest, n0, mrows, arow0)) return;
    const int g = gi.g;
    const int tpr = ((K >> 5) + 3) >> 2;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, q = (tid >> 5) & 3, c = tid & 3, rb = tid >> 2;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);

    W3Thread T;
    T.c16 = c * 16;
    T.K = K;
    T.a0 = (unsigned)ar0 * 64u + 16u * c;
    T.a1 = T.a0 + 512u;
    T.sa = (unsigned)((ar0 & 31) * 16 + (ar0 >> 5) * 4);
    T.b = (unsigned)rb * 64u + 16u * c;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = rb + 64 * i;  // tile row; its scale tile (r >> 7) is the 1st or 2nd B tile of the stage
        T.sb[i] = 512u + (unsigned)((r >> 7) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4);
    }

    W3Issue I;
    I.tmA = tmA;
    I.tmB = tmB;
    I.arow0 = (int)arow0;
    I.brow0 = g * N + n0;
    I.tpr = tpr;
    I.a_sc = As + (long long)(gi.toff + gi.tile) * tpr * 512;
    I.b_sc = Bs + ((long long)g * ((N + 127) >> 7) + (n0 >> 7)) * tpr * 512;
    I.b_hi = n0 + 128 < N;

    const unsigned sbase = (smem_u32(smem) + 1023u) & ~1023u;
    const unsigned raw0 = sbase + W3_RING_BYTES, bar0 = smem_u32(full);
    const int ksteps = (K + 63) / 64;
    if (tid == 0) {
        for (int j = 0; j < W3_RAW_STAGES; ++j) mbar_init(bar0 + 8u * j, 1u);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < W3_RAW_STAGES && s < ksteps; ++s)
            w3_issue(s, raw0, bar0, tmA, tmB, I.arow0, I.brow0, I.a_sc, I.b_sc, tpr, I.b_hi);
    }
    __syncthreads();  // the barriers are initialized before anyone waits on them

    const unsigned bst = sbase + (unsigned)rb * 128u + 4u * (unsigned)c, sw = (unsigned)(rb & 7);
    const unsigned long long db0 = wg_desc(sbase);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    unsigned fa[16], fb[16];

    mbar_wait(bar0, 0u);
    w3_convert_b(T, raw0, 0, bst, sw);
    w3_convert_a(T, raw0 + W3_RAW_A, raw0 + W3_RAW_SC, 0, fa);
    fence_proxy_async();
    __syncthreads();
    if (tid == 0 && W3_RAW_STAGES < ksteps)
        w3_issue(W3_RAW_STAGES, raw0, bar0, tmA, tmB, I.arow0, I.brow0, I.a_sc, I.b_sc, tpr, I.b_hi);
    int stage = 0;
    for (int s = 0; s < ksteps; s += 2) {
        w3_step(acc, fa, fb, T, I, s, ksteps, stage, db0, bst, sw, raw0, bar0, prof, last_);
        if (s + 1 < ksteps) w3_step(acc, fb, fa, T, I, s + 1, ksteps, stage, db0, bst, sw, raw0, bar0, prof, last_);
    }
    w2_drain(acc, fa, fb);
    w2_epilogue<OUT_F32>(acc, out, arow0, mrows, n0, N, ar0, sbase);
#ifdef W3_PROF
    if ((tid & 127) == 0 && blockIdx.x < W3_PROF_CTAS) {
        prof[7] = (unsigned long long)(clock64() - t_start);
        for (int i = 0; i < 8; ++i) w3_prof[(blockIdx.x * 2 + wg) * 8 + i] = prof[i];
    }
#else
    (void)t_start;
    (void)prof;
#endif
}

// Kernel parameters of the TMA kernels: GM_ARGS, then the tensor maps of A and B.
#define W3_ARGS GM_ARGS, const __grid_constant__ TmaMap tmA, const __grid_constant__ TmaMap tmB

// kernels/grouped_gemm_wg4.cu includes this file for its helpers and defines WG3_NO_KERNELS first.
#ifndef WG3_NO_KERNELS
// A and B are reached only through the tensor maps (the pointers stay in the argument list for the launcher's
// shared checks and GM_ARGS order).
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg3_2d3d_bf16(W3_ARGS) {
    w3_2d3d<0>(As, Bs, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 1) mx_gmm_wg3_2d3d_f32(W3_ARGS) {
    w3_2d3d<1>(As, Bs, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
#endif  // WG3_NO_KERNELS
