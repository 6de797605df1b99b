// Tensor-core rate probe for the fp8 question of DESIGN 5.3 (not used by the library; benchmarks/prof_wgmma_rate.py).
// Operands sit in shared memory (their values do not matter for the rate); each CTA = 2 warpgroups, each issuing
// m64n128 MMAs over ITERS k32 steps against its own 64-row A tile and a shared 128-row B tile:
//   MODE 0  bf16: 2 x wgmma.m64n128k16 per k32 into one accumulator (what the bf16 kernels run)
//   MODE 1  fp8, exact MXFP8 promotion per 32: wgmma.m64n128k32.e4m3 into a fresh partial (2 buffers, the MMA of
//           step s overlaps the promotion of step s - 1), then acc += partial * 2^(ea[row] + eb[col]) per element
//           (the row and column scale exponents of the step read from shared memory, the power of two built with
//           an integer add and a shift: 3 instructions per element)
//   MODE 2  fp8 accumulating straight into one accumulator (no promotion): the fp8 upper bound
//   MODE 3  hybrid: warpgroup 0 runs MODE 1, warpgroup 1 runs MODE 0 (the "mix" of DESIGN 5.3)
// out receives the accumulators (so nothing is optimized away); cycles[blockIdx.x] the clock64 span of the loop.

#define WG2_NO_KERNELS
#include "grouped_gemm_wg2.cu"  // (includes grouped_gemm_wgmma.cu without its kernels)

__device__ __forceinline__ void mma_bf16_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_STR "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void mma_fp8_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_ACC64_STR "}, %64, %65, p, 1, 1;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(acc));
}

// iters k32 steps of bf16 m64n128 (2 x k16) into acc, one MMA group in flight behind the current one.
__device__ __forceinline__ void bf16_steps(float* acc, unsigned long long da, unsigned long long db, int iters) {
    for (int s = 0; s < iters; ++s) {
        wg_fence();
        mma_bf16_n128(acc, da + 4 * (s & 1), db + 4 * (s & 1), 1);
        mma_bf16_n128(acc, da + 4 * (s & 1) + 2, db + 4 * (s & 1) + 2, 1);
        wg_commit();
        wg_wait<1>();
    }
    wg_wait<0>();
}

// MODE 1 promotion of one partial: 64 values of rows r0, r0 + 8 (h = (i / 2) % 2), columns 8 j + 2 c + e (i = 4 j +
// 2 h + e); exponent bytes: ea[2] for the two rows, eb[32] for the thread's columns (j, e).
__device__ __forceinline__ void promote(float* acc, const float* part, const int* ea, const unsigned char* eb) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const int j = i >> 2, h = (i >> 1) & 1, e = i & 1;
        const float s = __int_as_float((ea[h] + (int)eb[2 * j + e]) << 23);
        acc[i] = fmaf(part[i], s, acc[i]);
    }
}

__device__ __forceinline__ void pin64(float* r) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// the 32 column exponents of lane c for step parity j (two 16-byte shared loads)
__device__ __forceinline__ void load_eb(const unsigned char* ebt, int c, int j, unsigned char* eb) {
    *reinterpret_cast<uint4*>(eb) = *reinterpret_cast<const uint4*>(ebt + 128 * j + 32 * c);
    *reinterpret_cast<uint4*>(eb + 16) = *reinterpret_cast<const uint4*>(ebt + 128 * j + 32 * c + 16);
}

