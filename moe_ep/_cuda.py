"""The one loader of ``kernels/*.cu``: NVRTC compilation through CuPy, module cache, torch-stream interop.

CuPy is imported lazily (``import moe_ep`` works without it). Kernels are compiled with ``-arch=<arch>
-std=c++17`` (``get_function(..., arch=)``, default ``sm_90a``) and launched on torch's current stream of the
tensors' device; pointer arguments are ``tensor.data_ptr()`` values.

Local ``#include "x.cuh"`` lines are inlined before compiling, so CuPy's on-disk kernel cache (keyed by the source
text) is invalidated when a header changes.

Environment switches:
  MOE_EP_KERNELS_DIR     directory holding the ``.cu``/``.cuh`` files (default: repo ``kernels/`` in a source
                         checkout, else the installed ``moe_ep.kernels`` package).
  MOE_EP_NVRTC_OPTIONS   extra NVRTC options, whitespace separated (e.g. ``-lineinfo``).
"""

from __future__ import annotations

import functools
import os
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

_GPU_EXTRA = "pip install 'moe_ep[gpu]'"
BASE_OPTIONS = ("-std=c++17",)
DEFAULT_ARCH = "sm_90a"  # Hopper with its arch-specific instructions (wgmma, setmaxnreg)

_lock = threading.Lock()
_modules: dict[tuple, object] = {}
_functions: dict[tuple, object] = {}
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def cupy():
    """Import and return CuPy, or raise ImportError naming the extra to install."""
    try:
        import cupy as cp  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(f"the CUDA backend of moe_ep needs CuPy (cupy-cuda13x): {_GPU_EXTRA}") from e
    return cp


def kernels_dir() -> Path:
    """Directory with the CUDA sources: $MOE_EP_KERNELS_DIR, the source checkout, or the installed package."""
    env = os.environ.get("MOE_EP_KERNELS_DIR")
    return Path(env) if env else _package_kernels_dir()


@functools.cache
def _package_kernels_dir() -> Path:
    # Cached: get_function's cache key calls this through compile_options on every launch, and the resolve()
    # and is_file() below cost tens of microseconds each time.
    repo = Path(__file__).resolve().parent.parent / "kernels"
    if (repo / "common" / "common.cuh").is_file():
        return repo
    try:
        import moe_ep.kernels as pkg  # noqa: PLC0415  (installed copy: package-dir "moe_ep.kernels" = "kernels")

        return Path(pkg.__file__).resolve().parent
    except ImportError as e:
        raise FileNotFoundError(f"cannot find moe_ep's CUDA sources (looked in {repo})") from e


def _find_include(inc: str, including: Path, kdir: Path) -> Path | None:
    """A local include: beside the including file, at the kernels root, or the one file of that name anywhere under
    it (headers live in their implementation's folder or in ``common/``; names are unique across the tree)."""
    for cand in (including.parent / inc, kdir / inc):
        if cand.is_file():
            return cand
    hits = sorted(kdir.rglob(Path(inc).name))
    return hits[0] if hits else None


def read_source(name: str, kdir: Path | None = None) -> str:
    """Text of ``kernels/<name>`` (a path under ``kernels/``) with local ``#include "..."`` files inlined (each at
    most once)."""
    kdir = kdir or kernels_dir()
    seen: set[Path] = set()

    def expand(path: Path) -> str:
        text = path.read_text()

        def sub(m: re.Match) -> str:
            inc = m.group(1)
            found = _find_include(inc, path, kdir)
            if found is None:
                return m.group(0)
            found = found.resolve()
            if found in seen:
                return f"// (already included: {inc})"
            seen.add(found)
            return f"// ---- begin {inc} ----\n{expand(found)}\n// ---- end {inc} ----"

        return _INCLUDE_RE.sub(sub, text)

    root = (kdir / name).resolve()
    seen.add(root)
    return expand(root)


_DEFINE_RE = re.compile(r"^\s*#\s*define\s+(\w+)(\([^)]*\))?(?:\s+(.*?))?\s*(//.*)?$")
_COND_RE = re.compile(r"^\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b\s*(\w*)")


