// Weight preparation for the fprop / dgrad GEMM (kernels/experts/sm90/grouped_gemm.cu), two kernels:
//   mx_prepare_weight_operands_*  (below) both prepared operands straight from the bf16/fp16/fp32 weight, one pass:
//                                 what weight_operands runs;
//   mx_prepare_weight_bf16        one prepared operand from an MXFP8 weight (the GEMM launchers' fallback when no
//                                 prepared operand is passed, tests, benchmarks).
//
// mx_prepare_weight_bf16 (launcher moe_ep/experts/sm90/operands.py
// prepare_weight_bf16, reference prepare_weight_bf16_torch): MXFP8 weight e4m3 [G, N, K] + blocked scales -> exact
// bf16 [G, N, Kp] (Kp = K rounded up to 64, zero padded), each 64-wide k block stored in the GEMM kernels' permuted
// k order: logical position 16 s + 8 h + 2 c + e holds physical column 16 c + 4 s + 2 h + e.
//
//   * one thread = one 16-byte chunk c (physical columns 16 c .. 16 c + 15 of a 64-block: one 32-block, one scale
//     byte) of one row; quads of lanes hold the 4 chunks of one (row, 64-block). cvt16 (the GEMM kernels' exact
//     conversion) gives words o[q] = physical columns 16 c + 2 q, + 1, whose logical place is byte 16 q + 4 c of
//     the 128-byte output block. So for each half (q = 4 m + i) the quad holds a 4 x 4 matrix of words w[c][i]
//     that belongs at byte 16 (4 m + i) + 4 c: after quad_transpose4, lane c holds 16 contiguous bytes at
//     16 (4 m + c). Two 16-byte stores per thread, reads of 16 bytes: the pass is memory bound.
//   * chunks past K (K % 64 == 32) are written as zeros; a warp walks whole quads, and the loop bound is uniform
//     per warp (the shuffles need all 32 lanes), stores are masked.

#include "gemm_common.cuh"

