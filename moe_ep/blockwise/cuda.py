"""CUDA launchers of the blockwise FP8 quantizers (``kernels/blockwise/quantize.cu``): the bytes of
:mod:`moe_ep.blockwise.reference` (recipe row :data:`moe_ep.recipe.BLOCKWISE`), byte for byte.

Each ``*_into`` function checks its preallocated outputs (shape, dtype, device, contiguity, 16-byte alignment) and
launches on torch's current stream; the function without ``_into`` allocates. Nothing here synchronizes with the host:
group sizes stay on the device and the grids are sized from M and G alone.

Entry points (``B = 128``):
  * :func:`quantize_rowwise`: x [M, K] -> 1x128 rows (the activations of fprop / dgrad).
  * :func:`quantize_colwise_prepared`: expert-sorted rows, bf16 or 1x128 bytes (requantized) -> 128x1 blocks per
    group written exactly dequantized in bf16, in the prepared layout of the bf16 wgrad kernel (the MLP's wgrad
    operands; :func:`swiglu_colwise_prepared` / :func:`swiglu_bwd_quantize_prepared` for h and dA).
  * :func:`quantize_weight`: w [G, N, K] -> 128x128 blocks, data and its byte transpose (fprop's and dgrad's B).
  * :func:`transpose_weight`: data [G, N, K] e4m3 -> its byte transpose (dgrad's B of a weight gathered as data +
    scales, no re-quantization).
  * :func:`swiglu_quantize`: h = swiglu(a) fused with its 1x128 quantization (the forward: fprop2's A);
    :func:`swiglu_colwise_prepared` / :func:`swiglu_bwd_quantize_prepared` (above): the backward's SwiGLU kernels.

Prepared outputs (``data_c`` bf16 ``[64 (ceil(M/64) + G), K]``): the kernels write each group's rows and the zero
rows padding it to a multiple of 64; the rows past the groups' padded rows are left as they were (the allocating
functions return them uninitialized). Group sizes summing to more than M are a caller error: rows past M are treated
as absent (never read).
"""

from __future__ import annotations

import torch

from .. import _cuda
from ..mxfp8.checks import check_out as _check_out  # the same output contract as the MXFP8 launchers
from ..mxfp8.format import colwise_prep_rows
from .reference import B

