"""SwiGLU expert MLP on the CUDA kernels: the MXFP8 recipe of ``moe_ep.experts.reference.expert_mlp(quantize=True)``.

The reference with the same math is :func:`moe_ep.experts.reference.expert_mlp` (``expert_mlp_fwd`` /
``expert_mlp_bwd``); this module chains the kernels, with group sizes on the GPU and no host synchronization:

  forward   xq, xs, xc = quantize_grouped_dual(x, colwise="bf16")      x row-wise (fprop), x prepared column-wise
            a  = grouped_mm_fprop(xq, W13)                              [M, 2F] bf16
            hq, hs, hc = quantize_grouped_dual(a, apply_swiglu=True)    h = swiglu(a), both operands in one pass
            out = grouped_mm_fprop(hq, W2)                              [M, H] bf16
  backward  dq, ds, dc = quantize_grouped_dual(dout)
            dh  = grouped_mm_dgrad(dq, W2^T)                            [M, F] bf16 (as the reference rounds it)
            dW2 = grouped_wgrad_prepared_out(dc, hc)                    [E, H, F]
            aq, as, ac = quantize_grouped_dual(a, swiglu_dh=dh)         dA = swiglu_bwd(a, dh), both operands
            dx  = grouped_mm_dgrad(aq, W13^T)                           [M, H] bf16
            dW13 = grouped_wgrad_prepared_out(ac, xc)                   [E, 2F, H]

The weights' four operands (e4m3 both ways and the prepared bf16 copies,
:func:`moe_ep.experts.operands.weight_operands`) come from a ``WeightQuantCache`` when one is given: computed once per
weight version, shared by micro-batches and by the backward. Saved for the backward: ``a`` (bf16 [M, 2F], as the
reference saves it) and the two prepared column-wise operands ``xc`` (bf16 [~M, H]) and ``hc`` (bf16 [~M, F]) instead
of ``x``: 2 bytes per element each, kept so that the backward does not quantize x and h a second time.
"""

from __future__ import annotations

import torch

