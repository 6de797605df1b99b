#pragma once

// Hopper pieces of the warp-specialized persistent GEMM kernels (kernels/experts/sm90/grouped_gemm.cu: fprop / dgrad;
// kernels/experts/sm90/grouped_gemm_wgrad.cu: wgrad): TMA tensor maps and bulk copies, mbarriers and the full/empty stage ring,
// wgmma (descriptors, fences, the m64n256k16 instruction), register reallocation, named barriers, and the
// epilogues that both kernels share. Design: docs/design-kernels.md, "Grouped GEMMs".
//
// Both kernels run 384 threads (WS_THREADS): warpgroups 0 and 1 are the consumers (64 x 256 fp32 accumulators each,
// 128 per thread), warp 8 the producer that issues the TMA loads into the ring; warps 9-11 leave at once.

#include "gemm_common.cuh"

#define WS_THREADS 384
#define WS_CONSUMER_WARPS 8

// A CUtensorMap (128 opaque bytes, 64-byte aligned), encoded on the host by cuTensorMapEncodeTiled
// (moe_ep/experts/sm90/gemm.py _tma_map_2d) and passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};

// Kernel parameters of the TMA kernels: GM_ARGS, then the tensor maps of A and B.
#define GM_TMA_ARGS GM_ARGS, const __grid_constant__ TmaMap tmA, const __grid_constant__ TmaMap tmB

// ---------------------------------------------------------------------------------------------------------
// mbarriers, TMA and bulk copies
// ---------------------------------------------------------------------------------------------------------

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

// The box of the tensor map at coordinates (c0 = column, c1 = row) into shared memory at dst; completes on bar.
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

// The full/empty mbarrier pairs of an S-stage ring (full: the producer's arrival + TMA bytes; empty: one arrival
// per consumer warp), then the kernel's only block-wide barrier: they exist before anyone uses them.
__device__ __forceinline__ void ring_init(unsigned full0, unsigned empty0, int stages) {
    if (threadIdx.x == 0) {
        for (int j = 0; j < stages; ++j) {
            mbar_init(full0 + 8u * j, 1u);
            mbar_init(empty0 + 8u * j, WS_CONSUMER_WARPS);
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

// ---------------------------------------------------------------------------------------------------------
// register reallocation and named barriers
// ---------------------------------------------------------------------------------------------------------

// The kernels are compiled for 384 threads (168 registers each, which would spill the accumulators), so the
// producer warpgroup gives registers back (setmaxnreg_dec<56>) and the consumers take them (setmaxnreg_inc<224>):
// 128 x 56 + 256 x 224 = 64512 = 384 x 168, all the CTA holds (a larger inc waits forever for registers nobody
// frees).
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

// Barrier ids: 0 is __syncthreads, 1-2 the fprop kernel's MMA turns, 3 + wg the epilogue of consumer warpgroup wg.
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// ---------------------------------------------------------------------------------------------------------
// wgmma
// ---------------------------------------------------------------------------------------------------------

// wgmma shared-memory matrix descriptor, K-major operand in the 128-byte swizzle layout:
// bits 0-13 start address >> 4, bits 16-29 leading byte offset >> 4 (unused for swizzled K-major: 1),
// bits 32-45 stride byte offset >> 4 (1024 B between 8-row groups), bits 49-51 base offset (0: 1024-aligned
// tiles), bits 62-63 layout type (1 = 128-byte swizzle). + 2 in the start field = + 32 bytes = the next k16 slice.
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

// Keeps the compiler from moving accesses of registers r[0 .. N) (an A fragment buffer read by an MMA in flight)
// across this point.
template <int N>
__device__ __forceinline__ void wg_fence_regs(unsigned* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Accumulator operands of the wgmma inline asm, written once: the register list "%0, .., %127" and its "+f"(d[i])
// constraints for the 128 (m64n256) fp32 accumulators per thread; the instruction's other operands (descriptors,
// A fragments) follow as %128 onward.
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

// d[128] += A(64 x 16) x B(256 x 16)^T from shared memory, both bf16 and MN-major ("transposed": the 64 / 256
// output-dimension values of one k are contiguous), 128-byte swizzle; fp32 accumulation.
__device__ __forceinline__ void wgmma_m64n256k16_ss_mn(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_ACC128_STR "}, %128, %129, p, 1, 1, 1, 1;\n}\n"
                 : WG_ACC128(d)
                 : "l"(da), "l"(db));
}

// ---------------------------------------------------------------------------------------------------------
// epilogues of one consumer warpgroup's 64 x 256 accumulator tile
// ---------------------------------------------------------------------------------------------------------
// Accumulator register 4 j + 2 h + e of thread tid is tile row ar0 + 8 h (ar0 = 64 wg + 16 q + lane / 4; q: warp
// of the warpgroup), column 8 j + 2 (tid % 4) + e (the wgmma m64n256 D layout). The output is [rows, N] row-major
// from row arow0, column n0.

// fp32 output from registers: float2 stores; rows >= mrows and columns >= N - n0 are not written.
__device__ __forceinline__ void epilogue_f32(float* acc, void* __restrict__ out, long long arow0, int mrows, int n0,
                                             int N, int ar0) {
    const int tid = threadIdx.x, c = tid & 3;
    const int ncols = N - n0;
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
}

// The bf16 outputs of row half h, column group m of the 64 x 256 accumulator fragment: accumulator 4 j + 2 h + e
// of this thread is row 16 q + lane / 4 + 8 h, column 8 j + 2 c + e (c = lane % 4). For the 4 j's = 4 m + i the
// quad holds a 4 x 4 matrix of bf16x2 words w[c][i]; after quad_transpose4 lane c holds the 4 words of j = 4 m + c:
// columns 32 m + 8 c .. + 7 of its row, in order (16 bytes). Every lane of the warp must call it.
__device__ __forceinline__ void bf16_words_quad(const float* acc, int h, int m, unsigned* w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int a = 4 * (4 * m + i) + 2 * h;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(acc[a + 1]), "f"(acc[a]));
    }
    quad_transpose4(w);
}

// bf16 output from registers: per (h, m) one 16-byte store of bf16_words_quad (a warp writes 8 rows x 64
// contiguous bytes); rows >= mrows and columns >= N - n0 are not stored (N % 8 == 0).
__device__ __forceinline__ void epilogue_bf16(const float* acc, unsigned short* __restrict__ out, long long arow0,
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
            bf16_words_quad(acc, h, m, w);
            const int col = 32 * m + 8 * c;
            if (r < mrows && col < ncols) *reinterpret_cast<uint4*>(rowp + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// One round of a TMA-store epilogue. Begin: the leader waits until the previous stores (the previous round, or the
// previous tile) have read the region, then the warpgroup meets (named barrier 3 + wg). End: the region's writes are
// made visible to the TMA unit, the warpgroup meets, and the leader stores boxes b = 0 .. n - 1 (64 rows from row,
// columns col0 + width b, those that start before ncols; columns past the tensor map's width are clipped by it; box b
// at region + 8192 b) as one bulk group.
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
// TMA box; the region holds 4 / ROUNDS of them (fprop / dgrad: 32 KiB, one round; wgrad: 16 KiB, two), and each
// round is written after the previous round's stores have read it (epi_round_begin / epi_round_end).
template <int ROUNDS>
__device__ __forceinline__ void epilogue_bf16_tma(const float* acc, unsigned region, int wg, long long arow0, int n0,
                                                  int N, const TmaMap* tmO) {
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
