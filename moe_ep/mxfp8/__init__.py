"""MXFP8: E4M3 elements with one E8M0 scale per 32 consecutive values (docs/design.md, "MXFP8 format").

The public format API. Every operation has a pure-PyTorch reference (:mod:`.reference`, ``*_torch``) that runs on
any device and is the specification; CUDA tensors go to the kernels (:mod:`.cuda`), which produce the same bytes.
Set ``MOE_EP_FORCE_REFERENCE=1`` to keep CUDA tensors on the reference path.
"""

from __future__ import annotations

import os

import torch

from . import cuda
from .format import (
    BLOCK,
    E4M3_MAX,
    E4M3_NAN,
    SCALE_NAN,
    MXFP8Tensor,
    blocked_offset,
    blocked_size,
    colwise_prep_rows,
    from_blocked,
    group_tile_offsets,
    grouped_blocked_size,
    to_blocked,
    to_blocked_grouped,
)
from .reference import _check_quantize_args, dequantize_torch, quantize_torch

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "E4M3_NAN",
    "SCALE_NAN",
    "MXFP8Tensor",
    "blocked_offset",
    "blocked_size",
    "colwise_prep_rows",
    "dequantize",
    "dequantize_torch",
    "fake_quantize",
    "from_blocked",
    "group_tile_offsets",
    "grouped_blocked_size",
    "quantize",
    "quantize_torch",
    "to_blocked",
    "to_blocked_grouped",
    "use_reference",
]


def use_reference(t: torch.Tensor) -> bool:
    """True when work on ``t`` goes to the PyTorch reference: t is not on a CUDA device, or MOE_EP_FORCE_REFERENCE=1."""
    return t.device.type != "cuda" or os.environ.get("MOE_EP_FORCE_REFERENCE", "0") == "1"


def quantize(x: torch.Tensor, axis: int = -1) -> MXFP8Tensor:
    """Quantize ``x`` to MXFP8 along ``axis``.

    x: [..., K] (axis=-1, "1x32", row-wise) or [M, ...] (axis=0, "32x1", column-wise); bf16/fp16/fp32.
    Returns MXFP8Tensor(data: x.shape e4m3, scale: x.shape with shape[axis]//32, uint8, plain layout).
    Raises TypeError for other dtypes, ValueError when ``x.shape[axis] % 32 != 0``.
    """
    ax = _check_quantize_args(x, axis)
    if use_reference(x):
        return quantize_torch(x, ax)
    return cuda.quantize(x, ax)


def dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize to ``dtype``. t: MXFP8Tensor -> t.shape ``dtype`` tensor."""
    if use_reference(t.data):
        return dequantize_torch(t, dtype)
    return cuda.dequantize(t, dtype)


def fake_quantize(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """quantize -> dequantize back to ``x.dtype``: the value the fast path computes with. Same shape/dtype."""
    return dequantize(quantize(x, axis), x.dtype)
