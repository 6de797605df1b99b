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
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, quantize: bool
) -> torch.Tensor:
    """x: [T, H], topk_idx/topk_w: [T, k], w13: [E, 2F, H], w2: [E, H, F] (all experts) -> y [T, H]."""
    num_tokens, k = topk_idx.shape
    xq = x + (mxfp8.fake_quantize(x, -1) - x).detach() if quantize else x  # straight-through
    contrib = x.new_zeros(num_tokens, k, x.shape[1], dtype=torch.float32)
    for e in range(w13.shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)  # ascending token order
        if tok.numel() == 0:
            continue
        out = expert_mlp(xq[tok], w13[e : e + 1], w2[e : e + 1], [tok.numel()], quantize)
        contrib = contrib.index_put((tok, slot), out.to(torch.float32) * topk_w[tok, slot][:, None])
    y = contrib.sum(1).to(x.dtype)
    return _QuantizeGrad.apply(y) if quantize else y
