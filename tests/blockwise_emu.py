"""CPU emulator of kernels/blockwise/quantize.cu (a test helper, not a test module): the real kernel source compiled as
C++ and run on one OS thread, each CUDA thread of a CTA a cooperative fiber switched at its barriers (CTAs in
sequence; __syncthreads and warp shuffles on barriers): tests/quant_emu.py's runtime for the MXFP8 kernels.
tests/test_blockwise_quant.py routes moe_ep.blockwise.cuda's launches for CPU tensors here. The host build has no
__CUDA_ARCH__, so the PTX helpers take their host paths (software e4m3
conversions, exact IEEE division); the GPU tests check the device paths.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from quant_emu import EMU_SHIM  # the cooperative-fiber runtime of the MXFP8 emulator (tests/ is on sys.path)

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
# every kernel folder on the include path (headers are included by bare name from common/ and their own folder)
INCLUDES = [
    f"-I{d}" for d in (KERNELS, *sorted(p for p in KERNELS.rglob("*") if p.is_dir() and p.name != "__pycache__"))
]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")

# the MXFP8 emulator's pieces that do not depend on the kernels: the C++ preamble (CUDA keywords, dim3, the fibers'
# threadIdx), the intrinsics, and the cooperative-fiber runtime
_PREAMBLE = EMU_SHIM[: EMU_SHIM.index("alignas(128) static unsigned char g_smem")]
_INTRINSICS = EMU_SHIM[EMU_SHIM.index("static inline float __uint_as_float") : EMU_SHIM.index("// Cooperative CUDA")]
_FIBERS = EMU_SHIM[EMU_SHIM.index("// Cooperative CUDA threads") : EMU_SHIM.index("static EmuBarrier* g_cta;")]

SHIM = r"""
PREAMBLE
#include <cmath>
alignas(128) static unsigned char g_smem[128 * 1024];  // >= every launch's dynamic shared memory
#define BW_DYN_SMEM(name) unsigned char* name = g_smem
static bool g_bad_threads;
#define BW_CHECK_THREADS(n) if (blockDim.x != (unsigned)(n)) g_bad_threads = true
INTRINSICS
FIBERS
static EmuBarrier* g_cta;
static EmuBarrier* g_warp[16];
static uint64_t g_shfl[16][32];
static inline void __syncthreads() { g_cta->arrive_and_wait(); }
template <class T> static T shfl_impl(T v, int d, bool xr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t u = 0; memcpy(&u, &v, sizeof(T));
    g_shfl[warp][lane] = u;
    g_warp[warp]->arrive_and_wait();
    const int src = xr ? (lane ^ d) : (lane - d);
    T r = v;
    if (src >= 0 && src < 32) memcpy(&r, &g_shfl[warp][src], sizeof(T));
    g_warp[warp]->arrive_and_wait();
    return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int o) { return shfl_impl(v, o, true); }
template <class T> static T __shfl_up_sync(unsigned, T v, int o) { return shfl_impl(v, o, false); }
#include "blockwise/quantize.cu"

template <class F> static void run_grid(int gx, int gy, int threads, F f) {
    gridDim.x = gx; gridDim.y = gy; blockDim.x = threads;
    EmuBarrier cta(threads);
    std::vector<EmuBarrier> w(threads / 32, EmuBarrier(32));
    g_cta = &cta;
    for (int i = 0; i < threads / 32; ++i) g_warp[i] = &w[i];
    auto body = [&] {
        for (int y = 0; y < gy; ++y)
            for (int b = 0; b < gx; ++b) { blockIdx.x = b; blockIdx.y = y; f(); cta.arrive_and_wait(); }
    };
    emu_run_fibers(threads, [](void* p) { (*static_cast<decltype(body)*>(p))(); }, &body);
}

#define CU8(v) ((const unsigned char*)(intptr_t)(v))
#define U8(v) ((unsigned char*)(intptr_t)(v))
#define CI32(v) ((const int*)(intptr_t)(v))

// Shared memory past the launch's dynamic size is filled with a canary and checked after the grid (rc 2: the
// kernel wrote past what the launcher allocated).
extern "C" int emu_run(int kid, int gx, int gy, int threads, long long smem, const long long* a) {
    if (smem > (long long)sizeof(g_smem)) return 3;
    if (threads < 32 || threads > 512 || threads % 32) return 4;
    memset(g_smem, 0xA5, sizeof(g_smem));
    g_bad_threads = false;
    switch (kid) {
        KERNEL_CASES
        default: return 1;
    }
    if (g_bad_threads) return 5;
    if (g_deadlock) return 6;
    for (size_t i = (size_t)smem; i < sizeof(g_smem); ++i)
        if (g_smem[i] != 0xA5) return 2;
    return 0;
}

