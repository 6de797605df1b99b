// MXFP8 quantization / dequantization kernels (docs/design.md, "MXFP8 format", and docs/design-kernels.md, "Quantization kernels";
// moe_ep/mxfp8/reference.py is the specification).
//
// A CTA processes one 128 x 128 tile of the input x [M, K] (rows x columns; pipe 5: a 64 x 128 tile, see QuantCfg).
// Per tile:
//   phase 1  every thread loads 8 x 16-byte chunks (coalesced, all issued before use; pipes 4 and 5: by cp.async
//            into a shared-memory stage); the TPB = 32/VEC lanes that hold one 1x32 block reduce its amax with
//            shuffles and write the row-wise e4m3 bytes; the row scales go straight to global memory (plain) or
//            into a 512-byte smem tile (the blocked layouts: the 128 rows x 4 scale columns of this tile, padding
//            included). Column-wise modes also stage the raw chunk in smem (XOR-swizzled, conflict-free both ways).
//   phase 2  (column-wise) a thread owns one 32-bit word column (2 bf16 / 1 fp32 columns) of one 32-row
//            block: it reduces the 32x1 block. CS_BLOCKED quantizes it and stores 32 e4m3 bytes of the TRANSPOSED
//            output xt [K, M] (4 lanes write 128 contiguous bytes of a row of xt) and one blocked scale tile (K rows
//            x M/32 columns: 128 x 4 per CTA again); the other column modes keep the block's multiplier for phase 3.
//   phase 3  (CS_NT, CS_GPREP) re-read the staged tile and write column-wise data in x's own [M, K] layout
//            (CS_GPREP: as the exact bf16 value of each quantized element, in the wgrad kernel's prepared layout).
// Blocked scale tiles are written whole (zero padding included) with 16-byte stores, so no memset is needed.
// Grouped row layouts map CTAs to OUTPUT scale tiles: tile T of group g covers the group's rows
// [128*(T - off_g), ...), groups start on fresh tiles, and tiles past the last group only get their zero scale
// tile (a buffer sized for the worst case costs 1/32 byte per element of its unused rows, no tile pass).
// Kernels (moe_ep/mxfp8/plan.py chooses): mx_quant (quantize(x, axis), and the SwiGLU grouped dual where
// mx_swiglu_dual does not run), mx_quant_batch (the fused blocked mode over a batch of experts' weights), mx_quant_dual
// (kernels/mxfp8/quant_dual.cuh: bf16 grouped dual, register-tiled), mx_swiglu_dual (kernels/mxfp8/quant_swiglu.cuh: SwiGLU
// forward / backward + grouped dual), mx_dequant (kernels/mxfp8/quant_dequant.cuh).
#include "common.cuh"

#define IN_F32 0
#define IN_BF16 1
#define IN_F16 2
#define IN_SWIGLU 3   // bf16 a [M, 2K] = (gate | up); the quantized values are h = silu(gate) * up in fp32 ([M, K])
                      // (with RS_GROUPED: CS_GPREP, or CS_NONE for the forward's row-only h)
// 4: no longer used (the SwiGLU backward with an fp32 dh)
#define IN_SWIGLU_BWD16 5  // bf16 a [M, K] = (gate | up) and bf16 dh [M, K/2] (x2, the dgrad GEMM's output);
                           // quantizes dA = swiglu_bwd(a, dh)
#define IN_MXROWS 6  // mx_quant_dual only: e4m3 x [M, K] row-wise with its per-group blocked scales (x2, the layout
                     // RS_GROUPED writes), each element dequantized exactly to bf16 (mx_dequant's value) in
                     // registers; column-wise output only (the backward's x operand from the saved rows)

#define RS_NONE 0     // no row-wise output
#define RS_PLAIN 1    // scale [M, K/32]
#define RS_BLOCKED 2  // to_blocked(scale) (mx_quant_batch)
#define RS_GROUPED 3  // to_blocked_grouped(scale, sizes, "m"); sizes int32 on device

#define CS_NONE 0     // no column-wise output
#define CS_BLOCKED 2  // data xt [K, M], scale to_blocked([K, M/32]) (mx_quant_batch)
#define CS_NT 3       // data [M, K] (x's layout), scale [M/32, K]  (quantize(x, axis=0))
// 4: no longer used (the MXFP8 per-group column-wise output)
#define CS_GPREP 5    // per row group (RS_GROUPED only): 32-row blocks that restart at each group's first row,
                      // written dequantized: bf16 [64 (ceil(M/64) + G), K], group g from row 64 sum_{h<g}
                      // ceil(n_h/64), zero rows up to its next multiple of 64, no column scales: the wgrad GEMM's
                      // prepared operand (moe_ep.experts.operands.prepare_colwise_bf16_torch), so it needs no
                      // preparation pass

