"""moe_ep._cuda's function cache (CPU: CuPy replaced by a stand-in that records what gets compiled)."""

from __future__ import annotations

import contextlib
import types

from moe_ep import _cuda


def test_function_cache_follows_nvrtc_options_env(monkeypatch):
    """Changing MOE_EP_NVRTC_OPTIONS between calls gives the other build; the same options give the cached function
    without compiling again."""
    compiled = []

    class FakeModule:
        def __init__(self, opts):
            self.opts = opts

        def get_function(self, kernel):
            return (kernel, self.opts)

    def get_module(name, name_expressions=(), extra_options=()):
        opts = _cuda.compile_options(tuple(extra_options))
        compiled.append(opts)
        return FakeModule(opts)

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext()))
    monkeypatch.setattr(_cuda, "get_module", get_module)
    monkeypatch.setattr(_cuda, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(_cuda, "_functions", {})
    monkeypatch.setenv("MOE_EP_NVRTC_OPTIONS", "-DSOME_OPTION=1")
    a = _cuda.get_function("any.cu", "k", device=0)
    monkeypatch.setenv("MOE_EP_NVRTC_OPTIONS", "-DSOME_OPTION=8")
    b = _cuda.get_function("any.cu", "k", device=0)
    c = _cuda.get_function("any.cu", "k", device=0)
    assert "-DSOME_OPTION=1" in a[1] and "-DSOME_OPTION=8" in b[1]
    assert c is b and len(compiled) == 2
