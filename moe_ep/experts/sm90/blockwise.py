"""The blockwise recipe's expert MLP on Hopper (:data:`moe_ep.recipe.BLOCKWISE`): the FP8 grouped GEMMs of
:mod:`.blockwise_gemm` (fprop, dgrad) and the MXFP8 recipe's bf16 wgrad kernel (:mod:`.gemm`
``grouped_wgrad_prepared_out``) on the quantizers of :mod:`moe_ep.blockwise.cuda`, as an
:class:`moe_ep.experts.base.ExpertGemms` (:data:`HOPPER_BLOCKWISE`).

  forward   a  = fprop(xq, W13)                               [M, 2F] bf16 (xq: the 1x128 dispatch payload)
            hq = swiglu_quantize(a)                           h = swiglu(a), 1x128 rows (the only operand read)
            out = fprop(hq, W2)                               [M, H] bf16
  backward  dq = rowwise(dout), dc = colwise(dout)            dy: 1x128 rows for dgrad, 128x1 per group for wgrad
            dh = dgrad(dq, W2^T)                              [M, F] bf16 (the weight's transposed bytes)
            hc = swiglu_colwise(a)                            h's 128x1 blocks recomputed from a (column-only)
            dW2 = wgrad(dc, hc)                               [E, H, F] in W's dtype
            aq, ac = swiglu_bwd_quantize_prepared(a, dh)      dA, both operands in one pass
            dx = dgrad(aq, W13^T)                             [M, H] bf16
            xc = colwise(xq, xs)                              x's 128x1 blocks from the saved 1x128 bytes (a second
                                                              rounding)
            dW13 = wgrad(ac, xc)                              [E, 2F, H] in W's dtype

The wgrad operands (dc, hc, ac, xc) are the recipe's 128x1 blocks written exactly dequantized in bf16 (e4m3 times a
power of two: exact in bf16 but below 2**-133), rows in order with 64-row group padding: the prepared layout of the
MXFP8 recipe's wgrad, whose bf16 tensor-core kernel then computes exactly the recipe's products with fp32
accumulation (results equal ``moe_ep.blockwise.reference.grouped_wgrad_torch`` up to fp32 summation order). Why not
FP8 tensor cores: a 128x1 block's scale varies along the reduction (tokens), so an FP8 wgrad must promote every 128
tokens, which held it near 330 TFLOP/s; the bf16 path runs at the MXFP8 wgrad's rate for 1 more byte per element
written by each quantizer (docs/performance.md, benchmarks/results/bench_wgrad_blockwise.json).

Weights: one 128x128 quantization per weight version serves fprop (``data``) and dgrad (``data_t``, the same bytes
transposed, with the scales' transposed view): 2 bytes + 2/16384 per element held. Under FSDP2 with the blockwise
all-gather (:mod:`moe_ep.experts.fsdp_blockwise`) ``prepare`` takes the gathered ``data`` / ``scale`` as they arrived
and makes ``data_t`` (their transpose) for the backward only. Saved for the backward: the payload (1 + 1/128 bytes
per element) and ``a`` (bf16), as the MXFP8 recipe. Group sizes stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import profiling
from ...blockwise import cuda as bw
from ...recipe import BLOCKWISE
from ..fsdp_blockwise import BlockwiseExpertWeight
from ..fsdp_mxfp8 import MXFP8ExpertWeight
from . import blockwise_gemm as gemm
from .gemm import grouped_wgrad_prepared_out  # the MXFP8 recipe's bf16 wgrad kernel, on the prepared operands
from .mlp import _wgrad_out  # the weight gradient's buffer, in the weight's dtype when the epilogue writes it


@dataclass
class BlockwiseWeight:
    """One expert weight w [G, N, K] in 128x128 blocks: data [G, N, K] e4m3 (fprop's B), data_t [G, K, N] e4m3 (the
    same bytes transposed: dgrad's B; None when prepared for fprop only from a gathered weight), scale [G, N/128,
    K/128] u8 (dgrad reads ``scale.transpose(1, 2)``)."""

    data: torch.Tensor
    data_t: torch.Tensor | None
    scale: torch.Tensor


def _quantize_weight(w: torch.Tensor) -> BlockwiseWeight:
    return BlockwiseWeight(*bw.quantize_weight(w))


def weight_operands(w: torch.Tensor, cache=None) -> BlockwiseWeight:
    """w [G, N, K] fp32/bf16 CUDA -> its :class:`BlockwiseWeight` (once per weight version with a
    ``WeightQuantCache``; bypassed during CUDA-graph capture, so replays see optimizer steps)."""
    if cache is None or torch.cuda.is_current_stream_capturing():
        with torch.no_grad():
            return _quantize_weight(w.detach())
    return cache.get(w, "blockwise_operands", _quantize_weight)


def expert_mlp_bw_fwd(xq, xs, w13o: BlockwiseWeight, w2o: BlockwiseWeight, group_sizes):
    """xq e4m3 [M, H] + xs u8 [M, H/128] (expert-sorted rows), group_sizes int32 [E] (device) -> (out [M, H] bf16,
    a [M, 2F] bf16); rows past sum(group_sizes) of both are zero."""
    if xq.shape[0] == 0:
        f2 = w13o.data.shape[1]
        return xq.new_zeros(0, xq.shape[1], dtype=torch.bfloat16), xq.new_zeros(0, f2, dtype=torch.bfloat16)
    a = gemm.grouped_mm_blockwise(xq, xs, w13o.data, w13o.scale, group_sizes, zero_rest=True)
    profiling.mark("gemm1")
    hq, hs = bw.swiglu_quantize(a)
    profiling.mark("swiglu_quant")
    out = gemm.grouped_mm_blockwise(hq, hs, w2o.data, w2o.scale, group_sizes, zero_rest=True)
    profiling.mark("gemm2")
    return out, a


def expert_mlp_bw_bwd(saved, w13, w2, w13o: BlockwiseWeight, w2o: BlockwiseWeight, group_sizes, on_dx=None):
    """The backward of :func:`expert_mlp_bw_fwd`; same contract as ``moe_ep.experts.sm90.mlp.expert_mlp_mx_bwd``
    (``saved`` = {"dout", "xq", "xs", "a"}, consumed; dx handed to ``on_dx`` before the x-side wgrad)."""
    xq = saved["xq"]
    m, hdim = xq.shape
    del xq
    if m == 0:
        saved.clear()
        res = on_dx(torch.zeros(0, hdim, dtype=torch.bfloat16, device=w13.device)) if on_dx else None
        return res, torch.zeros_like(w13), torch.zeros_like(w2)
    dout = saved.pop("dout")
    dq, ds = bw.quantize_rowwise(dout)
    dc = bw.quantize_colwise_prepared(dout, group_sizes)
    del dout
    profiling.mark("quant_dy")
    dh = gemm.grouped_mm_blockwise(dq, ds, w2o.data_t, w2o.scale.transpose(1, 2), group_sizes, zero_rest=True)
    del dq, ds
    profiling.mark("dgrad2")
    a = saved.pop("a")
    hc = bw.swiglu_colwise_prepared(a, group_sizes)  # h's column operand alone (fprop2's rows were the forward's)
    dw2 = grouped_wgrad_prepared_out(dc, hc, group_sizes, _wgrad_out(w2), m)
    del dc, hc
    profiling.mark("wgrad2")
    aq, as_, ac = bw.swiglu_bwd_quantize_prepared(a, dh, group_sizes)
    del a, dh
    profiling.mark("swiglu_bwd_quant")
    res = None
    if on_dx is not None:
        dx = gemm.grouped_mm_blockwise(aq, as_, w13o.data_t, w13o.scale.transpose(1, 2), group_sizes, zero_rest=True)
        del aq, as_
        profiling.mark("dgrad1")
        res = on_dx(dx)
        del dx
    else:
        del aq, as_
    xc = bw.quantize_colwise_prepared((saved.pop("xq"), saved.pop("xs")), group_sizes)
    profiling.mark("x_colwise")
    dw13 = grouped_wgrad_prepared_out(ac, xc, group_sizes, _wgrad_out(w13), m)
    profiling.mark("wgrad1")
    return res, dw13.to(w13.dtype), dw2.to(w2.dtype)


class HopperBlockwise:
    """:class:`moe_ep.experts.base.ExpertGemms` of the blockwise recipe on Hopper (fprop / dgrad on FP8 tensor cores,
    one fp32 promotion per 128 of K; wgrad on bf16 tensor cores over the exactly dequantized 128x1 operands)."""

    recipe = BLOCKWISE

    def prepare(self, w, cache, fprop=True, dgrad=True) -> BlockwiseWeight:
        """w [G, N, K] -> its :class:`BlockwiseWeight`. A weight FSDP2 gathered in blockwise FP8
        (:class:`~moe_ep.experts.fsdp_blockwise.BlockwiseExpertWeight`): its gathered bytes, not re-quantized
        (``data_t`` their transpose, made only with ``dgrad``, else None); a plain weight: quantized (both copies)."""
        if isinstance(w, BlockwiseExpertWeight):
            return BlockwiseWeight(*w.operands(dgrad=dgrad))
        if isinstance(w, MXFP8ExpertWeight):
            raise TypeError(
                "a weight gathered in MXFP8 holds MXFP8 operands, not the blockwise recipe's: shard a blockwise layer "
                "with apply_fsdp(..., fp8_expert_gather=True), which gathers each layer in its own recipe"
            )
        return weight_operands(w, cache)

    def quantize_rows(self, x, group_sizes):
        return bw.quantize_rowwise(x)

    def mlp_fwd(self, xq, xs, w13o, w2o, group_sizes):
        out, a = expert_mlp_bw_fwd(xq, xs, w13o, w2o, group_sizes)
        return out, {"xq": xq, "xs": xs, "a": a}

    def mlp_bwd(self, saved, w13, w2, w13o, w2o, group_sizes, on_dx):
        return expert_mlp_bw_bwd(saved, w13, w2, w13o, w2o, group_sizes, on_dx)


HOPPER_BLOCKWISE = HopperBlockwise()
