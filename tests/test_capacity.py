"""Capacity (``MoEConfig.capacity_factor``) on the reference transport: which slots drop, that they contribute zero
and get zero gradient, and the drop counts, against the slot-by-slot rule of tests/moe_dense.capacity_keep.

Tolerances as in tests/test_layer.py: fp32 throughout; each expert sees the same kept rows in the same order under
EP and in the oracle, so only the order of the fp32 top-k / rank sums differs (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_ep import MoE, MoEConfig, init_ep
from moe_ep.experts.reference import expert_mlp
from moe_ep.router import route
from moe_ep.transport import combine, dispatch
from moe_ep.transport.reference import expand_layout
from tests._dist import run_distributed
from tests.moe_dense import capacity_keep, dense_moe

H, F = 64, 32
TIGHT = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "capacity,rows,slots,sizes,dropped",
    [
        (None, [1, 0, 1], [0, 0, 1], [1, 2], 0),
        (3, [1, 0, 1], [0, 0, 1], [1, 2], 0),
        (2, [1, 0], [0, 0], [1, 1], 1),  # expert 0's slot (row 1, slot 0) sorts before expert 1's two slots
        (1, [1], [0], [1, 0], 2),
        (0, [], [], [0, 0], 3),
    ],
)
def test_expand_layout_capacity_table(capacity, rows, slots, sizes, dropped):
    # recv_local [[1, -1], [0, 1]]: expanded order (expert 0: row 1 slot 0), (expert 1: row 0 slot 0, row 1 slot 1)
    got = expand_layout(torch.tensor([[1, -1], [0, 1]]), 2, capacity)
    assert got[0].tolist() == rows and got[1].tolist() == slots and got[2].tolist() == sizes and got[3] == dropped


@pytest.mark.parametrize(
    "c,tokens,top_k,rows", [(0.1, 3, 10, 3), (0.5, 13, 2, 13), (1.25, 7, 8, 70), (0.3, 6, 4, 8), (None, 5, 2, None)]
)
def test_capacity_rows_exact(c, tokens, top_k, rows):
    # 0.1 * 3 * 10 is 3.0000000000000004 in floats: a float ceil would keep 4 rows
    cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=16, top_k=top_k, capacity_factor=c)
    assert cfg.capacity_rows(tokens) == rows


def test_expand_layout_rejects_bad_capacity():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            expand_layout(torch.tensor([[0]]), 1, bad)


def _routes(case: str, counts: list[int], num_experts: int, top_k: int, gen: torch.Generator):
    """Per rank (topk_idx [n, top_k], topk_w [n, top_k]); "one_expert": every token's first choice is expert 3, so
    that expert's rank overflows first."""
    out = []
    for n in counts:
        rows = []
        for _ in range(n):
            if case == "one_expert":
                others = [e for e in torch.randperm(num_experts, generator=gen).tolist() if e != 3]
                rows.append(torch.tensor([3, *others[: top_k - 1]]))
            else:
                rows.append(torch.randperm(num_experts, generator=gen)[:top_k])
        idx = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
        out.append((idx, torch.rand(n, top_k, generator=gen) + 0.1))
    return out


CASES = [
    # (case, tokens per rank (cycled), num_experts, top_k, capacity_factor)
    ("random", [13, 7, 0, 21], 8, 2, 0.5),
    ("one_expert", [9, 16, 3, 5], 8, 2, 0.75),
    ("random", [6, 11, 4, 9], 8, 4, 0.3),
    ("random", [12, 12, 12, 12], 8, 2, 4.0),  # room for every slot: nothing drops
]


