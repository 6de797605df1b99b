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
from moe_ep.layer import routed_experts
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


@pytest.mark.parametrize(
    "sizing,ep,tokens,top_k,experts,rows",
    [
        ("exact", 1, 4096, 8, 64, 32768),  # ep 1: every slot is local, N = tokens * top_k, no host read either way
        ("worst_case", 1, 1000, 8, 64, 8000),
        ("exact", 1, 0, 8, 64, 1),  # at least 1 row
        ("exact", 4, 4096, 8, 256, None),  # ep > 1, exact: the transport reads N (host sync)
        ("worst_case", 4, 100, 8, 256, 4 * 4096 * 8),  # ep * max_tokens_per_rank * min(top_k, local experts)
        ("worst_case", 8, 4096, 8, 16, 8 * 4096 * 2),  # 2 local experts: a token sends at most 2 rows to a rank
    ],
)
def test_dropless_rows(sizing, ep, tokens, top_k, experts, rows):
    """The dropless buffers' rows known on the host (moe_ep.transport.nvshmem.buffer.layer_layout sizes by them)."""
    cfg = MoEConfig(
        hidden=H, ffn_hidden=F, num_experts=experts, top_k=top_k, max_tokens_per_rank=4096, dropless_sizing=sizing
    )
    assert cfg.dropless_rows(tokens, ep) == rows
    cap = MoEConfig(hidden=H, ffn_hidden=F, num_experts=experts, top_k=top_k, capacity_factor=1.0)
    assert cap.dropless_rows(tokens, ep) is None  # a capacity sizes the buffers itself


def test_dropless_sizing_rejects_bad_value():
    with pytest.raises(ValueError, match="dropless_sizing"):
        MoEConfig(hidden=H, ffn_hidden=F, num_experts=8, top_k=2, dropless_sizing="auto")


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


# ------------------------------------------------------------------------------ hand-worked tables, routed_experts
# Drop semantics through the functional layer ``moe_ep.layer.routed_experts`` (the path the cuda backend shares),
# with the kept slots written out by hand rather than computed: capacity rows = ceil(c * T * top_k) of the RECEIVING
# rank's own T; the expanded order is (local expert, source rank, source token). tests/moe_dense.capacity_keep is
# checked against the same tables.

_TOP8 = [[7, 6, 5, 4, 3, 2, 1, 0], [1, 0, 3, 2, 5, 4, 7, 6]]  # both tokens on every expert, in two slot orders

ROUTED_TABLES = [
    # (num_experts, top_k, capacity_factor, topk_idx, keep (1 = computed), num_dropped)
    # every token on expert 2; ceil(0.3 * 3 * 1) = 1 row: only (e2, t0) is computed
    (4, 1, 0.3, [[2], [2], [2]], [[1], [0], [0]], 2),
    # ceil(0.5 * 4 * 1) = 2 rows in the order (e0,t1) (e0,t2) (e0,t3) (e3,t0): expert 3's lone slot drops although
    # expert 0 is the overloaded one (expert-major order)
    (4, 1, 0.5, [[3], [0], [0], [0]], [[0], [1], [1], [0]], 2),
    # top 8 of 8, ceil(0.25 * 2 * 8) = 4 rows: (e0,t0) (e0,t1) (e1,t0) (e1,t1); token 0 holds experts 1, 0 in slots
    # 6, 7, token 1 in slots 0, 1
    (8, 8, 0.25, _TOP8, [[0, 0, 0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]], 12),
    # top 8 of 8, ceil(0.0625 * 16) = 1 row: only (e0, t0), token 0's slot 7
    (8, 8, 0.0625, _TOP8, [[0, 0, 0, 0, 0, 0, 0, 1], [0] * 8], 15),
    # top 8 of 8, c = 1: 16 rows, room for every slot
    (8, 8, 1.0, _TOP8, [[1] * 8, [1] * 8], 0),
]


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _check_routed_table(rank, world, cfg, xs, idxs, ws, dys, keep, dropped, group, moe, dense) -> None:
    """Run routed_experts on this rank's tokens and compare with the dense oracle under the hand-written ``keep``."""
    e, nl = cfg.num_experts, cfg.num_experts // world
    caps = [cfg.capacity_rows(x.shape[0]) for x in xs]
    got_keep = capacity_keep(idxs, e, world, caps)
    assert [k.tolist() for k in got_keep] == [k.tolist() for k in keep], "capacity_keep disagrees with the table"

    x, tw = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    y, num_dropped = routed_experts(x, idxs[rank], tw, moe.experts, cfg, group)
    (y * dys[rank]).sum().backward()

    dx = torch.cat(xs).clone().requires_grad_()
    dtw = torch.cat(ws).clone().requires_grad_()
    dw13, dw2 = dense.experts.w13.detach().clone(), dense.experts.w2.detach().clone()
    dw13.requires_grad_()
    dw2.requires_grad_()
    yd = dense_moe(dx, torch.cat(idxs), dtw, dw13, dw2, cfg.quantize, keep=torch.cat(keep))
    (yd * torch.cat(dys)).sum().backward()

    ctx = f"rank={rank} world={world} E={e} top_k={cfg.top_k} c={cfg.capacity_factor}"
    assert int(num_dropped) == dropped[rank], f"{ctx}: num_dropped {int(num_dropped)} != {dropped[rank]}"
    lo, hi = sum(x.shape[0] for x in xs[:rank]), sum(x.shape[0] for x in xs[: rank + 1])
    none_kept = ~keep[rank].any(1)
    assert torch.equal(y[none_kept], torch.zeros_like(y[none_kept])), f"{ctx}: a token with every slot dropped"
    torch.testing.assert_close(y, yd[lo:hi].detach(), **TIGHT, msg=lambda m: f"{ctx} y: {m}")
    torch.testing.assert_close(x.grad, dx.grad[lo:hi], **TIGHT, msg=lambda m: f"{ctx} dx: {m}")
    torch.testing.assert_close(tw.grad, dtw.grad[lo:hi], **TIGHT, msg=lambda m: f"{ctx} dw: {m}")
    assert torch.all(tw.grad[~keep[rank]] == 0), f"{ctx}: a dropped slot got a gradient"
    mine = slice(rank * nl, (rank + 1) * nl)
    # the same kept rows in the same order per expert: bitwise (module docstring); unused experts get zeros
    assert torch.equal(_grad_or_zeros(moe.experts.w13), _grad_or_zeros(dw13)[mine]), f"{ctx}: w13.grad"
    assert torch.equal(_grad_or_zeros(moe.experts.w2), _grad_or_zeros(dw2)[mine]), f"{ctx}: w2.grad"


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("table", range(len(ROUTED_TABLES)))
def test_routed_experts_capacity_table(table, quantize):
    e, top_k, c, idx, keep, dropped = ROUTED_TABLES[table]
    cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=e, top_k=top_k, capacity_factor=c, quantize=quantize)
    moe = MoE(cfg, seed=9)
    gen = torch.Generator().manual_seed(table)
    n = len(idx)
    xs, dys = [torch.randn(n, H, generator=gen)], [torch.randn(n, H, generator=gen)]
    ws = [torch.rand(n, top_k, generator=gen) + 0.1]
    keep_t = [torch.tensor(keep, dtype=torch.bool)]
    _check_routed_table(0, 1, cfg, xs, [torch.tensor(idx)], ws, dys, keep_t, [dropped], None, moe, moe)