// The SwiGLU values the kernels quantize, with the kernels' own host arithmetic (the emulated tests' reference
// values: the host expf is not torch's CPU exp): out [M, F] = h (bwd = 0) or [M, 2F] = dA (bwd = 1), fp32.
extern "C" void emu_swiglu_vals(int bwd, const unsigned short* a, const unsigned short* dh, long long M, int F,
                                float* out) {
    for (long long r = 0; r < M; ++r)
        for (int c = 0; c < F; ++c) {
            const float g = __uint_as_float((unsigned)a[r * 2 * F + c] << 16);
            const float u = __uint_as_float((unsigned)a[r * 2 * F + F + c] << 16);
            if (!bwd) {
                out[r * F + c] = bw_swiglu<false>(g, u);
            } else {
                const float y = __uint_as_float((unsigned)dh[r * F + c] << 16);
                const float sig = bw_sigmoid<false>(g);
                out[r * 2 * F + c] = bw_swiglu_dg(g, u, y, sig);
                out[r * 2 * F + F + c] = bw_swiglu_du(g, y, sig);
            }
        }
}
"""

# kernel family -> its argument list as C expressions of a[i] (the launchers' argument order)
_ARGS = {
    "bw_quant_rowwise": "CU8(a[0]), a[1], U8(a[2]), U8(a[3])",
    "bw_quant_colwise": "CU8(a[0]), CU8(a[1]), a[2], (int)a[3], CI32(a[4]), (int)a[5], a[6], U8(a[7])",
    "bw_quant_weight": "CU8(a[0]), (int)a[1], (int)a[2], U8(a[3]), U8(a[4]), U8(a[5])",
    "bw_transpose_weight": "CU8(a[0]), (int)a[1], (int)a[2], U8(a[3])",
    "bw_swiglu": "CU8(a[0]), CU8(a[1]), a[2], (int)a[3], CI32(a[4]), (int)a[5], a[6], U8(a[7]), U8(a[8]), U8(a[9])",
}


def build(workdir: Path):
    """Compile the emulator into ``workdir``; returns a ctypes.CDLL (None without a C++ compiler)."""
    from moe_ep.blockwise import cuda as bw_cuda  # noqa: PLC0415

    if CXX is None:
        return None
    cases = " ".join(
        f"case {i}: run_grid(gx, gy, threads, [&] {{ {name}({_ARGS[name.split('<')[0]]}); }}); break;"
        for i, name in enumerate(bw_cuda.NAMES)
    )
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "bw_emu.cpp"
    shim = SHIM.replace("PREAMBLE", _PREAMBLE).replace("INTRINSICS", _INTRINSICS).replace("FIBERS", _FIBERS)
    src.write_text(shim.replace("KERNEL_CASES", cases))
    lib = workdir / "libbwemu.so"
    cmd = [CXX, "-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]
    subprocess.run([*cmd, *INCLUDES, str(src), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    so.emu_run.argtypes = [i, i, i, i, ll, p]
    so.emu_swiglu_vals.argtypes = [i, p, p, ll, i, p]
    return so


_EMU: dict[Path, object] = {}


def emulator(workdir: Path):
    """The emulator, built once per ``workdir``."""
    if workdir not in _EMU:
        _EMU[workdir] = build(workdir / "bwemu")
    return _EMU[workdir]


def install(monkeypatch, workdir: Path) -> list[str]:
    """Route moe_ep.blockwise.cuda's launches for CPU tensors to the emulator; returns the list the launched kernel
    names are appended to."""
    from moe_ep.blockwise import cuda as bw_cuda  # noqa: PLC0415

    names: list[str] = []

    def launch(name, grid, threads, args, smem, device):
        so = emulator(workdir)
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
        vals = (ctypes.c_longlong * len(args))(*[int(v) for v in args])
        rc = so.emu_run(bw_cuda.NAMES.index(name), gx, gy, threads, smem, vals)
        assert rc != 2, f"{name} wrote shared memory past the {smem} bytes the launcher allocated"
        assert rc != 3, f"{name}: {smem} bytes of shared memory, more than the emulator has"
        assert rc != 5, f"{name}: launched with {threads} threads per CTA, not the kernel's"
        assert rc != 6, f"{name}: a barrier no emulated thread could pass (deadlock)"
        assert rc == 0, f"emulator failed on {name} (rc {rc})"
        names.append(name)

    monkeypatch.setattr(bw_cuda, "_launch", launch)
    monkeypatch.setattr(bw_cuda, "_on_gpu", lambda t: True)
    monkeypatch.setattr(bw_cuda, "_sm_count", lambda d: 2)  # persistent grids of a few CTAs, several tiles each
    return names


def swiglu_vals(workdir: Path, a, dh=None):
    """h = swiglu(a) [M, F] (dh None) or dA = swiglu_bwd(a, dh) [M, 2F] as fp32, with the kernels' host arithmetic.
    a: [M, 2F] bf16 CPU, dh: [M, F] bf16 CPU."""
    import torch  # noqa: PLC0415

    so = emulator(workdir)
    m, f2 = a.shape
    f = f2 // 2
    a = a.contiguous()
    out = torch.empty(m, f2 if dh is not None else f, dtype=torch.float32)
    dh = dh.contiguous() if dh is not None else None
    dptr = dh.data_ptr() if dh is not None else 0
    so.emu_swiglu_vals(int(dh is not None), a.data_ptr(), dptr, m, f, out.data_ptr())
    return out