#define TILE 128
#define NTHREADS 256

#ifndef MX_DYN_SMEM  // the CPU emulator (tests/quant_emu.py) provides its own
#define MX_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
#ifndef MX_CHECK_THREADS  // the CPU emulator checks that a launch has the CTA size the kernel was built for
#define MX_CHECK_THREADS(n)
#endif

#include "quant_elem.cuh"

#include "quant_sched.cuh"


// Shared-memory bytes of mx_quant beyond the staged tile: row-scale tile (512), column-scale tile (512), column
// multipliers 2**-E (4 x 128 fp32) and NaN-block masks (4 x 128 bytes) of phase 3, then (RS_GROUPED) the group
// table of 16 * (G + 1) bytes; the launcher passes the same sum (moe_ep/mxfp8/plan.py). CS_GPREP adds its
// column dequantization multipliers 2**E (4 x 128 fp32) before the table.
#define MX_SMEM_FIXED 3584
#define MX_SMEM_GPREP 2048

// Tile pipelining of mx_quant, fixed per mode (the launcher sizes grid, CTA size and shared memory by the same
// rule, moe_ep/mxfp8/plan.py effective_pipe). Every pipe runs one tile per CTA (grid = all tiles):
//   0  the chunks are loaded into registers: inputs staged as fp32 words (fp32 itself and the SwiGLU inputs,
//      whose tiles take two passes) and 16-bit column-only inputs of few tiles;
//   4  the tile lands by cp.async in one 32 KB shared-memory stage (more CTAs per SM; the block scheduler overlaps
//      CTAs and hands tiles to SMs as they free up): the fused blocked mode of mx_quant_batch, and 16-bit
//      column-only inputs of many tiles, which the launcher asks for by PREQ = 4 (mx_quant<IN, 0, CS, 4>);
//   5  pipe 4 on 64-row tiles of 128 threads for 16-bit row-only plain scales; a thread waits for each of its
//      chunks on its own (GROUPS).
// Why these, and the CTAs per SM (MINB): docs/performance.md.
template <int IN, int RS, int CS, int PREQ = -1> struct QuantCfg {
    static constexpr int ES = mx_w32<IN>() ? 4 : 2;
    static_assert(PREQ == -1 || (PREQ == 4 && RS == RS_NONE), "pipe 4 on request: column-only modes");
    static_assert(RS != RS_GROUPED || ((IN == IN_SWIGLU || IN == IN_SWIGLU_BWD16) && CS == CS_GPREP) ||
                      (IN == IN_SWIGLU && CS == CS_NONE),
                  "grouped dual: bf16 x runs mx_quant_dual; here only the SwiGLU inputs, prepared column output (or "
                  "the forward's row-only h)");
    static constexpr bool HALF = ES == 2 && CS == CS_NONE && RS == RS_PLAIN;  // pipe 5
    static constexpr bool CPA = ES == 2 && (HALF || PREQ == 4 || (RS == RS_BLOCKED && CS == CS_BLOCKED));  // 4, 5
    static constexpr int NT = HALF ? NTHREADS / 2 : NTHREADS;  // threads per CTA
    static constexpr int ROWS = HALF ? TILE / 2 : TILE;         // rows of a CTA's tile
    static constexpr int MINB = HALF ? 8 : (CPA || ES == 4 ? 3 : 4);
    // cp.async groups per thread's 8 chunks, each waited for just before its first chunk is read
    static constexpr int GROUPS = HALF ? 8 : 1;
    static_assert(GROUPS == 1 || (CPA && CS == CS_NONE), "per-chunk waits: no CTA-wide reads");
};

