// Grouped MXFP8 GEMMs for Hopper, implementation "wgmma" (MOE_EP_GEMM_IMPL=wgmma): fprop / dgrad (2d x 3d) only;
// wgrad stays on the "mma" kernels of grouped_gemm.cu. Same operand formats, tile schedule, group scan, masking and
// zero fill as mx_gmm_2d3d_* (the helpers are shared: grouped_gemm.cu is included with its kernels switched off).
//
// Design ("1.5": wgmma with the dequantization in the mainloop, no warp specialization):
//   * one CTA = 128 x 128 output tile, 256 threads = 2 warpgroups; warpgroup w owns tile rows 64 w .. 64 w + 63 and
//     issues wgmma.mma_async.m64n128k16 bf16 x bf16 -> fp32 (64 accumulator registers per thread);
//   * BK = 64: each k-step every thread loads 2 x 16 e4m3 bytes per operand (+ their scale bytes) into registers one
//     step ahead (exactly the loader of the mma kernel), converts them with the exact bit trick + bf16 multiply and
//     stores the bf16 values into a 3-stage ring of shared tiles in the K-major 128-byte-swizzle layout of wgmma:
//     tile row r (128 B = 64 bf16) at r * 128, its 16-byte chunk c (bf16 8c .. 8c + 7) at chunk c ^ (r % 8);
//     8-row groups 1024 B apart (descriptor SBO = 1024), tiles 1024-byte aligned;
//   * per k-step: wgmma.fence, 4 wgmma (k16 each: descriptor start + 32 B), commit; convert the next stage;
//     fence.proxy.async (the generic-proxy smem stores become visible to the wgmma async proxy; its MEMBAR waits
//     for loads in flight, so it precedes the next loads); issue the loads of the step after; wgmma.wait_group 1
//     (the previous step's MMAs are done); __syncthreads. So the MMAs of step s
//     run while step s + 1 is converted; stage (s + 1) % 3 is last read by step s - 2, finished by both
//     warpgroups before the barrier that ends step s - 1.
//   * epilogue: accumulator fragment of m64nNk16 (warp q of the warpgroup: rows 16 q + lane / 4 (+ 8), columns
//     8 j + 2 (lane % 4) (+ 1), register 4 j + 2 h + e) stored straight to global memory with row masking.
// Shared memory: 3 x 32 KiB + 1 KiB for the runtime alignment = 99 KiB dynamic, 2 CTAs/SM (<= 128 registers).

#define GM_NO_MMA_KERNELS
#include "grouped_gemm.cu"

#define WG_STAGES 3
#define WG_TILE_BYTES 16384                                  // 128 rows x 128 B (64 bf16 of K)
#define WG_STAGE_BYTES (2 * WG_TILE_BYTES)                   // A tile, then B tile
#define WG_SMEM_BYTES (WG_STAGES * WG_STAGE_BYTES + 1024)    // 99328 B (+1 KiB: 1024-byte alignment of the ring)

// wgmma shared-memory matrix descriptor, K-major operand in the 128-byte swizzle layout:
// bits 0-13 start address >> 4, bits 16-29 leading byte offset >> 4 (unused for swizzled K-major: 1),
// bits 32-45 stride byte offset >> 4 (1024 B between 8-row groups), bits 49-51 base offset (0: 1024-aligned
// tiles), bits 62-63 layout type (1 = 128-byte swizzle).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving accesses of an accumulator register across wgmma issue / wait points.
__device__ __forceinline__ void wg_fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator operands of the wgmma inline asm, written once: the register list "%0, .., %N-1" and its "+f"(d[i])
// constraints for the 64 (m64n128) and 128 (m64n256) fp32 accumulators per thread; the instruction's other operands
// (descriptors, A fragments, predicates) follow as %64 / %128 onward.
#define WG_ACC64_STR \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC128_STR WG_ACC64_STR ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, " \
    "%85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, " \
    "%105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, " \
    "%122, %123, %124, %125, %126, %127"
#define WG_ACC64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
    "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
    "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
    "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_ACC128(d) \
    WG_ACC64(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), \
    "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), \
    "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), \
    "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d[64] += A(64 x 16, smem desc da) x B(128 x 16, smem desc db)^T, both K-major bf16, fp32 accumulation.
__device__ __forceinline__ void wgmma_m64n128k16(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_STR "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db));
}