_SRC = "blockwise/quantize.cu"
# the kernels' constants, read from the source (never copied by hand)
_NT = _cuda.kernel_constant(_SRC, "BW_NT")
_IN = {torch.float32: _cuda.kernel_constant(_SRC, "BW_F32"), torch.bfloat16: _cuda.kernel_constant(_SRC, "BW_BF16")}
_E4M3 = _cuda.kernel_constant(_SRC, "BW_E4M3")
# bw_swiglu's launch configuration (threads, staged: the inputs land in shared memory by cp.async, so bytes in flight
# cost no registers and more CTAs fit per SM), per direction: the fastest of the configurations timed on an H200
# (benchmarks/results/bench_quant_blockwise.json; the register-staged and 512-thread builds lost and are gone from the
# launcher, git keeps them at a4aef65).
SWIGLU_CFG = {False: (256, 1), True: (256, 1)}
NAMES = (
    "bw_quant_rowwise<0>",
    "bw_quant_rowwise<1>",
    *(f"bw_quant_colwise<{src}>" for src in (1, 3)),
    "bw_quant_weight<0>",
    "bw_quant_weight<1>",
    "bw_transpose_weight",
    *(f"bw_swiglu<0,{col},{SWIGLU_CFG[False][0]},{SWIGLU_CFG[False][1]}>" for col in (0, 1)),
    f"bw_swiglu<1,1,{SWIGLU_CFG[True][0]},{SWIGLU_CFG[True][1]}>",
)
ROWWISE_CHUNKS_PER_CTA = 4 * _NT  # bw_quant_rowwise: 4 chunks of 16 bytes per thread
_COLWISE_CTAS_PER_SM = 2  # bw_quant_colwise: persistent, __launch_bounds__(256, 2)
_SMEM_MAX = 227 * 1024  # dynamic shared memory of one CTA (sm_90)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (sizes the persistent grids; the CPU emulator replaces this)."""
    return _cuda.num_sms(device)


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether t is a CUDA tensor (the CPU emulator, tests/blockwise_emu.py, replaces this)."""
    return t.device.type == "cuda"


def _launch(name: str, grid: int | tuple[int, int], threads: int, args: tuple, smem: int, device: torch.device) -> None:
    """Launch kernel ``name`` (one of :data:`NAMES`); the CPU emulator replaces this."""
    fn = _cuda.get_function(_SRC, name, NAMES, (), device.index)
    _cuda.launch(fn, grid, threads, args, shared_mem=smem, device=device)


# ------------------------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------------------------


def _check_in(x, what: str, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{what}: dtype must be one of {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")
    if not _on_gpu(x):
        raise ValueError(f"{what}: must be a CUDA tensor, got device {x.device}")
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError(f"{what}: must be contiguous and 16-byte aligned")


def _check_mult(what: str, name: str, v: int) -> None:
    if v % B:
        raise ValueError(f"{what}: {name} = {v} is not a multiple of {B} (blocks are never padded silently)")


def _check_groups(group_sizes, device: torch.device) -> torch.Tensor:
    """group_sizes: [G] int32 on ``device`` (read there by the kernels: no host sync)."""
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype != torch.int32:
        raise TypeError(f"group_sizes must be an int32 tensor, got {getattr(group_sizes, 'dtype', type(group_sizes))}")
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D, got shape {tuple(group_sizes.shape)}")
    if group_sizes.device != device:
        raise ValueError(
            f"group_sizes must be on {device} (read by the kernel, no host sync), got {group_sizes.device}"
        )
    return group_sizes.contiguous()


# ------------------------------------------------------------------------------------------------------------
# 1x128 row-wise
# ------------------------------------------------------------------------------------------------------------


def quantize_rowwise_into(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """x: [M, K] bf16 or fp32 (K % 128 == 0) -> data: [M, K] float8_e4m3fn, scale: [M, K/128] u8 (written in place),
    the bytes of :func:`moe_ep.blockwise.reference.quantize_rowwise_torch`."""
    _check_in(x, "quantize_rowwise: x", 2, tuple(_IN))
    m, k = x.shape
    _check_mult("quantize_rowwise", "K", k)
    _check_out(data, "data", (m, k), torch.float8_e4m3fn, x.device)
    _check_out(scale, "scale", (m, k // B), torch.uint8, x.device)
    nchunks = m * k * x.element_size() // 16
    if nchunks == 0:
        return
    p = _cuda.ptr
    args = (p(x), _cuda.i64(nchunks), p(data), p(scale))
    _launch(f"bw_quant_rowwise<{_IN[x.dtype]}>", _cdiv(nchunks, ROWWISE_CHUNKS_PER_CTA), _NT, args, 0, x.device)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] bf16 / fp32 -> (data [M, K] float8_e4m3fn, scale [M, K/128] u8): 1x128 blocks along K."""
    _check_in(x, "quantize_rowwise: x", 2, tuple(_IN))
    m, k = x.shape
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, k // B), dtype=torch.uint8, device=x.device)
    quantize_rowwise_into(x, data, scale)
    return data, scale


# ------------------------------------------------------------------------------------------------------------
# 128x1 grouped column-wise: the prepared bf16 wgrad operand
# ------------------------------------------------------------------------------------------------------------