// x: [M, K] (IN element type). Grid: 1-D over the n_row_tiles * ctiles tiles (column tile fastest), one tile per
// CTA; QuantCfg::NT threads on QuantCfg::ROWS-row tiles.
// rq: [M, K] e4m3 (RS != NONE); rs: row scales per RS; cq/cs: column-wise outputs per CS.
// RS_GROUPED: gsizes [G] int32. x2: SwiGLU backward's dh.
// The kernels mx_quant and mx_quant_batch (below) are this body with their pointers.
// The kernels' common parameters (mx_quant, mx_quant_batch, mx_quant_dual, mx_swiglu_dual: one launcher). G comes
// after n_row_tiles and ctiles so that these two share an 8-byte slot (one 64-bit constant load).
#define MX_QUANT_PARAMS                                                                                              \
    const unsigned char *__restrict__ x, long long M, int K, unsigned char *__restrict__ rq,                          \
        unsigned char *__restrict__ rs, unsigned char *__restrict__ cq, unsigned char *__restrict__ cs,              \
        const int *__restrict__ gsizes, int n_row_tiles, int ctiles, int G,                                          \
        const unsigned char *__restrict__ x2

template <int IN, int RS, int CS, int PREQ>
__device__ __forceinline__ void mx_quant_body(MX_QUANT_PARAMS) {
    using Cfg = QuantCfg<IN, RS, CS, PREQ>;
    constexpr int ES = Cfg::ES;      // element bytes
    constexpr bool CPA = Cfg::CPA;   // pipes 4 and 5: the tile lands by cp.async in a shared-memory stage
    constexpr int VEC = 16 / ES;              // elements per 16-byte chunk
    constexpr int CPR = TILE / VEC;           // chunks per tile row
    constexpr int TPB = 32 / VEC;             // lanes per 1x32 block
    constexpr int WPR = TILE * ES / 4;        // 32-bit words per tile row
    constexpr int PER = 8;                    // chunks in flight per thread
    constexpr int NT = Cfg::NT;      // threads
    constexpr int ROWS = Cfg::ROWS;  // tile rows (pipe 5: 64)
    constexpr int CPG = PER / Cfg::GROUPS;  // chunks per cp.async group
    constexpr int PASSES = ROWS * CPR / (NT * PER);
    constexpr bool RTILE = RS == RS_BLOCKED || RS == RS_GROUPED;  // a 512-byte blocked row-scale tile in smem
    static_assert(!RTILE || CS != CS_NONE || RS == RS_GROUPED, "row-only blocked scales: grouped only");
    static_assert(!CPA || PASSES == 1, "a cp.async stage holds the tile in one pass");

    // The tile in shared memory: [TILE][WPR] words, XOR-swizzled; its own area when a column-wise output needs
    // it (STAGED), or the cp.async stage (CPA), which uses the same layout.
    constexpr bool STAGED = CS != CS_NONE && !CPA;
    MX_DYN_SMEM(smem);
    unsigned* tile = reinterpret_cast<unsigned*>(smem);
    unsigned char* stile = smem + (STAGED ? TILE * WPR * 4 : 0);         // 512 B row-scale tile (RTILE)
    unsigned char* ctile = stile + 512;                                  // 512 B col-scale tile
    float* smul = reinterpret_cast<float*>(ctile + 512);                 // [4][128] col multipliers (phase 3)
    unsigned char* sbad = ctile + 512 + 4 * 4 * TILE;                    // [4][128] NaN-block masks (phase 3)
    float* sdeq = reinterpret_cast<float*>(stile + MX_SMEM_FIXED);       // [4][128] 2**E (CS_GPREP)
    constexpr int FIXED = MX_SMEM_FIXED + (CS == CS_GPREP ? MX_SMEM_GPREP : 0);
    long long* g_rstart = reinterpret_cast<long long*>(stile + FIXED);  // [G + 1] (RS_GROUPED)
    int* g_tstart = reinterpret_cast<int*>(g_rstart + (RS == RS_GROUPED ? G + 1 : 0));  // [G + 1]
    int* g_bstart = g_tstart + (RS == RS_GROUPED ? G + 1 : 0);                           // [G + 1]
    // CPA: the stage after the table, on 128 bytes (the launcher adds 32 KB + 128, or 16 KB + 128 on pipe 5's
    // 64-row tiles): a stage off 128 bytes makes L2 serve each line twice (kernels/mxfp8/quant_dual.cuh).
    // (Offset arithmetic on smem itself, so the compiler still sees a shared-memory pointer and emits LDS.)
    unsigned char* stage0 =
        smem + ((reinterpret_cast<unsigned char*>(g_bstart + (RS == RS_GROUPED ? G + 1 : 0)) - smem + 127) & ~127LL);
    static_assert(CS != CS_GPREP || RS == RS_GROUPED, "per-group column blocks follow the grouped row tiles");
    constexpr bool GCOL = CS == CS_GPREP;  // per-group column blocks, in x's row order

    MX_CHECK_THREADS(NT);
    const int tid = threadIdx.x, lane = tid & 31;
    const int C = K / 32;
    const int total = n_row_tiles * ctiles;
    if (RS == RS_GROUPED) grouped_table(gsizes, G, g_tstart, g_rstart, g_bstart);

    // Tile T -> (row tile, column tile, first row, rows).
    // bs: first scale row of the tile's column blocks (CS_NT: row0 / 32; CS_GPREP: first 64-row block of the
    // tile in the prepared layout).
    auto coords = [&](int T, int& rt, int& ct, long long& row0, int& nrows, long long& bs) {
        rt = (int)((unsigned)T / (unsigned)ctiles);
        ct = (int)((unsigned)T % (unsigned)ctiles);
        bs = 0;
        if (RS == RS_GROUPED) {
            grouped_lookup(g_tstart, g_rstart, g_bstart, G, rt, row0, nrows, bs);
            nrows = (int)max(0LL, min((long long)nrows, M - row0));
        } else {
            row0 = (long long)rt * ROWS;
            nrows = (int)min((long long)ROWS, M - row0);
        }
        if (!GCOL) bs = row0 >> 5;
    };
    // Chunk m (= p * PER + j) of this thread is tile row m * RPM + r0, 16-byte column cc0: the element offset of
    // its first value is base + m * RPM * K, so the per-chunk address is one add (no 64-bit row arithmetic per
    // chunk).
    constexpr int RPM = NT / CPR;  // tile rows per chunk step
    const int r0 = tid / CPR, cc0 = tid % CPR;
    const long long step = (long long)RPM * K;
    // Byte offset of chunk (tile row r, 16-byte column cc) in the swizzled tile: bits 3-4 of the word index are
    // XORed with the row's 32-row block, so 16-byte row writes and 32-row column reads are both conflict-free.
    auto soff = [&](int r, int cc) { return (r * WPR + ((cc * 4) ^ (((r >> 5) & 3) << 3))) * 4; };
    auto issue = [&](unsigned char* stage, long long row0, int nrows, int col0) {  // CPA (PASSES == 1)
        const bool cok = col0 + cc0 * VEC < K;
        const unsigned char* src = x + ((row0 + r0) * K + col0 + cc0 * VEC) * ES;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const bool ok = cok && j * RPM + r0 < nrows;
            cp_async16(stage + soff(j * RPM + r0, cc0), ok ? src + j * step * ES : x, ok);
            if ((j + 1) % CPG == 0) cp_async_commit();  // CPG divides PER: the last chunk closes the last group
        }
    };
    auto load = [&](uint4* v, int p, long long row0, int nrows, int col0) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int r = (p * PER + j) * RPM + r0, cc = cc0;
            const bool ok = r < nrows && col0 + cc * VEC < K;
            if (IN == IN_SWIGLU_BWD16) {  // a: row stride K bf16; dh (x2): K/2 bf16 values
                v[j] = ok ? swiglu_bwd4(x + (row0 + r) * (2LL * K), x2 + (row0 + r) * (K / 2LL * 2), col0 + cc * VEC,
                                        K >> 1)
                          : make_uint4(0u, 0u, 0u, 0u);
            } else if (IN == IN_SWIGLU) {  // row stride 2K bf16; gate at column c, up at K + c
                const unsigned char* rp = x + (row0 + r) * (4LL * K) + (col0 + cc * VEC) * 2;
                v[j] = ok ? swiglu4(ld_nc8(rp), ld_nc8(rp + 2LL * K)) : make_uint4(0u, 0u, 0u, 0u);
            } else {
                v[j] = ok ? ld_nc16(x + ((row0 + r) * K + col0 + cc * VEC) * ES) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    int T = (int)blockIdx.x;
    if (T >= total) return;
    // grouped: past the groups' tiles only the zero scale tile (a CTA-uniform exit)
    if (RS == RS_GROUPED && (int)((unsigned)T / (unsigned)ctiles) >= g_tstart[G]) {
        if (tid < 32) reinterpret_cast<uint4*>(rs + (long long)T * 512)[tid] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    int rt, ct, nrows;
    long long row0, bs;
    coords(T, rt, ct, row0, nrows, bs);
    int buf = 0;
    if (CPA) issue(stage0, row0, nrows, ct * TILE);
    // One tile per CTA (Tn == total), inside the loop of a double-buffered persistent tile order: the CPA pipes keep
    // its next-tile branch, which never runs, because the compiler's code for the straight-line tile was slower
    // (docs/performance.md, "Quantizer pipes, schedules, grids, dual variants").
    int Tn = total;

    for (;;) {
        const int col0 = ct * TILE;
        int rt_n = 0, ct_n = 0, nrows_n = 0;
        long long row0_n = 0, bs_n = 0;
        unsigned char* cur = stage0 + buf * MX_STAGE_BYTES;
        if (CPA) {
            tile = reinterpret_cast<unsigned*>(cur);
            if (Tn < total) {
                coords(Tn, rt_n, ct_n, row0_n, nrows_n, bs_n);
                issue(stage0 + (buf ^ 1) * MX_STAGE_BYTES, row0_n, nrows_n, ct_n * TILE);
                cp_async_wait<1>();  // all but the copies just issued: the current tile has landed
            } else if (CPG == PER) {
                cp_async_wait<0>();
            }  // else: each group is waited for at its first chunk (phase 1)
        }

    // ---------------- phase 1: load, row-wise quantization, staging ----------------
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        uint4 v[PER];
        if (!CPA) load(v, p, row0, nrows, col0);
        const bool cok = col0 + cc0 * VEC < K;
        unsigned char* const rq0 = rq + (row0 + r0) * K + col0 + cc0 * VEC;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int m = p * PER + j;
            const int r = m * RPM + r0, cc = cc0;
            const bool ok = cok && r < nrows;
            if (CPG < PER && j % CPG == 0) cp_async_wait_n(Cfg::GROUPS - 1 - j / CPG);
            if (CPA) v[j] = *reinterpret_cast<const uint4*>(cur + soff(r, cc));  // at use: few registers
            if (STAGED) *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(tile) + soff(r, cc)) = v[j];
            if (RS != RS_NONE) {
                unsigned key = chunk_key<IN>(v[j]);
#pragma unroll
                for (int o = 1; o < TPB; o <<= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
                const bool bad = key >= Key<IN>::BAD;
                const int e = mx_block_exp(Key<IN>::to_float(key));
                uint2 q = quant_chunk<IN>(v[j], mx_exp2i(-e));
                if (bad) q = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
                if (ok) {
                    unsigned char* dst = rq0 + m * step;
                    if (VEC == 8) *reinterpret_cast<uint2*>(dst) = q;
                    else *reinterpret_cast<unsigned*>(dst) = q.x;
                }
                const unsigned sb = bad ? MX_SCALE_NAN : (unsigned)(e + 127);
                if (RS == RS_PLAIN) {
                    if ((lane & (TPB - 1)) == 0 && ok) rs[(row0 + r) * C + ct * 4 + cc / TPB] = (unsigned char)sb;
                } else if ((lane & (TPB - 1)) == 0) {
                    stile[tile_off(r, cc / TPB)] = ok ? (unsigned char)sb : (unsigned char)0;
                }
            }
        }
    }
    if (CS != CS_NONE || RTILE) __syncthreads();  // RTILE: the row-scale tile is stored by other threads below

    // ---------------- phase 2: column-wise 32x1 blocks from the staged tile ----------------
    if (CS != CS_NONE) {
        constexpr int UPW = 4 / ES;  // columns per word
        const int mb = tid & 3;
        const bool mb_ok = mb * 32 < nrows;
#pragma unroll
        for (int p = 0; p < WPR / 64; ++p) {
            const int u = p * 64 + (tid >> 2);
            const int kc0 = u * UPW;
            const bool ok = mb_ok && col0 + kc0 < K;
            unsigned w[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) w[i] = tile[(mb * 32 + i) * WPR + (u ^ (mb << 3))];
            unsigned acc = 0u;
#pragma unroll
            for (int i = 0; i < 32; ++i) acc = Key<IN>::of_word(acc, w[i]);
#pragma unroll
            for (int c = 0; c < UPW; ++c) {
                const unsigned key = Key<IN>::lane(acc, c);
                const bool bad = key >= Key<IN>::BAD;
                const int e = mx_block_exp(Key<IN>::to_float(key));
                const unsigned char sb = (unsigned char)(bad ? MX_SCALE_NAN : (unsigned)(e + 127));
                const int kl = kc0 + c;
                if (CS == CS_NT || GCOL) {
                    smul[mb * TILE + kl] = bad ? 0.0f : mx_exp2i(-e);
                    sbad[mb * TILE + kl] = bad ? 0xFFu : 0u;
                    if (CS == CS_GPREP) sdeq[mb * TILE + kl] = mx_exp2i(e);
                    else if (ok) cs[(bs + mb) * K + col0 + kl] = sb;
                } else {
                    const float s = mx_exp2i(-e);
                    unsigned o[8];
                    quant_col32<IN>(w, c, s, bad, o);
                    if (ok) {
                        uint4* dst = reinterpret_cast<uint4*>(cq + (long long)(col0 + kl) * M + row0 + 32 * mb);
                        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
                    }
                    ctile[tile_off(kl, mb)] = ok ? sb : (unsigned char)0;
                }
            }
        }
        if (CS == CS_BLOCKED || CS == CS_NT || GCOL) __syncthreads();
    }

    // ---------------- phase 3 (CS_NT, CS_GPREP): column-wise data in x's layout ----------------
    if (CS == CS_NT || GCOL) {
        // CS_GPREP also writes the zero rows that pad the tile to whole 64-row blocks (the GEMM reads them).
        const int wrows = CS == CS_GPREP ? (nrows + 63) & ~63 : nrows;
        // CS_GPREP: the chunk's VEC bf16 values at prepared row 64 bs + r (16 or 8 bytes).
        auto store_prep = [&](int r, int cc, unsigned b0, unsigned b1, unsigned b2, unsigned b3) {
            unsigned short* dst = reinterpret_cast<unsigned short*>(cq) + (64 * bs + r) * K + col0 + cc * VEC;
            if (VEC == 8) *reinterpret_cast<uint4*>(dst) = make_uint4(b0, b1, b2, b3);
            else *reinterpret_cast<uint2*>(dst) = make_uint2(b0, b1);
        };
#pragma unroll 4
        for (int q = 0; q < TILE * CPR / NT; ++q) {
            const int c = q * NT + tid;
            const int r = c / CPR, cc = c % CPR;
            if (!(r < wrows && col0 + cc * VEC < K)) continue;
            if (CS == CS_GPREP && r >= nrows) {
                store_prep(r, cc, 0u, 0u, 0u, 0u);
                continue;
            }
            const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(tile) + soff(r, cc));
            // The chunk's VEC column multipliers (16-byte shared loads; offset is a multiple of VEC) and NaN-block
            // byte masks (one 8- or 4-byte load): per element one multiply, per 4 elements one cvt and one mask.
            const int xo = (r >> 5) * TILE + cc * VEC;
            float mul[8];
            unsigned nanmask[2] = {0u, 0u};
#pragma unroll
            for (int h = 0; h < VEC / 4; ++h) {
                const uint4 t = *reinterpret_cast<const uint4*>(smul + xo + 4 * h);
                mul[4 * h] = __uint_as_float(t.x);
                mul[4 * h + 1] = __uint_as_float(t.y);
                mul[4 * h + 2] = __uint_as_float(t.z);
                mul[4 * h + 3] = __uint_as_float(t.w);
                nanmask[h] = *reinterpret_cast<const unsigned*>(sbad + xo + 4 * h);
            }
            const unsigned vw[4] = {v.x, v.y, v.z, v.w};
            float f[8];
#pragma unroll
            for (int i = 0; i < VEC; ++i) f[i] = mx_mul(word_elem<IN>(vw[i * ES / 4], (i * ES / 2) & 1), mul[i]);
            unsigned o[2];
#pragma unroll
            for (int h = 0; h < VEC / 4; ++h)
                o[h] = (mx_cvt4_e4m3(f[4 * h], f[4 * h + 1], f[4 * h + 2], f[4 * h + 3]) & ~nanmask[h]) |
                       (0x7F7F7F7Fu & nanmask[h]);
            if (CS == CS_GPREP) {
                // The exact value of each byte: e4m3 -> fp32 (exact) times 2**E (exact: a power of two, the
                // product is >= 2**-136, within fp32's subnormal range), rounded once to bf16 as the reference's
                // .to(bfloat16) of its fp32 dequantization; NaN blocks give bf16 NaN 0x7FC0.
                float d[8];
#pragma unroll
                for (int h = 0; h < VEC / 4; ++h) {
                    const uint4 t = *reinterpret_cast<const uint4*>(sdeq + xo + 4 * h);
                    mx_e4m3x2_to_f32(o[h] & 0xFFFFu, d[4 * h], d[4 * h + 1]);
                    mx_e4m3x2_to_f32(o[h] >> 16, d[4 * h + 2], d[4 * h + 3]);
                    d[4 * h] = mx_mul(d[4 * h], __uint_as_float(t.x));
                    d[4 * h + 1] = mx_mul(d[4 * h + 1], __uint_as_float(t.y));
                    d[4 * h + 2] = mx_mul(d[4 * h + 2], __uint_as_float(t.z));
                    d[4 * h + 3] = mx_mul(d[4 * h + 3], __uint_as_float(t.w));
                }
                unsigned b[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int i = 0; i < VEC / 2; ++i) {
                    const unsigned nm = __byte_perm(nanmask[i >> 1], 0u, (i & 1) ? 0x3322u : 0x1100u);
                    b[i] = (mx_pack16x2<1>(d[2 * i], d[2 * i + 1]) & ~nm) | (0x7FC07FC0u & nm);
                }
                store_prep(r, cc, b[0], b[1], b[2], b[3]);
                continue;
            }
            unsigned char* dst = cq + (row0 + r) * K + col0 + cc * VEC;
            if (VEC == 8) {
                *reinterpret_cast<uint2*>(dst) = make_uint2(o[0], o[VEC / 4 - 1]);
            } else {
                *reinterpret_cast<unsigned*>(dst) = o[0];
            }
        }
    }

    // ---------------- blocked scale tiles from smem: 512 B each, 16-byte stores ----------------
    if (RTILE && tid < 32) {
        reinterpret_cast<uint4*>(rs + ((long long)rt * ctiles + ct) * 512)[tid] =
            reinterpret_cast<const uint4*>(stile)[tid];
    }
    if (CS == CS_BLOCKED && tid >= 32 && tid < 64) {
        reinterpret_cast<uint4*>(cs + ((long long)ct * n_row_tiles + rt) * 512)[tid - 32] =
            reinterpret_cast<const uint4*>(ctile)[tid - 32];
    }
        if (!CPA || Tn >= total) break;
        if (CS != CS_NONE) __syncthreads();  // the next tile rewrites the staged tile and the column-scale tile
        T = Tn;
        Tn = T + (int)gridDim.x;
        buf ^= 1;
        rt = rt_n;
        ct = ct_n;
        row0 = row0_n;
        nrows = nrows_n;
        bs = bs_n;
    }
}