template <int OUT_F32>
__device__ __forceinline__ void wg_2d3d(const unsigned char* __restrict__ A, const unsigned char* __restrict__ As,
                                        const unsigned char* __restrict__ B, const unsigned char* __restrict__ Bs,
                                        const int* __restrict__ sizes, void* __restrict__ out, int G, long long M,
                                        int N, int K, int zero_rest) {
    extern __shared__ __align__(16) unsigned char smem[];  // the ring is aligned at run time
    __shared__ GroupInfo gi;
    int mrows, n0;
    long long arow0;
    Gm2d3dLoad L;  // the same tile schedule, zero fill and loader as gmm_2d3d
    if (!gm_2d3d_tile<OUT_F32>(gi, A, As, B, Bs, sizes, out, G, M, N, K, zero_rest, mrows, arow0, n0, L)) return;
    const int tid = threadIdx.x, crow = L.crow, ck = L.ck;
    const unsigned sbase = (smem_u32(smem) + 1023u) & ~1023u;
    // swizzled byte offsets of this thread's logical chunks c = ck / 8 and c + 1 in tile row crow (row crow + 64:
    // + 8192, same swizzle since 64 % 8 == 0)
    const unsigned c0 = (unsigned)(ck >> 3), sw = (unsigned)(crow & 7);
    const unsigned so0 = (unsigned)crow * 128u + ((c0 ^ sw) << 4), so1 = (unsigned)crow * 128u + (((c0 + 1u) ^ sw) << 4);

    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;

    const int ksteps = (K + GM_BK - 1) / GM_BK;
    auto store = [&](int stage) {
        const unsigned base = sbase + (unsigned)stage * WG_STAGE_BYTES;
        cvt_store16_2(L.ra[0], L.sc & 0xFFu, base + so0, base + so1);
        cvt_store16_2(L.ra[1], (L.sc >> 8) & 0xFFu, base + 8192u + so0, base + 8192u + so1);
        cvt_store16_2(L.rb[0], (L.sc >> 16) & 0xFFu, base + WG_TILE_BYTES + so0, base + WG_TILE_BYTES + so1);
        cvt_store16_2(L.rb[1], L.sc >> 24, base + WG_TILE_BYTES + 8192u + so0, base + WG_TILE_BYTES + 8192u + so1);
    };
    // descriptors of stage 0, k16 slice 0: A rows 64 wg .. (8 KiB per warpgroup), B all 128 rows
    const int wg = tid >> 7;
    const unsigned long long da0 = wg_desc(sbase + (unsigned)wg * 8192u);
    const unsigned long long db0 = wg_desc(sbase + WG_TILE_BYTES);

    L.load(0);
    store(0);
    fence_proxy_async();
    if (ksteps > 1) L.load(1);
    __syncthreads();
    int stage = 0;
    for (int s = 0; s < ksteps; ++s) {
        wg_fence();
        const unsigned long long soff = (unsigned long long)(stage * (WG_STAGE_BYTES >> 4));
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // k16 slice kk: + 32 bytes (2 in descriptor units) inside the swizzle atom
            wgmma_m64n128k16(acc, da0 + soff + 2 * kk, db0 + soff + 2 * kk);
        wg_commit();
        const int nstage = stage == WG_STAGES - 1 ? 0 : stage + 1;
        if (s + 1 < ksteps) store(nstage);
        fence_proxy_async();  // MEMBAR.ALL.CTA inside: it waits for loads in flight, so before the next loads
        if (s + 2 < ksteps) L.load(s + 2);
        wg_wait<1>();
        __syncthreads();
        stage = nstage;
    }
    wg_wait<0>();
    wg_fence_acc(acc);

    // epilogue: rows 64 wg + 16 q + lane/4 + 8 h, columns 8 j + 2 (lane % 4) + e, register 4 j + 2 h + e
    const int lane = tid & 31, q = (tid >> 5) & 3;
    // tile origin re-read from shared memory / blockIdx (keeps it out of registers during the mainloop)
    const long long erow0 = gi.row0 + (long long)gi.tile * GM_BM;
    const int n_tiles = (N + GM_BN - 1) / GM_BN;
    const int en0 = (int)(blockIdx.x % n_tiles) * GM_BN, ncols = N - en0;
    const int erows = min(GM_BM, gi.rows - gi.tile * GM_BM);
    void* obase = OUT_F32 ? (void*)(static_cast<float*>(out) + erow0 * N + en0)
                          : (void*)(static_cast<unsigned short*>(out) + erow0 * N + en0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wg * 64 + q * 16 + (lane >> 2) + 8 * h;
        if (r >= erows) continue;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int c = j * 8 + (lane & 3) * 2;
            if (c >= ncols) continue;
            const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if (OUT_F32) {
                *reinterpret_cast<float2*>(static_cast<float*>(obase) + (long long)r * N + c) = make_float2(v0, v1);
            } else {
                unsigned pk;
                asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pk) : "f"(v1), "f"(v0));
                *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(obase) + (long long)r * N + c) = pk;
            }
        }
    }
}

// kernels/grouped_gemm_wg2.cu includes this file for its helpers and defines WG_NO_KERNELS first.
#ifndef WG_NO_KERNELS
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_wg_2d3d_bf16(GM_ARGS) {
    wg_2d3d<0>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
extern "C" __global__ void __launch_bounds__(GM_THREADS, 2) mx_gmm_wg_2d3d_f32(GM_ARGS) {
    wg_2d3d<1>(A, As, B, Bs, sizes, out, G, M, N, K, zero_rest);
}
#endif  // WG_NO_KERNELS