def _colwise_src(x) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """x as (rows, 1x128 scales or None, kernel source code)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(
                "quantize_colwise_prepared: a quantized input is a pair (data [M, K] e4m3, scale [M, K/128])"
            )
        data, scale = x
        _check_in(data, "quantize_colwise_prepared: x data", 2, (torch.float8_e4m3fn,))
        m, k = data.shape
        _check_mult("quantize_colwise_prepared", "K", k)
        _check_out(scale, "x scale", (m, k // B), torch.uint8, data.device)
        return data, scale, _E4M3
    _check_in(x, "quantize_colwise_prepared: x", 2, (torch.bfloat16,))
    _check_mult("quantize_colwise_prepared", "K", x.shape[1])
    return x, None, _IN[torch.bfloat16]


def _colwise_launch(src, xs, code: int, group_sizes, rows: int, data_c) -> None:
    """bw_quant_colwise<code> on checked arguments (rows: data_c's)."""
    m, k = src.shape
    g = group_sizes.numel()
    tiles = (_cdiv(m, B) + g) * (k // B)  # a bound on the (128-row group tile, K tile) pairs from M and G
    if tiles == 0:
        return
    stages = 4 if code == _E4M3 else 3  # kernels: BwColCfg (S tiles in shared memory, S - 1 loading)
    smem = stages * B * B * src.element_size() + (stages * B * 4 if code == _E4M3 else 0) + 16 * (g + 1)
    if smem > _SMEM_MAX:
        raise ValueError(f"quantize_colwise_prepared: {g} groups need {smem} bytes of shared memory (max {_SMEM_MAX})")
    grid = min(tiles, _COLWISE_CTAS_PER_SM * _sm_count(src.device))
    p, i32, i64 = _cuda.ptr, _cuda.i32, _cuda.i64
    args = (p(src), p(xs), i64(m), i32(k), p(group_sizes), i32(g), i64(rows), p(data_c))
    _launch(f"bw_quant_colwise<{code}>", grid, _NT, args, smem, src.device)


def _prep_out(data_c, what: str, m: int, k: int, g: int, device: torch.device) -> int:
    rows = colwise_prep_rows(m, g)
    _check_out(data_c, f"{what}: data_c", (rows, k), torch.bfloat16, device)
    return rows


def quantize_colwise_prepared_into(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], group_sizes: torch.Tensor, data_c: torch.Tensor
) -> None:
    """128x1 blocks along each group's rows, written exactly dequantized in bf16: the operand the bf16 wgrad kernel
    reads (``moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out``), in one pass.

    x: [M, K] bf16 expert-sorted rows, or the pair (data [M, K] float8_e4m3fn, scale [M, K/128] u8) of their 1x128
        quantization (the dispatched x or dy: dequantized exactly in the kernel, then requantized; the bytes of the
        reference applied to ``dequantize_rowwise_torch(data, scale)``).
    group_sizes: [G] int32 on x's device (rows of each group in order, summing to at most M; not read on the host).
    data_c: bf16 [64 (ceil(M/64) + G), K] (``moe_ep.mxfp8.format.colwise_prep_rows``). Written: each group's rows
        (group g from row 64 sum_{h<g} ceil(n_h/64)) and the zero rows padding it to a multiple of 64, the bytes of
        :func:`moe_ep.blockwise.reference.quantize_colwise_prepared_torch` there; the other rows are left as they were.
    Grid: persistent, min((ceil(M/128) + G) * K/128, 2 per SM) CTAs of 256 threads walking the (128-row group tile,
    128 K values) pairs; shared memory 3 x 32 KB (bf16) / 4 x 16 KB (e4m3) of tile stages + 16 (G + 1) bytes. Each
    thread stores 4 (bf16 input) / 8 (e4m3 input) bytes of each of its rows.
    """
    src, xs, code = _colwise_src(x)
    m, k = src.shape
    group_sizes = _check_groups(group_sizes, src.device)
    rows = _prep_out(data_c, "quantize_colwise_prepared", m, k, group_sizes.numel(), src.device)
    _colwise_launch(src, xs, code, group_sizes, rows, data_c)


def quantize_colwise_prepared(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], group_sizes: torch.Tensor
) -> torch.Tensor:
    """Allocating form of :func:`quantize_colwise_prepared_into` -> data_c bf16 [64 (ceil(M/64) + G), K] (rows past
    the groups' padded rows uninitialized)."""
    src, _, _ = _colwise_src(x)
    m, k = src.shape
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    data_c = torch.empty((colwise_prep_rows(m, g), k), dtype=torch.bfloat16, device=src.device)
    quantize_colwise_prepared_into(x, group_sizes, data_c)
    return data_c