@functools.cache
def _defines(name: str, kdir: Path, given: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """Object-like ``#define`` values of a kernel file as the preprocessor sees them with ``given`` (-D options):
    ``#ifdef`` / ``#ifndef`` / ``#else`` / ``#endif`` are followed (a plain ``#if`` section is skipped)."""
    out: dict[str, str] = dict(given)
    active: list[bool] = []
    for line in read_source(name, kdir).splitlines():
        c = _COND_RE.match(line)
        if c:
            kind, sym = c.groups()
            if kind in ("ifdef", "ifndef"):
                active.append((sym in out) == (kind == "ifdef"))
            elif kind == "if":
                active.append(False)
            elif kind in ("else", "elif") and active:
                active[-1] = not active[-1] and kind == "else"
            elif kind == "endif" and active:
                active.pop()
            continue
        if all(active):
            m = _DEFINE_RE.match(line)
            if m and m.group(2) is None and m.group(1) not in dict(given):  # -D wins over the file's own define
                out[m.group(1)] = m.group(3) or "1"
    return out


def kernel_constant(name: str, macro: str, defines: dict[str, int] | None = None) -> int:
    """The integer value of ``#define macro`` in ``kernels/<name>`` (its includes inlined), with ``defines`` taking the
    place of ``-D`` options: the one source of the tile sizes, shared-memory bytes and slot indices a launcher needs,
    so none is copied by hand. The macro must be an integer expression of other such macros.

    Example: ``kernel_constant("experts/sm90/grouped_gemm.cu", "GG_SMEM_BYTES")`` -> 231920; with
    ``{"GG_STAGES": 5, "GG_REG_EPI": 1}`` -> the long-reduction build's bytes.
    """
    return _kernel_constant(name, macro, tuple(sorted((defines or {}).items())), kernels_dir())


@functools.cache
def _kernel_constant(name: str, macro: str, defines: tuple[tuple[str, int], ...], kdir: Path) -> int:
    table = _defines(name, kdir, tuple((k, str(v)) for k, v in defines))

    def value(sym: str, depth: int = 0) -> int:
        if depth > 32:
            raise ValueError(f"{name}: {macro} does not reduce to an integer (macro loop at {sym})")
        expr = table.get(sym)
        if expr is None and depth == 0:
            raise KeyError(f"{name} defines no {sym}")
        if expr is None:
            raise ValueError(f"{name}: {macro} refers to {sym}, which is not an integer macro")
        expr = re.sub(r"//.*", "", expr)
        expr = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: str(value(m.group(1), depth + 1)), expr)
        if not re.fullmatch(r"[\d\s()+\-*/%<>]*", expr):
            raise ValueError(f"{name}: {sym} = {table[sym]!r} is not an integer expression")
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only (checked above)

    return value(macro)


def compile_options(extra: tuple[str, ...] = (), arch: str = DEFAULT_ARCH) -> tuple[str, ...]:
    env = tuple(os.environ.get("MOE_EP_NVRTC_OPTIONS", "").split())
    return (f"-arch={arch}", *BASE_OPTIONS, f"-I{kernels_dir()}", *extra, *env)


def get_module(
    name: str, name_expressions: tuple[str, ...] = (), extra_options: tuple[str, ...] = (), arch: str = DEFAULT_ARCH
):
    """Compiled ``cupy.RawModule`` of ``kernels/<name>`` for ``arch``, cached per (file, options, name
    expressions)."""
    cp = cupy()
    opts = compile_options(tuple(extra_options), arch)
    key = (name, opts, tuple(name_expressions))
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            code = read_source(name)
            kwargs = {"name_expressions": list(name_expressions)} if name_expressions else {}
            mod = cp.RawModule(code=code, options=opts, **kwargs)
            _modules[key] = mod
    return mod


def get_function(
    name: str,
    kernel: str,
    name_expressions: tuple[str, ...] = (),
    extra_options: tuple[str, ...] = (),
    device: int | None = None,
    arch: str = DEFAULT_ARCH,
):
    """Kernel ``kernel`` (a plain name or one of ``name_expressions``) of ``kernels/<name>``, built for ``arch``
    (``"sm_90a"``: Hopper; a Blackwell implementation passes its own).

    Cached per (file, kernel, name expressions, full option list, device): the options include
    MOE_EP_NVRTC_OPTIONS as it is at the call, so changing it between calls (e.g. adding -lineinfo) gets
    the other build, not the function cached for the first one.
    """
    dev = torch.cuda.current_device() if device is None else device
    key = (name, kernel, tuple(name_expressions), compile_options(tuple(extra_options), arch), dev)
    fn = _functions.get(key)
    if fn is None:
        mod = get_module(name, name_expressions, extra_options, arch)
        with cupy().cuda.Device(dev):
            fn = mod.get_function(kernel)
        _functions[key] = fn
    return fn


def ptr(t: torch.Tensor | None) -> np.uint64:
    """Kernel pointer argument for a tensor (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def _device_index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


_streams: dict[tuple[int, int], object] = {}


def torch_stream(device: torch.device | int | None = None):
    """CuPy view (``cupy.cuda.ExternalStream``, cached) of torch's current stream on ``device``."""
    dev = _device_index(device)
    handle = torch.cuda.current_stream(dev).cuda_stream
    s = _streams.get((dev, handle))
    if s is None:
        cp = cupy()
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream in favour of Stream.from_external
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cp.cuda.ExternalStream(handle, dev)
        _streams[(dev, handle)] = s
    return s


_smem_set: dict[tuple[int, int], int] = {}


def launch(
    fn,
    grid: int | tuple,
    block: int | tuple,
    args: tuple,
    *,
    shared_mem: int = 0,
    device: torch.device | int | None = None,
) -> None:
    """Launch ``fn`` on torch's current stream of ``device`` (default: the current CUDA device).

    ``args`` are numpy scalars (see :func:`ptr`, :func:`i32`, :func:`i64`) matching the kernel's parameters.
    """
    cp = cupy()
    dev = _device_index(device)
    grid = grid if isinstance(grid, tuple) else (int(grid),)
    block = block if isinstance(block, tuple) else (int(block),)
    with cp.cuda.Device(dev):
        if shared_mem > 48 * 1024 and _smem_set.get((id(fn), dev), 0) < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem
            _smem_set[(id(fn), dev)] = shared_mem
        fn(grid, block, args, shared_mem=shared_mem, stream=torch_stream(dev))


def num_sms(device: torch.device | int | None = None) -> int:
    return torch.cuda.get_device_properties(_device_index(device)).multi_processor_count
