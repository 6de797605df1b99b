"""MXFP8 format and scale layouts (docs/design.md, "MXFP8 format" and "Scale layouts").

Format, per block ``V`` of 32 values along the quantized axis (computed in fp32):
  * any NaN/Inf in ``V``: scale byte 0xFF and every element byte 0x7F (NaN);
  * ``d = amax / 448`` (one fp32 division, RNE); ``E`` = smallest integer with ``2**E >= d`` (``-127`` for
    ``d == 0``), clamped to ``[-127, 127]``; scale byte ``E + 127``;
  * ``q = e4m3(v * 2**-E)``: exact power-of-two multiply, round-to-nearest-even, saturating to +-448.
"""

from __future__ import annotations

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


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: [..., blocked_size(rows, cols)] u8 -> plain scales [..., rows, cols] u8
    (the tiles' padding dropped).

    Example: from_blocked(to_blocked(s), *s.shape[-2:]) equals s; byte blocked_offset(r, c, cols) is s[r, c].
    """
    *lead, size = blocked.shape
    if size != blocked_size(rows, cols):
        raise ValueError(f"blocked scales of [{rows}, {cols}] take {blocked_size(rows, cols)} bytes, got {size}")
    mt, ct = _ceil_div(rows, 128), _ceil_div(cols, 4)
    n = len(lead)
    t = blocked.reshape(*lead, mt, ct, 32, 4, 4)  # tile (rb, cb), then rs, rg, cc
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)  # rb, rg, rs, cb, cc
    return t.reshape(*lead, mt * 128, ct * 4)[..., :rows, :cols]


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
    if groups_along not in ("m", "k"):
        raise ValueError(f"groups_along must be 'm' or 'k', got {groups_along!r}")
    along_m = groups_along == "m"
    total, other = (rows, cols) if along_m else (cols, rows)
    if int(sizes.sum()) != total:
        what = "rows" if along_m else "columns"
        raise ValueError(f"group sizes sum to {int(sizes.sum())}, but scale has {total} {what}")
    offs = group_tile_offsets(sizes, 128 if along_m else 4).tolist()
    # bytes from one group tile to the next: a 128-row tile spans ceil(C/4) 512-byte tiles (m); a 4-column tile
    # spans ceil(R/128) of them (k)
    tile_stride = 512 * (_ceil_div(cols, 4) if along_m else _ceil_div(rows, 128))
    out = scale.new_zeros(grouped_blocked_size(total, g, other, groups_along))
    start = 0
    for gi in range(g):
        n = int(sizes[gi])
        if n:
            blk = _tile_2d(scale[start : start + n] if along_m else scale[:, start : start + n])
            base = offs[gi] * tile_stride
            out[base : base + blk.numel()] = blk
        start += n
    return out


def from_blocked_grouped(blocked: torch.Tensor, group_sizes: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blocked_grouped(scale, sizes, "m")`` on the scales' device, without a host sync.

    blocked: u8 [>= grouped_blocked_size(rows, G, cols, "m")]; group_sizes: [G] int (device; rows of each group,
    summing to at most ``rows``) -> plain scales u8 [rows, cols]; rows past sum(group_sizes) are 0.
    How: un-tile every 128-row tile at once (a permute of the whole buffer), then gather one row per data row
    (group g's row j sits at tiled row 128 tile_off_g + j).

    Example: sizes [2, 1], cols 1: row 0 from byte 0, row 1 from byte 16, row 2 (group 1, fresh tile) from 512.
    """
    dev = blocked.device
    g = group_sizes.numel()
    if g == 0 or rows == 0 or cols == 0:
        return torch.zeros((rows, cols), dtype=torch.uint8, device=dev)
    ct = _ceil_div(cols, 4)
    tiles = _ceil_div(rows, 128) + g
    # tile (rb, cb) byte rs*16 + rg*4 + cc holds scale (rb*128 + rg*32 + rs, cb*4 + cc)
    plain = blocked[: tiles * ct * 512].view(tiles, ct, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(tiles * 128, ct * 4)
    gs = group_sizes.to(device=dev, dtype=torch.int64)
    ends = torch.cumsum(gs, 0)
    r = torch.arange(rows, device=dev)
    grp = torch.searchsorted(ends, r, right=True).clamp_(max=g - 1)
    src = group_tile_offsets(gs)[grp] * 128 + (r - (ends[grp] - gs[grp]))
    valid = r < ends[-1]
    out = plain.index_select(0, torch.where(valid, src, 0).clamp_(max=tiles * 128 - 1))[:, :cols]
    return out.masked_fill_(~valid[:, None], 0)


def colwise_prep_rows(m: int, num_groups: int) -> int:
    """Rows of a prepared wgrad operand (static bound ``64 (ceil(M/64) + G)`` >= sum of ceil64(n_g), no sync)."""
    return 64 * (_ceil_div(m, 64) + num_groups)