# ------------------------------------------------------------------------------------------------------------
# 128x128 weights
# ------------------------------------------------------------------------------------------------------------


def quantize_weight_into(w: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor, scale: torch.Tensor) -> None:
    """w: [G, N, K] bf16 / fp32 master weights (N, K % 128 == 0) -> data: [G, N, K] float8_e4m3fn (fprop's B),
    data_t: [G, K, N] float8_e4m3fn (the same bytes transposed: dgrad's B), scale: [G, N/128, K/128] u8 (dgrad
    reads ``scale.transpose(1, 2)``); the bytes of :func:`moe_ep.blockwise.reference.quantize_weight_torch`.
    One pass: each CTA reads one 128x128 tile once (grid (N/128 * K/128, G), 256 threads) and writes the tile and
    its transpose; bytes moved per element: 2 + 2 (bf16), 4 + 2 (fp32)."""
    _check_in(w, "quantize_weight: w", 3, tuple(_IN))
    g, n, k = w.shape
    _check_mult("quantize_weight", "N", n)
    _check_mult("quantize_weight", "K", k)
    _check_out(data, "data", (g, n, k), torch.float8_e4m3fn, w.device)
    _check_out(data_t, "data_t", (g, k, n), torch.float8_e4m3fn, w.device)
    _check_out(scale, "scale", (g, n // B, k // B), torch.uint8, w.device)
    if w.numel() == 0:
        return
    p, i32 = _cuda.ptr, _cuda.i32
    args = (p(w), i32(n), i32(k), p(data), p(data_t), p(scale))
    grid = ((n // B) * (k // B), g)
    _launch(f"bw_quant_weight<{_IN[w.dtype]}>", grid, _NT, args, B * B * w.element_size(), w.device)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [G, N, K] bf16 / fp32 -> (data [G, N, K] e4m3, data_t [G, K, N] e4m3, scale [G, N/128, K/128] u8)."""
    _check_in(w, "quantize_weight: w", 3, tuple(_IN))
    g, n, k = w.shape
    data = torch.empty((g, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    data_t = torch.empty((g, k, n), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((g, n // B, k // B), dtype=torch.uint8, device=w.device)
    quantize_weight_into(w, data, data_t, scale)
    return data, data_t, scale


def transpose_weight_into(data: torch.Tensor, data_t: torch.Tensor) -> None:
    """data: [G, N, K] float8_e4m3fn (N, K % 128 == 0; e.g. the gathered ``data`` of
    :mod:`moe_ep.experts.fsdp_blockwise`) -> data_t: [G, K, N] float8_e4m3fn, its bytes transposed: the ``data_t``
    :func:`quantize_weight` writes for the weight those bytes quantize, without re-quantizing (a 128x128 block is a
    block of the transpose). One pass: each CTA moves one 128x128 tile through shared memory (grid (N/128 * K/128, G),
    256 threads); 2 bytes moved per element."""
    _check_in(data, "transpose_weight: data", 3, (torch.float8_e4m3fn,))
    g, n, k = data.shape
    _check_mult("transpose_weight", "N", n)
    _check_mult("transpose_weight", "K", k)
    _check_out(data_t, "data_t", (g, k, n), torch.float8_e4m3fn, data.device)
    if data.numel() == 0:
        return
    p, i32 = _cuda.ptr, _cuda.i32
    _launch("bw_transpose_weight", ((n // B) * (k // B), g), _NT, (p(data), i32(n), i32(k), p(data_t)), 0, data.device)


def transpose_weight(data: torch.Tensor) -> torch.Tensor:
    """data: [G, N, K] e4m3 -> data_t [G, K, N] e4m3 (:func:`transpose_weight_into`)."""
    _check_in(data, "transpose_weight: data", 3, (torch.float8_e4m3fn,))
    g, n, k = data.shape
    data_t = torch.empty((g, k, n), dtype=torch.float8_e4m3fn, device=data.device)
    transpose_weight_into(data, data_t)
    return data_t


# ------------------------------------------------------------------------------------------------------------
# fused SwiGLU
# ------------------------------------------------------------------------------------------------------------


def _swiglu_a(a, what: str) -> tuple[int, int]:
    _check_in(a, f"{what}: a", 2, (torch.bfloat16,))
    m, f2 = a.shape
    if f2 % (2 * B):
        raise ValueError(f"{what}: a must be [M, 2F] (gate | up) with F % {B} == 0, got {tuple(a.shape)}")
    return m, f2 // 2


def _swiglu_launch(bwd: bool, a, dh, m: int, f: int, group_sizes, data, scale, data_c) -> None:
    """bw_swiglu on checked arguments: the row-only forward (group_sizes None), the column-only forward (data / scale
    None) or the backward (both)."""
    col = group_sizes is not None
    g = group_sizes.numel() if col else 0
    # the groups' tiles (+ the tiles of the rows past sum(sizes): the backward's row-wise output covers all M rows)
    rows = _cdiv(m, B) + g + int(bwd) if col else _cdiv(m, B)
    grid = rows * (f // B)
    if grid == 0 or (m == 0 and not col):
        return
    cols = data_c.shape[0] if col else 0
    p, i32, i64 = _cuda.ptr, _cuda.i32, _cuda.i64
    args = (p(a), p(dh), i64(m), i32(f), p(group_sizes), i32(g), i64(cols), p(data), p(scale), p(data_c))
    nt, staged = SWIGLU_CFG[bwd]
    smem = (3 if bwd else 2) * B * 256 if staged else 0  # kernels: BwSwCfg::SMEM (NS streams of 128 x 256 bytes)
    _launch(f"bw_swiglu<{int(bwd)},{int(col)},{nt},{staged}>", grid, nt, args, smem, a.device)


def swiglu_quantize_into(a: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """h = silu(gate) * up, computed in fp32 bit for bit as ``moe_ep.experts.reference.swiglu`` on CUDA, quantized in
    the same pass (h is never written in bf16).

    a: [M, 2F] bf16 (gate | up), F % 128 == 0.
    data: [M, F] float8_e4m3fn, scale: [M, F/128] u8: h in 1x128 rows (fprop2's A), every row written.
    Grid: ceil(M/128) x F/128 CTAs (threads and staging: :data:`SWIGLU_CFG`).
    """
    m, f = _swiglu_a(a, "swiglu_quantize")
    _check_out(data, "data", (m, f), torch.float8_e4m3fn, a.device)
    _check_out(scale, "scale", (m, f // B), torch.uint8, a.device)
    _swiglu_launch(False, a, None, m, f, None, data, scale, None)


def swiglu_quantize(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a: [M, 2F] bf16 -> (data [M, F] e4m3, scale [M, F/128] u8) of h = swiglu(a) in 1x128 rows
    (:func:`swiglu_quantize_into`)."""
    m, f = _swiglu_a(a, "swiglu_quantize")
    data = torch.empty((m, f), dtype=torch.float8_e4m3fn, device=a.device)
    scale = torch.empty((m, f // B), dtype=torch.uint8, device=a.device)
    swiglu_quantize_into(a, data, scale)
    return data, scale


def swiglu_colwise_prepared_into(a: torch.Tensor, group_sizes: torch.Tensor, data_c: torch.Tensor) -> None:
    """h = silu(gate) * up (as :func:`swiglu_quantize_into` computes it) in 128x1 grouped blocks only, written exactly
    dequantized in bf16: wgrad2's operand for the bf16 wgrad kernel. No row-wise byte is written (the backward
    recomputes h for this operand alone; fprop2's 1x128 rows came from the forward).

    a: [M, 2F] bf16 (gate | up), F % 128 == 0; group_sizes: [G] int32 on a's device; data_c: bf16
    [64 (ceil(M/64) + G), F], contract of :func:`quantize_colwise_prepared_into`. Grid: (ceil(M/128) + G) x F/128
    CTAs (the groups' 128-row tiles; the others exit at once).
    """
    m, f = _swiglu_a(a, "swiglu_colwise_prepared")
    group_sizes = _check_groups(group_sizes, a.device)
    _prep_out(data_c, "swiglu_colwise_prepared", m, f, group_sizes.numel(), a.device)
    _swiglu_launch(False, a, None, m, f, group_sizes, None, None, data_c)


def swiglu_colwise_prepared(a: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """a: [M, 2F] bf16, group_sizes: [G] int32 -> data_c bf16 [64 (ceil(M/64) + G), F] of h = swiglu(a)
    (:func:`swiglu_colwise_prepared_into`; rows past the groups' padded rows uninitialized)."""
    m, f = _swiglu_a(a, "swiglu_colwise_prepared")
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    data_c = torch.empty((colwise_prep_rows(m, g), f), dtype=torch.bfloat16, device=a.device)
    swiglu_colwise_prepared_into(a, group_sizes, data_c)
    return data_c


def swiglu_bwd_quantize_prepared_into(
    a: torch.Tensor,
    dh: torch.Tensor,
    group_sizes: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    data_c: torch.Tensor,
) -> None:
    """dA = swiglu_bwd(a, dh), computed in fp32 bit for bit as ``moe_ep.experts.reference.swiglu_bwd`` on CUDA (dh
    widened exactly), quantized both ways in one pass (one sigmoid per element, a, dh read once; no bf16 dA).

    a: [M, 2F] bf16 (gate | up), F % 128 == 0; dh: [M, F] bf16 (the dgrad2 GEMM's output);
    group_sizes: [G] int32 on a's device.
    data: [M, 2F] float8_e4m3fn, scale: [M, 2F/128] u8: dA in 1x128 rows (dgrad1's A), every row written.
    data_c: bf16 [64 (ceil(M/64) + G), 2F]: dA in 128x1 grouped blocks written exactly dequantized (wgrad1's operand
    for the bf16 wgrad kernel, contract of :func:`quantize_colwise_prepared_into`).
    Grid: (ceil(M/128) + G + 1) x F/128 CTAs, one 128 x 128 tile of h (dA's gate and up tiles) each (threads and
    staging: :data:`SWIGLU_CFG`).
    """
    m, f = _swiglu_a(a, "swiglu_bwd_quantize_prepared")
    _check_in(dh, "swiglu_bwd_quantize_prepared: dh", 2, (torch.bfloat16,))
    _check_out(dh, "dh", (m, f), torch.bfloat16, a.device)
    group_sizes = _check_groups(group_sizes, a.device)
    _check_out(data, "data", (m, 2 * f), torch.float8_e4m3fn, a.device)
    _check_out(scale, "scale", (m, 2 * f // B), torch.uint8, a.device)
    _prep_out(data_c, "swiglu_bwd_quantize_prepared", m, 2 * f, group_sizes.numel(), a.device)
    _swiglu_launch(True, a, dh, m, f, group_sizes, data, scale, data_c)


def swiglu_bwd_quantize_prepared(
    a: torch.Tensor, dh: torch.Tensor, group_sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a: [M, 2F] bf16, dh: [M, F] bf16, group_sizes: [G] int32 -> (data [M, 2F] e4m3, scale [M, 2F/128] u8,
    data_c bf16 [64 (ceil(M/64) + G), 2F]) of dA; see :func:`swiglu_bwd_quantize_prepared_into`."""
    m, f = _swiglu_a(a, "swiglu_bwd_quantize_prepared")
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    dev = a.device
    data = torch.empty((m, 2 * f), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty((m, 2 * f // B), dtype=torch.uint8, device=dev)
    data_c = torch.empty((colwise_prep_rows(m, g), 2 * f), dtype=torch.bfloat16, device=dev)
    swiglu_bwd_quantize_prepared_into(a, dh, group_sizes, data, scale, data_c)
    return data, scale, data_c
