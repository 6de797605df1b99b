"""Dispatch and combine with autograd over a :class:`Transport` (the reference or the CUDA one).

Forward:  dispatch = MXFP8 quantize + send once per (token, rank) + expert-sorted expansion;
          combine  = weight by top-k weight, reduce per (token, rank) on the expert side, send back, sum on
                     the source rank in rank order.
Backward: combine-backward is an MXFP8 dispatch of dy; dispatch-backward is a combine of dx (and of the
          top-k weight gradients). The forward's handle is reused; nothing is recomputed.

Quantization uses a straight-through gradient: the dispatch payload's quantization is the identity for
the backward pass (as in every MXFP8 training recipe); dy is quantized where the fast path sends it.

The payload is a recipe's (:func:`~.reference.payload_recipe`: a :class:`moe_ep.recipe.Recipe`, its name, or None for
raw rows) in every pass of a :class:`Transport`; the public :func:`dispatch` / :func:`combine` also keep the earlier
``quantize=True`` (MXFP8) / ``False`` (raw rows) and translate it once (:func:`as_payload`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..recipe import MXFP8, Recipe
from .reference import REFERENCE, check_payload_hidden, payload_recipe

# what the public functions' ``quantize`` takes: True (MXFP8, the default recipe), False / None (raw rows), a Recipe
# or its name
Payload = bool | Recipe | str | None


class Transport(Protocol):
    """A transport: its layout and the four passes; :class:`_Dispatch` / :class:`_Combine` add autograd around them.

    ``handle`` is the transport's own handle type (:class:`EPHandle` or the CUDA transport's ``CudaEPHandle``).
    Implementations: :data:`moe_ep.transport.reference.REFERENCE` (torch.distributed) and
    :data:`moe_ep.transport.nvshmem.buffer.CUDA` (NVSHMEM kernels).
    """

    def build_layout(self, topk_idx: torch.Tensor, num_experts: int, group: Any, **options: Any) -> Any:
        """topk_idx: [T, top_k] global expert ids -> the handle of this routing (collective over ``group``)."""
        ...

    def layer_layout(self, topk_idx: torch.Tensor, cfg: Any, group: Any, num_tokens: int) -> Any:
        """The handle of one MoE layer call (``cfg``: its :class:`moe_ep.config.MoEConfig`: experts, capacity, the
        sizes a transport allocates for)."""
        ...

    def dispatch_fwd(
        self, x: torch.Tensor, topk_w: torch.Tensor, handle: Any, recipe: Recipe | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H], topk_w: [T, top_k] fp32 -> (expert-sorted rows [N, H] x.dtype: the recipe's payload dequantized,
        or the raw rows for None; row weights [N] fp32)."""
        ...

    def dispatch_fwd_quantized(
        self, x: torch.Tensor, topk_w: torch.Tensor, handle: Any, recipe: Recipe | str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (e4m3 expert-sorted rows [N, H], their scales in the recipe's dispatch layout, row weights [N]
        fp32): the payload the expert GEMMs read as it arrives (no autograd; the layer's node owns the backward)."""
        ...

    def dispatch_bwd(
        self, grad_rows: torch.Tensor, grad_w: torch.Tensor, handle: Any, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """grad_rows: [N, H], grad_w: [N] fp32 -> (dx [T, H] dtype, d topk_w [T, top_k] fp32)."""
        ...

    def combine_fwd(self, y: torch.Tensor, w: torch.Tensor, handle: Any) -> torch.Tensor:
        """y: [N, H] expert outputs, w: [N] fp32 -> [T, H] y.dtype."""
        ...

    def combine_bwd(
        self, dy: torch.Tensor, y: torch.Tensor, w: torch.Tensor, handle: Any, recipe: Recipe | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dy: [T, H] sent in the recipe's payload (None: raw rows) -> (d y [N, H] y.dtype, d w [N] fp32)."""
        ...


class _Dispatch(torch.autograd.Function):
    """Dispatch with autograd over ``transport.dispatch_fwd`` / ``dispatch_bwd``."""

    @staticmethod
    def forward(ctx, x, topk_w, handle, recipe, transport):
        ctx.handle, ctx.dtype, ctx.transport = handle, x.dtype, transport
        rows, w = transport.dispatch_fwd(x, topk_w, handle, recipe)
        ctx.rows_shape, ctx.w_shape, ctx.device = rows.shape, w.shape, rows.device
        return rows, w

    @staticmethod
    def backward(ctx, grad_rows, grad_w):
        # An output that the loss does not use gets no gradient: it contributes zeros.
        if grad_rows is None:
            grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.dtype, device=ctx.device)
        if grad_w is None:
            grad_w = torch.zeros(ctx.w_shape, dtype=torch.float32, device=ctx.device)
        dx, dw = ctx.transport.dispatch_bwd(grad_rows, grad_w, ctx.handle, ctx.dtype)
        return dx, dw, None, None, None


class _Combine(torch.autograd.Function):
    """Combine with autograd over ``transport.combine_fwd`` / ``combine_bwd``."""

    @staticmethod
    def forward(ctx, y, w, handle, recipe, transport):
        ctx.save_for_backward(y, w)
        ctx.handle, ctx.recipe, ctx.transport = handle, recipe, transport
        return transport.combine_fwd(y, w, handle)

    @staticmethod
    def backward(ctx, dy):
        y, w = ctx.saved_tensors
        dyr, dw = ctx.transport.combine_bwd(dy, y, w, ctx.handle, ctx.recipe)
        return dyr, dw, None, None, None


def as_payload(quantize: Payload) -> Recipe | None:
    """The public ``quantize`` argument as the recipe the transport passes take: True -> MXFP8, False / None ->
    None (raw rows), a :class:`~moe_ep.recipe.Recipe` or a name -> its table row
    (:func:`~.reference.payload_recipe`)."""
    if isinstance(quantize, bool):
        return MXFP8 if quantize else None
    return payload_recipe(quantize)


def check_dispatch_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, recipe: Recipe | None) -> None:
    """Shape checks shared by every transport's ``dispatch``: x [T, H], topk_idx / topk_w [T, top_k],
    H a multiple of the payload's scale block when quantizing (``recipe``: the payload's recipe or None)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if topk_idx.shape != topk_w.shape or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx {tuple(topk_idx.shape)} / topk_w {tuple(topk_w.shape)} do not match x {tuple(x.shape)}"
        )
    check_payload_hidden(x.shape[1], recipe)


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    num_experts: int,
    group=None,
    quantize: Payload = True,
    transport: Transport = REFERENCE,
    **layout_options: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Send tokens to the ranks owning their experts and expand them into expert-sorted rows.

    x: [T, H] bf16/fp32; topk_idx: [T, top_k] int32/int64 global expert ids; topk_w: [T, top_k] float;
    group: the EP process group (None: single process owns every expert); quantize: the payload (True: MXFP8,
    False / None: raw rows, or a :class:`~moe_ep.recipe.Recipe` / its name); transport: REFERENCE (default) or
    ``moe_ep.transport.nvshmem.buffer.CUDA``; layout_options go to its ``build_layout`` (``capacity``: drop mode, both
    transports; CUDA also ``expand_capacity``).
    Returns (rows [N, H] x.dtype, row weights [N] fp32, handle); rows of local expert e are
    ``rows[off[e]:off[e+1]]`` with ``off = cumsum(handle.group_sizes)`` (the CUDA transport returns
    ``expand_capacity`` rows, zero past N). Differentiable in x and topk_w.
    """
    recipe = as_payload(quantize)
    check_dispatch_inputs(x, topk_idx, topk_w, recipe)
    handle = transport.build_layout(topk_idx, num_experts, group, **layout_options)
    rows, w = _Dispatch.apply(x, topk_w, handle, recipe, transport)
    return rows, w, handle


def combine(
    y: torch.Tensor, w: torch.Tensor, handle: Any, quantize: Payload = True, transport: Transport = REFERENCE
) -> torch.Tensor:
    """Weight expert outputs and return them to their source tokens.

    y: [N, H] expert outputs (expert-sorted rows of ``handle``); w: [N] fp32 row weights -> [T, H] y.dtype.
    Backward sends dy in the payload ``quantize`` names (as :func:`dispatch`: True = MXFP8, a recipe, or raw rows).
    Differentiable in y and w. ``transport`` must be the one that made ``handle``; it checks the shapes.
    """
    recipe = as_payload(quantize)
    check_payload_hidden(y.shape[-1], recipe, "y")
    return _Combine.apply(y, w, handle, recipe, transport)


def dispatch_with_layout(
    x: torch.Tensor, topk_w: torch.Tensor, handle: Any, quantize: Payload = True, transport: Transport = REFERENCE
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dispatch` for a layout the caller built (``transport.build_layout``), e.g. to size buffers from it
    first. x: [T, H]; topk_w: [T, top_k] float -> (rows [N, H] x.dtype, row weights [N] fp32); differentiable."""
    recipe = as_payload(quantize)
    check_payload_hidden(x.shape[-1], recipe)
    return _Dispatch.apply(x, topk_w, handle, recipe, transport)
