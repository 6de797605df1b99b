"""benchmarks/torchtitan_moe.py's ``gemm="fp8_rowwise"`` (torchtitan's layer on torchao's FP8 rowwise grouped GEMM)
and its bench_layer variant, on the CPU: torchao's FP8 GEMMs cannot run here (E4M3 tensor cores, triton), so the
construction path and the layer's plumbing run on stand-ins with torchao's contract (the grouped GEMM asserts what
``_to_fp8_rowwise_then_scaled_grouped_mm`` asserts, then computes in bf16; the padded permute follows
``ep.permute.permute_and_pad``: a zero row appended, int32 indices with -1 at the padding slots, group sizes
``round_up(max(n, a), a)``). The real torchao path runs in the ``gpu`` test, where torchao and a GPU with FP8 are.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import torchtitan_moe as tm  # noqa: E402

H, F, E, K, T = 32, 48, 4, 2, 40


def _standin_grouped_mm(calls: list):
    def grouped_mm(a: torch.Tensor, b_t: torch.Tensor, config, offs: torch.Tensor) -> torch.Tensor:
        assert config == "cfg"
        assert a.ndim == 2 and a.is_contiguous() and a.dtype == torch.bfloat16 and a.shape[-1] % 16 == 0
        assert b_t.ndim == 3 and b_t.stride(-2) == 1 and b_t.shape[-1] % 16 == 0  # column-major B_t, as torchao needs
        assert offs.dtype == torch.int32
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert bool((sizes % 16 == 0).all()), f"group sizes {sizes.tolist()} not multiples of 16"
        calls.append(sizes.tolist())
        return torch._grouped_mm(a, b_t, offs=offs)

    return grouped_mm


def _standin_permute_and_pad(x, counts, ep_degree, num_local, alignment):
    """torchao's permute_and_pad, by its contract (rank-major (rank, expert) counts -> expert-major padded rows)."""
    max_len = -(-(x.shape[0] + num_local * alignment) // alignment) * alignment
    c = counts.view(ep_degree, num_local)
    starts = (counts.cumsum(0) - counts).view(ep_degree, num_local)
    m_sizes = ((c.sum(0).clamp_min(alignment) + alignment - 1) // alignment * alignment).to(torch.int32)
    idx = torch.full((max_len,), -1, dtype=torch.int32)
    w = 0
    for e in range(num_local):
        pos = w
        for r in range(ep_degree):
            n = int(c[r, e])
            idx[pos : pos + n] = torch.arange(int(starts[r, e]), int(starts[r, e]) + n, dtype=torch.int32)
            pos += n
        w += int(m_sizes[e])
    x = torch.vstack((x, x.new_zeros((1, x.shape[-1]))))
    return x.shape, x[idx, :], idx, m_sizes, m_sizes.cumsum(0).to(torch.int32)


def _standins(calls: list) -> dict:
    return {
        "grouped_mm": _standin_grouped_mm(calls),
        "config": "cfg",
        "permute_and_pad": _standin_permute_and_pad,
        "version": "standin",
    }


def _pair(calls: list):
    torch.manual_seed(0)
    ref = tm.TorchtitanMoE(H, F, E, K, dtype=torch.bfloat16)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fp8 = tm.TorchtitanMoE(H, F, E, K, dtype=torch.bfloat16, gemm="fp8_rowwise", torchao_fns=_standins(calls))
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def _step(layer, x, g):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    out = {"y": y.detach(), "dx": x.grad, **layer.grads_moe_ep_layout()}
    for p in layer.parameters():
        p.grad = None
    return out


def test_fp8_rowwise_plumbing_matches_bf16_layer():
    """With a bf16 stand-in for torchao's GEMM, the fp8_rowwise layer (torchao's padded permute, groups of 16) computes
    what the bf16 layer does; every grouped GEMM saw 16-row groups, in a column-major B_t."""
    calls: list = []
    ref, fp8 = _pair(calls)
    assert fp8.align == 16 and ref.align == 1 and fp8.gemm == "fp8_rowwise" and ref.gemm == "bf16"
    assert fp8.experts.gemm == "fp8_rowwise" and ref.experts._ao is None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).bfloat16()
    g = torch.randn(T, H, generator=gen).bfloat16()
    a, b = _step(ref, x, g), _step(fp8, x, g)
    assert len(calls) == 3  # w1, w3, w2 in the forward (the stand-in's backward is torch._grouped_mm's)
    assert all(len(s) == E for s in calls)
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=2e-2, msg=k)
    # the same parameters, the same plain-tensor state (torchtitan keeps FP8 experts' parameters plain)
    assert all(type(p) is torch.nn.Parameter for p in fp8.parameters())
    assert fp8.gemm_info["torchao"] == "standin" and fp8.gemm_info["group_align"] == 16
    assert fp8.gemm_info["permute"].endswith("_standin_permute_and_pad")


