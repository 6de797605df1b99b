"""Pure-PyTorch MXFP8 quantization and dequantization: the specification the CUDA kernels
(:mod:`moe_ep.mxfp8.cuda`) must match byte for byte. Runs on any device."""

from __future__ import annotations

import torch

from .format import _FLOAT_DTYPES, BLOCK, E4M3_MAX, E4M3_NAN, SCALE_NAN, MXFP8Tensor


def _check_quantize_args(x: torch.Tensor, axis: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize supports bf16/fp16/fp32 inputs, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least a 1-D tensor")
    ax = axis % x.dim() if -x.dim() <= axis < x.dim() else None
    if ax is None:
        raise ValueError(f"axis {axis} out of range for a {x.dim()}-D tensor")
    if x.shape[ax] % BLOCK != 0:
        raise ValueError(
            f"the quantized axis ({ax}) has size {x.shape[ax]}, which is not a multiple of {BLOCK}; "
            "MXFP8 blocks are never padded silently"
        )
    return ax


# ----------------------------------------------------------------------------------------------------------
# Bit-exact helpers (fp32 bit manipulation, no transcendental functions, so every device gives the same bytes)
# ----------------------------------------------------------------------------------------------------------


def _exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for integer ``e`` in [-127, 127] (``2**-127`` is an fp32 subnormal).

    e: int32 tensor -> fp32 tensor of the same shape.
    """
    normal = (e + 127).clamp(min=1) << 23
    bits = torch.where(e >= -126, normal, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def _ceil_log2_pow(d: torch.Tensor) -> torch.Tensor:
    """Smallest integer ``E`` with ``2**E >= d`` for finite ``d >= 0``, clamped to [-127, 127].

    Read off the fp32 bits of ``d`` so that it is exact. d: fp32 -> int32.

    Example: d = 1.0 -> 0; d = 1.0000001 -> 1; d = 0.75 -> 0; d = 0 -> -127.
    """
    bits = d.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # normal: d = 2**(exp-127) * 1.m  -> E = exp-127, +1 unless the mantissa is zero
    e_normal = exp - 127 + (mant != 0).to(torch.int32)
    # subnormal: d = mant * 2**-149 <= 2**-126; E = -126 if mant > 2**22, else <= -127 (clamped)
    e_sub = torch.where(mant > (1 << 22), -126, -127).to(torch.int32)
    e = torch.where(exp == 0, e_sub, e_normal)
    return e.clamp(-127, 127)


def _quantize_lastdim_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise reference on the last axis. x: [..., K] float -> (data [..., K] e4m3, scale [..., K//32] u8)."""
    shape = x.shape
    v = x.to(torch.float32).reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    bad = ~torch.isfinite(v).all(dim=-1)  # [..., nb]
    amax = torch.where(bad.unsqueeze(-1), 0.0, v.abs()).amax(dim=-1)
    d = amax / E4M3_MAX
    e = _ceil_log2_pow(d)
    q = (v * _exp2_int(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad.unsqueeze(-1), 0.0, q)
    data = q.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(bad.unsqueeze(-1), torch.tensor(E4M3_NAN, dtype=torch.uint8, device=x.device), data)
    scale = torch.where(bad, SCALE_NAN, e + 127).to(torch.uint8)
    return data.reshape(shape).view(torch.float8_e4m3fn), scale


def quantize_torch(x: torch.Tensor, axis: int = -1) -> MXFP8Tensor:
    """Reference MXFP8 quantization (pure PyTorch, any device). Same contract as :func:`quantize`."""
    ax = _check_quantize_args(x, axis)
    xt = x.movedim(ax, -1)
    data, scale = _quantize_lastdim_torch(xt)
    return MXFP8Tensor(data.movedim(-1, ax).contiguous(), scale.movedim(-1, ax).contiguous(), ax)


def dequantize_torch(t: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference dequantization: ``e4m3 * 2**(s-127)`` in fp32 (exact), then cast to ``dtype``.

    t.data: [..., K] e4m3, t.scale: [..., K//32] u8 (along t.axis) -> [..., K] ``dtype``; scale 0xFF gives NaN.
    """
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dequantize supports bf16/fp16/fp32 outputs, got {dtype}")
    if t.data.dtype != torch.float8_e4m3fn or t.scale.dtype != torch.uint8:
        raise TypeError(f"expected e4m3 data and uint8 scales, got {t.data.dtype} and {t.scale.dtype}")
    ax = t.axis
    data = t.data.movedim(ax, -1)
    scale = t.scale.movedim(ax, -1)
    if data.shape[:-1] != scale.shape[:-1] or data.shape[-1] != scale.shape[-1] * BLOCK:
        raise ValueError(f"data {tuple(t.data.shape)} and scale {tuple(t.scale.shape)} do not match (axis {ax})")
    s = scale.to(torch.int32)
    mult = torch.where(s == SCALE_NAN, float("nan"), _exp2_int((s - 127).clamp(-127, 127)))
    v = data.to(torch.float32).reshape(*scale.shape, BLOCK) * mult.unsqueeze(-1)
    return v.reshape(data.shape).movedim(-1, ax).to(dtype).contiguous()


def quantize_blocks_torch(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 + E8M0 quantization in 2-D blocks of the last two axes (the rule above, any block shape).

    x: [..., R, C] float; block (br, bc) -> (data [..., R, C] e4m3, scale [..., ceil(R/br), ceil(C/bc)] u8). A block
    that runs past R or C is padded with zeros (which never change its amax). ``block=(1, 32)`` gives the bytes of
    :func:`quantize_torch` along the last axis.

    Example: x [3, 256], block (1, 128) -> scale [3, 2]; x [200, 256], block (128, 128) -> scale [2, 2], the
    second block row holding rows 128-199.
    """
    br, bc = block
    *lead, r, c = x.shape
    nr, nc = -(-r // br), -(-c // bc)
    v = x.to(torch.float32)
    if nr * br != r or nc * bc != c:
        v = torch.nn.functional.pad(v, (0, nc * bc - c, 0, nr * br - r))
    v = v.reshape(*lead, nr, br, nc, bc).movedim(-3, -2)  # [..., nr, nc, br, bc]
    bad = ~torch.isfinite(v).flatten(-2).all(dim=-1)  # [..., nr, nc]
    amax = torch.where(bad[..., None, None], 0.0, v.abs()).flatten(-2).amax(dim=-1)
    e = _ceil_log2_pow(amax / E4M3_MAX)
    q = (v * _exp2_int(-e)[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad[..., None, None], 0.0, q)
    data = q.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(bad[..., None, None], torch.tensor(E4M3_NAN, dtype=torch.uint8, device=x.device), data)
    data = data.movedim(-2, -3).reshape(*lead, nr * br, nc * bc)[..., :r, :c]
    scale = torch.where(bad, SCALE_NAN, e + 127).to(torch.uint8)
    return data.contiguous().view(torch.float8_e4m3fn), scale


def dequantize_blocks_torch(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks_torch`, exact in fp32. data: [..., R, C] e4m3, scale: [..., ceil(R/br),
    ceil(C/bc)] u8 -> [..., R, C] fp32 (a 0xFF scale gives NaN)."""
    br, bc = block
    r, c = data.shape[-2:]
    s = scale.to(torch.int32)
    mult = torch.where(s == SCALE_NAN, float("nan"), _exp2_int((s - 127).clamp(-127, 127)))
    mult = mult.repeat_interleave(br, dim=-2)[..., :r, :].repeat_interleave(bc, dim=-1)[..., :c]
    return data.to(torch.float32) * mult


def fake_quantize_blocks_torch(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Quantize-dequantize round trip in ``block``s of the last two axes: [..., R, C] float -> fp32."""
    return dequantize_blocks_torch(*quantize_blocks_torch(x, block), block)