template <int MODE>
__device__ __forceinline__ void rate_loop(float* out, long long* cycles, int iters) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned sbase = smem_u32(smem);
    const int tid = threadIdx.x, wg = tid >> 7, c = tid & 3;
    // A: 2 tiles of 64 rows x 128 B, B: 128 rows x 128 B (SW128 K-major); exponent tables after them
    const unsigned long long da = wg_desc(sbase + 8192u * (unsigned)wg), db = wg_desc(sbase + 16384u);
    unsigned char* ebt = smem + 32768;  // [2 steps][4 lanes c][32] column exponents
    for (int i = tid; i < 32768 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(smem)[i] = 0x3C3C3C3Cu ^ i;
    for (int i = tid; i < 256; i += blockDim.x) ebt[i] = (unsigned char)(i & 7);
    __syncthreads();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    const long long t0 = clock64();
    const bool fp8_promoted = MODE == 1 || (MODE == 3 && wg == 0);
    unsigned char eb_r[32];
    if (fp8_promoted) {
        float p0[64], p1[64];
        int ea[2] = {1, 2};
        // step 0 into p0; then per pair: issue s + 1 into p1, promote p0 (step s); issue s + 2 into p0, promote p1
        wg_fence();
        mma_fp8_n128(p0, da, db, 0);
        wg_commit();
        for (int s = 0; s < iters; s += 2) {
            wg_fence();
            mma_fp8_n128(p1, da + 2 * ((s + 1) & 3), db + 2 * ((s + 1) & 3), 0);
            wg_commit();
            wg_wait<1>();  // step s (p0) done
            pin64(p0);
            load_eb(ebt, c, 0, eb_r);
            promote(acc, p0, ea, eb_r);
            wg_fence();
            mma_fp8_n128(p0, da + 2 * ((s + 2) & 3), db + 2 * ((s + 2) & 3), 0);
            wg_commit();
            wg_wait<1>();  // step s + 1 (p1) done
            pin64(p1);
            load_eb(ebt, c, 1, eb_r);
            promote(acc, p1, ea, eb_r);
            ea[0] ^= 1;
        }
        wg_wait<0>();  // the extra step issued last is not counted (its promotion is skipped)
        pin64(p0);
    } else if (MODE == 2) {
        for (int s = 0; s < iters; ++s) {
            wg_fence();
            mma_fp8_n128(acc, da + 2 * (s & 3), db + 2 * (s & 3), 1);
            wg_commit();
            wg_wait<1>();
        }
        wg_wait<0>();
    } else {  // bf16 (MODE 0, or warpgroup 1 of MODE 3)
        bf16_steps(acc, da, db, iters);
    }
    const long long t1 = clock64();
#pragma unroll
    for (int i = 0; i < 64; ++i) out[((long long)blockIdx.x * blockDim.x + tid) * 64 + i] = acc[i];
    if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

// ---- second probe (serial promotion, per-warpgroup spans) ----
// Why: ptxas serializes every wgmma of MODE 1 (C7514: the promotion reads a partial while the other partial's MMA is
// in flight), so MODE 1 / 3 measured the serialized code, not the overlap DESIGN 5.3 asks about. Here a warpgroup
// that promotes waits for its own MMA first (wait_group 0, as DeepGEMM does; no C7514), and overlap can only come
// from the other warpgroups on the same SM sub-partitions. The promotion is the cheapest exact form found without
// per-(row, column) tables (promote2): 2.25 instructions per accumulator in the SASS (64 FFMA + 80 integer ops).
// Every warpgroup runs its own number of k32 steps (fp8 warpgroups iters_fp8, bf16 ones iters_bf16) and records
// its own clock64 span in cycles[blockIdx.x * 4 + wg], so a mix can be balanced.
//   R2_FP8   all warpgroups fp8 + serial promotion        R2_BF16  all bf16 (2 x m64n128k16 per k32)
//   R2_MIX   warpgroup NWG - 1 bf16, the others fp8 + serial promotion
#define R2_FP8 0
#define R2_BF16 1
#define R2_MIX 2

__device__ __forceinline__ void mma_fp8_n128_fresh(float* d, unsigned long long da, unsigned long long db) {
    // scale-d = 0 as an immediate predicate: the partial is written, never read, by the MMA
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_ACC64_STR "}, %64, %65, 0, 1, 1;\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db));
}

// acc[i] += part[i] * 2^(ea[h] + eb[col] - 254): i = 4 j + 2 h + e is row h, column 2 j + e of the thread's 32;
// eaw[h] = (ea[h] - 127) << 23; ebw: the 32 column exponents as bf16 bit patterns (eb << 7), 2 per word, so one
// LOP3 / SHF per column gives the fp32 bits eb << 23, one IADD per accumulator adds the row's, one FFMA promotes.
__device__ __forceinline__ void promote2(float* acc, const float* part, const int* eaw, const unsigned* ebw) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int cb = (int)(e ? (ebw[j] & 0xFFFF0000u) : (ebw[j] << 16));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int i = 4 * j + 2 * h + e;
                acc[i] = fmaf(part[i], __int_as_float(cb + eaw[h]), acc[i]);
            }
        }
    }
}

template <int MODE, int NWG>
__device__ __forceinline__ void rate2_loop(float* out, long long* cycles, int iters_fp8, int iters_bf16) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned sbase = smem_u32(smem);
    const int tid = threadIdx.x, wg = tid >> 7, c = tid & 3;
    // A: NWG tiles of 64 rows x 128 B, then B: 128 rows x 128 B (SW128 K-major), then the exponent table
    const unsigned boff = 8192u * NWG;
    const unsigned long long da = wg_desc(sbase + 8192u * (unsigned)wg), db = wg_desc(sbase + boff);
    // [2 steps][4 lanes c][32 columns] exponents as 16-bit bf16 patterns eb << 7
    unsigned short* ebt = reinterpret_cast<unsigned short*>(smem + boff + 16384);
    for (int i = tid; i < (int)(boff + 16384) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(smem)[i] = 0x3C3C3C3Cu ^ i;
    for (int i = tid; i < 256; i += blockDim.x) ebt[i] = (unsigned short)((120 + (i & 7)) << 7);
    __syncthreads();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    const bool fp8 = MODE == R2_FP8 || (MODE == R2_MIX && wg < NWG - 1);
    const long long t0 = clock64();
    if (fp8) {
        float part[64];
        int eaw[2] = {(120 - 127) << 23, (121 - 127) << 23};
        for (int s = 0; s < iters_fp8; ++s) {
            wg_fence();
            mma_fp8_n128_fresh(part, da + 2 * (s & 3), db + 2 * (s & 3));
            wg_commit();
            wg_wait<0>();
            wg_fence_acc(part);
            unsigned ebw[16];
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const uint4 t = *reinterpret_cast<const uint4*>(ebt + 128 * (s & 1) + 32 * c + 8 * v);
                ebw[4 * v] = t.x, ebw[4 * v + 1] = t.y, ebw[4 * v + 2] = t.z, ebw[4 * v + 3] = t.w;
            }
            promote2(acc, part, eaw, ebw);
            eaw[0] ^= 1 << 23;
        }
    } else {
        bf16_steps(acc, da, db, iters_bf16);
    }
    wg_fence_acc(acc);
    const long long t1 = clock64();