ROUTED_TABLES_2 = [
    # (num_experts, top_k, capacity_factor, topk_idx per rank, keep per rank, num_dropped per rank); 2 ranks, 2 local
    # experts each. Every token on expert 3 (rank 1): rank 1 keeps ceil(0.5 * 2 * 1) = 1 row of the 5 it receives,
    # (rank 0, t0); rank 0's own capacity ceil(0.5 * 3) = 2 is unused. Rank 1's tokens all drop: y = 0 there.
    (4, 1, 0.5, [[[3], [3], [3]], [[3], [3]]], [[[1], [0], [0]], [[0], [0]]], [0, 4]),
    # rank 0 has no tokens, so its capacity is ceil(0.25 * 0 * 2) = 0: all 4 slots of rank 1's tokens on expert 0
    # drop; rank 1 keeps ceil(0.25 * 4 * 2) = 2 of the 4 slots on expert 2 (tokens 0 and 1, slot 1)
    (4, 2, 0.25, [[], [[0, 2], [0, 2], [0, 2], [0, 2]]], [[], [[0, 1], [0, 1], [0, 0], [0, 0]]], [4, 2]),
]


def _routed_tables_2(rank: int, world: int) -> None:
    mesh = init_ep(ep_size=world)
    for t, (e, top_k, c, idx, keep, dropped) in enumerate(ROUTED_TABLES_2):
        for quantize in (True, False):
            cfg = MoEConfig(hidden=H, ffn_hidden=F, num_experts=e, top_k=top_k, capacity_factor=c, quantize=quantize)
            moe = MoE(cfg, mesh=mesh, seed=4)
            dense = MoE(cfg, mesh=None, seed=4)  # the same global weights
            gen = torch.Generator().manual_seed(100 + t)
            counts = [len(i) for i in idx]
            xs = [torch.randn(n, H, generator=gen) for n in counts]
            dys = [torch.randn(n, H, generator=gen) for n in counts]
            ws = [torch.rand(n, top_k, generator=gen) + 0.1 for n in counts]
            idxs = [torch.tensor(i, dtype=torch.int64).reshape(-1, top_k) for i in idx]
            keep_t = [torch.tensor(k, dtype=torch.bool).reshape(-1, top_k) for k in keep]
            _check_routed_table(rank, world, cfg, xs, idxs, ws, dys, keep_t, dropped, moe.ep_group, moe, dense)


def test_routed_experts_capacity_tables_two_ranks():
    run_distributed(_routed_tables_2, 2)
