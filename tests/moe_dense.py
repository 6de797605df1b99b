"""Single-process dense oracle of the MoE: every expert in one place, tokens of all ranks concatenated in
rank order (so each expert sees its rows in the same order as under EP), no dispatch/combine code."""

from __future__ import annotations

import torch

from moe_ep import mxfp8
from moe_ep.experts.reference import expert_mlp


class _QuantizeGrad(torch.autograd.Function):
    """Identity forward; backward rounds dy through MXFP8 (the combine-backward dispatch of dy)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return mxfp8.fake_quantize(dy.contiguous(), -1)


def dense_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    quantize: bool,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H], topk_idx/topk_w: [T, k], w13: [E, 2F, H], w2: [E, H, F] (all experts) -> y [T, H].

    keep: [T, k] bool, the slots that are computed (None: all); the others contribute nothing.
    """
    num_tokens, k = topk_idx.shape
    xq = x + (mxfp8.fake_quantize(x, -1) - x).detach() if quantize else x  # straight-through
    contrib = x.new_zeros(num_tokens, k, x.shape[1], dtype=torch.float32)
    for e in range(w13.shape[0]):
        hit = topk_idx == e if keep is None else (topk_idx == e) & keep
        tok, slot = hit.nonzero(as_tuple=True)  # ascending token order
        if tok.numel() == 0:
            continue
        out = expert_mlp(xq[tok], w13[e : e + 1], w2[e : e + 1], [tok.numel()], quantize)
        contrib = contrib.index_put((tok, slot), out.to(torch.float32) * topk_w[tok, slot][:, None])
    y = contrib.sum(1).to(x.dtype)
    return _QuantizeGrad.apply(y) if quantize else y


def capacity_keep(
    idx_per_rank: list[torch.Tensor], num_experts: int, world: int, caps: list[int | None]
) -> list[torch.Tensor]:
    """The capacity rule written out slot by slot: rank r keeps the first caps[r] of the slots routed to its experts
    in (local expert, source rank, source token) order (None: all) -> per source rank a [T, k] bool keep mask.

    Example: world 1, 2 experts, idx [[1], [0], [1]], cap 2 -> order (e0, t1), (e1, t0), (e1, t2): keep
    [[True], [True], [False]].
    """
    nl = num_experts // world
    keep = [torch.ones(idx.shape, dtype=torch.bool) for idx in idx_per_rank]
    for r in range(world):
        slots = []
        for src, idx in enumerate(idx_per_rank):
            for t, row in enumerate(idx.tolist()):
                for j, e in enumerate(row):
                    if e // nl == r:
                        slots.append((e % nl, src, t, j))
        slots.sort()
        if caps[r] is not None:
            for _, src, t, j in slots[caps[r] :]:
                keep[src][t, j] = False
    return keep
