// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma6" (MOE_EP_GEMM_IMPL=wgmma6): fprop / dgrad (2d x 3d) with
// the prepared bf16 weight (as wgmma4/5), the A conversion moved off the MMA warps.
//
//   * why: in wgmma5 the consumer warpgroups dequantize their own A fragments between MMA issues; a build without
//     that conversion (prof_gemm.py --kernel wgmma5, no_cvt) runs 10-15 % faster. Here the 3 idle warps of the
//     producer warpgroup (warps 9-11) convert each stage's raw A tile (128 x 64 e4m3 + its scale tile) into a bf16
//     tile in shared memory (128-byte swizzle, the permuted k order of the prepared weight), and the consumers run
//     wgmma.m64n256k16 with both operands from shared memory: they only wait, issue MMAs and store.
//   * ring: 4 stages of [B bf16 256 x 128 B | A bf16 128 x 128 B | A raw 128 x 64 B] + a 512-byte scale tile per
//     stage; three mbarriers per stage: full (TMA bytes), converted (count 3: lane 0 of each converter warp,
//     after its stores and a proxy fence), empty (count 8: the consumer warps, once the MMAs reading the stage have
//     retired). The producer refills a stage only after empty, so the converters never overwrite an A tile still
//     read by MMAs, and have read the raw tile before the consumers (hence the producer) can release it.
//   * converter thread ct (0..95) takes chunks i = ct, ct + 96, ... of the 512 16-byte chunks (row i / 4, chunk
//     c = i % 4: one 32-block, one scale byte): cvt16 gives words q = physical columns 16 c + 2 q, + 1, whose
//     permuted place is byte 16 q + 4 c of the row, i.e. 16-byte unit q ^ (row % 8) in the swizzled layout
//     (4-byte stores; a warp's 8 rows x 4 chunks hit 32 different banks).
//   * persistent schedule, group scans, zero fill and the register epilogue as wgmma5 (no shared output tile:
//     the A tiles take its place).
// Shared memory (all dynamic): 4 x 57344 + 4 x 512 + 3 x 4 x 8 + 12 x 48 = 232096 B.

#define WG5_NO_KERNELS
#include "grouped_gemm_wg5.cu"

#define W6_STAGES 4
#define W6_ABF 32768          // bf16 A tile (128 rows x 128 B, SW128)
#define W6_ARAW 49152         // raw A tile (128 rows x 64 B)
#define W6_STAGE_BYTES 57344  // B bf16 256 x 128 B at 0 | A bf16 | A raw
#define W6_SC (W6_STAGES * W6_STAGE_BYTES)  // 229376: scale tiles, 512 B per stage
#define W6_BAR (W6_SC + 512 * W6_STAGES)    // full[S], converted[S], empty[S]
#define W6_GI (W6_BAR + 24 * W6_STAGES)     // one GroupInfo per warp (12)
#define W6_SMEM_BYTES (W6_GI + 12 * 48)     // 232096
#define W6_PER 6                            // chunks per converter thread: ceil(512 / 96)

// d[128] += A(64 x 16, smem desc da) x B(256 x 16, smem desc db)^T, both bf16 K-major with the 128-byte swizzle.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
        "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
        "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
        "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, "
        "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "
        "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
          "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
          "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
          "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
          "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),
          "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
          "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]),
          "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]),
          "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]),
          "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
          "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
          "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db));
}

// Converter warps 9-11: for every k-step of every tile of this CTA, dequantize the stage's raw A tile into its
// bf16 tile and signal it.
__device__ __forceinline__ void w6_convert(GroupInfo* gi, const int* __restrict__ sizes, int G, long long M, int N,
                                           int K, unsigned sbase, unsigned full0, unsigned conv0) {
    const int ct = (int)threadIdx.x - 288, lane = threadIdx.x & 31;
    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    const int total = ((int)((M + W2_BM - 1) / W2_BM) + G) * n_tiles;
    const int ksteps = (K + 63) / 64;
    int stage = 0;
    unsigned phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int n0, mrows;
        long long arow0, r_zero;
        if (w5_tile(gi, sizes, G, M, N, t, n0, mrows, arow0, r_zero) != 1) continue;
        for (int s = 0; s < ksteps; ++s) {
            mbar_wait(full0 + 8u * (unsigned)stage, phase);
            const unsigned st = sbase + (unsigned)stage * W6_STAGE_BYTES;
            const unsigned sc = sbase + W6_SC + 512u * (unsigned)stage;
            // all loads first (6 independent chains per thread): one warp per SMSP would otherwise wait out
            // the shared-memory latency of every chunk in turn
            uint4 raw[W6_PER];
            unsigned scl[W6_PER];
#pragma unroll
            for (int j = 0; j < W6_PER; ++j) {
                const int i = ct + 96 * j, r = i >> 2, c = i & 3, k = s * 64 + 16 * c;
                if (i < 512) {
                    raw[j] = lds128(st + W6_ARAW + (unsigned)(r * 64 + 16 * c));
                    // past K the data is TMA zero fill and the scale byte may be anything: take 127 (x 1)
                    scl[j] = k < K ? lds8(sc + (unsigned)((r & 31) * 16 + (r >> 5) * 4 + ((k >> 5) & 3))) : 127u;
                }
            }
#pragma unroll
            for (int j = 0; j < W6_PER; ++j) {
                const int i = ct + 96 * j, r = i >> 2, c = i & 3;
                if (i < 512) {
                    unsigned o[8];
                    cvt16(raw[j], scl[j], o);
                    const unsigned row = st + W6_ABF + (unsigned)r * 128u + 4u * (unsigned)c;
                    const unsigned sw = (unsigned)(r & 7);
#pragma unroll
                    for (int q = 0; q < 8; ++q) sts32(row + (((unsigned)q ^ sw) << 4), o[q]);
                }
            }
            fence_proxy_async();  // this thread's generic stores -> visible to the MMAs (async proxy)
            __syncwarp();
            if (lane == 0) mbar_arrive(conv0 + 8u * (unsigned)stage);
            if (++stage == W6_STAGES) {
                stage = 0;
                phase ^= 1u;
            }
        }
    }
}

