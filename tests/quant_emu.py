"""CPU emulator of kernels/mxfp8/quantize.cu (a test helper, not a test module): the real kernel source compiled as C++
and run on one OS thread, each CUDA thread of a CTA a cooperative fiber (ucontext) switched at the barriers.
tests/test_quant_cuda.py and tests/test_quant_dual_cuda.py run their whole suites through it (device "emu");
tests/test_quant_hostmath.py checks it and the launch plans."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
# every kernel folder on the include path: a kernel includes headers of common/ and of its own folder by bare name
INCLUDES = [
    f"-I{d}" for d in (KERNELS, *sorted(p for p in KERNELS.rglob("*") if p.is_dir() and p.name != "__pycache__"))
]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")

# ------------------------------------------------------------------------------------------------------------
# CPU emulator of kernels/mxfp8/quantize.cu: the real kernel source compiled as C++, one fiber per CUDA thread (the
# launch's CTA size, CTAs in sequence) on the calling OS thread, __syncthreads and warp shuffles emulated with
# barriers at which a fiber yields until every participant has arrived (bounded: one OS thread whatever the CTA
# size; a barrier no fiber can pass anymore is reported as a deadlock instead of hanging). test_quant_cuda.py
# runs its whole suite through it (device "emu") by replacing mxfp8_cuda._launch. The host build has no
# __CUDA_ARCH__, so the PTX helpers take their host paths (the software e4m3 conversion among them).
# ------------------------------------------------------------------------------------------------------------

EMU_SHIM = r"""
#include <ucontext.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
using std::max;
using std::min;
struct dim3 { unsigned x = 0, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
static dim3 threadIdx, blockIdx;  // the running fiber's; the scheduler swaps them
static dim3 gridDim, blockDim;
alignas(128) static unsigned char g_smem[6 * 128 * 128 * 2 + 65536];  // >= every plan's dynamic shared memory (227 KiB)
#define MX_DYN_SMEM(name) unsigned char* name = g_smem
static bool g_bad_threads;
#define MX_CHECK_THREADS(n) if (blockDim.x != (unsigned)(n)) g_bad_threads = true
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline unsigned __vmaxu2(unsigned a, unsigned b) {
    return max(a & 0xFFFFu, b & 0xFFFFu) | (max(a >> 16, b >> 16) << 16);
}
static inline unsigned __vminu2(unsigned a, unsigned b) {
    return min(a & 0xFFFFu, b & 0xFFFFu) | (min(a >> 16, b >> 16) << 16);
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}
// Cooperative CUDA threads: each is a fiber with its own stack; the scheduler resumes the live fibers round robin
// and a fiber runs until it waits at a barrier (then it yields back) or its body returns.
struct EmuFiber { ucontext_t ctx; dim3 tid, bid; bool done; };
static ucontext_t g_sched;
static EmuFiber* g_fiber;              // the running one
static unsigned long long g_progress;  // barrier arrivals + finished fibers: a round without any is a deadlock
static bool g_deadlock;
static void (*g_entry)(void*);
static void* g_entry_arg;
struct EmuBarrier {
    int count, arrived = 0;
    unsigned phase = 0;
    explicit EmuBarrier(int n) : count(n) {}
    void arrive_and_wait() {
        const unsigned p = phase;
        ++g_progress;
        if (++arrived == count) { arrived = 0; ++phase; return; }
        while (phase == p) swapcontext(&g_fiber->ctx, &g_sched);
    }
};
static void emu_fiber_main() { g_entry(g_entry_arg); g_fiber->done = true; ++g_progress; }
// Runs entry(arg) as `n` fibers with threadIdx.x = 0..n-1 until all return (or none can move: g_deadlock).
static void emu_run_fibers(int n, void (*entry)(void*), void* arg) {
    static const size_t STACK = 256u << 10;
    static std::vector<char*> stacks;  // kept for later launches (virtual memory, touched pages only)
    while ((int)stacks.size() < n) stacks.push_back(static_cast<char*>(malloc(STACK)));
    std::vector<EmuFiber> fib(n);
    g_entry = entry; g_entry_arg = arg; g_deadlock = false;
    for (int t = 0; t < n; ++t) {
        getcontext(&fib[t].ctx);
        fib[t].ctx.uc_stack.ss_sp = stacks[t];
        fib[t].ctx.uc_stack.ss_size = STACK;
        fib[t].ctx.uc_link = &g_sched;
        makecontext(&fib[t].ctx, emu_fiber_main, 0);
        fib[t].tid = dim3{(unsigned)t, 0, 0};
        fib[t].done = false;
    }
    for (int live = n; live > 0;) {
        const unsigned long long before = g_progress;
        for (auto& f : fib) {
            if (f.done) continue;
            g_fiber = &f; threadIdx = f.tid; blockIdx = f.bid;
            swapcontext(&g_sched, &f.ctx);
            f.tid = threadIdx; f.bid = blockIdx;
            live -= f.done;
        }
        if (live > 0 && g_progress == before) { g_deadlock = true; return; }  // the stuck fibers' stacks are reused
    }
}
static EmuBarrier* g_cta;
static EmuBarrier* g_warp[16];  // 16 warps: the 512-thread blockwise kernels too
static uint64_t g_shfl[16][32];
static inline void __syncthreads() { g_cta->arrive_and_wait(); }
template <class T> static T shfl_impl(T v, int src_of_lane_delta, bool xr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t u = 0; memcpy(&u, &v, sizeof(T));
    g_shfl[warp][lane] = u;
    g_warp[warp]->arrive_and_wait();
    int src = xr ? (lane ^ src_of_lane_delta) : (lane - src_of_lane_delta);
    T r = v;
    if (src >= 0 && src < 32) memcpy(&r, &g_shfl[warp][src], sizeof(T));
    g_warp[warp]->arrive_and_wait();
    return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int o) { return shfl_impl(v, o, true); }
template <class T> static T __shfl_up_sync(unsigned, T v, int o) { return shfl_impl(v, o, false); }
#include "mxfp8/quantize.cu"

template <class F> static void run_grid(int grid, F f, int grid_y = 1, int threads = 256) {
    gridDim.x = grid; gridDim.y = grid_y; blockDim.x = threads;
    EmuBarrier cta(threads);
    std::vector<EmuBarrier> w(threads / 32, EmuBarrier(32));
    g_cta = &cta;
    for (int i = 0; i < threads / 32; ++i) g_warp[i] = &w[i];
    auto body = [&] {
        for (int y = 0; y < grid_y; ++y)
            for (int b = 0; b < grid; ++b) { blockIdx.x = b; blockIdx.y = y; f(); cta.arrive_and_wait(); }
    };
    emu_run_fibers(threads, [](void* p) { (*static_cast<decltype(body)*>(p))(); }, &body);
}

typedef void (*QuantFn)(const unsigned char*, long long, int, unsigned char*, unsigned char*, unsigned char*,
                        unsigned char*, const int*, int, int, int, const unsigned char*);
typedef void (*DeqFn)(const unsigned char*, const unsigned char*, unsigned char*, long long, int);

// Shared memory past the launch's dynamic size is filled with a canary before the grid runs and checked after it:
// a kernel that writes beyond what the launcher allocated (a wrong size formula) fails with rc 2.
extern "C" int emu_quant(int in, int rs, int cs, int pp, int grid, int grid_y, int threads, long long smem,
                         const unsigned char* x,
                         long long M, int K, unsigned char* rq, unsigned char* rsp, unsigned char* cq,
                         unsigned char* csp, const int* g, int nrt, int ctiles, int G, const unsigned char* x2) {
    QuantFn fn = nullptr;
    QUANT_TABLE
    if (!fn) return 1;
    if (smem > (long long)sizeof(g_smem)) return 3;
    if (threads < 32 || threads > 256 || threads % 32) return 4;
    memset(g_smem, 0xA5, sizeof(g_smem));
    g_bad_threads = false;
    run_grid(grid, [&] { fn(x, M, K, rq, rsp, cq, csp, g, nrt, ctiles, G, x2); }, grid_y, threads);
    if (g_deadlock) return 6;
    if (g_bad_threads) return 5;
    for (size_t i = (size_t)smem; i < sizeof(g_smem); ++i)
        if (g_smem[i] != 0xA5) return 2;
    return 0;
}

// kernels/mxfp8/quantize.cu's QuantCfg for (IN, RS, CS, PREQ): 5 pipe 5 (HALF), 4 pipe 4 (CPA), else 0
extern "C" int emu_pipe(int in, int rs, int cs, int pp) {
    PIPE_TABLE
    return -100;
}

extern "C" int emu_dequant(int out, int colw, int grid, const unsigned char* q, const unsigned char* s,
                           unsigned char* o, long long nchunks, int K) {
    DeqFn fn = nullptr;
    DEQ_TABLE
    if (!fn) return 1;
    run_grid(grid, [&] { fn(q, s, o, nchunks, K); });
    return g_deadlock ? 6 : 0;
}
"""


def build_emulator(workdir: Path):
    """Compile the kernel emulator as a shared library; returns a ctypes.CDLL (or None without a compiler)."""
    import ctypes  # noqa: PLC0415

    from moe_ep.mxfp8 import plan as quant_plan  # noqa: PLC0415

    if CXX is None:
        return None
    qt = (
        " ".join(
            f"if (in == {i} && rs == {r} && cs == {c} && pp < 0) fn = &mx_quant<{i},{r},{c}>;"
            for i, r, c in quant_plan.QUANT_COMBOS
        )
        + " ".join(
            f"if (in == {i} && rs == {r} && cs == {c} && pp == 4) fn = &mx_quant<{i},{r},{c},4>;"
            for i, r, c in quant_plan.ONE_COMBOS
        )
        + " ".join(
            f"if (in == {i} && rs == 3 && cs == {c} && pp == -{st}) fn = &mx_quant_dual<{i},{c},{st}>;"
            for i, c, st in quant_plan.DUAL_KERNELS
        )
        + " ".join(
            f"if (in == {3 + 2 * b} && rs == 3 && cs == {c} && pp == -{10 + st}) fn = &mx_swiglu_dual<{b},{c},{st}>;"
            for b, c, st in quant_plan.SWIGLU_KERNELS
        )
        + " ".join(f"if (in == {i} && rs == 2 && cs == 2 && pp == 100) fn = &mx_quant_batch<{i}>;" for i in range(3))
    )
    dt = " ".join(f"if (out == {o} && colw == {c}) fn = &mx_dequant<{o},{c}>;" for o in range(3) for c in range(2))
    pt = " ".join(
        f"if (in == {i} && rs == {r} && cs == {c} && pp == {q}) {{ using Q = QuantCfg<{i},{r},{c},{q}>;"
        " return Q::HALF ? 5 : Q::CPA ? 4 : 0; }"
        for i, r, c, q in pipe_cases()
    )
    src = workdir / "emu.cpp"
    src.write_text(EMU_SHIM.replace("QUANT_TABLE", qt).replace("DEQ_TABLE", dt).replace("PIPE_TABLE", pt))
    lib = workdir / "libmxemu.so"
    subprocess.run(
        [
            CXX,
            "-O1",
            "-std=c++20",
            "-shared",
            "-fPIC",
            "-pthread",
            "-fno-strict-aliasing",
            "-Wno-unknown-pragmas",
            *INCLUDES,
            str(src),
            "-o",
            str(lib),
        ],
        check=True,
    )
    so = ctypes.CDLL(str(lib))
    i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    so.emu_quant.argtypes = [i, i, i, i, i, i, i, ll, p, ll, i, p, p, p, p, p, i, i, i, p]
    so.emu_dequant.argtypes = [i, i, i, p, p, p, ll, i]
    so.emu_pipe.argtypes = [i, i, i, i]
    return so


def pipe_cases() -> list[tuple[int, int, int, int]]:
    """Every (IN, RS, CS, requested pipe) mx_quant and mx_quant_batch are compiled for (moe_ep.mxfp8.plan.NAMES)."""
    from moe_ep.mxfp8 import plan as quant_plan  # noqa: PLC0415

    return (
        [(i, r, c, -1) for i, r, c in quant_plan.QUANT_COMBOS]
        + [(i, r, c, 4) for i, r, c in quant_plan.ONE_COMBOS]
        + [(i, quant_plan.RS["blocked"], quant_plan.CS["blocked"], -1) for i in range(3)]  # mx_quant_batch
    )


_EMU: dict[Path, object] = {}  # the emulator, built once per work directory


def emulator(workdir: Path):
    """The emulator of the kernels, built once into a directory under ``workdir``."""
    if workdir not in _EMU:
        d = workdir / "emu"
        d.mkdir(parents=True, exist_ok=True)
        _EMU[workdir] = build_emulator(d)
    return _EMU[workdir]


def install_emulator(monkeypatch, workdir: Path) -> None:
    """Route moe_ep.mxfp8.cuda's launches for CPU tensors to :func:`emulator` (builds under ``workdir``)."""
    import re  # noqa: PLC0415

