"""MXFP8: E4M3 elements with one E8M0 scale per 32 consecutive values (DESIGN.md section 3).

Every public function here has a pure-PyTorch reference (``*_torch``) that runs on any device and is the
specification; CUDA tensors are routed to the CuPy kernels when they are available, which must produce the
same bytes. Set ``MOE_EP_FORCE_REFERENCE=1`` to keep CUDA tensors on the reference path.

Format, per block ``V`` of 32 values along the quantized axis (computed in fp32):
  * any NaN/Inf in ``V``: scale byte 0xFF and every element byte 0x7F (NaN);
  * ``d = amax / 448`` (one fp32 division, RNE); ``E`` = smallest integer with ``2**E >= d`` (``-127`` for
    ``d == 0``), clamped to ``[-127, 127]``; scale byte ``E + 127``;
  * ``q = e4m3(v * 2**-E)``: exact power-of-two multiply, round-to-nearest-even, saturating to +-448.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BLOCK = 32
E4M3_MAX = 448.0
SCALE_NAN = 0xFF
E4M3_NAN = 0x7F
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class MXFP8Tensor:
    """A quantized tensor.

    data:  same shape as the source, ``float8_e4m3fn``.
    scale: ``uint8`` E8M0 bytes, the source shape with ``shape[axis] // 32`` (plain row-major layout).
    axis:  the quantized axis (non-negative).
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self, dtype)


def use_reference(t: torch.Tensor) -> bool:
    """True when work on ``t`` goes to the PyTorch reference: t is not on a CUDA device, or MOE_EP_FORCE_REFERENCE=1."""
    return t.device.type != "cuda" or os.environ.get("MOE_EP_FORCE_REFERENCE", "0") == "1"


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


def quantize(x: torch.Tensor, axis: int = -1) -> MXFP8Tensor:
    """Quantize ``x`` to MXFP8 along ``axis``.

    x: [..., K] (axis=-1, "1x32", row-wise) or [M, ...] (axis=0, "32x1", column-wise); bf16/fp16/fp32.
    Returns MXFP8Tensor(data: x.shape e4m3, scale: x.shape with shape[axis]//32, uint8, plain layout).
    Raises TypeError for other dtypes, ValueError when ``x.shape[axis] % 32 != 0``.
    """
    ax = _check_quantize_args(x, axis)
    if use_reference(x):
        return quantize_torch(x, ax)
    from . import mxfp8_cuda  # noqa: PLC0415  (GPU packages are imported lazily)

    return mxfp8_cuda.quantize(x, ax)


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


def dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize to ``dtype``. t: MXFP8Tensor -> t.shape ``dtype`` tensor."""
    if use_reference(t.data):
        return dequantize_torch(t, dtype)
    from . import mxfp8_cuda  # noqa: PLC0415

    return mxfp8_cuda.dequantize(t, dtype)


def fake_quantize(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """quantize -> dequantize back to ``x.dtype``: the value the fast path computes with. Same shape/dtype."""
    return dequantize(quantize(x, axis), x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Scale layouts
# ----------------------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocked_offset(r: int, c: int, num_scale_cols: int) -> int:
    """Byte offset of scale ``(r, c)`` in the 128x4-tiled (cuBLAS) layout with ``num_scale_cols`` columns.

    Example: blocked_offset(5, 0, 2) == 80; blocked_offset(5, 1, 2) == 81; blocked_offset(32, 0, 2) == 4;
    blocked_offset(0, 4, 8) == 512.
    """
    tiles_per_row = _ceil_div(num_scale_cols, 4)
    return ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def blocked_size(rows: int, num_scale_cols: int) -> int:
    """Bytes of the blocked layout of a [rows, num_scale_cols] scale matrix (whole 128x4 tiles)."""
    return _ceil_div(rows, 128) * _ceil_div(num_scale_cols, 4) * 512


def _tile_2d(scale: torch.Tensor) -> torch.Tensor:
    """[..., M, C] u8 -> [..., ceil(M/128)*ceil(C/4)*512] blocked bytes, padding with zeros."""
    *lead, m, c = scale.shape
    mp, cp = _ceil_div(m, 128) * 128, _ceil_div(c, 4) * 4
    padded = scale.new_zeros(*lead, mp, cp)
    padded[..., :m, :c] = scale
    # row r = rb*128 + rg*32 + rs, col c = cb*4 + cc  ->  tile (rb, cb), then rs*16 + rg*4 + cc
    t = padded.reshape(*lead, mp // 128, 4, 32, cp // 4, 4)
    n = len(lead)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return t.reshape(*lead, -1)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Plain scales -> cuBLAS 128x4 blocked layout.

    scale: [M, C] u8 (or [E, M, C] for per-expert weights) -> [blocked_size(M, C)] u8 (or [E, ...]).
    Tiles are padded with zero bytes.
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"scales must be uint8, got {scale.dtype}")
    if scale.dim() < 2:
        raise ValueError(f"scales must be at least 2-D, got shape {tuple(scale.shape)}")
    return _tile_2d(scale)


def group_tile_offsets(group_sizes: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Start tile of each group when every group begins on a fresh tile of ``block`` rows.

    group_sizes: [G] int -> [G + 1] int64 (exclusive prefix sum of ceil(size/block); last entry = total).

    Example: sizes [0, 130, 5] -> [0, 0, 2, 3].
    """
    tiles = (group_sizes.to(torch.int64) + block - 1) // block
    return torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)])


