"""Blockwise FP8 grouped GEMMs on Hopper (recipe row :data:`moe_ep.recipe.BLOCKWISE`): the CuPy launcher of
``kernels/experts/sm90/blockwise_gemm.cu`` (fprop / dgrad). The recipe's wgrad runs on the MXFP8 recipe's bf16 wgrad
kernel over exactly dequantized 128x1 operands (``moe_ep.experts.sm90.blockwise``; the FP8 k-grouped wgrad kernel
lost to it and was deleted, git keeps it at bfa5169: benchmarks/results/bench_wgrad_blockwise.json).

The specification is :mod:`moe_ep.blockwise.reference` (byte layouts; ``grouped_mm_torch``):
the kernels multiply the e4m3 bytes exactly on the FP8 tensor cores, sum 128 of K there (fp32 accumulation with the
tensor cores' limited alignment precision) and promote each 128-block's partial sum into an fp32 accumulator with
the product of its two E8M0 scales, so they differ from the reference only in summation order and in that
in-block accumulation.

Operand formats (CUDA tensors on one device; ``group_sizes`` int32 [G] on the device, never read on the host;
groups are contiguous, expert-sorted rows from row 0, sum(sizes) <= M; B = 128):

fprop / dgrad  :func:`grouped_mm_blockwise_out`: out[rows of g] = deq(a)[rows of g] @ deq(b[g])^T
    a        e4m3 [M, K], contiguous; a_scale u8 [M, K/B] contiguous (one E8M0 byte per 1x128 block of a row)
    b        e4m3 [G, N, K], contiguous (K-major: fprop's weight ``data``; dgrad's ``data_t`` [G, K_w, N_w])
    b_scale  u8 [G, N/B, K/B], any strides (fprop: ``scale``; dgrad: ``scale.transpose(1, 2)``)
    out      bf16 [M, N], contiguous; rows >= sum(sizes) untouched, or zero-filled with ``zero_rest``
    K % 128 == 0, N % 128 == 0.

E8M0 byte s scales by 2**(s-127) (s = 0: 2**-127), s = 255 marks a block that held NaN/Inf: its outputs are NaN.
"""

from __future__ import annotations

import torch

from ..._cuda import kernel_constant
from ...blockwise.reference import B