def _ep2_worker(rank: int, world: int) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    calls: list = []
    torch.manual_seed(10 + rank)  # each rank its own local experts and tokens
    group = dist.group.WORLD
    ref = tm.TorchtitanMoE(H, F, 2 * E, K, group, dtype=torch.bfloat16)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        dist.broadcast(ref.gate, 0)  # one router
    fns = _standins(calls)
    fp8 = tm.TorchtitanMoE(H, F, 2 * E, K, group, dtype=torch.bfloat16, gemm="fp8_rowwise", torchao_fns=fns)
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(T + 8 * rank, H).bfloat16()  # uneven: the ranks receive different row counts
    g = torch.randn(T + 8 * rank, H).bfloat16()
    a, b = _step(ref, x, g), _step(fp8, x, g)
    assert len(calls) == 3 and all(len(c) == E for c in calls)
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=2e-2, msg=k)


def test_fp8_rowwise_plumbing_under_ep2():
    """The same on 2 gloo ranks: all-to-all, torchao's rank-major -> expert-major padded permute and the unpad."""
    run_distributed(_ep2_worker, 2)


def test_fp8_rowwise_empty_expert_gets_a_padded_group():
    """An expert with no rows still gets 16 (zero) rows, as torchao pads it; the output is unchanged."""
    calls: list = []
    ref, fp8 = _pair(calls)
    with torch.no_grad():
        fp8.expert_bias[0] = -1e4  # no token picks expert 0
        ref.expert_bias[0] = -1e4
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    g = torch.ones(T, H, dtype=torch.bfloat16)
    a, b = _step(ref, x, g), _step(fp8, x, g)
    assert calls[0][0] == 16
    torch.testing.assert_close(b["y"].float(), a["y"].float(), rtol=2e-2, atol=2e-2)


def test_fp8_rowwise_options_and_missing_torchao(monkeypatch):
    with pytest.raises(ValueError, match="multiple of 16"):
        tm.TorchtitanMoE(H, F, E, K, gemm="fp8_rowwise", align=8, torchao_fns=_standins([]))
    with pytest.raises(ValueError, match="gemm must be"):
        tm.TorchtitanMoE(H, F, E, K, gemm="fp8")
    with pytest.raises(ValueError, match="divisible by 16"):
        tm.TorchtitanMoE(H, 40, E, K, gemm="fp8_rowwise", torchao_fns=_standins([]))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(ImportError, match="torchao"):
        tm.TorchtitanMoE(H, F, E, K, gemm="fp8_rowwise")
    assert "torchao" in tm.torchao_fp8_rowwise_info()["error"]
    tm.TorchtitanMoE(H, F, E, K)  # bf16 does not import torchao


def test_bench_layer_variant_ratios_and_targets():
    pytest.importorskip("torch.distributed")
    import bench_layer as bl  # noqa: PLC0415

    assert "torchtitan_fp8_rowwise" in bl.VARIANTS and "torchtitan_fp8_rowwise" not in bl.DRY_VARIANTS
    assert bl.FP8_ROWWISE_BOUND == bl.MXFP8_BOUND
    for shape in ("dsv3", "small"):
        assert bl.TARGETS[shape]["blockwise_vs_torchtitan_fp8_rowwise"] == 1.6
    ms = {"torchtitan_bf16": 30.0, "torchtitan_fp8_rowwise": 24.0, "bf16": 18.0, "mxfp8": 20.0}
    ms |= {"blockwise": 12.0, "blockwise_cached": 10.0}
    rows = [{"variant": v, "fwd_bwd_ms": t, "fwd_ms": t / 3} for v, t in ms.items()]
    r = bl.ratios("dsv3", rows)
    assert r["blockwise_vs_torchtitan_fp8_rowwise"] == {"measured": 2.0, "target": 1.6, "met": True}
    assert math.isclose(r["mxfp8_vs_torchtitan_fp8_rowwise"]["measured"], 1.2)
    assert math.isclose(r["blockwise_cached_vs_torchtitan_fp8_rowwise"]["measured"], 2.4)
    assert math.isclose(r["torchtitan_fp8_rowwise_vs_torchtitan_bf16"]["measured"], 1.25)
    r = bl.ratios("small", [x for x in rows if x["variant"] != "torchtitan_fp8_rowwise"])
    assert r["blockwise_vs_torchtitan_fp8_rowwise"] == {"measured": None, "target": 1.6, "met": None}


@pytest.mark.gpu
def test_fp8_rowwise_real_torchao_against_bf16():
    """torchao's FP8 rowwise path itself (GPU with FP8, torchao installed): within the bench's bound of bf16."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao (pip install torchao==0.18.0)")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs SM89 or later")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h, f, e, k, t = 256, 512, 8, 2, 1024
    ref = tm.TorchtitanMoE(h, f, e, k, device=dev, dtype=torch.bfloat16)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=h**-0.5)
    fp8 = tm.TorchtitanMoE(h, f, e, k, device=dev, dtype=torch.bfloat16, gemm="fp8_rowwise")
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(t, h, device=dev).bfloat16()
    g = torch.randn(t, h, device=dev).bfloat16()
    a, b = _step(ref, x, g), _step(fp8, x, g)
    for key in a:
        rel = float((b[key].float() - a[key].float()).norm() / a[key].float().norm())
        assert rel < 0.15, (key, rel)
    assert fp8.gemm_info["grouped_mm"].endswith("_quantize_then_scaled_grouped_mm")
