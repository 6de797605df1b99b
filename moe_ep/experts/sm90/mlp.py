"""SwiGLU expert MLP on the CUDA kernels: the MXFP8 recipe of ``moe_ep.experts.reference.expert_mlp(quantize=True)``.

The reference with the same math is :func:`moe_ep.experts.reference.expert_mlp` (``expert_mlp_fwd`` /
``expert_mlp_bwd``). The functions here start from the MXFP8 rows themselves (e4m3 + per-group blocked scales, as the
fused dispatch writes them), keep group sizes on the GPU and never synchronize with the host:

  forward   a  = fprop(xq, W13)                                        [M, 2F] bf16
            hq, hs = quantize_grouped_dual(a, apply_swiglu=True,       h = swiglu(a), quantized row-wise only
                                           colwise="none")
            out = fprop(hq, W2)                                        [M, H] bf16
  backward  dq, ds, dc = quantize_grouped_dual(dout)
            dh  = dgrad(dq, W2^T)                                      [M, F] bf16 (as the reference rounds it)
            hc  = quantize_grouped_dual(a, apply_swiglu=True)[2]       h column-wise, recomputed from a
            dW2 = wgrad(dc, hc)                                        [E, H, F]
            aq, as, ac = quantize_grouped_dual(a, swiglu_dh=dh)        dA = swiglu_bwd(a, dh), both operands
            dx  = dgrad(aq, W13^T)                                     [M, H] bf16
            xc  = colwise_from_rows(xq, xs)                            x column-wise, from the saved MXFP8 rows
            dW13 = wgrad(ac, xc)                                       [E, 2F, H]

Saved for the backward: the MXFP8 rows ``xq`` / ``xs`` (1 byte + 1/32 per element: the dispatch payload itself) and
``a`` (bf16 [M, 2F], as the reference saves it); the column-wise operands of x and h are rebuilt in the backward
(one memory-bound pass each) instead of holding 2-byte copies from forward to backward.

The layer reaches this module only through :data:`HOPPER_MXFP8` (an :class:`moe_ep.experts.base.ExpertGemms`, picked
by :func:`moe_ep.experts.base.gemms_for`): the seam where another architecture's kernels plug in without touching
the layer. Weights' operands (:func:`moe_ep.experts.sm90.operands.weight_operands`) come from a ``WeightQuantCache``
when one is given: computed once per weight version, shared by micro-batches and by the backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ... import profiling
from ...mxfp8 import cuda as mxfp8_cuda
from ...recipe import MXFP8
from ..fsdp_blockwise import BlockwiseExpertWeight
from ..fsdp_mxfp8 import MXFP8ExpertWeight
from ..weight_cache import WeightQuantCache
from . import gemm as gemm_cuda
from .operands import WeightOperands, weight_operands


class _HopperMXFP8Gemms:
    """The three GEMM directions of the MXFP8 recipe on sm_90a: exact MXFP8 grouped GEMMs on bf16 tensor cores
    (:mod:`.gemm`), the weights' operands prepared as exact bf16 (:mod:`.operands`)."""

    def prepare(self, w, cache, fprop=True, dgrad=True) -> WeightOperands:
        """The weight's operands for the directions asked for. Without a cache the other direction's operand is
        dropped at once: one launch writes both, but the forward never reads the dgrad operand nor the backward the
        fprop one (2 bytes per weight element fewer held through each pass); a cache keeps both (shared by every
        micro-batch's forward and backward of one weight version)."""
        if isinstance(w, MXFP8ExpertWeight):
            return w.operands(fprop, dgrad)
        if isinstance(w, BlockwiseExpertWeight):
            raise TypeError("a weight gathered in blockwise FP8 holds 128x128 operands, not the MXFP8 recipe's")
        ops = weight_operands(w, cache)
        if cache is None and not (fprop and dgrad):
            ops = dataclasses.replace(
                ops,
                w=ops.w if fprop else None,
                w_scale=ops.w_scale if fprop else None,
                w_prepared=ops.w_prepared if fprop else None,
                wt=ops.wt if dgrad else None,
                wt_scale=ops.wt_scale if dgrad else None,
                wt_prepared=ops.wt_prepared if dgrad else None,
            )
        return ops

    # fprop / dgrad leave the output rows past sum(gs) unwritten (a given ``out``: no zero fill): nothing reads them
    # (the quantizers and the transport's combine read the groups' rows only), and with a dropless buffer sized for
    # the worst case the fill was a pass over every row the layer might have had, not over the ones it has.
    def fprop(self, xq, xs, w, gs):
        out = torch.empty(
            xq.shape[0], gemm_cuda._out_cols(w.w, w.w_prepared, "w"), dtype=torch.bfloat16, device=xq.device
        )
        return gemm_cuda.grouped_mm_fprop(xq, xs, w.w, w.w_scale, gs, out=out, w_prepared=w.w_prepared)

    def dgrad(self, dq, ds, w, gs):
        cols = gemm_cuda._out_cols(w.wt, w.wt_prepared, "wt")
        out = torch.empty(dq.shape[0], cols, dtype=torch.bfloat16, device=dq.device)
        return gemm_cuda.grouped_mm_dgrad(dq, ds, w.wt, w.wt_scale, gs, out=out, wt_prepared=w.wt_prepared)

    def wgrad(self, a_prep, b_prep, gs, out, m):
        return gemm_cuda.grouped_wgrad_prepared_out(a_prep, b_prep, gs, out, m)