#pragma unroll
    for (int i = 0; i < 64; ++i) out[((long long)blockIdx.x * blockDim.x + tid) * 64 + i] = acc[i];
    if ((tid & 127) == 0) cycles[blockIdx.x * 4 + wg] = t1 - t0;
}

#define R2_KERNEL(name, MODE, NWG)                                                                              \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) name(float* out, long long* cycles, int iters_fp8, \
                                                                     int iters_bf16) {                          \
        rate2_loop<MODE, NWG>(out, cycles, iters_fp8, iters_bf16);                                             \
    }
R2_KERNEL(rate2_bf16_2wg, R2_BF16, 2)
R2_KERNEL(rate2_fp8_2wg, R2_FP8, 2)
R2_KERNEL(rate2_fp8_3wg, R2_FP8, 3)
R2_KERNEL(rate2_mix_2wg, R2_MIX, 2)
R2_KERNEL(rate2_mix_3wg, R2_MIX, 3)

// ---- third probe: the m64n256k16 bf16 shapes the 128 x 256 kernels issue ----
// Why: the fprop/dgrad kernels feed A from registers (RS); if RS alone ran below the shared-memory (SS) rate, the
// register path would cap them whatever the conversion costs. 2 warpgroups x m64n256, 4 x k16 per k-step of 64
// (= one 128 x 256 x 64 CTA step, 1024 tensor clocks at the probe's bf16 rate), wait_group 1 as the kernels do.
__device__ __forceinline__ void wgmma_m64n256k16_ss(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_ACC128_STR "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC128(d)
                 : "l"(da), "l"(db));
}

template <bool RS>
__device__ __forceinline__ void rate3_loop(float* out, long long* cycles, int iters) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned sbase = smem_u32(smem);
    const int tid = threadIdx.x, wg = tid >> 7;
    // A: 2 tiles of 64 rows x 128 B, B: 256 rows x 128 B (SW128 K-major)
    const unsigned long long da = wg_desc(sbase + 8192u * (unsigned)wg), db = wg_desc(sbase + 16384u);
    for (int i = tid; i < 49152 / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(smem)[i] = 0x3C003C00u ^ (i & 0x00FF00FFu);
    __syncthreads();
    unsigned af[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) af[i] = 0x3C003C00u ^ (unsigned)(tid * 16 + i);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const long long t0 = clock64();
    for (int s = 0; s < iters; ++s) {
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            if (RS) wgmma_m64n256k16_rs(acc, af + 4 * kk, db + 2 * kk);
            else wgmma_m64n256k16_ss(acc, da + 2 * kk, db + 2 * kk);
        }
        wg_commit();
        wg_wait<1>();
        wg_fence_regs<16>(af);
    }
    wg_wait<0>();
    const long long t1 = clock64();
#pragma unroll
    for (int i = 0; i < 128; ++i) out[((long long)blockIdx.x * blockDim.x + tid) * 128 + i] = acc[i];
    if ((tid & 127) == 0) cycles[blockIdx.x * 4 + wg] = t1 - t0;
}
extern "C" __global__ void __launch_bounds__(256, 1) rate3_rs_n256(float* out, long long* cycles, int iters) {
    rate3_loop<true>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate3_ss_n256(float* out, long long* cycles, int iters) {
    rate3_loop<false>(out, cycles, iters);
}

extern "C" __global__ void __launch_bounds__(256, 1) rate_bf16(float* out, long long* cycles, int iters) {
    rate_loop<0>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_fp8_promoted(float* out, long long* cycles, int iters) {
    rate_loop<1>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_fp8_plain(float* out, long long* cycles, int iters) {
    rate_loop<2>(out, cycles, iters);
}
extern "C" __global__ void __launch_bounds__(256, 1) rate_hybrid(float* out, long long* cycles, int iters) {
    rate_loop<3>(out, cycles, iters);
}