from ..mxfp8 import cuda as mxfp8_cuda
from . import gemm as gemm_cuda
from .operands import weight_operands
from .weight_cache import WeightQuantCache


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: torch.Tensor) -> None:
    e, f2, hdim = w13.shape if w13.dim() == 3 else (0, 0, 0)
    if x.dim() != 2 or x.shape[1] != hdim or w2.shape != (e, hdim, f2 // 2):
        raise ValueError(
            f"expert_mlp_cuda shapes: x {tuple(x.shape)} (want [M, H]), w13 {tuple(w13.shape)} (want [E, 2F, H]), "
            f"w2 {tuple(w2.shape)} (want [E, H, F])"
        )
    if x.dtype != torch.bfloat16:
        raise TypeError(f"expert_mlp_cuda: x must be bf16, got {x.dtype}")
    if hdim % 32 or f2 % 64:
        raise ValueError(f"expert_mlp_cuda: H ({hdim}) and F ({f2 // 2}) must be multiples of 32 (MXFP8 blocks)")
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype != torch.int32 or group_sizes.shape != (e,):
        raise TypeError(f"group_sizes must be an int32 [E={e}] tensor, got {getattr(group_sizes, 'dtype', None)}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("group_sizes", group_sizes)):
        if t.device != x.device or x.device.type != "cuda":
            raise ValueError(f"expert_mlp_cuda: {name} must be a CUDA tensor on x's device, got {t.device}")


def expert_mlp_cuda_fwd(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: torch.Tensor, cache=None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """x: [M, H] bf16 expert-sorted (sum(group_sizes) == M, not checked: that needs a host sync), w13: [E, 2F, H],
    w2: [E, H, F] (bf16/fp32), group_sizes: int32 [E] on the GPU -> (out [M, H] bf16, saved = (a [M, 2F] bf16,
    xc bf16 [64 (ceil(M/64) + E), H], hc bf16 [same rows, F])) for :func:`expert_mlp_cuda_bwd`."""
    w13o, w2o = weight_operands(w13, cache), weight_operands(w2, cache)
    xq, xs, xc, _ = mxfp8_cuda.quantize_grouped_dual(x, group_sizes, colwise="bf16")
    a = gemm_cuda.grouped_mm_fprop(xq, xs, w13o.w, w13o.w_scale, group_sizes, w_prepared=w13o.w_prepared)
    hq, hs, hc, _ = mxfp8_cuda.quantize_grouped_dual(a, group_sizes, apply_swiglu=True, colwise="bf16")
    out = gemm_cuda.grouped_mm_fprop(hq, hs, w2o.w, w2o.w_scale, group_sizes, w_prepared=w2o.w_prepared)
    return out, (a, xc, hc)


def expert_mlp_cuda_bwd(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_sizes: torch.Tensor,
    cache=None,
    need_dx: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """dout: [M, H] bf16, saved: from :func:`expert_mlp_cuda_fwd` -> (dx [M, H] bf16 or None without ``need_dx``,
    dw13 [E, 2F, H] w13.dtype, dw2 [E, H, F] w2.dtype)."""
    a, xc, hc = saved
    m = a.shape[0]
    w13o, w2o = weight_operands(w13, cache), weight_operands(w2, cache)
    dq, ds, dc, _ = mxfp8_cuda.quantize_grouped_dual(dout, group_sizes, colwise="bf16")
    # bf16 dh: the reference rounds dh to x.dtype, and mx_swiglu_dual's backward reads a bf16 dh
    dh = gemm_cuda.grouped_mm_dgrad(
        dq, ds, w2o.wt, w2o.wt_scale, group_sizes, out_dtype=torch.bfloat16, wt_prepared=w2o.wt_prepared
    )
    dw2 = gemm_cuda.grouped_wgrad_prepared_out(dc, hc, group_sizes, _wgrad_out(w2), m)
    aq, as_, ac, _ = mxfp8_cuda.quantize_grouped_dual(a, group_sizes, swiglu_dh=dh, colwise="bf16")
    dx = None
    if need_dx:
        dx = gemm_cuda.grouped_mm_dgrad(aq, as_, w13o.wt, w13o.wt_scale, group_sizes, wt_prepared=w13o.wt_prepared)
    dw13 = gemm_cuda.grouped_wgrad_prepared_out(ac, xc, group_sizes, _wgrad_out(w13), m)
    return dx, dw13.to(w13.dtype), dw2.to(w2.dtype)


def _wgrad_out(w: torch.Tensor) -> torch.Tensor:
    """The weight gradient's buffer: in the weight's dtype when the kernel writes it (bf16 / fp32: its epilogue
    rounds the fp32 sums once, as a cast would), else fp32 (cast after)."""
    dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return torch.empty(w.shape, dtype=dtype, device=w.device)


class _ExpertMLPCuda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, group_sizes, cache):
        out, saved = expert_mlp_cuda_fwd(x, w13, w2, group_sizes, cache)
        ctx.save_for_backward(*saved, w13, w2, group_sizes)
        ctx.cache = cache
        return out

    @staticmethod
    def backward(ctx, dout):
        a, xc, hc, w13, w2, group_sizes = ctx.saved_tensors
        dx, dw13, dw2 = expert_mlp_cuda_bwd(
            dout.contiguous(), (a, xc, hc), w13, w2, group_sizes, ctx.cache, need_dx=ctx.needs_input_grad[0]
        )
        return dx, dw13, dw2, None, None


def expert_mlp_cuda(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_sizes: torch.Tensor,
    cache: WeightQuantCache | None = None,
) -> torch.Tensor:
    """SwiGLU expert MLP over expert-sorted rows on the MXFP8 CUDA kernels (Hopper), differentiable in x, w13, w2.

    x: [M, H] bf16 CUDA (groups contiguous from row 0; sum(group_sizes) must equal M), w13: [E, 2F, H] (gate rows
    then up rows), w2: [E, H, F], group_sizes: int32 [E] on x's device (never read on the host), cache: a
    ``WeightQuantCache`` (the weights' MXFP8 operands once per weight version; without one, the backward quantizes
    the weights again rather than holding their operands, ~6 bytes per weight element, from forward to backward)
    -> [M, H] bf16.
    The reference is ``moe_ep.experts.reference.expert_mlp(x, w13, w2, sizes, quantize=True)`` (the same recipe;
    results equal up to fp32 summation order, which can move an intermediate across an e4m3 rounding boundary).
    """
    _check(x, w13, w2, group_sizes)
    return _ExpertMLPCuda.apply(x.contiguous(), w13, w2, group_sizes, cache)