// w: [G * N, K] e4m3 rows; ws: [G, bsz] blocked scales (bsz = blocked_size(N, K / 32)); out: [G * N, Kp] bf16.
extern "C" __global__ void __launch_bounds__(256) mx_prepare_weight_bf16(const unsigned char* __restrict__ w,
                                                                          const unsigned char* __restrict__ ws,
                                                                          unsigned short* __restrict__ out, int G,
                                                                          int N, int K, long long bsz) {
    const int nblk = (K + 63) >> 6, tpr = ((K >> 5) + 3) >> 2;
    const long long total = (long long)G * N * nblk * 4;  // chunks, a multiple of 4: quads never straddle the end
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31, c = lane & 3;
    for (long long base = (long long)blockIdx.x * blockDim.x + (threadIdx.x & ~31); base < total; base += stride) {
        const long long idx = base + lane;
        const bool valid = idx < total;
        const long long rb = idx >> 2;  // (row, block)
        const long long row = rb / nblk;
        const int b = (int)(rb - row * nblk);
        const int k0 = b * 64 + 16 * c;
        unsigned o[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (valid && k0 < K) {
            const int g = (int)(row / N), n = (int)(row - (long long)g * N), kb = k0 >> 5;
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(w + row * K + k0));
            const unsigned s =
                ws[(long long)g * bsz + ((long long)(n >> 7) * tpr + (kb >> 2)) * 512 + (n & 31) * 16 +
                   ((n >> 5) & 3) * 4 + (kb & 3)];
            cvt16(raw, s, o);
        }
        quad_transpose4(o);
        quad_transpose4(o + 4);
        if (valid) {
            uint4* dst = reinterpret_cast<uint4*>(out + row * (long long)(nblk * 64) + b * 64);
            dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[4 + c] = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// mx_prepare_weight_operands_{f32,bf16}: both prepared operands straight from the weight
// ---------------------------------------------------------------------------------------------------------
// Launcher moe_ep/experts/sm90/operands.py prepare_weight_operands, reference prepare_weight_operands_torch. From one read
// of W [G, N, K] (fp32 / bf16 / fp16) it writes
//   wp  [G, N, Kp]  = prepare_weight_bf16 of W quantized along K (1x32 blocks): the fprop operand, and
//   wtp [G, K, Np]  = prepare_weight_bf16 of W^T quantized along N (W in 32x1 blocks, transposed): the dgrad operand
// (Kp, Np: K, N rounded up to 64, zero padded), byte for byte what quantize_weights_fused (kernels/mxfp8/quantize.cu
// mx_quant_batch) followed by two mx_prepare_weight_bf16 passes wrote, without the e4m3 copies and scales in
// between: 2 bytes read and 2 + 2 written per element instead of about 10. The quantization is mx_quant_body's
// arithmetic (quant_elem.cuh: block key, mx_block_exp, quant_chunk / mx_cvt4_e4m3, 0x7F bytes and scale 0xFF for
// NaN/Inf blocks) and the conversion back is cvt16 (gemm_common.cuh), so every byte, NaN payloads included, is the
// two-step path's.
//
//   * one CTA of 256 threads per 128 x 128 tile of one expert's W (grid (tiles, G)); the tile lands in shared
//     memory by cp.async, rows past N and columns past K as zeros, in 16-byte units swizzled by
//     unit ^ 2 ((r / 32) % 4) ^ (r % 2), so that both reads below are conflict-free (fp32 rows: 2-way).
//   * columns (wtp) first: a thread owns one 32-bit word column (2 bf16 / fp16 columns, or 1 fp32) of one
//     32-row block mb (mx_quant's phase 2). It reads the 32 words, reduces each column's key, quantizes the 32
//     values and converts them with cvt16 in two 16-row halves: the halves are physical chunks c0 = 2 (mb % 2) and
//     c0 + 1 of the 64-row block mb / 2, whose words o[q] belong at logical words 4 q + c0 and 4 q + c0 + 1 of
//     that block's 128-byte row segment of W^T (k_permutation). The pairs (o0[q], o1[q]) go as 8-byte stores into
//     a bf16 [128 k][128 n] staging tile (16-byte unit u of row kr at u ^ 4 (u / 8) ^ ((kr / columns per word)
//     % 4): conflict-free for these stores and for the 16-byte reads below).
//   * rows (wp): a quad of lanes owns one (row, 64-wide k block), lane c its physical chunk c (16 columns, half a
//     32-block; lanes c, c ^ 1 exchange their key), exactly mx_prepare_weight_bf16 after its load: quantize,
//     cvt16, two quad_transpose4, two 16-byte stores straight to global memory. Every lane runs every step (the
//     shuffles need whole warps; rows past N are zeros in the tile), only the stores are masked.
//   * after a barrier, the staging tile leaves as 16-byte stores of whole 256-byte rows of W^T.
//   Padding (k in [K, Kp) of wp, n in [N, Np) of wtp) comes out of the zero-filled tile as +0 bytes, as the
//   two-step path writes it. Shared memory: the tile (128 x 128 x element bytes) + 32 KiB staging (WP_SMEM).

#ifndef IN_F32  // the input codes of kernels/mxfp8/quantize.cu (moe_ep/mxfp8/plan.py IN); quant_elem.cuh needs them all
#define IN_F32 0
#define IN_BF16 1
#define IN_F16 2
#define IN_SWIGLU 3
#define IN_SWIGLU_BWD16 5
#endif
#include "common.cuh"

#include "quant_elem.cuh"

#ifndef MX_DYN_SMEM  // the CPU emulator (tests/test_weight_prep_cuda.py) provides its own
#define MX_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#define WP_TILE 128
#define WP_THREADS 256
#define WP_STAGE_BYTES (WP_TILE * 256)  // the bf16 W^T staging tile
// dynamic shared memory for element size ES (moe_ep/experts/sm90/operands.py _operands_plan passes the same)
#define WP_SMEM(ES) (WP_TILE * WP_TILE * (ES) + WP_STAGE_BYTES)

// Byte offset of 16-byte unit u of tile row r (UPR units per row). The XOR touches bits 0-2 of u only, so a unit
// stays in its aligned group of 8 (UPR is 16 or 32).
template <int UPR> __device__ __forceinline__ int wp_tile_off(int r, int u) {
    return (r * UPR + (u ^ (((r >> 5) & 3) << 1) ^ (r & 1))) * 16;
}
// Byte offset of 16-byte unit u (0..15) of row kr of the W^T staging tile; SH = log2(columns per 32-bit word).
template <int SH> __device__ __forceinline__ int wp_stage_off(int kr, int u) {
    return (kr * 16 + (u ^ ((u >> 3) << 2) ^ ((kr >> SH) & 3))) * 16;
}

template <int IN>
__device__ __forceinline__ void wp_operands_body(const unsigned char* __restrict__ w, unsigned short* __restrict__ wp,
                                                 unsigned short* __restrict__ wtp, int N, int K, int ktiles) {
    constexpr int ES = IN == IN_F32 ? 4 : 2;  // element bytes
    constexpr int VEC = 16 / ES;              // elements per 16-byte unit
    constexpr int UPR = WP_TILE / VEC;        // units per tile row
    constexpr int WPR = WP_TILE * ES / 4;     // 32-bit words per tile row
    constexpr int UPW = 4 / ES;               // columns per word
    constexpr int SH = UPW == 2 ? 1 : 0;
    static_assert(WP_THREADS == 256 && WPR % 64 == 0, "a thread per (word column, 32-row block)");
    MX_DYN_SMEM(smem);
    unsigned char* const tile = smem;
    unsigned char* const stage = smem + WP_TILE * WP_TILE * ES;

    const int tid = threadIdx.x;
    const long long g = blockIdx.y;
    const int tn = (int)blockIdx.x / ktiles, tk = (int)blockIdx.x - tn * ktiles;
    const int n0 = tn * WP_TILE, k0 = tk * WP_TILE;
    const int nrows = min(WP_TILE, N - n0), kcols = min(WP_TILE, K - k0);  // multiples of 32
    const int Kp = (K + 63) & ~63, Np = (N + 63) & ~63;

    // ---------------- the tile by cp.async (zeros past N and K) ----------------
    {
        const unsigned char* src = w + ((g * N + n0) * K + k0) * ES;
#pragma unroll
        for (int j = 0; j < WP_TILE * UPR / WP_THREADS; ++j) {
            const int i = j * WP_THREADS + tid, r = i / UPR, u = i % UPR;
            const bool ok = r < nrows && u * VEC < kcols;
            cp_async16(tile + wp_tile_off<UPR>(r, u), ok ? src + ((long long)r * K + u * VEC) * ES : w, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();

    // ---------------- columns: W quantized in 32x1 blocks -> the W^T staging tile ----------------
    {
        const int mb = tid & 3;
#pragma unroll 1
        for (int p = 0; p < WPR / 64; ++p) {
            const int uw = p * 64 + (tid >> 2);  // word column
            unsigned v[32];
#pragma unroll
            for (int i = 0; i < 32; ++i)
                v[i] = *reinterpret_cast<const unsigned*>(tile + wp_tile_off<UPR>(mb * 32 + i, uw >> 2) + (uw & 3) * 4);
            unsigned acc = 0u;
#pragma unroll
            for (int i = 0; i < 32; ++i) acc = Key<IN>::of_word(acc, v[i]);
#pragma unroll
            for (int cc = 0; cc < UPW; ++cc) {
                const unsigned key = Key<IN>::lane(acc, cc);
                const bool bad = key >= Key<IN>::BAD;
                const int e = mx_block_exp(Key<IN>::to_float(key));
                const float s = mx_exp2i(-e);
                unsigned q[8];
                quant_col32<IN>(v, cc, s, bad, q);
                const unsigned sb = bad ? MX_SCALE_NAN : (unsigned)(e + 127);
                unsigned o0[8], o1[8];
                cvt16(make_uint4(q[0], q[1], q[2], q[3]), sb, o0);  // rows 32 mb .. + 15: chunk 2 (mb % 2)
                cvt16(make_uint4(q[4], q[5], q[6], q[7]), sb, o1);  // rows 32 mb + 16 .. + 31: the next chunk
                const int kr = uw * UPW + cc;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    *reinterpret_cast<uint2*>(stage + wp_stage_off<SH>(kr, 8 * (mb >> 1) + j) + 8 * (mb & 1)) =
                        make_uint2(o0[j], o1[j]);
            }
        }
    }

    // ---------------- rows: W quantized in 1x32 blocks -> wp, straight to global memory ----------------
#pragma unroll 1
    for (int it = 0; it < WP_TILE * 8 / WP_THREADS; ++it) {
        const int i = it * WP_THREADS + tid;
        const int c = i & 3, b = (i >> 3) & 1, r = ((i >> 4) << 1) | ((i >> 2) & 1);
        uint4 x[ES];
#pragma unroll
        for (int j = 0; j < ES; ++j)
            x[j] = *reinterpret_cast<const uint4*>(tile + wp_tile_off<UPR>(r, b * 4 * ES + c * ES + j));
        unsigned key = 0u;
#pragma unroll
        for (int j = 0; j < ES; ++j) key = max(key, chunk_key<IN>(x[j]));
        key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, 1));  // lanes c, c ^ 1: one 32-block
        const bool bad = key >= Key<IN>::BAD;
        const int e = mx_block_exp(Key<IN>::to_float(key));
        const float s = mx_exp2i(-e);
        uint4 q;
        if constexpr (ES == 2) {
            const uint2 q0 = quant_chunk<IN>(x[0], s), q1 = quant_chunk<IN>(x[1], s);
            q = make_uint4(q0.x, q0.y, q1.x, q1.y);
        } else {
            q = make_uint4(quant_chunk<IN>(x[0], s).x, quant_chunk<IN>(x[1], s).x, quant_chunk<IN>(x[2], s).x,
                           quant_chunk<IN>(x[3], s).x);
        }
        if (bad) q = make_uint4(0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu, 0x7F7F7F7Fu);
        unsigned o[8];
        cvt16(q, bad ? MX_SCALE_NAN : (unsigned)(e + 127), o);
        quad_transpose4(o);
        quad_transpose4(o + 4);
        if (r < nrows && k0 + 64 * b < K) {
            uint4* dst = reinterpret_cast<uint4*>(wp + (g * N + n0 + r) * (long long)Kp + k0 + 64 * b);
            dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[4 + c] = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
    __syncthreads();

    // ---------------- the W^T staging tile -> wtp: whole 256-byte rows ----------------
#pragma unroll
    for (int it = 0; it < WP_TILE * 16 / WP_THREADS; ++it) {
        const int i = it * WP_THREADS + tid, u = i & 15, kr = i >> 4;
        if (kr < kcols && n0 + 8 * u < Np) {
            const uint4 val = *reinterpret_cast<const uint4*>(stage + wp_stage_off<SH>(kr, u));
            *reinterpret_cast<uint4*>(wtp + (g * K + k0 + kr) * (long long)Np + n0 + 8 * u) = val;
        }
    }
}

// w: [G, N, K] of the input type (contiguous, 16-byte aligned); wp: bf16 [G, N, Kp]; wtp: bf16 [G, K, Np];
// grid (ceil(N/128) * ktiles, G) with ktiles = ceil(K/128), WP_THREADS threads, WP_SMEM(element bytes) of dynamic
// shared memory. N % 32 == K % 32 == 0.
#define WP_PARAMS                                                                                                \
    const unsigned char *__restrict__ w, unsigned short *__restrict__ wp, unsigned short *__restrict__ wtp, int N, \
        int K, int ktiles
extern "C" __global__ void __launch_bounds__(WP_THREADS, 3) mx_prepare_weight_operands_f32(WP_PARAMS) {
    wp_operands_body<IN_F32>(w, wp, wtp, N, K, ktiles);
}
extern "C" __global__ void __launch_bounds__(WP_THREADS, 3) mx_prepare_weight_operands_bf16(WP_PARAMS) {
    wp_operands_body<IN_BF16>(w, wp, wtp, N, K, ktiles);
}
