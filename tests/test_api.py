"""Public API: import without GPU packages, configuration checks, clear errors on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep import MoE, MoEConfig
from moe_ep.router import route
from moe_ep.transport import combine, dispatch


def test_import_without_gpu_packages():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['nvshmem'] = None\n"
        "import moe_ep, torch\n"
        "m = moe_ep.MoE(moe_ep.MoEConfig(hidden=32, ffn_hidden=32, num_experts=2, top_k=1))\n"
        "y, aux = m(torch.randn(3, 32)); assert y.shape == (3, 32)\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_cuda_backend_on_cpu_names_what_is_missing():
    """backend="cuda" on a machine without the GPU packages (or with CPU tensors) raises, naming the reason;
    "auto" falls back to the reference path."""
    m = MoE(MoEConfig(hidden=32, ffn_hidden=32, num_experts=2, top_k=1, backend="cuda"))
    with pytest.raises((ImportError, ValueError, RuntimeError), match="backend='cuda' needs"):
        m(torch.randn(3, 32))
    y, _ = MoE(MoEConfig(hidden=32, ffn_hidden=32, num_experts=2, top_k=1, backend="auto"))(torch.randn(3, 32))
    assert y.shape == (3, 32) and torch.isfinite(y).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden=48), "multiples of 32"),
        (dict(top_k=9), "exceeds num_experts"),
        (dict(num_experts=0), "positive int"),
        (dict(hidden=True), "positive int"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
        (dict(init_std=float("nan")), "init_std"),
        (dict(quantize=1), "quantize must be a bool"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(capacity_factor=float("inf")), "capacity_factor"),
        (dict(backend="tpu"), "backend"),
    ],
)
def test_config_errors(kwargs, match):
    base = dict(hidden=64, ffn_hidden=32, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_unquantized_config_allows_any_width():
    m = MoE(MoEConfig(hidden=40, ffn_hidden=24, num_experts=4, top_k=2, quantize=False))
    y, _ = m(torch.randn(5, 40))
    assert y.shape == (5, 40) and torch.isfinite(y).all()


def test_layer_input_errors():
    m = MoE(MoEConfig(hidden=64, ffn_hidden=32, num_experts=4, top_k=2, max_tokens_per_rank=8))
    with pytest.raises(ValueError, match="hidden size"):
        m(torch.randn(3, 32))
    with pytest.raises(TypeError, match="bf16 or fp32"):
        m(torch.randn(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        m(torch.randn(9, 64))


def test_layer_keeps_leading_dims_and_is_deterministic():
    m = MoE(MoEConfig(hidden=64, ffn_hidden=32, num_experts=4, top_k=2, max_tokens_per_rank=64))
    x = torch.randn(2, 5, 64)
    y1, a1 = m(x)
    y2, a2 = m(x)
    assert y1.shape == x.shape and torch.equal(y1, y2) and torch.equal(a1, a2)


def test_dispatch_errors():
    x = torch.randn(4, 64)
    w = torch.rand(4, 2)
    with pytest.raises(ValueError, match="out of range"):
        dispatch(x, torch.tensor([[0, 1], [2, 8], [0, 1], [0, 1]]), w, 8)
    with pytest.raises(ValueError, match="out of range"):
        dispatch(x, torch.tensor([[0, 1], [2, -1], [0, 1], [0, 1]]), w, 8)
    with pytest.raises(ValueError, match="do not match"):
        dispatch(x, torch.zeros(3, 2, dtype=torch.int64), w, 8)
    with pytest.raises(TypeError, match="int32/int64"):
        dispatch(x, torch.zeros(4, 2), w, 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        dispatch(torch.randn(4, 40), torch.zeros(4, 2, dtype=torch.int64), w, 8)
    rows, rw, handle = dispatch(x, torch.tensor([[0, 1]] * 4), w, 8)
    with pytest.raises(ValueError, match="combine expects"):
        combine(rows[:-1], rw[:-1], handle)


def test_router_aux_loss_and_renormalization():
    # uniform logits: every expert equally likely; aux = E * sum f_e P_e = 1 for balanced assignment
    r = route(torch.zeros(8, 4), 1, renormalize=True)
    assert torch.allclose(r.topk_w, torch.ones(8, 1))
    assert abs(float(r.aux_loss) - 1.0) < 1e-6  # P_e = 1/E for every e, so aux = sum_e f_e = 1
    # all tokens on expert 2 with prob ~1: f_2 = 1, P_2 ~ 1 -> aux ~ E
    logits = torch.full((8, 4), -30.0)
    logits[:, 2] = 30.0
    r = route(logits, 2, renormalize=False)
    assert (r.topk_idx[:, 0] == 2).all()
    assert abs(float(r.aux_loss) - 4 * 0.5) < 1e-4  # f_2 = 1/2 (top-2), P_2 ~ 1
    r = route(torch.randn(16, 8), 3, renormalize=True)
    assert torch.allclose(r.topk_w.sum(-1), torch.ones(16))


def test_readme_quickstart_runs_as_written():
    """The README's CPU quickstart, executed exactly as printed there."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(4, 32, 64) (8, 192, 64) (8, 64)"