def grouped_blocked_size(total: int, num_groups: int, other: int, groups_along: str = "m") -> int:
    """Static byte bound of a per-group blocked buffer (no host sync needed to size it).

    groups along "m": ``total`` scale rows split in groups, ``other`` scale columns:
      (ceil(total/128) + G) row tiles x ceil(other/4) column tiles x 512.
    groups along "k": ``total`` scale columns split in groups, ``other`` scale rows:
      ceil(other/128) row tiles x (ceil(total/4) + G) column tiles x 512.
    """
    if groups_along == "m":
        return (_ceil_div(total, 128) + num_groups) * _ceil_div(other, 4) * 512
    if groups_along == "k":
        return _ceil_div(other, 128) * (_ceil_div(total, 4) + num_groups) * 512
    raise ValueError(f"groups_along must be 'm' or 'k', got {groups_along!r}")


def to_blocked_grouped(scale: torch.Tensor, group_sizes: torch.Tensor, groups_along: str = "m") -> torch.Tensor:
    """Plain scales -> per-group blocked layout (reference).

    groups_along="m" (fprop/dgrad inputs): scale [M, C] u8, group_sizes [G] int summing to M (rows of the
    data, one scale row each). Group g's scale rows start on row tile ``group_tile_offsets(sizes)[g]``.
    groups_along="k" (wgrad inputs): scale [R, Ck] u8 with groups cutting the scaled axis; group_sizes [G]
    count *scale columns* (data elements / 32) summing to Ck. Group g is an independent blocked matrix
    ``to_blocked(scale[:, cols of g])`` stored at byte ``ceil(R/128) * group_tile_offsets(sizes, 4)[g] * 512``,
    so a grouped GEMM sees a standard layout per group.
    Returns [grouped_blocked_size(...)] u8; unused bytes are zero.

    Example (groups along m, C=1): sizes [2, 1] -> group 0 rows at tile 0 offsets 0, 16;
    group 1's row at tile 1, offset 512.
    """
    if scale.dtype != torch.uint8 or scale.dim() != 2:
        raise TypeError(f"scales must be a 2-D uint8 tensor, got {scale.dtype} {tuple(scale.shape)}")
    sizes = group_sizes.to(device="cpu", dtype=torch.int64)  # reference only: reads sizes on the host
    g = sizes.numel()
    rows, cols = scale.shape
    if (sizes < 0).any():
        raise ValueError("group sizes must be non-negative")
    if groups_along == "m":
        if int(sizes.sum()) != rows:
            raise ValueError(f"group sizes sum to {int(sizes.sum())}, but scale has {rows} rows")
        offs = group_tile_offsets(sizes).tolist()
        tiles_per_row = _ceil_div(cols, 4)
        out = scale.new_zeros(grouped_blocked_size(rows, g, cols, "m"))
        start = 0
        for gi in range(g):
            n = int(sizes[gi])
            if n:
                blk = _tile_2d(scale[start : start + n])
                base = offs[gi] * tiles_per_row * 512
                out[base : base + blk.numel()] = blk
            start += n
        return out
    if groups_along == "k":
        if int(sizes.sum()) != cols:
            raise ValueError(f"group sizes sum to {int(sizes.sum())}, but scale has {cols} columns")
        offs = group_tile_offsets(sizes, 4).tolist()
        row_tiles = _ceil_div(rows, 128)
        out = scale.new_zeros(grouped_blocked_size(cols, g, rows, "k"))
        start = 0
        for gi in range(g):
            n = int(sizes[gi])
            if n:
                blk = _tile_2d(scale[:, start : start + n])
                base = row_tiles * offs[gi] * 512
                out[base : base + blk.numel()] = blk
            start += n
        return out
    raise ValueError(f"groups_along must be 'm' or 'k', got {groups_along!r}")