def _pipeline(rank: int, world: int) -> None:
    group = dist.group.WORLD if world > 1 else None
    for case, counts_all, num_experts, top_k, c in CASES:
        counts = [counts_all[i % 4] for i in range(world)]
        gen = torch.Generator().manual_seed(321)
        xs = [torch.randn(n, H, generator=gen) for n in counts]
        routes = _routes(case, counts, num_experts, top_k, gen)
        w13 = torch.randn(num_experts, 2 * F, H, generator=gen) * 0.1
        w2 = torch.randn(num_experts, H, F, generator=gen) * 0.1
        dys = [torch.randn(n, H, generator=gen) for n in counts]
        ccfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=num_experts, top_k=top_k, capacity_factor=c)
        caps = [ccfg.capacity_rows(n) for n in counts]
        keep = capacity_keep([r[0] for r in routes], num_experts, world, caps)
        nl = num_experts // world
        mine = slice(rank * nl, (rank + 1) * nl)

        x = xs[rank].clone().requires_grad_()
        tw = routes[rank][1].clone().requires_grad_()
        lw13, lw2 = w13[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
        rows, rw, handle = dispatch(x, routes[rank][0], tw, num_experts, group, True, capacity=caps[rank])
        y = combine(expert_mlp(rows, lw13, lw2, handle.group_sizes_host, True), rw, handle, True)
        (y * dys[rank]).sum().backward()

        dx = torch.cat(xs).clone().requires_grad_()
        dtw = torch.cat([r[1] for r in routes]).clone().requires_grad_()
        dw13, dw2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
        yd = dense_moe(dx, torch.cat([r[0] for r in routes]), dtw, dw13, dw2, True, keep=torch.cat(keep))
        (yd * torch.cat(dys)).sum().backward()

        ctx = f"case={case} c={c} rank={rank} world={world}"
        # slots routed to this rank's experts that the rule drops = this rank's count
        want_dropped = sum(int(((r[0] // nl == rank) & ~k).sum()) for r, k in zip(routes, keep, strict=True))
        assert handle.num_dropped == want_dropped, ctx
        assert rows.shape[0] == min(caps[rank], rows.shape[0] + handle.num_dropped), ctx
        total = sum(int((~k).sum()) for k in keep)  # every rank's drops (the rule runs on every rank)
        assert (total == 0) if c == 4.0 else (total > 0), f"{ctx}: {total} drops"
        lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
        torch.testing.assert_close(y, yd[lo:hi].detach(), **TIGHT, msg=lambda m, c=ctx: f"{c} y: {m}")
        torch.testing.assert_close(x.grad, dx.grad[lo:hi], **TIGHT, msg=lambda m, c=ctx: f"{c} dx: {m}")
        torch.testing.assert_close(tw.grad, dtw.grad[lo:hi], **TIGHT, msg=lambda m, c=ctx: f"{c} dw: {m}")
        assert torch.all(tw.grad[~keep[rank]] == 0), f"{ctx}: a dropped slot got a gradient"
        assert torch.equal(lw13.grad, dw13.grad[mine]) and torch.equal(lw2.grad, dw2.grad[mine]), ctx


@pytest.mark.parametrize("world", [1, 2, 4])
def test_capacity_matches_dense(world):
    run_distributed(_pipeline, world)


def _layer(rank: int, world: int) -> None:
    top_k, c = 2, 0.5
    mesh = init_ep(ep_size=world)
    cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=8, top_k=top_k, capacity_factor=c, max_tokens_per_rank=64)
    moe = MoE(cfg, mesh=mesh, seed=3)
    dense = MoE(MoEConfig(hidden=H, ffn_hidden=F, num_experts=8, top_k=top_k), mesh=None, seed=3)
    counts = [10 + 7 * i for i in range(world)]
    gen = torch.Generator().manual_seed(55)
    xs = [torch.randn(n, H, generator=gen) for n in counts]
    dys = [torch.randn(n, H, generator=gen) for n in counts]
    x = xs[rank].clone().requires_grad_()
    y, aux = moe(x)
    ((y * dys[rank]).sum() + aux).backward()

    dx = torch.cat(xs).clone().requires_grad_()
    routes = [route(t @ dense.router.weight.t(), top_k, cfg.renormalize) for t in dx.split(counts)]
    caps = [cfg.capacity_rows(n) for n in counts]
    keep = capacity_keep([r.topk_idx for r in routes], 8, world, caps)
    idx = torch.cat([r.topk_idx for r in routes])
    yd = dense_moe(
        dx, idx, torch.cat([r.topk_w for r in routes]), dense.experts.w13, dense.experts.w2, True, keep=torch.cat(keep)
    )
    ((yd * torch.cat(dys)).sum() + sum(r.aux_loss for r in routes) * cfg.aux_loss_coef).backward()

    nl = 8 // world
    want_dropped = sum(int(((r.topk_idx // nl == rank) & ~k).sum()) for r, k in zip(routes, keep, strict=True))
    assert moe.num_dropped == want_dropped > 0, (moe.num_dropped, want_dropped)
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    torch.testing.assert_close(y, yd[lo:hi].detach(), **TIGHT)
    torch.testing.assert_close(x.grad, dx.grad[lo:hi], **TIGHT)
    mine = slice(rank * nl, (rank + 1) * nl)
    torch.testing.assert_close(moe.experts.w13.grad, dense.experts.w13.grad[mine], **TIGHT)


@pytest.mark.parametrize("world", [1, 2])
def test_layer_capacity_matches_dense(world):
    run_distributed(_layer, world)