GEMMS = _HopperMXFP8Gemms()


def _check(m_cols: int, w13: torch.Tensor, w2: torch.Tensor, group_sizes: torch.Tensor, dev: torch.device) -> None:
    e, f2, hdim = w13.shape if w13.dim() == 3 else (0, 0, 0)
    if m_cols != hdim or w2.shape != (e, hdim, f2 // 2):
        raise ValueError(
            f"expert MLP shapes: rows of {m_cols} columns (want H), w13 {tuple(w13.shape)} (want [E, 2F, H]), "
            f"w2 {tuple(w2.shape)} (want [E, H, F])"
        )
    if hdim % 32 or f2 % 64:
        raise ValueError(f"expert MLP: H ({hdim}) and F ({f2 // 2}) must be multiples of 32 (MXFP8 blocks)")
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype != torch.int32 or group_sizes.shape != (e,):
        raise TypeError(f"group_sizes must be an int32 [E={e}] tensor, got {getattr(group_sizes, 'dtype', None)}")
    for name, t in (("w13", w13), ("w2", w2), ("group_sizes", group_sizes)):
        if t.device != dev or dev.type != "cuda":
            raise ValueError(f"expert MLP: {name} must be a CUDA tensor on the rows' device {dev}, got {t.device}")


def expert_mlp_mx_fwd(
    xq: torch.Tensor, xs: torch.Tensor, w13o: WeightOperands, w2o: WeightOperands, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """xq: e4m3 [M, H] expert-sorted rows, xs: u8 [grouped_blocked_size(M, E, H // 32, "m")] their per-group blocked
    scales, w13o / w2o: the weights' operands, group_sizes: int32 [E] (device) -> (out [M, H] bf16, a [M, 2F] bf16,
    saved for :func:`expert_mlp_mx_bwd`). Rows past sum(group_sizes) of both are not written (unspecified): no pass
    over a dropless buffer's rows past the real ones."""
    if xq.shape[0] == 0:  # no rows here (a rank whose capacity is 0): nothing for the kernels to do
        f2 = w13o.w_prepared.shape[1]
        return xq.new_zeros(0, xq.shape[1], dtype=torch.bfloat16), xq.new_zeros(0, f2, dtype=torch.bfloat16)
    a = GEMMS.fprop(xq, xs, w13o, group_sizes)
    profiling.mark("gemm1")
    # row-wise h only: GEMM2 reads nothing else (the backward rebuilds h's column operand from a)
    hq, hs, _, _ = mxfp8_cuda.quantize_grouped_dual(a, group_sizes, apply_swiglu=True, colwise="none")
    profiling.mark("swiglu_quant")
    out = GEMMS.fprop(hq, hs, w2o, group_sizes)
    profiling.mark("gemm2")
    return out, a


def expert_mlp_mx_bwd(
    saved: dict[str, torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13o: WeightOperands,
    w2o: WeightOperands,
    group_sizes: torch.Tensor,
    on_dx: Callable[[torch.Tensor], Any] | None = None,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The backward of :func:`expert_mlp_mx_fwd`.

    saved: {"dout": [M, H] bf16 (rows past the groups are not read), "xq", "xs", "a": from the forward}; the dict
    is CONSUMED (each tensor is popped and freed after its last use, which keeps the backward's peak memory near
    the bf16 path's). w13 [E, 2F, H] / w2 [E, H, F]: the weights (for the gradients' dtype); on_dx: called with dx
    [M, H] bf16 as soon as it exists, before the x-side weight gradient (the layer starts the return of dx there,
    and dx is freed before wgrad's operands are built); None: dx is not computed.
    -> (on_dx(dx) or None, dw13 [E, 2F, H] w13.dtype, dw2 [E, H, F] w2.dtype)
    """
    xq = saved["xq"]
    m, hdim = xq.shape
    del xq
    if m == 0:
        saved.clear()
        res = on_dx(torch.zeros(0, hdim, dtype=torch.bfloat16, device=w13.device)) if on_dx else None
        return res, torch.zeros_like(w13), torch.zeros_like(w2)
    dq, ds, dc, _ = mxfp8_cuda.quantize_grouped_dual(saved.pop("dout"), group_sizes)
    profiling.mark("quant_dy")
    # bf16 dh: the reference rounds dh to x.dtype, and mx_swiglu_dual's backward reads a bf16 dh
    dh = GEMMS.dgrad(dq, ds, w2o, group_sizes)
    del dq, ds
    profiling.mark("dgrad2")
    a = saved.pop("a")
    hc = mxfp8_cuda.quantize_grouped_dual(a, group_sizes, apply_swiglu=True)[2]
    dw2 = GEMMS.wgrad(dc, hc, group_sizes, _wgrad_out(w2), m)
    del dc, hc
    profiling.mark("wgrad2")
    aq, as_, ac, _ = mxfp8_cuda.quantize_grouped_dual(a, group_sizes, swiglu_dh=dh)
    del a, dh
    profiling.mark("swiglu_bwd_quant")
    res = None
    if on_dx is not None:
        dx = GEMMS.dgrad(aq, as_, w13o, group_sizes)
        del aq, as_
        profiling.mark("dgrad1")
        res = on_dx(dx)
        del dx
    else:
        del aq, as_
    # x column-wise from the saved MXFP8 rows in one pass: the reference quantizes the (dequantized) received rows
    # again along the other axis, and the kernel dequantizes the saved bytes exactly in registers
    xc = mxfp8_cuda.colwise_from_rows(saved.pop("xq"), saved.pop("xs"), group_sizes)
    profiling.mark("x_colwise")
    dw13 = GEMMS.wgrad(ac, xc, group_sizes, _wgrad_out(w13), m)
    profiling.mark("wgrad1")
    return res, dw13.to(w13.dtype), dw2.to(w2.dtype)


def _wgrad_out(w: torch.Tensor) -> torch.Tensor:
    """The weight gradient's buffer: in the weight's dtype when the kernel writes it (bf16 / fp32: its epilogue
    rounds the fp32 sums once, as a cast would), else fp32 (cast after)."""
    dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return torch.empty(w.shape, dtype=dtype, device=w.device)


class _ExpertMLPCuda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, group_sizes, cache):
        w13o, w2o = GEMMS.prepare(w13, cache, dgrad=False), GEMMS.prepare(w2, cache, dgrad=False)
        xq, xs, _, _ = mxfp8_cuda.quantize_grouped_dual(x, group_sizes)
        out, a = expert_mlp_mx_fwd(xq, xs, w13o, w2o, group_sizes)
        ctx.save_for_backward(w13, w2, group_sizes)
        # intermediates as attributes, not saved tensors: the backward frees each after its last use
        ctx.saved = {"xq": xq, "xs": xs, "a": a}
        ctx.cache = cache
        return out

    @staticmethod
    def backward(ctx, dout):
        w13, w2, group_sizes = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None
        if saved is None:
            raise RuntimeError("expert_mlp_cuda's backward ran twice (retain_graph=True): its intermediates are freed")
        saved["dout"] = dout.contiguous()
        del dout
        w13o, w2o = GEMMS.prepare(w13, ctx.cache, fprop=False), GEMMS.prepare(w2, ctx.cache, fprop=False)
        on_dx = (lambda dx: dx) if ctx.needs_input_grad[0] else None
        dx, dw13, dw2 = expert_mlp_mx_bwd(saved, w13, w2, w13o, w2o, group_sizes, on_dx)
        return dx, dw13, dw2, None, None


def expert_mlp_cuda(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_sizes: torch.Tensor,
    cache: WeightQuantCache | None = None,
) -> torch.Tensor:
    """SwiGLU expert MLP over expert-sorted bf16 rows on the MXFP8 CUDA kernels (Hopper), differentiable in x, w13, w2.

    x: [M, H] bf16 CUDA (groups contiguous from row 0; sum(group_sizes) must equal M), w13: [E, 2F, H] (gate rows
    then up rows), w2: [E, H, F], group_sizes: int32 [E] on x's device (never read on the host), cache: a
    ``WeightQuantCache`` (the weights' operands once per weight version; without one the backward prepares the
    weights again rather than holding their operands from forward to backward) -> [M, H] bf16.
    The reference is ``moe_ep.experts.reference.expert_mlp(x, w13, w2, sizes, quantize=True)`` (the same recipe;
    results equal up to fp32 summation order, which can move an intermediate across an e4m3 rounding boundary).
    """
    if x.dim() != 2:
        raise ValueError(f"expert_mlp_cuda: x must be [M, H], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"expert_mlp_cuda: x must be bf16, got {x.dtype}")
    _check(x.shape[1], w13, w2, group_sizes, x.device)
    return _ExpertMLPCuda.apply(x.contiguous(), w13, w2, group_sizes, cache)


class HopperMXFP8:
    """:class:`moe_ep.experts.base.ExpertGemms` of the MXFP8 recipe on Hopper: :func:`expert_mlp_mx_fwd` /
    :func:`expert_mlp_mx_bwd` on the MXFP8 payload of the fused dispatch (per-group blocked scales)."""

    recipe = MXFP8

    def prepare(self, w, cache, fprop=True, dgrad=True) -> WeightOperands:
        return GEMMS.prepare(w, cache, fprop, dgrad)

    def quantize_rows(self, x, group_sizes):
        xq, xs, _, _ = mxfp8_cuda.quantize_grouped_dual(x, group_sizes)
        return xq, xs

    def mlp_fwd(self, xq, xs, w13o, w2o, group_sizes):
        out, a = expert_mlp_mx_fwd(xq, xs, w13o, w2o, group_sizes)
        return out, {"xq": xq, "xs": xs, "a": a}

    def mlp_bwd(self, saved, w13, w2, w13o, w2o, group_sizes, on_dx):
        return expert_mlp_mx_bwd(saved, w13, w2, w13o, w2o, group_sizes, on_dx)


HOPPER_MXFP8 = HopperMXFP8()