template <int IN, int RS, int CS, int PREQ = -1>
__global__ void __launch_bounds__(QuantCfg<IN, RS, CS, PREQ>::NT, QuantCfg<IN, RS, CS, PREQ>::MINB)
    mx_quant(MX_QUANT_PARAMS) {
    mx_quant_body<IN, RS, CS, PREQ>(x, M, K, rq, rs, cq, cs, gsizes, n_row_tiles, ctiles, G, x2);
}

// The fused blocked mode (rq + rs blocked, cq = x^T + cs blocked) over a batch of gridDim.y equal [M, K] problems
// stored back to back (quantize_weights_fused: one launch for all experts instead of one each, which was
// host-bound for small experts). Problem blockIdx.y: x, rq and cq advance by M * K elements, rs by
// blocked_size(M, K/32) and cs by blocked_size(K, M/32) bytes; the arguments are those of problem 0. M % 32 == 0.
template <int IN>
__global__ void __launch_bounds__(NTHREADS, QuantCfg<IN, RS_BLOCKED, CS_BLOCKED>::MINB)
    mx_quant_batch(MX_QUANT_PARAMS) {
    constexpr int ES = QuantCfg<IN, RS_BLOCKED, CS_BLOCKED>::ES;
    const long long b = blockIdx.y, mk = b * M * K;
    // rs (blocked [M, K/32]) and cs (blocked [K, M/32]) have the same size: ceil(M/128) x ceil(K/128) tiles of
    // 512 bytes either way, since M and K are multiples of 32
    const long long sb = b * ((M + TILE - 1) / TILE) * ((K + TILE - 1) / TILE) * 512;
    mx_quant_body<IN, RS_BLOCKED, CS_BLOCKED, -1>(x + mk * ES, M, K, rq + mk, rs + sb, cq + mk, cs + sb, gsizes,
                                                  n_row_tiles, ctiles, G, x2);
}

#include "quant_dequant.cuh"

#include "quant_dual.cuh"

#include "quant_swiglu.cuh"