    from moe_ep.mxfp8 import checks as quant_checks  # noqa: PLC0415
    from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415
    from moe_ep.mxfp8 import plan as quant_plan  # noqa: PLC0415

    def launch(name, grid, args, shared_mem, device, threads=256):
        so = emulator(workdir)
        params = [int(v) for v in re.findall(r"\d+", name)]
        a = [int(v) for v in args]
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)  # 2-D: the batched weight launch
        t = (gx, gy, threads, shared_mem)
        if name.startswith("mx_quant_dual"):  # mx_quant_dual<in,cs,stages>: grouped rows; pipe code -stages
            rc = so.emu_quant(params[0], 3, params[1], -params[2], *t, *a)
        elif name.startswith("mx_swiglu_dual"):  # mx_swiglu_dual<bwd,cs,stages>: IN 3 / 5, pipe code -(10 + stages)
            rc = so.emu_quant(3 + 2 * params[0], 3, params[1], -10 - params[2], *t, *a)
        elif name.startswith("mx_quant_batch"):  # mx_quant_batch<in>: the fused blocked mode, pipe code 100
            rc = so.emu_quant(params[0], 2, 2, 100, *t, *a)
        elif name.startswith("mx_quant"):  # mx_quant<in,rs,cs> or mx_quant<in,rs,cs,pipe>
            rc = so.emu_quant(*params[:3], params[3] if len(params) > 3 else -1, *t, *a)
        else:
            assert gy == 1 and threads == 256
            rc = so.emu_dequant(*params, gx, *a)
        assert rc != 2, f"{name} wrote shared memory past the {shared_mem} bytes the launcher allocated"
        assert rc != 3, f"{name}: the launch asks for {shared_mem} bytes of shared memory, more than the emulator has"
        assert rc != 4, f"{name}: {threads} threads per CTA, not a multiple of 32 up to 256"
        assert rc != 5, f"{name}: launched with {threads} threads per CTA, not the kernel's"
        assert rc != 6, f"{name}: deadlock, some CUDA threads wait at a barrier the others never reach"
        assert rc == 0, f"emulator has no kernel {name} (rc {rc})"

    monkeypatch.setattr(mxfp8_cuda, "_launch", launch)
    monkeypatch.setattr(quant_checks, "on_gpu", lambda t: True)
    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 2)
