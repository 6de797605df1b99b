"""MXFP8 grouped GEMMs on Hopper: CuPy launchers for ``kernels/experts/sm90/grouped_gemm.cu`` (fprop / dgrad) and
``kernels/experts/sm90/grouped_gemm_wgrad.cu`` (wgrad). Design: docs/design-kernels.md, "Grouped GEMMs".

The specification is ``moe_ep.experts.reference`` (``grouped_mm_torch``, ``grouped_wgrad_torch``,
``fake_quantize_grouped_cols``; :func:`~moe_ep.experts.reference.grouped_wgrad_prepared_torch` for the wgrad's
prepared operands): the kernels multiply the exactly dequantized MXFP8 operands (e4m3 * 2**(s-127) is exact in bf16
except below 2**-133) on bf16 tensor cores with fp32 accumulation, so results equal the reference up to fp32 summation
order.

Operand formats (all tensors CUDA, contiguous, 16-byte aligned; ``G`` groups; ``group_sizes`` int32 [G] on the
device, never read on the host; rows are NOT padded; a group's rows are contiguous and groups follow each other):

fprop  ``grouped_mm_fprop``: out[M, N] = X_g @ W[g]^T for the rows of each group g
    x        float8_e4m3fn [M, K]  row-wise MXFP8 (1x32 blocks along K), M arbitrary
    x_scale  uint8 [>= (ceil(M/128) + G) * ceil(K/128) * 512]: ``mxfp8.to_blocked_grouped(scale, sizes, "m")``
             (group g starts on 128-row scale tile ``sum_{h<g} ceil(n_h/128)``, computed on device)
    w        float8_e4m3fn [G, N, K] quantized along K, or None when w_prepared is given
    w_scale  uint8 [G, blocked_size(N, K/32)]: ``mxfp8.to_blocked(scale [G, N, K/32])``; None with w
    w_prepared  bf16 [G, N, ceil(K/64) * 64]: ``prepare_weight_bf16(w, w_scale)``, the weight as the kernel reads it
             (exact bf16, k permuted inside each 64-block, ``k_permutation``); computed once per weight version
             (``weight_operands`` with a ``WeightQuantCache``: ``prepare_weight_operands`` straight from W, with
             w / w_scale None) and passed in; without it every call prepares it from w (one memory-bound pass and a
             transient bf16 copy of the weight). The kernel reads only this operand, never w / w_scale.
    out      bf16 [M, N]. Rows past sum(sizes) (the only rows outside every group: groups are
             contiguous from row 0) are zero-filled by the kernel when the wrapper allocates ``out`` (or when
             ``zero_rest=True``); a caller-given ``out`` keeps them untouched by default.
dgrad  ``grouped_mm_dgrad``: the same kernel with the transposed weight copy: dX[M, K] = dY_g @ W[g]
    dy       float8_e4m3fn [M, N] row-wise (blocks along N), dy_scale as x_scale with N for K
    wt       float8_e4m3fn [G, K, N] = W^T per expert quantized along N (= quantize(W, axis=-2) transposed),
    wt_scale uint8 [G, blocked_size(K, N/32)]; wt_prepared bf16 [G, K, ceil(N/64) * 64] as w_prepared (wt and
             wt_scale may be None with it)
wgrad  ``grouped_wgrad_prepared_out``: dW[g] = dY_g^T @ X_g, [G, N, K], reduction over each group's rows
    a_prep   bf16 [64 (ceil(M/64) + G), N]: dY quantized COLUMN-wise in 32x1 blocks that restart at each group's
             first row (a group's last block may be short: zero padded), i.e. ``fake_quantize_grouped_cols``, and
             stored exactly dequantized with group g at row 64 sum_{h<g} ceil(n_h/64) and zero rows up to its next
             multiple of 64, as ``mxfp8_cuda.quantize_grouped_dual`` writes it (``prepare_colwise_bf16_torch`` of
             ``colwise_operand_ref``'s MXFP8 pair is its reference)
    b_prep   bf16 [same rows, K]: the same for X
    out      fp32 or bf16 [G, N, K]; empty groups get zeros.

Kernels. fprop and dgrad run one persistent, warp-specialized kernel (grid = min(tiles, SMs), 384 threads: a
producer warp issues TMA loads into a ring of shared-memory stages, two consumer warpgroups dequantize the
activation tile into wgmma register fragments and multiply it by the prepared bf16 weight; 128 x 256 output tiles).
It has two builds, picked from the reduction length by :func:`ring_stages`: 4 ring stages with a TMA-store
epilogue, or, for K >= 3072, 5 stages with the register epilogue (the shared output tile does not fit next to a
fifth stage); both give the same results. wgrad runs a kernel of the same structure on the two prepared bf16
operands (MN-major wgmma, 128 x 256 tiles of [N, K] per group, 4 ring stages, TMA-store epilogue in rounds).

Shape rules: K (the reduction axis of fprop/dgrad) % 32 == 0; output columns % 8 == 0; wgrad N, K % 8 == 0.
Group sizes must be >= 0 (negative counts as 0) and sum to <= M (rows past M are clamped, never touched).
Everything runs on torch's current stream with no host synchronization.

The operand side lives in :mod:`.operands`: the bf16 preparation of weights (``prepare_weight_operands`` from W,
``prepare_weight_bf16`` from an MXFP8 weight, ``weight_operands``); the pure-PyTorch converters from plain tensors to
these formats are test helpers (tests/refs.py).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ... import mxfp8
from ..._cuda import kernel_constant
from ...mxfp8.format import colwise_prep_rows
from .operands import _cdiv, _check_dtype, _check_memory, prepare_weight_bf16

_GEMM_FILE = "experts/sm90/grouped_gemm.cu"
_WGRAD_FILE = "experts/sm90/grouped_gemm_wgrad.cu"
# The kernels' constants, read from their sources (moe_ep._cuda.kernel_constant), never copied by hand.
_THREADS = kernel_constant(_GEMM_FILE, "WS_THREADS")  # 2 consumer warpgroups + 1 producer warpgroup
_BM, _BN = kernel_constant(_GEMM_FILE, "GG_BM"), kernel_constant(_GEMM_FILE, "GG_BN")  # output tile (both kernels)
_GEMM_SMEM_BYTES = kernel_constant(_GEMM_FILE, "GG_SMEM_BYTES")
# the long-reduction build: 5 ring stages, no shared output tile (register epilogue)
_DEEP_DEFINES = {"GG_STAGES": 5, "GG_REG_EPI": 1}
_DEEP_OPTIONS = tuple(f"-D{k}={v}" for k, v in _DEEP_DEFINES.items())
_DEEP_SMEM_BYTES = kernel_constant(_GEMM_FILE, "GG_SMEM_BYTES", _DEEP_DEFINES)
_DEEP_K = 3072  # reductions from this length on run the deep build (a launcher choice, measured)
_WGRAD_SMEM_BYTES = kernel_constant(_WGRAD_FILE, "WR_SMEM_BYTES")
_OUT_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}  # the wgrad's outputs (fprop / dgrad: bf16 only)


def ring_stages(k: int) -> int:
    """Ring stages of the fprop / dgrad kernel build for a reduction of ``k``: 5 (register epilogue) when
    k >= 3072, else 4 (TMA-store epilogue). Same results either way (the same k-steps in the same order).

    Example: ring_stages(2048) == 4, ring_stages(7168) == 5.
    """
    return 5 if k >= _DEEP_K else 4


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


def _check_common(a, a_scale, b, b_scale, group_sizes, out) -> None:
    """dtypes first (TypeError), then device / contiguity / alignment (ValueError). b and b_scale may both be None
    (the launcher then needs b_prepared)."""
    if (b is None) != (b_scale is None):
        raise ValueError("b and b_scale must be given together, or both None (with b_prepared)")
    named = (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("group_sizes", group_sizes), ("out", out))
    want = (
        (torch.float8_e4m3fn,),
        (torch.uint8,),
        (torch.float8_e4m3fn,),
        (torch.uint8,),
        (torch.int32,),
        (torch.bfloat16,),
    )
    skip = ("b", "b_scale") if b is None else ()
    named_want = [(name, t, dts) for (name, t), dts in zip(named, want, strict=True) if name not in skip]
    for name, t, dts in named_want:
        _check_dtype(name, t, dts)
    dev = None
    for name, t, _ in named_want:
        dev = _check_memory(name, t, dev)
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")


def _launch(
    kernel: str,
    kernel_file: str,
    grid: int,
    smem: int,
    tensors: tuple,
    g: int,
    m: int,
    n: int,
    k: int,
    zero_rest: bool,
    maps: tuple,
    options: tuple[str, ...] = (),
) -> None:
    """Launch ``kernel`` of ``kernels/<kernel_file>`` (built with ``options``) on ``grid`` CTAs of ``_THREADS``
    threads: GM_ARGS from ``tensors`` = (a, a_scale, b, b_scale, group_sizes, out) and the sizes, then the tensor
    maps ``maps``. Nothing happens when grid <= 0."""
    if grid <= 0:
        return
    from ... import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    out = tensors[5]
    fn = _cuda.get_function(kernel_file, kernel, extra_options=options, device=out.device.index)
    args = _kernel_args(*tensors, g, m, n, k, zero_rest) + tuple(maps)
    _cuda.launch(fn, grid, _THREADS, args, shared_mem=smem, device=out.device)


def _kernel_args(a, a_scale, b, b_scale, group_sizes, out, g: int, m: int, n: int, k: int, zero_rest: bool) -> tuple:
    """The kernels' GM_ARGS: (6 pointers, int G, long long M, int N, int K, int zero_rest) as numpy scalars."""
    from ... import _cuda  # noqa: PLC0415  (numpy + torch only; CuPy is imported by get_function / launch)

    ptrs = tuple(_cuda.ptr(t) for t in (a, a_scale, b, b_scale, group_sizes, out))
    return ptrs + (_cuda.i32(g), _cuda.i64(m), _cuda.i32(n), _cuda.i32(k), _cuda.i32(int(zero_rest)))


