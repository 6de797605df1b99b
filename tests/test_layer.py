"""EP MoE on 1, 2 and 4 CPU processes (gloo) against a single-process dense oracle with the same weights.

Tolerances: everything runs in fp32. Each expert sees the same rows in the same order under EP and in the
oracle (tokens concatenated in rank order), so its GEMM operands, MXFP8 blocks and therefore its outputs and
weight gradients are bitwise identical; only the fp32 reductions differ in order (EP sums top-k slots per
(token, rank), then ranks; the oracle sums all slots at once) -- a few fp32 ulps of the summands, hence
rtol=1e-5, atol=1e-6 on values of order 1e-2..1. bf16 runs compare at bf16 resolution (2^-8 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_ep import MoE, MoEConfig, init_ep
from moe_ep.experts.reference import expert_mlp
from moe_ep.router import route
from moe_ep.transport import combine, dispatch
from tests._dist import run_distributed
from tests.moe_dense import dense_moe

H, F = 64, 32
TIGHT = dict(rtol=1e-5, atol=1e-6)


def _routing(case: str, counts: list[int], num_experts: int, top_k: int, gen: torch.Generator):
    """Routing of every rank's tokens for an awkward case -> list of (topk_idx, topk_w) per rank."""
    out = []
    for n in counts:
        if case == "one_expert":  # every token's only expert is 3
            idx = torch.full((n, top_k), 3, dtype=torch.int64)
        else:  # "sparse": only experts 0 and 5 get tokens; the rest (whole ranks at ep=4) get none
            pool, mult = (2, 5) if case == "sparse" else (num_experts, 1)
            perms = [torch.randperm(pool, generator=gen)[:top_k] * mult for _ in range(n)]
            idx = torch.stack(perms) if perms else torch.zeros(0, top_k, dtype=torch.int64)
        w = torch.rand(n, top_k, generator=gen) + 0.1
        out.append((idx, w))
    return out


CASES = [
    # (case, tokens per rank (cycled), num_experts, top_k, dtype)
    ("random", [13, 7, 0, 21], 8, 2, torch.float32),
    ("one_expert", [5, 9, 1, 3], 8, 1, torch.float32),
    ("topk8", [6, 11, 4, 0], 8, 8, torch.float32),
    ("sparse", [10, 0, 17, 2], 8, 2, torch.float32),
    ("random", [9, 16, 3, 5], 8, 2, torch.bfloat16),
]