_GEMM_FILE = "experts/sm90/blockwise_gemm.cu"
# the kernels' constants, read from their sources (never copied by hand)
_THREADS = kernel_constant(_GEMM_FILE, "WS_THREADS")  # 2 consumer warpgroups + 1 producer warpgroup
_BM, _BN = kernel_constant(_GEMM_FILE, "BW_BM"), kernel_constant(_GEMM_FILE, "BW_BN")  # output tile
_GEMM_SMEM_BYTES = kernel_constant(_GEMM_FILE, "BW_SMEM_BYTES")
_I32_MAX = 2**31 - 1
__all__ = [
    "fprop_tiles",
    "grouped_mm_blockwise",
    "grouped_mm_blockwise_out",
    "tile_schedule",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------------------
# host-side plan (what the kernels compute on the device, for tests and for sizing the grid)
# ----------------------------------------------------------------------------------------------------------


def fprop_tiles(m: int, n: int, num_groups: int) -> int:
    """Tiles of the fprop / dgrad grid: (ceil(M/128) + G) row tiles x N/128 column tiles. The row tiles of the
    groups are sum_g ceil(n_g/128) <= ceil(M/128) + G - 1 (each group wastes less than one tile); the rest zero-fill
    rows past sum(sizes) when ``zero_rest``. Example: M = 300, N = 256, G = 3 -> (3 + 3) * 2 = 12."""
    return (_cdiv(m, _BM) + num_groups) * (n // _BN) if num_groups else 0


def _raster(t: int, m_tiles: int, n_tiles: int, band: int = 8) -> tuple[int, int]:
    """gm_raster (kernels/gemm_common.cuh): linear tile -> (row tile, column tile), row tiles in bands."""
    if band <= 1:
        return t // n_tiles, t % n_tiles
    b = t // (band * n_tiles)
    rows = min(band, m_tiles - b * band)
    r = t - b * band * n_tiles
    return b * band + r % rows, r // rows


def tile_schedule(group_sizes, m: int, n: int) -> list[tuple]:
    """The fprop / dgrad kernel's work list, emulated on the host: for every linear tile t, ``("mm", g, row0, rows,
    n0)`` (rows row0 .. row0 + rows - 1 of group g, columns n0 .. n0 + 127), ``("zero", row0, n0)`` (a tile past the
    groups: zero-fills up to 128 rows from row0 when zero_rest and row0 < M) or ``("none",)``.

    Example: sizes [130, 0, 5], M = 140, N = 128: row tiles (g0: 0-127, g0: 128-129, g2: 130-134, then tiles past
    the groups from row 135) -> [("mm", 0, 0, 128, 0), ("mm", 0, 128, 2, 0), ("mm", 2, 130, 5, 0),
    ("zero", 135, 0), ("zero", 263, 0), ...].
    """
    sizes = [max(int(v), 0) for v in group_sizes]
    g = len(sizes)
    m_tiles, n_tiles = _cdiv(m, _BM) + g, n // _BN
    tiles, starts, row = [], [], 0
    for gi, s in enumerate(sizes):
        for i in range(_cdiv(s, _BM)):
            rows = max(0, min(_BM, min(s, max(m - row, 0)) - i * _BM))
            tiles.append((gi, row + i * _BM, rows))
        starts.append(row)
        row += s
    out = []
    for t in range((m_tiles * n_tiles) if g else 0):
        mt, nt = _raster(t, m_tiles, n_tiles)
        if mt < len(tiles):
            gi, r0, rows = tiles[mt]
            out.append(("mm", gi, r0, rows, nt * _BN) if rows > 0 else ("none",))
        else:
            out.append(("zero", row + (mt - len(tiles)) * _BM, nt * _BN))
    return out


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 exactly as the kernels decode them (wgmma_fp8.cuh e8m0_f32): bits s << 23, s = 0 ->
    2**-127 (subnormal bit 22), s = 255 -> NaN."""
    s = s.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------------


def _dtype(name: str, t, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")


def _shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _mult(what: str, v: int) -> None:
    if v <= 0 or v % B:
        raise ValueError(f"blockwise GEMM: {what} ({v}) must be a positive multiple of {B}")


def _devices(named: tuple, contiguous: tuple[str, ...]) -> torch.device:
    """All on one CUDA device (group sizes included: the kernels read them there, no host sync); the named ones
    contiguous and 16-byte aligned (TMA and vector stores)."""
    dev = None
    for name, t in named:
        if t.device.type != "cuda":
            hint = " (the kernel reads the sizes on the device: no host sync)" if name == "group_sizes" else ""
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}{hint}")
        if dev is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev}")
        dev = t.device
        if name in contiguous:
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")
    return dev


def _check_mm(a, a_scale, b, b_scale, group_sizes, out) -> tuple[int, int, int, int]:
    for name, t, dts in (
        ("a", a, (torch.float8_e4m3fn,)),
        ("a_scale", a_scale, (torch.uint8,)),
        ("b", b, (torch.float8_e4m3fn,)),
        ("b_scale", b_scale, (torch.uint8,)),
        ("group_sizes", group_sizes, (torch.int32,)),
        ("out", out, (torch.bfloat16,)),
    ):
        _dtype(name, t, dts)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"expected a [M, K] and b [G, N, K], got {list(a.shape)} and {list(b.shape)}")
    m, k = a.shape
    g, n, kb = b.shape
    if kb != k:
        raise ValueError(f"reduction sizes differ: a {list(a.shape)}, b {list(b.shape)}")
    _mult("K", k)
    _mult("N", n)
    if group_sizes.dim() != 1 or group_sizes.numel() != g:
        raise ValueError(f"group_sizes must be [G] = [{g}] (b's groups), got {list(group_sizes.shape)}")
    _shape("a_scale", a_scale, (m, k // B))
    _shape("b_scale", b_scale, (g, n // B, k // B))
    _shape("out", out, (m, n))
    if any(s < 0 for s in b_scale.stride()):
        raise ValueError(f"b_scale strides must be non-negative, got {b_scale.stride()}")
    extent = sum((d - 1) * s for d, s in zip(b_scale.shape, b_scale.stride(), strict=True))
    if m * (k // B) > _I32_MAX or extent > _I32_MAX:
        raise ValueError("scale tensors larger than 2**31 bytes are not supported (32-bit offsets in the kernel)")
    _devices(
        (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("group_sizes", group_sizes), ("out", out)),
        ("a", "a_scale", "b", "group_sizes", "out"),
    )
    return m, n, k, g


# ----------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------


def _tma_map_2d(*args, **kwargs):
    try:  # the MXFP8 launcher's encoder (moved to experts/sm90 by the tree restructure, issue 39)
        from ..gemm import _tma_map_2d as enc  # noqa: PLC0415
    except ImportError:  # pragma: no cover - depends on the tree layout
        from .gemm import _tma_map_2d as enc  # noqa: PLC0415
    return enc(*args, **kwargs)


def _run(file: str, kernel: str, grid: int, smem: int, args: tuple, device: torch.device, options=()) -> None:
    from ... import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    fn = _cuda.get_function(file, kernel, extra_options=tuple(options), device=device.index, arch="sm_90a")
    _cuda.launch(fn, grid, _THREADS, args, shared_mem=smem, device=device)


def _gm_args(tensors: tuple, g: int, m: int, n: int, k: int, zero_rest: bool) -> tuple:
    from ... import _cuda  # noqa: PLC0415

    ptrs = tuple(_cuda.ptr(t) for t in tensors)
    return ptrs + (_cuda.i32(g), _cuda.i64(m), _cuda.i32(n), _cuda.i32(k), _cuda.i32(int(zero_rest)))


def grouped_mm_blockwise_out(a, a_scale, b, b_scale, group_sizes, out, zero_rest: bool = False, _options=()):
    """out[rows of g] = deq(a)[rows of g] @ deq(b[g])^T (fprop; dgrad with b = data_t, b_scale =
    scale.transpose(1, 2)). Formats: module docstring. Rows >= sum(sizes) are left alone, or zero-filled with
    ``zero_rest``. Returns ``out``. (``_options``: extra NVRTC defines, for the rate probe's -DBW_NO_PROMOTE.)"""
    m, n, k, g = _check_mm(a, a_scale, b, b_scale, group_sizes, out)
    if m == 0:
        return out
    if g == 0:
        if zero_rest:
            out.zero_()
        return out
    from ... import _cuda  # noqa: PLC0415

    tiles = fprop_tiles(m, n, g)
    grid = min(tiles, _cuda.num_sms(out.device))
    maps = (_tma_map_2d(a, m, k, 128, 128, 1, True), _tma_map_2d(b, g * n, k, 128, 128, 1, True))
    strides = tuple(_cuda.i64(s) for s in b_scale.stride())
    args = _gm_args((a, a_scale, b, b_scale, group_sizes, out), g, m, n, k, zero_rest) + maps + strides
    _run(_GEMM_FILE, "bw_gmm_2d3d_bf16", grid, _GEMM_SMEM_BYTES, args, out.device, _options)
    return out


def grouped_mm_blockwise(
    a, a_scale, b, b_scale, group_sizes, out_dtype: torch.dtype = torch.bfloat16, zero_rest: bool = False
):
    """Allocating :func:`grouped_mm_blockwise_out`: -> bf16 [M, N] (rows past sum(sizes) are zero only with
    ``zero_rest``; otherwise uninitialized)."""
    if out_dtype != torch.bfloat16:
        raise TypeError(f"the blockwise fprop / dgrad kernel writes bf16 only, got out_dtype={out_dtype}")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 3:
        raise ValueError("expected a [M, K] and b [G, N, K] tensors")
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return grouped_mm_blockwise_out(a, a_scale, b, b_scale, group_sizes, out, zero_rest=zero_rest)