# CUtensorMap of the kernels' operands and outputs: 128 opaque bytes, encoded by the driver and passed by value to a
# ``const __grid_constant__`` struct parameter (a numpy structured scalar; CuPy passes its bytes).
_TMA_MAP = np.dtype([("bytes", np.uint8, (128,))])
_libcuda = None


def _tma_map_2d(
    t: torch.Tensor, rows: int, cols: int, box_rows: int, box_cols: int, elem_bytes: int = 1, swizzle128: bool = False
) -> np.void:
    """Tensor map of the matrix at ``t`` ([rows, cols] row-major elements of ``elem_bytes`` = 1, 2 or 4 bytes, rows
    16-byte aligned) for boxes of ``box_rows`` x ``box_cols`` elements, out-of-range elements read as zero; no
    swizzle, or the 128-byte swizzle (``swizzle128``: rows of exactly 128 bytes, the wgmma K-major layout).

    Host-only (``cuTensorMapEncodeTiled`` of the driver through ctypes): no device work, no synchronization.
    """
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuTensorMapEncodeTiled.restype = ctypes.c_int
    raw = np.zeros(128 + 64, dtype=np.uint8)  # the driver wants a 64-byte aligned CUtensorMap
    off = (-raw.ctypes.data) % 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    res = _libcuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(raw.ctypes.data + off),
        ctypes.c_int({1: 0, 2: 1, 4: 2}[elem_bytes]),  # CU_TENSOR_MAP_DATA_TYPE_UINT8 / _UINT16 / _UINT32
        u32(2),
        ctypes.c_void_p(t.data_ptr()),
        (u64 * 2)(cols, rows),  # sizes, innermost first
        (u64 * 1)(cols * elem_bytes),  # byte stride of dimension 1
        (u32 * 2)(box_cols, box_rows),
        (u32 * 2)(1, 1),
        ctypes.c_int(0),  # CU_TENSOR_MAP_INTERLEAVE_NONE
        ctypes.c_int(3 if swizzle128 else 0),  # CU_TENSOR_MAP_SWIZZLE_128B / _NONE
        ctypes.c_int(2),  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
        ctypes.c_int(0),  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (zeros)
    )
    if res != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed (CUresult {res}) for a [{rows}, {cols}] byte matrix, "
            f"box {box_rows}x{box_cols}"
        )
    return raw[off : off + 128].copy().view(_TMA_MAP)[0]


