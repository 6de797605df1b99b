"""moe_ep._cuda's function cache (CPU: CuPy replaced by a stand-in that records what gets compiled)."""

from __future__ import annotations

import contextlib
import types

import pytest

from moe_ep import _cuda


class FakeModule:
    """A compiled module's stand-in: get_function returns (kernel name, the options it was built with)."""

    def __init__(self, opts):
        self.opts = opts

    def get_function(self, kernel):
        return (kernel, self.opts)


def _install(monkeypatch, get_module) -> None:
    """_cuda compiles through ``get_module`` with an empty function cache and a CuPy without devices."""
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext()))
    monkeypatch.setattr(_cuda, "get_module", get_module)
    monkeypatch.setattr(_cuda, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(_cuda, "_functions", {})


def test_function_cache_follows_nvrtc_options_env(monkeypatch):
    """Changing MOE_EP_NVRTC_OPTIONS between calls gives the other build; the same options give the cached function
    without compiling again."""
    compiled = []

    def get_module(name, name_expressions=(), extra_options=(), arch=_cuda.DEFAULT_ARCH):
        opts = _cuda.compile_options(tuple(extra_options), arch)
        compiled.append(opts)
        return FakeModule(opts)

    _install(monkeypatch, get_module)
    monkeypatch.setenv("MOE_EP_NVRTC_OPTIONS", "-DSOME_OPTION=1")
    a = _cuda.get_function("any.cu", "k", device=0)
    monkeypatch.setenv("MOE_EP_NVRTC_OPTIONS", "-DSOME_OPTION=8")
    b = _cuda.get_function("any.cu", "k", device=0)
    c = _cuda.get_function("any.cu", "k", device=0)
    assert "-DSOME_OPTION=1" in a[1] and "-DSOME_OPTION=8" in b[1]
    assert c is b and len(compiled) == 2


def test_arch_is_part_of_the_build(monkeypatch):
    """get_function(arch=) compiles for that architecture and caches the builds apart."""
    built = []

    def get_module(name, name_expressions=(), extra_options=(), arch=_cuda.DEFAULT_ARCH):
        built.append(arch)
        return FakeModule(_cuda.compile_options(tuple(extra_options), arch))

    _install(monkeypatch, get_module)
    monkeypatch.delenv("MOE_EP_NVRTC_OPTIONS", raising=False)
    a = _cuda.get_function("any.cu", "k", device=0)
    b = _cuda.get_function("any.cu", "k", device=0, arch="sm_100a")
    assert "-arch=sm_90a" in a[1] and "-arch=sm_100a" in b[1] and built == ["sm_90a", "sm_100a"]


def test_includes_resolve_across_folders(tmp_path):
    """A header is found beside the including file, at the root, or by its unique name in another folder; each is
    inlined once."""
    (tmp_path / "common").mkdir()
    (tmp_path / "impl").mkdir()
    (tmp_path / "common" / "c.cuh").write_text("int c;\n")
    (tmp_path / "impl" / "h.cuh").write_text('#include "c.cuh"\nint h;\n')
    (tmp_path / "impl" / "k.cu").write_text('#include "h.cuh"\n#include "c.cuh"\n#include <cuda.h>\nint k;\n')
    src = _cuda.read_source("impl/k.cu", tmp_path)
    assert src.count("int c;") == 1 and "int h;" in src and "int k;" in src
    assert "#include <cuda.h>" in src and "already included: c.cuh" in src


def test_kernel_constant_follows_the_preprocessor(tmp_path, monkeypatch):
    """kernel_constant evaluates a macro through other macros, #ifdef / #ifndef / #else and -D overrides, across an
    include; a non-integer macro raises naming it."""
    (tmp_path / "h.cuh").write_text("#define TILE 128\n#define NAME foo\n")
    (tmp_path / "k.cu").write_text(
        '#include "h.cuh"\n#ifndef STAGES\n#define STAGES 4\n#endif\n#ifdef REG_EPI\n#define EPI 0\n#else\n'
        "#define EPI (2 * TILE)  // bytes\n#endif\n#define SMEM (STAGES * TILE + EPI)\n"
    )
    monkeypatch.setenv("MOE_EP_KERNELS_DIR", str(tmp_path))
    assert _cuda.kernel_constant("k.cu", "SMEM") == 4 * 128 + 256
    assert _cuda.kernel_constant("k.cu", "SMEM", {"STAGES": 5, "REG_EPI": 1}) == 5 * 128
    with pytest.raises(ValueError, match="NAME"):
        _cuda.kernel_constant("h.cuh", "NAME")
