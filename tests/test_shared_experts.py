"""Shared experts (``num_shared_experts`` / ``shared_ffn_hidden``) on the reference backend: the SwiGLU against a
hand-worked value, the layer with them against itself without them plus the SwiGLU, and under EP on 2 gloo ranks
(with DeepSeek-V3 routing: sigmoid, groups, a non-zero expert bias, route_scale) against one process holding every
expert. The side-stream overlap is CUDA only: tests/multigpu/moe_cuda_graph.py (graph capture, determinism) and
tests/multigpu/hf_cuda.py (the overlap in a profile; the cuda backend inside HF models)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_ep import MoE, MoEConfig, init_ep, update_expert_bias
from moe_ep.shared_experts import SharedExperts, with_shared_experts
from tests._dist import run_distributed

# fp32 everywhere; EP vs one process differ only in the order of fp32 sums (module docstring of tests/test_layer.py)
TIGHT = dict(rtol=1e-5, atol=1e-6)


def test_swiglu_hand_value():
    # H=2, width 1: gate row [1 0], up row [0 2], w2 [[1], [3]]; x = [1 1] -> gate 1, up 2 -> h = silu(1) * 2
    s = SharedExperts(2, 1)
    with torch.no_grad():
        s.w13.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        s.w2.copy_(torch.tensor([[1.0], [3.0]]))
    h = 2.0 / (1.0 + math.exp(-1.0))
    torch.testing.assert_close(s(torch.tensor([[1.0, 1.0]])), torch.tensor([[h, 3 * h]]))


def test_config_width_default_and_cpu_path():
    cfg = MoEConfig(hidden=32, ffn_hidden=16, num_experts=4, top_k=2, num_shared_experts=3, quantize=False)
    assert cfg.shared_width == 48
    moe = MoE(cfg)
    assert moe.shared_experts.w13.shape == (96, 32) and moe.shared_experts.w2.shape == (32, 48)
    x = torch.randn(5, 32)
    y, ys = with_shared_experts(moe.shared_experts, x, lambda: torch.zeros(5, 32), overlap=True)  # CPU: no stream
    assert torch.equal(y, torch.zeros(5, 32)) and torch.equal(ys, moe.shared_experts(x))


def test_layer_is_routed_plus_shared():
    base = dict(hidden=32, ffn_hidden=32, num_experts=4, top_k=2, quantize=False, backend="reference")
    with_shared = MoE(MoEConfig(**base, num_shared_experts=1, shared_ffn_hidden=24), seed=2)
    plain = MoE(MoEConfig(**base), seed=2)  # the same router / expert weights (drawn per global expert first)
    assert torch.equal(plain.experts.w13, with_shared.experts.w13)
    x = torch.randn(2, 3, 32)
    y, _ = with_shared(x)
    y0, _ = plain(x)
    torch.testing.assert_close(y, y0 + with_shared.shared_experts(x.reshape(-1, 32)).reshape(2, 3, 32), **TIGHT)


def _ep(rank: int, world: int) -> None:
    cfg = MoEConfig(hidden=32, ffn_hidden=32, num_experts=8, top_k=2, quantize=False, backend="reference",
                    score_func="sigmoid", n_group=4, topk_group=2, route_scale=2.0, expert_bias=True,
                    num_shared_experts=2, shared_ffn_hidden=40, max_tokens_per_rank=32)  # fmt: skip
    mesh = init_ep(ep_size=2)
    moe, full = MoE(cfg, mesh=mesh, seed=4), MoE(cfg, seed=4)
    bias = torch.linspace(-0.1, 0.1, 8)
    with torch.no_grad():
        moe.router.expert_bias.copy_(bias)
        full.router.expert_bias.copy_(bias)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, 32, generator=gen) for n in (7, 12)]
    dys = [torch.randn(n, 32, generator=gen) for n in (7, 12)]
    x = xs[rank].clone().requires_grad_()
    y, _ = moe(x)
    (y * dys[rank]).sum().backward()
    xf = torch.cat(xs).requires_grad_()
    yf, _ = full(xf)
    (yf * torch.cat(dys)).sum().backward()
    lo = 0 if rank == 0 else 7
    torch.testing.assert_close(y, yf[lo : lo + x.shape[0]].detach(), **TIGHT)
    torch.testing.assert_close(x.grad, xf.grad[lo : lo + x.shape[0]], **TIGHT)
    for name in ("router.weight", "shared_experts.w13", "shared_experts.w2"):  # replicated: sum over the ranks
        g = dict(moe.named_parameters())[name].grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, dict(full.named_parameters())[name].grad, **TIGHT)
    mine = slice(4 * rank, 4 * rank + 4)
    torch.testing.assert_close(moe.experts.w13.grad, full.experts.w13.grad[mine], **TIGHT)
    torch.testing.assert_close(moe.experts.w2.grad, full.experts.w2.grad[mine], **TIGHT)
    # the expert-bias update: counts summed over both ranks = the one process's counts of every token
    assert update_expert_bias(moe) == 1 and update_expert_bias(full) == 1
    assert not moe.router.expert_counts.any()
    torch.testing.assert_close(moe.router.expert_bias, full.router.expert_bias, rtol=0, atol=0)
    assert not torch.equal(full.router.expert_bias, bias)  # it moved


def _bias_hand_table(rank: int) -> None:
    """Hand-worked: rank 0 routes 4 tokens to expert 0, rank 1 2 tokens to expert 2 -> load [4 0 2 0], mean 1.5 ->
    sign(mean - load) = [-1 +1 -1 +1] -> bias = 0.5 * that on both ranks."""
    cfg = MoEConfig(hidden=32, ffn_hidden=32, num_experts=4, top_k=1, quantize=False, backend="reference",
                    expert_bias=True, bias_update_rate=0.5, max_tokens_per_rank=16)  # fmt: skip
    moe = MoE(cfg, mesh=init_ep(ep_size=2))
    with torch.no_grad():  # token t goes to the expert of its one-hot row
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = torch.eye(4) * 10
    experts = [[0, 0, 0, 0], [2, 2]][rank]
    x = torch.zeros(len(experts), 32)
    for t, e in enumerate(experts):
        x[t, e] = 1.0
    moe.train()
    moe(x)
    update_expert_bias(moe)
    assert moe.router.expert_bias.tolist() == [-0.5, 0.5, -0.5, 0.5], moe.router.expert_bias


def _two_ranks(rank: int, world: int) -> None:
    _ep(rank, world)
    _bias_hand_table(rank)


def test_shared_experts_dsv3_routing_and_bias_update_under_ep_two_ranks():
    run_distributed(_two_ranks, 2)
