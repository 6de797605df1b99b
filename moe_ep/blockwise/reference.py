"""The blockwise recipe's byte layouts in pure PyTorch: the specification its kernels match byte for byte
(quantizers) or within fp32 summation order (GEMMs). Recipe row: :data:`moe_ep.recipe.BLOCKWISE`.

Elements E4M3 and E8M0 scales with the RCEIL rule of :mod:`moe_ep.mxfp8` (``quantize_blocks_torch``), in three
layouts (``B = 128``):

* **rowwise** (activations of fprop / dgrad: x, h, dy, da): ``data [M, K]`` e4m3 and ``scale [M, K/B]`` u8, one
  scale per 1x128 block of a row, row-major (what a token carries through the dispatch).
* **colwise, grouped, transposed** (wgrad operands: dy^T, h^T, da^T, x^T): the expert-sorted rows ``[M, K]``
  quantized in 128x1 blocks along the rows of each expert group, stored transposed and group-padded so that the
  FP8 tensor cores read them K-major (tokens contiguous): ``data_t [K, Mp]`` e4m3, ``scale_t [Mp/B, K]`` u8, where
  group g's n_g rows sit at columns ``P_g .. P_g + n_g - 1`` with ``P_g = B * sum_{h<g} ceil(n_h / B)``
  (:func:`padded_group_offsets`), the columns ``P_g + n_g .. P_g + B ceil(n_g/B) - 1`` hold zero bytes, and
  ``Mp >= colwise_cols(M, G) = B (ceil(M/B) + G)`` bounds the padded width from M and G alone (no host read of
  the group sizes). Columns past ``P_G`` (and their scale rows) are not part of the contract.
* **colwise, prepared bf16** (the wgrad operands as the bf16 wgrad kernel of the MXFP8 recipe reads them,
  ``moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out``): the same 128x1 blocks per group, stored exactly
  dequantized in bf16, rows in order (not transposed): ``[64 (ceil(M/64) + G), K]`` bf16 with group g at rows
  ``64 sum_{h<g} ceil(n_h / 64)`` and zero rows up to its next multiple of 64 (the 64-row padding of the MXFP8
  prepared operand, ``moe_ep.mxfp8.format.colwise_prep_rows``; independent of the 128-row blocks, which start at
  each group's first row). :func:`quantize_colwise_prepared_torch`.
* **weight** (128x128): ``w [G, N, K]`` -> ``data [G, N, K]`` (fprop's B, K-major), ``data_t [G, K, N]`` (the same
  bytes transposed: dgrad's B, N-major) and ``scale [G, N/B, K/B]`` u8 (dgrad reads ``scale.transpose(1, 2)``).

The GEMM references dequantize exactly (fp32) and multiply in fp32 (fp64 on request), rows of group g by the
group's weight; the kernels promote once per 128 of K, so they differ only in summation order and in the FP8
tensor cores' accumulation inside one 128-long block.
"""

from __future__ import annotations

import torch

from ..mxfp8.format import colwise_prep_rows
from ..mxfp8.reference import dequantize_blocks_torch, quantize_blocks_torch

B = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _host_sizes(group_sizes) -> list[int]:
    if isinstance(group_sizes, torch.Tensor):
        return [int(v) for v in group_sizes.to("cpu")]  # the reference reads sizes on the host
    return [int(v) for v in group_sizes]


def _check_k(name: str, k: int) -> None:
    if k % B:
        raise ValueError(f"blockwise {name} needs a multiple of {B}, got {k}")


def colwise_cols(m: int, num_groups: int) -> int:
    """Padded width of a colwise operand for M rows in G groups, sized without reading the group sizes."""
    return B * (_cdiv(m, B) + num_groups)


def padded_group_offsets(group_sizes) -> list[int]:
    """P_0 .. P_G: the first padded column of each group and the end of the last one.

    Example: sizes [130, 0, 5] -> [0, 256, 256, 384].
    """
    out = [0]
    for n in _host_sizes(group_sizes):
        out.append(out[-1] + B * _cdiv(n, B))
    return out


