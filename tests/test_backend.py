"""Backend selection, the ``transport`` field and the functional layer (``moe_ep.layer.routed_experts``) on the CPU.

The cuda backend itself is tested on GPUs by tests/multigpu/moe_cuda_*.py (torchrun). Here: "auto" runs the reference
on the CPU (bitwise the same results as backend="reference"), "cuda" without its packages or without a GPU raises
naming what is missing, ``MoEConfig.transport`` accepts exactly "nvshmem" / "nccl", and ``routed_experts`` on the
reference path equals the dense oracle (tolerances as in tests/test_layer.py: fp32, only the order of the top-k sums
differs, rtol 1e-5, atol 1e-6; expert weight gradients bitwise).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from moe_ep import MoE, MoEConfig, layer_cuda
from moe_ep.layer import routed_experts
from tests.moe_dense import dense_moe

H, F = 64, 32
TIGHT = dict(rtol=1e-5, atol=1e-6)


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(**{**dict(hidden=H, ffn_hidden=F, num_experts=4, top_k=2, max_tokens_per_rank=64), **kw})


# ------------------------------------------------------------------------------------------- the transport field
def test_transport_default_and_values():
    assert _cfg().transport == "nvshmem"
    assert _cfg(transport="nccl").transport == "nccl"
    assert dataclasses.replace(_cfg(), transport="nccl").transport == "nccl"


@pytest.mark.parametrize("bad", ["gloo", "NCCL", "", None, 1])
def test_transport_rejects_other_values(bad):
    with pytest.raises(ValueError, match="transport"):
        _cfg(transport=bad)
    with pytest.raises(ValueError, match="transport"):
        dataclasses.replace(_cfg(), transport=bad)  # replace() runs the same checks


# ------------------------------------------------------------------------------------------- backend selection
def _fwd_bwd(cfg: MoEConfig, x: torch.Tensor, dy: torch.Tensor):
    moe = MoE(cfg, seed=5)
    xx = x.clone().requires_grad_()
    y, aux = moe(xx)
    ((y * dy).sum() + aux).backward()
    return y.detach(), aux.detach(), xx.grad, moe.router.weight.grad, moe.experts.w13.grad, moe.experts.w2.grad


@pytest.mark.parametrize("transport", ["nvshmem", "nccl"])
@pytest.mark.parametrize("quantize", [True, False])
def test_auto_runs_the_reference_on_cpu(transport, quantize):
    """On CPU tensors "auto" is the reference path whatever the transport: bitwise the same forward and backward."""
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(13, H, generator=gen), torch.randn(13, H, generator=gen)
    auto = _fwd_bwd(_cfg(backend="auto", transport=transport, quantize=quantize), x, dy)
    ref = _fwd_bwd(_cfg(backend="reference", quantize=quantize), x, dy)
    for name, a, b in zip(("y", "aux", "x.grad", "router.grad", "w13.grad", "w2.grad"), auto, ref, strict=True):
        assert torch.equal(a, b), name
    assert layer_cuda.resolve_backend(_cfg(backend="auto", transport=transport), x) == "reference"


def test_auto_rule(monkeypatch):
    """ "auto" is "cuda" only with x on a GPU, the GPU packages importable and torch.distributed initialized."""
    gpu_x = types.SimpleNamespace(is_cuda=True)  # resolve_backend reads only x.is_cuda
    auto = _cfg(backend="auto")
    monkeypatch.setattr(layer_cuda, "missing_gpu_packages", lambda transport: ("cupy",))
    assert layer_cuda.resolve_backend(auto, gpu_x) == "reference"
    monkeypatch.setattr(layer_cuda, "missing_gpu_packages", lambda transport: ())
    assert not dist.is_initialized()  # (the multi-process tests run in spawned processes)
    assert layer_cuda.resolve_backend(auto, gpu_x) == "reference"
    assert layer_cuda.resolve_backend(auto, torch.zeros(1, H)) == "reference"
    monkeypatch.setattr(layer_cuda.dist, "is_initialized", lambda: True)
    assert layer_cuda.resolve_backend(auto, gpu_x) == "cuda"
    assert layer_cuda.resolve_backend(_cfg(backend="reference"), gpu_x) == "reference"


def test_cuda_backend_without_gpu_packages_names_the_extra():
    """backend="cuda" with CuPy / nvshmem4py not importable: ImportError naming the packages and ``moe_ep[gpu]``
    (nvshmem4py only for transport="nvshmem"). A fresh process, since the package probe is cached; a GPU and x on it
    are faked there, so the packages are the first blocker (without a GPU that one comes first: the next test)."""
    code = (
        "import sys, types; sys.modules['cupy'] = None; sys.modules['nvshmem'] = None\n"
        "import torch, moe_ep\n"
        "from moe_ep import layer_cuda\n"
        "torch.cuda.is_available = lambda: True\n"
        "for transport in ('nvshmem', 'nccl'):\n"
        "    cfg = moe_ep.MoEConfig(hidden=32, ffn_hidden=32, num_experts=2, top_k=1, backend='cuda',\n"
        "                           transport=transport)\n"
        "    try:\n"
        "        layer_cuda.resolve_backend(cfg, types.SimpleNamespace(is_cuda=True))\n"
        "        print(transport, 'no error')\n"
        "    except ImportError as e:\n"
        "        print(transport, 'ImportError', str(e).replace(chr(10), ' '))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert set(lines) == {"nvshmem", "nccl"}, r.stdout
    for transport, msg in lines.items():
        assert msg.startswith("ImportError") and "moe_ep[gpu]" in msg and "cupy" in msg, (transport, msg)
    assert "nvshmem4py" in lines["nvshmem"] and "nvshmem4py" not in lines["nccl"], lines


def test_cuda_backend_names_the_real_blocker_first(monkeypatch):
    """On a machine without a usable GPU the first words name that (a CPU-only torch build, or no GPU visible), then
    x on the CPU, then the GPU extra; MoE(device="cuda") there says what to do instead of torch's bare error."""
    monkeypatch.setattr(layer_cuda, "missing_gpu_packages", lambda transport: ("cupy", "nvshmem4py"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cuda_version, words in ((None, "CPU-only build"), ("13.0", "no CUDA GPU is visible")):
        monkeypatch.setattr(torch.version, "cuda", cuda_version)
        with pytest.raises(RuntimeError) as e:
            MoE(_cfg(backend="cuda"))(torch.randn(3, H))
        msg = str(e.value)
        assert msg.startswith("backend='cuda' needs a CUDA GPU: ") and words in msg, msg
        assert msg.index(words) < msg.index("x on a CUDA device, got cpu") < msg.index("moe_ep[gpu]"), msg
        with pytest.raises(RuntimeError) as e:
            MoE(_cfg(), device="cuda")
        assert str(e.value).startswith("MoE(device='cuda'): ") and words in str(e.value), e.value
        assert "device='cpu'" in str(e.value) and "not compiled" not in str(e.value), e.value
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, x on the CPU: that is the blocker
    with pytest.raises(ValueError, match=r"^backend='cuda' needs x on a CUDA device, got cpu; then also cupy"):
        MoE(_cfg(backend="cuda"))(torch.randn(3, H))


def test_cuda_backend_without_cuda_says_so(monkeypatch):
    """With the packages present (here: the probe patched) but x on the CPU or no process group, backend="cuda"
    raises naming the missing piece instead of falling back silently."""
    monkeypatch.setattr(layer_cuda, "missing_gpu_packages", lambda transport: ())
    cuda = _cfg(backend="cuda")
    with pytest.raises((ValueError, RuntimeError), match="CUDA"):
        MoE(cuda)(torch.randn(3, H))
    with pytest.raises((ValueError, RuntimeError), match="CUDA"):
        routed_experts(
            torch.randn(3, H), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2), MoE(cuda).experts, cuda
        )
    with pytest.raises(RuntimeError, match="torch.distributed"):
        layer_cuda.resolve_backend(cuda, types.SimpleNamespace(is_cuda=True))


def test_cuda_backend_on_a_cpu_machine():
    """This machine as it is (CI: no GPU, no CuPy): "cuda" raises ImportError or one naming CUDA; never runs."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the cuda backend may run here")
    with pytest.raises((ImportError, ValueError, RuntimeError), match=r"moe_ep\[gpu\]|CUDA"):
        MoE(_cfg(backend="cuda"))(torch.randn(3, H))


# --------------------------------------------------------------------------------- routed_experts on the reference
def _routing(n: int, num_experts: int, top_k: int, gen: torch.Generator):
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n)])
    return idx, torch.rand(n, top_k, generator=gen) + 0.1


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("top_k,idx_dtype", [(1, torch.int64), (2, torch.int32), (4, torch.int64)])
def test_routed_experts_matches_dense(quantize, top_k, idx_dtype):
    cfg = _cfg(top_k=top_k, quantize=quantize)
    moe = MoE(cfg, seed=11)
    gen = torch.Generator().manual_seed(top_k)
    x, dy = torch.randn(17, H, generator=gen), torch.randn(17, H, generator=gen)
    idx, w = _routing(17, 4, top_k, gen)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, dropped = routed_experts(xx, idx.to(idx_dtype), ww, moe.experts, cfg, moe.ep_group)
    (y * dy).sum().backward()
    assert dropped == 0 and y.dtype == x.dtype and y.shape == x.shape

    dx, dw = x.clone().requires_grad_(), w.clone().requires_grad_()
    w13, w2 = (t.detach().clone().requires_grad_() for t in (moe.experts.w13, moe.experts.w2))
    yd = dense_moe(dx, idx, dw, w13, w2, quantize)
    (yd * dy).sum().backward()
    torch.testing.assert_close(y, yd.detach(), **TIGHT)
    torch.testing.assert_close(xx.grad, dx.grad, **TIGHT)
    torch.testing.assert_close(ww.grad, dw.grad, **TIGHT)
    assert torch.equal(moe.experts.w13.grad, w13.grad) and torch.equal(moe.experts.w2.grad, w2.grad)


def test_routed_experts_empty_input():
    cfg = _cfg()
    moe = MoE(cfg)
    x = torch.zeros(0, H, requires_grad=True)
    y, dropped = routed_experts(x, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), moe.experts, cfg)
    assert y.shape == (0, H) and dropped == 0


@pytest.mark.parametrize("bad", [7, -1])
def test_routed_experts_invalid_expert_id_is_named(bad):
    cfg = _cfg()
    moe = MoE(cfg)
    idx = torch.tensor([[0, 1], [2, bad], [3, 0]])
    with pytest.raises(ValueError, match=rf"out of range.*{bad}"):
        routed_experts(torch.randn(3, H), idx, torch.rand(3, 2), moe.experts, cfg)