# ----------------------------------------------------------------------------------------------------------
# launchers (preallocated outputs) and allocating wrappers
# ----------------------------------------------------------------------------------------------------------


def grouped_mm_2d3d_out(a, a_scale, b, b_scale, group_sizes, out, zero_rest: bool = False, b_prepared=None):
    """out[rows of g] = dequant(a)[rows of g] @ dequant(b[g])^T for every group g (fprop and dgrad kernel).

    a: e4m3 [M, K]; a_scale: u8 per-group blocked along M (>= (ceil(M/128)+G) * ceil(K/128) * 512 bytes);
    b: e4m3 [G, N, K]; b_scale: u8 [G, blocked_size(N, K/32)]; group_sizes: int32 [G] (device);
    out: bf16 [M, N], written in the rows of the groups; rows sum(sizes) .. M-1 are set to zero when
    ``zero_rest`` (by the kernel, no extra pass), else left untouched. Returns ``out``.
    b_prepared: bf16 [G, N, ceil(K/64) * 64] = ``prepare_weight_bf16(b, b_scale)`` (or the matching half of
    ``prepare_weight_operands(W)``) computed once per weight version; without it the launcher prepares it on every
    call (one memory-bound pass over the weight). The kernel reads only b_prepared, so with it b and b_scale may
    both be None: G and N then come from b_prepared's shape, K from a's, and b_prepared's width must be
    ceil(K/64) * 64.
    """
    _check_common(a, a_scale, b, b_scale, group_sizes, out)
    if b is None:  # shapes from b_prepared (G, N) and a (K)
        if b_prepared is None:
            raise ValueError("b and b_scale may be None only when b_prepared is given")
        _check_dtype("b_prepared", b_prepared, (torch.bfloat16,))
    bw = b if b is not None else b_prepared
    if a.dim() != 2 or bw.dim() != 3:
        raise ValueError(f"expected a [M, K] and b (or b_prepared) [G, N, K], got {tuple(a.shape)}, {tuple(bw.shape)}")
    m, k = a.shape
    g, n, kb = (*b_prepared.shape[:2], k) if b is None else b.shape
    if kb != k:
        raise ValueError(f"reduction sizes differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if k % 32 or k == 0:
        raise ValueError(f"the reduction axis ({k}) must be a positive multiple of 32 (MXFP8 blocks)")
    if n % 8:
        raise ValueError(f"the output width ({n}) must be a multiple of 8")
    if group_sizes.numel() != g:
        raise ValueError(f"group_sizes has {group_sizes.numel()} entries, b has {g} groups")
    need_a = (_cdiv(m, 128) + g) * _cdiv(k // 32, 4) * 512
    if a_scale.numel() < need_a:
        raise ValueError(
            f"a_scale has {a_scale.numel()} bytes, the per-group blocked layout needs >= {need_a} "
            "(mxfp8.grouped_blocked_size(M, G, K // 32, 'm'))"
        )
    bsz = mxfp8.blocked_size(n, k // 32)
    if b_scale is not None and b_scale.numel() != g * bsz:
        raise ValueError(
            f"b_scale must hold [G, blocked_size(N, K/32)] = [{g}, {bsz}] bytes, got {tuple(b_scale.shape)}"
        )
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    grid = (_cdiv(m, _BM) + g) * _cdiv(n, _BN) if g else 0
    if grid == 0:
        if zero_rest:  # G == 0: no CTA to zero-fill with (all M rows are past the groups)
            out.zero_()
        return out
    kp = _cdiv(k, 64) * 64
    if b_prepared is None:
        b_prepared = prepare_weight_bf16(b, b_scale)
    _check_dtype("b_prepared", b_prepared, (torch.bfloat16,))
    _check_memory("b_prepared", b_prepared, out.device)
    if tuple(b_prepared.shape) != (g, n, kp):
        raise ValueError(f"b_prepared must be [{g}, {n}, {kp}] bf16, got {tuple(b_prepared.shape)}")
    deep = ring_stages(k) == 5
    options, smem = (_DEEP_OPTIONS, _DEEP_SMEM_BYTES) if deep else ((), _GEMM_SMEM_BYTES)
    # A [M, K] e4m3 in boxes of 128 rows x 64 bytes; the prepared B [G N, Kp] bf16 in boxes of 256 rows x 64
    # columns with the 128-byte swizzle; the bf16 output [M, N] in boxes of 64 x 64 with the 128-byte swizzle for the
    # TMA-store epilogue (the deep build stores from registers: the map is then a placeholder)
    a_map = _tma_map_2d(a, m, k, 128, 64)
    b_map = _tma_map_2d(b_prepared, g * n, kp, 256, 64, elem_bytes=2, swizzle128=True)
    o_map = a_map if deep else _tma_map_2d(out, m, n, 64, 64, 2, True)
    grid = min(grid, torch.cuda.get_device_properties(out.device).multi_processor_count)  # persistent CTAs
    tensors = (a, a_scale, b, b_scale, group_sizes, out)
    _launch("mx_gmm_2d3d_bf16", _GEMM_FILE, grid, smem, tensors, g, m, n, k, zero_rest, (a_map, b_map, o_map), options)
    return out


def grouped_mm_fprop(
    x, x_scale, w, w_scale, group_sizes, out_dtype: torch.dtype = torch.bfloat16, out=None, w_prepared=None
):
    """Forward grouped GEMM: x e4m3 [M, K] (+ grouped blocked scales) x w e4m3 [G, N, K] -> [M, N] bf16.

    x_scale: u8 [>= (ceil(M/128)+G) * ceil(K/128) * 512]; w_scale: u8 [G, blocked_size(N, K/32)]; group_sizes: int32
    [G] (device); w_prepared: bf16 [G, N, ceil(K/64) * 64] (``prepare_weight_bf16`` / ``weight_operands``; prepared
    per call when None); w and w_scale may both be None when w_prepared is given (the kernel reads only w_prepared:
    ``weight_operands`` on CUDA returns them None). out_dtype: bf16 (the only output the kernel writes); out: bf16
    [M, N]. Without ``out``, every row of the result is defined: rows past sum(group_sizes) are zero (written by the
    kernel). A given ``out`` keeps those rows as they were.
    """
    alloc = out is None
    if alloc:
        out = torch.empty(x.shape[0], _out_cols(w, w_prepared, "w"), dtype=out_dtype, device=x.device)
    return grouped_mm_2d3d_out(x, x_scale, w, w_scale, group_sizes, out, zero_rest=alloc, b_prepared=w_prepared)


def grouped_mm_dgrad(
    dy, dy_scale, wt, wt_scale, group_sizes, out_dtype: torch.dtype = torch.bfloat16, out=None, wt_prepared=None
):
    """Input-gradient grouped GEMM: dy e4m3 [M, N] x wt e4m3 [G, K, N] (W^T, quantized along N) -> [M, K].

    dy_scale: u8 [>= (ceil(M/128)+G) * ceil(N/128) * 512]; wt_scale: u8 [G, blocked_size(K, N/32)]; group_sizes:
    int32 [G] (device); wt_prepared: bf16 [G, K, ceil(N/64) * 64] (prepared per call when None; with it wt and
    wt_scale may both be None, as in :func:`grouped_mm_fprop`); out_dtype: bf16; out: bf16 [M, K].

    Rows past sum(group_sizes) as in :func:`grouped_mm_fprop` (zero without ``out``, untouched with it).
    """
    alloc = out is None
    if alloc:
        out = torch.empty(dy.shape[0], _out_cols(wt, wt_prepared, "wt"), dtype=out_dtype, device=dy.device)
    return grouped_mm_2d3d_out(dy, dy_scale, wt, wt_scale, group_sizes, out, zero_rest=alloc, b_prepared=wt_prepared)


def _out_cols(b, b_prepared, name: str) -> int:
    """Output columns of fprop / dgrad: dim 1 of the weight operand, or of its prepared form when it is None."""
    src = b if b is not None else b_prepared
    if not isinstance(src, torch.Tensor) or src.dim() != 3:
        raise ValueError(f"{name} (or {name}_prepared, when {name} is None) must be a [G, N, K] tensor")
    return src.shape[1]


def _launch_wgrad_prepared(ap, bp, group_sizes, out, m: int) -> None:
    """The wgrad kernel on prepared operands, checked by grouped_wgrad_prepared_out: ap bf16 [R, N], bp bf16 [R, K] with
    R = 64 (ceil(M/64) + G), group_sizes int32 [G], out fp32/bf16 [G, N, K]; m = M."""
    g, n, k = out.shape
    tiles = g * _cdiv(n, _BM) * _cdiv(k, _BN)
    if tiles == 0:
        return
    rp = ap.shape[0]
    eo = out.element_size()  # the output as [G N, K] in boxes of 64 rows x 128 bytes for the TMA-store epilogue
    maps = (
        _tma_map_2d(ap, rp, n, 64, 64, 2, True),
        _tma_map_2d(bp, rp, k, 64, 64, 2, True),
        _tma_map_2d(out, g * n, k, 64, 128 // eo, eo, True),
    )
    grid = min(tiles, torch.cuda.get_device_properties(out.device).multi_processor_count)
    # GM_ARGS' operand pointers are unused by this kernel (it reads the tensor maps); ap / bp stand in for them.
    tensors = (ap, ap, bp, bp, group_sizes, out)
    kernel = f"mx_gmm_wgrad_{_OUT_SUFFIX[out.dtype]}"
    _launch(kernel, _WGRAD_FILE, grid, _WGRAD_SMEM_BYTES, tensors, g, m, n, k, False, maps)


def grouped_wgrad_prepared_out(a_prep, b_prep, group_sizes, out, num_rows: int):
    """wgrad from operands already in the prepared layout: out[g] = a_prep[rows of g]^T @ b_prep[rows of g].

    a_prep: bf16 [64 (ceil(M/64) + G), N], b_prep: bf16 [same rows, K], as ``prepare_colwise_bf16_torch`` makes them or
    as ``mxfp8_cuda.quantize_grouped_dual`` writes them straight from the quantizer (group g
    at rows 64 poff_g .., zero rows up to its next multiple of 64); group_sizes int32 [G] (device); num_rows: M,
    the data rows the groups cover (a host int known without a sync: the quantizer's input rows);
    out: fp32/bf16 [G, N, K], every element written (zeros for empty groups). Returns ``out``. The sizes must sum
    to at most num_rows (not checked: that would need a host sync); a num_rows that is wrong but gives the same
    row count passes the shape check, and the kernel then clamps the groups to it.
    """
    for name, t, dts in (
        ("a_prep", a_prep, (torch.bfloat16,)),
        ("b_prep", b_prep, (torch.bfloat16,)),
        ("group_sizes", group_sizes, (torch.int32,)),
        ("out", out, tuple(_OUT_SUFFIX)),
    ):
        _check_dtype(name, t, dts)
    dev = None
    for name, t in (("a_prep", a_prep), ("b_prep", b_prep), ("group_sizes", group_sizes), ("out", out)):
        dev = _check_memory(name, t, dev)
    g = group_sizes.numel()
    rows = colwise_prep_rows(num_rows, g)
    if a_prep.dim() != 2 or b_prep.dim() != 2 or a_prep.shape[0] != rows or b_prep.shape[0] != rows:
        raise ValueError(
            f"expected a_prep [{rows}, N] and b_prep [{rows}, K] (64 (ceil(M/64) + G) rows for M = {num_rows}), "
            f"got {tuple(a_prep.shape)} and {tuple(b_prep.shape)}"
        )
    n, k = a_prep.shape[1], b_prep.shape[1]
    if n % 8 or k % 8:
        raise ValueError(f"wgrad needs N and K multiples of 8, got N={n}, K={k}")
    if tuple(out.shape) != (g, n, k):
        raise ValueError(f"out must be [{g}, {n}, {k}], got {tuple(out.shape)}")
    _launch_wgrad_prepared(a_prep, b_prep, group_sizes, out, num_rows)
    return out
