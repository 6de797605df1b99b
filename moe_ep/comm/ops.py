"""Dispatch and combine with autograd, following the fast path's structure.

Forward:  dispatch = MXFP8 quantize + send once per (token, rank) + expert-sorted expansion;
          combine  = weight by top-k weight, reduce per (token, rank) on the expert side, send back, sum on
                     the source rank in rank order.
Backward: combine-backward is an MXFP8 dispatch of dy; dispatch-backward is a combine of dx (and of the
          top-k weight gradients). The forward's handle is reused; nothing is recomputed.

Quantization uses a straight-through gradient: the dispatch payload's quantization is the identity for
the backward pass (as in every MXFP8 training recipe); dy is quantized where the fast path sends it.
"""

from __future__ import annotations

import sys

import torch

from .. import mxfp8
from .handle import EPHandle
from .reference import RecvBuffers, _all_to_all, build_layout, dispatch_send, rank_reduce, send_rows, slot_reduce


def _rows(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Received payload -> values: [R, H] e4m3 + [R, H//32] scales (or plain rows) -> [R, H] dtype."""
    return data if scale is None else mxfp8.dequantize(mxfp8.MXFP8Tensor(data, scale, 1), dtype)


def dispatch_fwd(
    x: torch.Tensor, topk_w: torch.Tensor, handle: EPHandle, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H], topk_w: [T, top_k] fp32 -> (expanded x [N, H] x.dtype, expanded weights [N] fp32)."""
    recv: RecvBuffers = dispatch_send(x, topk_w, handle, quantize)
    rows = _rows(recv.data, recv.scale, x.dtype)
    return rows[handle.expand_row], recv.weight[handle.expand_row, handle.expand_slot]


def dispatch_bwd(
    grad_rows: torch.Tensor, grad_w: torch.Tensor, handle: EPHandle, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine of dx: grad_rows [N, H], grad_w [N] fp32 -> (dx [T, H] dtype, d topk_w [T, top_k] fp32)."""
    grp, ss, rs = handle.group, handle.send_splits, handle.recv_splits
    per_row = slot_reduce(grad_rows, handle, handle.num_recv).to(dtype)  # the wire carries `dtype`
    dx = rank_reduce(_all_to_all(per_row, rs, ss, grp), handle).to(dtype)
    gw = torch.zeros(handle.num_recv, handle.top_k, dtype=torch.float32, device=grad_w.device)
    gw[handle.expand_row, handle.expand_slot] = grad_w.to(torch.float32)
    gw_src = _all_to_all(gw, rs, ss, grp)  # [S, top_k]
    row_of_slot = handle.send_row_of.gather(1, handle.topk_rank)  # [T, top_k]: each slot's sent row
    slots = torch.arange(handle.top_k, device=gw_src.device).expand_as(row_of_slot)
    return dx, gw_src[row_of_slot, slots]


def combine_fwd(y: torch.Tensor, w: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """y: [N, H] expert outputs, w: [N] fp32 -> [T, H] y.dtype (fp32 sums, y.dtype on the wire)."""
    per_row = slot_reduce(y.to(torch.float32) * w[:, None], handle, handle.num_recv).to(y.dtype)
    back = _all_to_all(per_row, handle.recv_splits, handle.send_splits, handle.group)
    return rank_reduce(back, handle).to(y.dtype)


def combine_bwd(
    dy: torch.Tensor, y: torch.Tensor, w: torch.Tensor, handle: EPHandle, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 dispatch of dy: dy [T, H] -> (d y [N, H] y.dtype, d w [N] fp32)."""
    data, scale = send_rows(dy.contiguous(), handle, quantize)
    dy_rows = _rows(data, scale, dy.dtype)[handle.expand_row].to(torch.float32)
    return (dy_rows * w[:, None]).to(y.dtype), (dy_rows * y.to(torch.float32)).sum(-1)


class _Dispatch(torch.autograd.Function):
    """Dispatch with autograd over a transport's ``dispatch_fwd`` / ``dispatch_bwd`` (``impl``: this module, or
    :mod:`moe_ep.comm.cuda_transport`, which shares these two Functions)."""

    @staticmethod
    def forward(ctx, x, topk_w, handle, quantize, impl):
        ctx.handle, ctx.dtype, ctx.impl = handle, x.dtype, impl
        rows, w = impl.dispatch_fwd(x, topk_w, handle, quantize)
        ctx.rows_shape, ctx.w_shape, ctx.device = rows.shape, w.shape, rows.device
        return rows, w

    @staticmethod
    def backward(ctx, grad_rows, grad_w):
        # An output that the loss does not use gets no gradient: it contributes zeros.
        if grad_rows is None:
            grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.dtype, device=ctx.device)
        if grad_w is None:
            grad_w = torch.zeros(ctx.w_shape, dtype=torch.float32, device=ctx.device)
        dx, dw = ctx.impl.dispatch_bwd(grad_rows, grad_w, ctx.handle, ctx.dtype)
        return dx, dw, None, None, None


class _Combine(torch.autograd.Function):
    """Combine with autograd over a transport's ``combine_fwd`` / ``combine_bwd`` (``impl`` as in _Dispatch)."""

    @staticmethod
    def forward(ctx, y, w, handle, quantize, impl):
        ctx.save_for_backward(y, w)
        ctx.handle, ctx.quantize, ctx.impl = handle, quantize, impl
        return impl.combine_fwd(y, w, handle)

    @staticmethod
    def backward(ctx, dy):
        y, w = ctx.saved_tensors
        dyr, dw = ctx.impl.combine_bwd(dy, y, w, ctx.handle, ctx.quantize)
        return dyr, dw, None, None, None


_SELF = sys.modules[__name__]


def check_dispatch_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, quantize: bool) -> None:
    """Shape checks shared by every transport's ``dispatch``: x [T, H], topk_idx / topk_w [T, top_k],
    H % 32 == 0 when quantizing."""
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if topk_idx.shape != topk_w.shape or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx {tuple(topk_idx.shape)} / topk_w {tuple(topk_w.shape)} do not match x {tuple(x.shape)}"
        )
    if quantize and x.shape[1] % mxfp8.BLOCK:
        raise ValueError(f"hidden ({x.shape[1]}) must be a multiple of 32 for MXFP8 dispatch")


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    num_experts: int,
    group=None,
    quantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, EPHandle]:
    """Send tokens to the ranks owning their experts and expand them into expert-sorted rows.

    x: [T, H] bf16/fp32; topk_idx: [T, top_k] int32/int64 global expert ids; topk_w: [T, top_k] float;
    group: the EP process group (None: single process owns every expert).
    Returns (rows [N, H] x.dtype, row weights [N] fp32, handle); rows of local expert e are
    ``rows[off[e]:off[e+1]]`` with ``off = cumsum(handle.group_sizes)``. Differentiable in x and topk_w.
    """
    check_dispatch_inputs(x, topk_idx, topk_w, quantize)
    handle = build_layout(topk_idx, num_experts, group)
    rows, w = _Dispatch.apply(x, topk_w, handle, quantize, _SELF)
    return rows, w, handle


def combine(y: torch.Tensor, w: torch.Tensor, handle: EPHandle, quantize: bool = True) -> torch.Tensor:
    """Weight expert outputs and return them to their source tokens.

    y: [N, H] expert outputs (expert-sorted rows of ``handle``); w: [N] fp32 row weights -> [T, H] y.dtype.
    Backward quantizes dy to MXFP8 before sending it (``quantize``). Differentiable in y and w.
    """
    if y.dim() != 2 or y.shape[0] != handle.num_expanded or w.shape != (handle.num_expanded,):
        raise ValueError(
            f"combine expects y [{handle.num_expanded}, H] and w [{handle.num_expanded}], "
            f"got {tuple(y.shape)} and {tuple(w.shape)}"
        )
    return _Combine.apply(y, w, handle, quantize, _SELF)
