"""Argument checks of the CUDA quantization launchers (:mod:`moe_ep.mxfp8.cuda`): each raises a TypeError or
ValueError that names the argument and the problem (dtype, shape, device, contiguity, alignment, K % 32)."""

from __future__ import annotations

import torch

from . import plan as qp
from .format import BLOCK


def on_gpu(t: torch.Tensor) -> bool:
    """Whether t is a CUDA tensor (the CPU emulator, tests/quant_emu.py, replaces this)."""
    return t.device.type == "cuda"


def check_input(x: torch.Tensor, ndim: int, what: str) -> None:
    """x: an ``ndim``-D bf16 / fp16 / fp32 CUDA tensor, contiguous, 16-byte aligned, last dimension a multiple of 32;
    ``what`` (the caller's name) starts every message."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in qp.IN:
        raise TypeError(f"{what}: input must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D input, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{what}: input must be contiguous")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{what}: K = {x.shape[-1]} is not a multiple of {BLOCK} (blocks are never padded)")
    if not on_gpu(x):
        raise ValueError(f"{what}: input must be a CUDA tensor, got device {x.device}")
    if x.data_ptr() % 16:
        raise ValueError(f"{what}: input must be 16-byte aligned (got a view with a misaligned offset)")


def check_out(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """A preallocated output ``name``: exactly ``shape``, ``dtype`` and ``device``, contiguous, 16-byte aligned."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: must be 16-byte aligned")


def check_groups(group_sizes: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """group_sizes: [G] int32 on ``device`` (read by the kernels there: no host sync); returned contiguous."""
    if group_sizes is None:
        raise ValueError("scale_layout='grouped' needs group_sizes ([G] int32 on the GPU)")
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype != torch.int32:
        raise TypeError(f"group_sizes must be an int32 tensor, got {getattr(group_sizes, 'dtype', type(group_sizes))}")
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D, got shape {tuple(group_sizes.shape)}")
    if group_sizes.device != device:
        raise ValueError(f"group_sizes must be on the device of x, {device} (no host sync), got {group_sizes.device}")
    return group_sizes.contiguous()
