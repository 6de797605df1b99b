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
# threadIdx), the intrinsics, the cooperative-fiber runtime with __syncthreads and the warp shuffles, and run_grid
_PREAMBLE = EMU_SHIM[: EMU_SHIM.index("alignas(128) static unsigned char g_smem")]
_INTRINSICS = EMU_SHIM[EMU_SHIM.index("static inline float __uint_as_float") : EMU_SHIM.index("// Cooperative CUDA")]
_RUNTIME = EMU_SHIM[EMU_SHIM.index("// Cooperative CUDA threads") : EMU_SHIM.index('#include "mxfp8/quantize.cu"')]
_RUN_GRID = EMU_SHIM[
    EMU_SHIM.index("template <class F> static void run_grid") : EMU_SHIM.index("typedef void (*QuantFn)")
]

SHIM = r"""
PREAMBLE
#include <cmath>
alignas(128) static unsigned char g_smem[128 * 1024];  // >= every launch's dynamic shared memory
#define BW_DYN_SMEM(name) unsigned char* name = g_smem
static bool g_bad_threads;
#define BW_CHECK_THREADS(n) if (blockDim.x != (unsigned)(n)) g_bad_threads = true
INTRINSICS
RUNTIME
#include "blockwise/quantize.cu"

RUN_GRID
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
        f"case {i}: run_grid(gx, [&] {{ {name}({_ARGS[name.split('<')[0]]}); }}, gy, threads); break;"
        for i, name in enumerate(bw_cuda.NAMES)
    )
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "bw_emu.cpp"
    shim = SHIM.replace("PREAMBLE", _PREAMBLE).replace("INTRINSICS", _INTRINSICS).replace("RUNTIME", _RUNTIME)
    shim = shim.replace("RUN_GRID", _RUN_GRID)
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