template <int OUT_F32>
__device__ __forceinline__ void w6_2d3d(const unsigned char* __restrict__ As, const int* __restrict__ sizes,
                                        void* __restrict__ out, int G, long long M, int N, int K, int zero_rest,
                                        const TmaMap* tmA, const TmaMap* tmB) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned sbase = smem_u32(smem);
    if (sbase & 1023u) __trap();  // the 128-byte swizzle needs 1024-aligned tiles (no static shared memory)
    const unsigned full0 = sbase + W6_BAR, conv0 = full0 + 8u * W6_STAGES, empty0 = conv0 + 8u * W6_STAGES;
    if (tid == 0) {
        for (int j = 0; j < W6_STAGES; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(conv0 + 8u * j, 3u);
            mbar_init(empty0 + 8u * j, W5_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();  // the only block-wide barrier
    GroupInfo* gi = reinterpret_cast<GroupInfo*>(smem + W6_GI) + warp;
    if (warp >= W5_CONSUMER_WARPS) {
        setmaxnreg_dec<96>();
        if (warp == W5_CONSUMER_WARPS)
            w5_produce(gi, As, sizes, G, M, N, K, tmA, tmB, sbase, full0, empty0, W6_STAGES, W6_STAGE_BYTES,
                       W6_ARAW, W6_SC);
        else
            w6_convert(gi, sizes, G, M, N, K, sbase, full0, conv0);
        return;
    }
    setmaxnreg_inc<200>();  // 256 x 200 + 128 x 96 = 63488 <= 384 x 168 (the CTA's registers; more would hang)

    const int wg = tid >> 7, q = warp & 3;
    const int ar0 = wg * 64 + q * 16 + (lane >> 2);
    const int n_tiles = (N + W2_BN - 1) / W2_BN;
    const int total = ((int)((M + W2_BM - 1) / W2_BM) + G) * n_tiles;
    const int ksteps = (K + 63) / 64;
    int stage = 0;
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
        int prev = 0;
        for (int s = 0; s < ksteps; ++s) {
            mbar_wait(conv0 + 8u * (unsigned)stage, phase);
            const unsigned st = sbase + (unsigned)stage * W6_STAGE_BYTES;
            const unsigned long long da = wg_desc(st + W6_ABF + 8192u * (unsigned)wg), db = wg_desc(st);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss(acc, da + 2 * kk, db + 2 * kk);
            wg_commit();
            wg_wait<1>();  // M(s - 1) retired: its stage is free
            if (s >= 1 && lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
            prev = stage;
            if (++stage == W6_STAGES) {
                stage = 0;
                phase ^= 1u;
            }
        }
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
        if (lane == 0) mbar_arrive(empty0 + 8u * (unsigned)prev);
        if (OUT_F32)
            w2_epilogue<1>(acc, out, arow0, mrows, n0, N, ar0, sbase);
        else
            w5_epilogue_bf16(acc, static_cast<unsigned short*>(out), arow0, mrows, n0, N, ar0);
    }
}

// Same parameters as the wgmma4 kernels (B = the prepared bf16 weight [G, N, Kp], reached only through tmB).
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg6_2d3d_bf16(W3_ARGS) {
    w6_2d3d<0>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
extern "C" __global__ void __launch_bounds__(W5_THREADS, 1) mx_gmm_wg6_2d3d_f32(W3_ARGS) {
    w6_2d3d<1>(As, sizes, out, G, M, N, K, zero_rest, &tmA, &tmB);
}