def quantize_rowwise_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float (K % 128 == 0) -> (data [M, K] e4m3, scale [M, K/128] u8)."""
    _check_k("K", x.shape[-1])
    return quantize_blocks_torch(x, (1, B))


def dequantize_rowwise_torch(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data: [M, K] e4m3, scale: [M, K/128] u8 -> [M, K] fp32."""
    return dequantize_blocks_torch(data, scale, (1, B))


def quantize_colwise_grouped_torch(
    x: torch.Tensor, group_sizes, cols: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float (expert-sorted rows), group_sizes: G ints summing to at most M -> (data_t [K, Mp] e4m3,
    scale_t [Mp/128, K] u8) with ``Mp = cols`` (default :func:`colwise_cols`); columns and scale rows past P_G are
    zero here.

    Example: sizes [130, 5], K = 128: group 0 = columns 0-129 (block 0: rows 0-127, block 1: rows 128-129 with
    126 zero columns), group 1 = columns 256-260; scale_t rows 0, 1, 2.
    """
    m, k = x.shape
    sizes = _host_sizes(group_sizes)
    if sum(sizes) > m or min(sizes, default=0) < 0:
        raise ValueError(f"group sizes {sizes} do not fit M = {m}")
    cols = colwise_cols(m, len(sizes)) if cols is None else cols
    offs = padded_group_offsets(sizes)
    if offs[-1] > cols or cols % B:
        raise ValueError(f"cols = {cols} must be a multiple of {B} holding the padded groups ({offs[-1]})")
    data_t = torch.zeros(k, cols, dtype=torch.uint8, device=x.device)
    scale_t = torch.zeros(cols // B, k, dtype=torch.uint8, device=x.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            d, s = quantize_blocks_torch(x[start : start + n].t(), (1, B))  # [K, n], [K, ceil(n/B)]
            data_t[:, offs[g] : offs[g] + n] = d.view(torch.uint8)
            scale_t[offs[g] // B : offs[g + 1] // B] = s.t()
        start += n
    return data_t.view(torch.float8_e4m3fn), scale_t


def dequantize_colwise_grouped_torch(data_t: torch.Tensor, scale_t: torch.Tensor, group_sizes) -> torch.Tensor:
    """Inverse of :func:`quantize_colwise_grouped_torch`: -> [sum(sizes), K] fp32 expert-sorted rows."""
    sizes = _host_sizes(group_sizes)
    offs = padded_group_offsets(sizes)
    full = dequantize_blocks_torch(data_t, scale_t.t(), (1, B))  # [K, Mp]
    return torch.cat([full[:, offs[g] : offs[g] + n] for g, n in enumerate(sizes)], dim=1).t()


def quantize_colwise_prepared_torch(x: torch.Tensor, group_sizes) -> torch.Tensor:
    """x: [M, K] float (expert-sorted rows), group_sizes: G ints summing to at most M -> bf16 [64 (ceil(M/64) + G), K]:
    the values of :func:`quantize_colwise_grouped_torch` (128x1 blocks from each group's first row) dequantized in
    fp32 (``dequantize_colwise_grouped_torch``) and rounded to bf16, group g at rows ``64 sum_{h<g} ceil(n_h/64)``;
    every other row zero here (the kernels write the groups' rows and the zero rows padding each group to a multiple
    of 64, nothing else).

    bf16 holds every dequantized value exactly (an e4m3 value has 3 mantissa bits; times 2**E it stays in fp32's and
    bf16's exponent range) except: values below 2**-133 (an e4m3 subnormal under a block exponent E <= -125: bf16's
    subnormals stop there; rounded to nearest even, as the MXFP8 operand), and Inf where e4m3 * 2**E passes fp32's
    largest value (a block whose amax rounds up to 2**128, e.g. the largest finite bf16/fp32: the fp32 reference is
    Inf there too). A NaN/Inf block (scale byte 0xFF) gives bf16 NaN 0x7FC0 on the group's rows (set here explicitly:
    torch's ``.to(torch.bfloat16)`` of a NaN is 0xFFFF on some CPU builds, 0x7FFF on CUDA; 0x7FC0 is also what the
    MXFP8 prepared operand writes), zeros on the pad rows.

    Example: sizes [130, 0, 5], K = 128 -> [64 (ceil(135/64) + 3), 128] = [384, 128]: group 0 = rows 0-129 (block 0:
    rows 0-127, block 1: rows 128-129), rows 130-191 zero, group 2 = rows 192-196 (one block), rows 197-255 zero.
    """
    m, k = x.shape
    sizes = _host_sizes(group_sizes)
    vals = dequantize_colwise_grouped_torch(*quantize_colwise_grouped_torch(x, sizes), sizes)  # [sum(n), K] fp32
    out = torch.zeros(colwise_prep_rows(m, len(sizes)), k, dtype=torch.bfloat16, device=x.device)
    start = poff = 0
    for n in sizes:
        out[poff : poff + n] = vals[start : start + n].to(torch.bfloat16)
        start += n
        poff += 64 * _cdiv(n, 64)
    out.view(torch.int16)[torch.isnan(out)] = 0x7FC0
    return out


def quantize_weight_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [G, N, K] float (N, K % 128 == 0) -> (data [G, N, K] e4m3, data_t [G, K, N] e4m3, scale [G, N/128, K/128]
    u8)."""
    if w.dim() != 3:
        raise ValueError(f"weights must be [G, N, K], got {tuple(w.shape)}")
    _check_k("N", w.shape[1])
    _check_k("K", w.shape[2])
    data, scale = quantize_blocks_torch(w, (B, B))
    return data, data.transpose(1, 2).contiguous(), scale


def dequantize_weight_torch(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data: [G, N, K] e4m3, scale: [G, N/128, K/128] u8 -> [G, N, K] fp32."""
    return dequantize_blocks_torch(data, scale, (B, B))


def grouped_mm_torch(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, group_sizes, acc=torch.float32
) -> torch.Tensor:
    """fprop / dgrad reference: out[rows of g] = deq(A)[rows of g] @ deq(B[g])^T.

    a: [M, K] e4m3, a_scale: [M, K/128] u8, b: [G, N, K] e4m3, b_scale: [G, N/128, K/128] u8 (dgrad: ``data_t``
    and ``scale.transpose(1, 2)``), group_sizes: G ints summing to at most M -> [M, N] ``acc`` (rows past the
    groups are zero).
    """
    sizes = _host_sizes(group_sizes)
    xa = dequantize_rowwise_torch(a, a_scale).to(acc)
    xb = dequantize_weight_torch(b, b_scale).to(acc)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = xa[start : start + n] @ xb[g].t()
        start += n
    return out


def grouped_wgrad_torch(
    a_t: torch.Tensor, a_st: torch.Tensor, b_t: torch.Tensor, b_st: torch.Tensor, group_sizes, acc=torch.float32
) -> torch.Tensor:
    """wgrad reference: out[g] = deq(A_g) @ deq(B_g)^T over the group's padded columns.

    a_t: [N, Mp] e4m3, a_st: [Mp/128, N] u8, b_t: [K, Mp] e4m3, b_st: [Mp/128, K] u8 (colwise grouped layouts),
    group_sizes: G ints -> [G, N, K] ``acc`` (zeros for empty groups).
    """
    sizes = _host_sizes(group_sizes)
    offs = padded_group_offsets(sizes)
    xa = dequantize_blocks_torch(a_t, a_st.t(), (1, B)).to(acc)
    xb = dequantize_blocks_torch(b_t, b_st.t(), (1, B)).to(acc)
    out = torch.zeros(len(sizes), a_t.shape[0], b_t.shape[0], dtype=acc, device=a_t.device)
    for g in range(len(sizes)):
        lo, hi = offs[g], offs[g + 1]
        if hi > lo:
            out[g] = xa[:, lo:hi] @ xb[:, lo:hi].t()
    return out