def _pipeline(rank: int, world: int, device: str = "cpu") -> None:
    group = dist.group.WORLD if world > 1 else None
    for case, counts_all, num_experts, top_k, dtype in CASES:
        counts = [counts_all[i % 4] for i in range(world)]
        gen = torch.Generator().manual_seed(123)
        xs = [torch.randn(n, H, generator=gen).to(dtype) for n in counts]
        routes = _routing(case, counts, num_experts, top_k, gen)
        w13 = (torch.randn(num_experts, 2 * F, H, generator=gen) * 0.1).to(dtype)
        w2 = (torch.randn(num_experts, H, F, generator=gen) * 0.1).to(dtype)
        dys = [torch.randn(n, H, generator=gen).to(dtype) for n in counts]
        xs, dys, w13, w2 = [t.to(device) for t in xs], [t.to(device) for t in dys], w13.to(device), w2.to(device)
        routes = [(i.to(device), w.to(device)) for i, w in routes]
        nl = num_experts // world
        mine = slice(rank * nl, (rank + 1) * nl)

        # EP
        x = xs[rank].clone().requires_grad_()
        tw = routes[rank][1].clone().requires_grad_()
        lw13, lw2 = w13[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
        rows, rw, handle = dispatch(x, routes[rank][0], tw, num_experts, group, quantize=True)
        assert handle.group_sizes.sum().item() == rows.shape[0]
        y = combine(expert_mlp(rows, lw13, lw2, handle.group_sizes_host, True), rw, handle, True)
        (y * dys[rank]).sum().backward()

        # dense oracle on every rank's tokens
        dx = torch.cat(xs).clone().requires_grad_()
        dtw = torch.cat([r[1] for r in routes]).clone().requires_grad_()
        dw13, dw2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
        dy_ = dense_moe(dx, torch.cat([r[0] for r in routes]), dtw, dw13, dw2, quantize=True)
        (dy_ * torch.cat(dys)).sum().backward()

        lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
        tol = TIGHT if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
        ctx = f"case={case} rank={rank} world={world} dtype={dtype}"
        torch.testing.assert_close(y, dy_[lo:hi].detach(), **tol, msg=lambda m, c=ctx: f"{c} y: {m}")
        torch.testing.assert_close(x.grad, dx.grad[lo:hi], **tol, msg=lambda m, c=ctx: f"{c} dx: {m}")
        torch.testing.assert_close(tw.grad, dtw.grad[lo:hi], **tol, msg=lambda m, c=ctx: f"{c} dw: {m}")
        # expert weight grads: identical rows/order/blocks -> bitwise equal (see module docstring)
        assert torch.equal(lw13.grad, dw13.grad[mine]), ctx
        assert torch.equal(lw2.grad, dw2.grad[mine]), ctx
        if case == "sparse" and world == 4:
            assert rank not in (0, 2) or handle.num_expanded > 0
            assert rank not in (1, 3) or handle.num_expanded == 0  # these ranks' experts get no token


def _layer(rank: int, world: int, ep: int, top_k: int, device: str = "cpu") -> None:
    mesh = init_ep(ep_size=ep)
    cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=8, top_k=top_k, max_tokens_per_rank=64)
    moe = MoE(cfg, mesh=mesh, seed=7).to(device)
    dense = MoE(cfg, mesh=None, seed=7).to(device)  # the same global weights (drawn per global expert)
    ep_rank, dp_rank = mesh["ep"].get_local_rank(), mesh["dp"].get_local_rank()
    counts = [11 + 5 * ((dp_rank + i) % 3) for i in range(ep)]  # differ per rank and per EP group
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    xs = [torch.randn(n, H, generator=gen).to(device) for n in counts]
    dys = [torch.randn(n, H, generator=gen).to(device) for n in counts]

    x = xs[ep_rank].clone().requires_grad_()
    y, aux = moe(x)
    ((y * dys[ep_rank]).sum() + aux).backward()
    grad_router = moe.router.weight.grad.clone()
    if ep > 1:  # the router is replicated: its gradient is the sum over the EP group's tokens
        dist.all_reduce(grad_router, group=mesh["ep"].get_group())

    dx = torch.cat(xs).clone().requires_grad_()
    routes = [route(c @ dense.router.weight.t(), top_k, cfg.renormalize) for c in dx.split(counts)]
    idx = torch.cat([r.topk_idx for r in routes])
    tw = torch.cat([r.topk_w for r in routes])
    yd = dense_moe(dx, idx, tw, dense.experts.w13, dense.experts.w2, quantize=True)
    auxd = sum(r.aux_loss for r in routes) * cfg.aux_loss_coef
    ((yd * torch.cat(dys)).sum() + auxd).backward()

    lo, hi = sum(counts[:ep_rank]), sum(counts[: ep_rank + 1])
    mine = slice(ep_rank * moe.num_local_experts, (ep_rank + 1) * moe.num_local_experts)
    torch.testing.assert_close(y, yd[lo:hi].detach(), **TIGHT)
    torch.testing.assert_close(x.grad, dx.grad[lo:hi], **TIGHT)
    torch.testing.assert_close(grad_router, dense.router.weight.grad, **TIGHT)
    torch.testing.assert_close(moe.experts.w13.grad, dense.experts.w13.grad[mine], **TIGHT)
    torch.testing.assert_close(moe.experts.w2.grad, dense.experts.w2.grad[mine], **TIGHT)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_matches_dense(world):
    run_distributed(_pipeline, world)


@pytest.mark.parametrize("world,ep,top_k", [(1, 1, 2), (2, 2, 8), (4, 4, 1), (4, 2, 2)])
def test_layer_matches_dense(world, ep, top_k):
    run_distributed(_layer, world, ep, top_k)
