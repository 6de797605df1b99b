"""MXFP8 grouped GEMMs on Hopper: CuPy launchers for ``kernels/grouped_gemm.cu`` (DESIGN.md sections 3 and 5.3).

The specification is ``moe_ep.gemm`` (``grouped_mm_torch``, ``grouped_wgrad_torch``, ``fake_quantize_grouped_cols``):
the kernels multiply the exactly dequantized MXFP8 operands (e4m3 * 2**(s-127) is exact in bf16 except below
2**-133) on bf16 tensor cores with fp32 accumulation, so results equal the reference up to fp32 summation order.

Operand formats (all tensors CUDA, contiguous, 16-byte aligned; ``G`` groups; ``group_sizes`` int32 [G] on the
device, never read on the host; rows are NOT padded; a group's rows are contiguous and groups follow each other):

fprop  ``grouped_mm_fprop``: out[M, N] = X_g @ W[g]^T for the rows of each group g
    x        float8_e4m3fn [M, K]  row-wise MXFP8 (1x32 blocks along K), M arbitrary
    x_scale  uint8 [>= (ceil(M/128) + G) * ceil(K/128) * 512]: ``mxfp8.to_blocked_grouped(scale, sizes, "m")``
             (group g starts on 128-row scale tile ``sum_{h<g} ceil(n_h/128)``, computed on device)
    w        float8_e4m3fn [G, N, K] quantized along K
    w_scale  uint8 [G, blocked_size(N, K/32)]: ``mxfp8.to_blocked(scale [G, N, K/32])``
    out      bf16 (default) or fp32 [M, N]. Rows past sum(sizes) (the only rows outside every group: groups are
             contiguous from row 0) are zero-filled by the kernel when the wrapper allocates ``out`` (or when
             ``zero_rest=True``); a caller-given ``out`` keeps them untouched by default.
dgrad  ``grouped_mm_dgrad``: the same kernel with the transposed weight copy: dX[M, K] = dY_g @ W[g]
    dy       float8_e4m3fn [M, N] row-wise (blocks along N), dy_scale as x_scale with N for K
    wt       float8_e4m3fn [G, K, N] = W^T per expert quantized along N (= quantize(W, axis=-2) transposed),
    wt_scale uint8 [G, blocked_size(K, N/32)]
wgrad  ``grouped_mm_wgrad``: dW[g] = dY_g^T @ X_g, [G, N, K], reduction over each group's rows
    dy       float8_e4m3fn [M, N] in dY's own layout, quantized COLUMN-wise in 32x1 blocks that restart at each
             group's first row (a group's last block may be short: zero padded), i.e. ``fake_quantize_grouped_cols``
    dy_scale uint8 [>= ceil(M/32) + G, N] ("grouped column-wise plain" layout): block j of group g (rows
             start_g + 32 j ..) is scale row ``sum_{h<g} ceil(n_h/32) + j``; other rows are ignored
    x        float8_e4m3fn [M, K], x_scale uint8 [>= ceil(M/32) + G, K]: the same for X
    out      fp32 (default) or bf16 [G, N, K]; empty groups get zeros.
    (This layout keeps the producers' row-major data, needs no transpose and no alignment of group starts;
    the 16 scales of 16 consecutive columns are contiguous. ``colwise_operand_ref`` builds it.)

Shape rules: K (the reduction axis of fprop/dgrad) % 32 == 0; output columns % 8 == 0; wgrad N, K % 8 == 0.
Group sizes must be >= 0 (negative counts as 0) and sum to <= M (rows past M are clamped, never touched).
Everything runs on torch's current stream with no host synchronization.

Environment: ``MOE_EP_GEMM_IMPL`` selects the kernel family of fprop/dgrad (H200 TFLOP/s ratios to torch bf16
``_grouped_mm`` in benchmarks/NOTES.md):
  ``wgmma3`` (``kernels/grouped_gemm_wg3.cu``): 128x256 tiles; the raw MXFP8 operands arrive by TMA in a
      4-stage ring (tensor maps from the driver's ``cuTensorMapEncodeTiled``); A is dequantized straight into
      wgmma register fragments (k permuted inside each 64-block, ``k_permutation``), B into a bf16 shared ring
      read by wgmma.m64n256k16. 0.50-0.58x.
  ``wgmma4`` (default; ``kernels/grouped_gemm_wg4.cu``): A as wgmma3; the weight is exact bf16 prepared once per
      weight version (``weight_operands`` with a ``WeightQuantCache``, or ``prepare_weight_bf16``; pass it as
      ``w_prepared`` / ``wt_prepared``; without it every call prepares it: one memory-bound pass and a
      transient bf16 copy of the weight) and TMA-loaded with the 128-byte swizzle: no conversion of B. 0.86-0.97x.
  ``wgmma5`` (``kernels/grouped_gemm_wg5.cu``): wgmma4's math in a warp-specialized persistent kernel (a producer
      warp loads ahead across tiles into a 4-stage mbarrier ring, 2 consumer warpgroups issuing their MMAs in
      turn, TMA-store epilogue). Same prepared weight.
  ``wgmma2`` (``grouped_gemm_wg2.cu``): wgmma3's math with per-thread global loads one step ahead. 0.44-0.52x.
  ``wgmma`` (``grouped_gemm_wgmma.cu``): 128x128 tiles, both operands dequantized into 128B-swizzled shared
      tiles read by wgmma.m64n128k16, 3 stages. 0.45-0.53x.
  ``mma`` (``grouped_gemm.cu``): ldmatrix + mma.sync bf16, 128x128x64 tiles, 2 CTAs/SM. 0.33-0.41x.
``MOE_EP_WGRAD_IMPL`` selects the wgrad kernel: ``wgmma`` (default; ``kernels/grouped_gemm_wgrad.cu``: both
operands dequantized to bf16 by one pass per call, ``prepare_colwise_bf16``, then TMA + wgmma with MN-major
operands, persistent and warp-specialized as wgmma5) or ``mma`` (the design-1 kernel). Unknown values raise
ValueError.

The ``*_ref`` functions at the bottom are pure-PyTorch converters from plain tensors to these operand formats
(used by the tests and the benchmark; they read group sizes on the host).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
import torch

from . import mxfp8

IMPLS = ("mma", "wgmma", "wgmma2", "wgmma3", "wgmma4", "wgmma5")
_KERNEL_FILE = "grouped_gemm.cu"
_WGMMA_FILE = "grouped_gemm_wgmma.cu"
_WGMMA2_FILE = "grouped_gemm_wg2.cu"
_WGMMA3_FILE = "grouped_gemm_wg3.cu"
_WGMMA4_FILE = "grouped_gemm_wg4.cu"
_WGMMA5_FILE = "grouped_gemm_wg5.cu"
_WGRAD_FILE = "grouped_gemm_wgrad.cu"
WGRAD_IMPLS = ("wgmma", "mma")
_WGRAD_SMEM_BYTES = 213472  # 3 x 49152 + 65536 + 48 + 9 x 48, grouped_gemm_wgrad.cu WR_SMEM_BYTES
_PREP_FILE = "weight_prep.cu"
_THREADS = 256
_TILE = 128
_SMEM_BYTES = 73728  # 2 stages x (A + B) x 18432 B, kernels/grouped_gemm.cu GM_SMEM_BYTES
_WGMMA_SMEM_BYTES = 99328  # 3 stages x (A + B) x 16384 B + 1024 (alignment), grouped_gemm_wgmma.cu WG_SMEM_BYTES
_WGMMA2_SMEM_BYTES = 99328  # 3 stages x B 32768 B + 1024 (alignment), grouped_gemm_wg2.cu W2_SMEM_BYTES
_WGMMA2_BN = 256  # output columns per CTA of the wgmma2 / wgmma3 kernels (128 rows)
_WGMMA3_SMEM_BYTES = 203776  # bf16 ring 3 x 32768 + raw ring 4 x 26112 + 1024, grouped_gemm_wg3.cu W3_SMEM_BYTES
_WGMMA4_SMEM_BYTES = 168960  # 4 x (32768 + 8192 + 512 -> 41984) + 1024, grouped_gemm_wg4.cu W4_SMEM_BYTES
_WGMMA5_SMEM_BYTES = 231920  # 4 x 40960 + 65536 + 4 x 512 + 64 + 9 x 48, grouped_gemm_wg5.cu W5_SMEM_BYTES
_WGMMA5_THREADS = 384  # 2 consumer warpgroups + 1 producer warpgroup (grouped_gemm_wg5.cu W5_THREADS)
_PREPARED_IMPLS = ("wgmma4", "wgmma5")  # the kernels that read the weight as prepare_weight_bf16's output
_OUT_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


DEFAULT_IMPL = "wgmma4"


def gemm_impl() -> str:
    """The kernel family selected by ``MOE_EP_GEMM_IMPL`` (default ``wgmma4``: the weight as exact bf16, prepared
    once per weight version by :func:`weight_operands` / :func:`prepare_weight_bf16`, or on every call when the
    caller passes none; ``wgmma3`` is the fastest that reads MXFP8 weights as they are)."""
    impl = os.environ.get("MOE_EP_GEMM_IMPL", DEFAULT_IMPL).strip().lower() or DEFAULT_IMPL
    if impl not in IMPLS:
        raise ValueError(f"MOE_EP_GEMM_IMPL={impl!r} is not one of {IMPLS}")
    return impl


def wgrad_impl() -> str:
    """The wgrad kernel selected by ``MOE_EP_WGRAD_IMPL``: ``wgmma`` (default; operands dequantized to bf16 by one
    pass per call, then TMA + wgmma) or ``mma`` (dequantized inside the kernel, mma.sync)."""
    impl = os.environ.get("MOE_EP_WGRAD_IMPL", "wgmma").strip().lower() or "wgmma"
    if impl not in WGRAD_IMPLS:
        raise ValueError(f"MOE_EP_WGRAD_IMPL={impl!r} is not one of {WGRAD_IMPLS}")
    return impl


def colwise_scale_rows(m: int, num_groups: int) -> int:
    """Rows of a grouped column-wise scale buffer (static bound ``ceil(M/32) + G``, no host sync)."""
    return _cdiv(m, 32) + num_groups


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


def _check_dtype(name: str, t, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")


def _check_memory(name: str, t: torch.Tensor, device: torch.device | None) -> torch.device:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")
    return t.device


def _check_common(a, a_scale, b, b_scale, group_sizes, out) -> None:
    """dtypes first (TypeError), then device / contiguity / alignment (ValueError)."""
    named = (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("group_sizes", group_sizes), ("out", out))
    want = (
        (torch.float8_e4m3fn,),
        (torch.uint8,),
        (torch.float8_e4m3fn,),
        (torch.uint8,),
        (torch.int32,),
        tuple(_OUT_SUFFIX),
    )
    for (name, t), dts in zip(named, want, strict=True):
        _check_dtype(name, t, dts)
    dev = None
    for name, t in named:
        dev = _check_memory(name, t, dev)
    if group_sizes.dim() != 1:
        raise ValueError(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")


def _launch(
    kernel: str,
    grid: int,
    a,
    a_scale,
    b,
    b_scale,
    group_sizes,
    out,
    g: int,
    m: int,
    n: int,
    k: int,
    zero_rest: bool = False,
    kernel_file: str = _KERNEL_FILE,
    smem: int = _SMEM_BYTES,
    extra: tuple = (),
    threads: int = _THREADS,
):
    if grid <= 0:
        return
    from . import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    fn = _cuda.get_function(kernel_file, kernel, device=out.device.index)
    args = _kernel_args(a, a_scale, b, b_scale, group_sizes, out, g, m, n, k, zero_rest) + tuple(extra)
    _cuda.launch(fn, grid, threads, args, shared_mem=smem, device=out.device)


def _kernel_args(a, a_scale, b, b_scale, group_sizes, out, g: int, m: int, n: int, k: int, zero_rest: bool) -> tuple:
    """The kernels' GM_ARGS: (6 pointers, int G, long long M, int N, int K, int zero_rest) as numpy scalars."""
    from . import _cuda  # noqa: PLC0415  (numpy + torch only; CuPy is imported by get_function / launch)

    ptrs = tuple(_cuda.ptr(t) for t in (a, a_scale, b, b_scale, group_sizes, out))
    return ptrs + (_cuda.i32(g), _cuda.i64(m), _cuda.i32(n), _cuda.i32(k), _cuda.i32(int(zero_rest)))


# CUtensorMap for the wgmma3 kernel: 128 opaque bytes, encoded by the driver and passed by value to a
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


def k_permutation(device=None) -> torch.Tensor:
    """int64 [64]: for the wgmma2/3/4 kernels' logical k position l = 16 s + 8 h + 2 c + e of a 64-wide k block, the
    physical column 16 c + 4 s + 2 h + e it holds (s: k16 slice, h: fragment half, c: lane % 4, e: pair element).

    Example: k_permutation()[:4] = [0, 1, 16, 17] (lane c = 1 holds physical columns 16, 17 at logical 2, 3).
    """
    lg = torch.arange(64, device=device)  # built on the device: no host-to-device copy (sync-free)
    s, h, c, e = lg // 16, (lg // 8) % 2, (lg // 2) % 4, lg % 2
    return 16 * c + 4 * s + 2 * h + e


def _check_weight_prep(w: torch.Tensor, w_scale: torch.Tensor) -> None:
    _check_dtype("w", w, (torch.float8_e4m3fn,))
    _check_dtype("w_scale", w_scale, (torch.uint8,))
    if w.dim() != 3 or w.shape[2] % 32:
        raise ValueError(f"w must be [G, N, K] with K % 32 == 0, got {tuple(w.shape)}")
    g, n, k = w.shape
    bsz = mxfp8.blocked_size(n, k // 32)
    if w_scale.numel() != g * bsz:
        raise ValueError(
            f"w_scale must hold [G, blocked_size(N, K/32)] = [{g}, {bsz}] bytes, got {tuple(w_scale.shape)}"
        )


def prepare_weight_bf16_torch(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`prepare_weight_bf16` (same signature and bytes): pure torch on w's device."""
    _check_weight_prep(w, w_scale)
    g, n, k = w.shape
    kb = k // 32
    r = torch.arange(n, device=w.device)[:, None]
    c = torch.arange(kb, device=w.device)[None, :]
    tpr = _cdiv(kb, 4)
    offs = ((r // 128) * tpr + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4  # [N, K/32]
    scale = w_scale.reshape(g, -1)[:, offs.reshape(-1)].reshape(g, n, kb)
    deq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(w, scale, 2), torch.bfloat16)
    kp = _cdiv(k, 64) * 64
    padded = torch.zeros(g, n, kp, dtype=torch.bfloat16, device=w.device)
    padded[..., :k] = deq
    return padded.view(g, n, kp // 64, 64)[..., k_permutation(w.device)].reshape(g, n, kp).contiguous()


def prepare_weight_bf16(w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight operand of the ``wgmma4`` / ``wgmma5`` kernels: the exact bf16 dequantization of an MXFP8 weight,
    each 64-wide k block in the kernels' permuted order (:func:`k_permutation`), K padded with zeros to a multiple
    of 64.

    w: e4m3 [G, N, K] (K % 32 == 0); w_scale: u8 [G, blocked_size(N, K/32)] (``mxfp8.to_blocked``)
    -> bf16 [G, N, ceil(K/64) * 64] (into ``out`` when given). CUDA tensors: one memory-bound kernel
    (``kernels/weight_prep.cu``), no host sync; others: :func:`prepare_weight_bf16_torch` (the same bytes). Meant
    to run once per weight version and be cached with the quantized weight (e4m3 * 2^(s-127) is exact in bf16
    down to 2^-133, like the in-kernel conversion of the other kernels, so the GEMM products are the same).
    """
    if w.device.type != "cuda":
        ref = prepare_weight_bf16_torch(w, w_scale)
        return ref if out is None else out.copy_(ref)
    _check_weight_prep(w, w_scale)
    g, n, k = w.shape
    kp = _cdiv(k, 64) * 64
    if out is None:
        out = torch.empty(g, n, kp, dtype=torch.bfloat16, device=w.device)
    _check_dtype("out", out, (torch.bfloat16,))
    if tuple(out.shape) != (g, n, kp):
        raise ValueError(f"out must be [{g}, {n}, {kp}] bf16, got {tuple(out.shape)}")
    for name, t in (("w", w), ("w_scale", w_scale), ("out", out)):
        _check_memory(name, t, w.device)
    chunks = g * n * (kp // 64) * 4
    if chunks == 0:
        return out
    from . import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    fn = _cuda.get_function(_PREP_FILE, "mx_prepare_weight_bf16", device=w.device.index)
    grid = min(_cdiv(chunks, 256), _cuda.num_sms(w.device) * 8)
    args = (_cuda.ptr(w), _cuda.ptr(w_scale), _cuda.ptr(out), _cuda.i32(g), _cuda.i32(n), _cuda.i32(k))
    args += (_cuda.i64(mxfp8.blocked_size(n, k // 32)),)
    _cuda.launch(fn, grid, 256, args, device=w.device)
    return out


def colwise_prep_rows(m: int, num_groups: int) -> int:
    """Rows of a prepared wgrad operand (static bound ``64 (ceil(M/64) + G)`` >= sum of ceil64(n_g), no sync)."""
    return 64 * (_cdiv(m, 64) + num_groups)


def prepare_colwise_bf16_torch(data: torch.Tensor, scale: torch.Tensor, group_sizes) -> torch.Tensor:
    """Reference of :func:`prepare_colwise_bf16` (host group sizes): rows past the groups are zero here (the
    kernel leaves them unwritten; nothing reads them)."""
    sizes = _host_sizes(group_sizes)
    m, c = data.shape
    out = torch.zeros(colwise_prep_rows(m, len(sizes)), c, dtype=torch.bfloat16, device=data.device)
    deq = colwise_dequantize_ref(data, scale, sizes)
    start = poff = 0
    for rows in sizes:
        out[poff : poff + rows] = deq[start : start + rows].to(torch.bfloat16)
        start += rows
        poff += 64 * _cdiv(rows, 64)
    return out


def prepare_colwise_bf16(data: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor, out=None) -> torch.Tensor:
    """A wgrad operand (grouped column-wise MXFP8, see the module docstring) as exact bf16 with every group on a
    64-row boundary: data e4m3 [M, C], scale u8 [>= ceil(M/32) + G, C], group_sizes int32 [G] (device)
    -> bf16 [64 (ceil(M/64) + G), C] where group g is rows 64 poff_g .. (poff_g = sum_{h<g} ceil(n_h/64)), zero
    padded to a multiple of 64 rows.

    Example: sizes [40, 0, 8] -> group 0 at rows 0-39 (rows 40-63 zero), group 2 at rows 64-71 (72-127 zero).
    CUDA: one memory-bound kernel (``kernels/weight_prep.cu``), no host sync; rows past the groups are left
    unwritten. Other devices: :func:`prepare_colwise_bf16_torch`.
    """
    if data.device.type != "cuda":
        ref = prepare_colwise_bf16_torch(data, scale, group_sizes)
        return ref if out is None else out.copy_(ref)
    _check_dtype("data", data, (torch.float8_e4m3fn,))
    _check_dtype("scale", scale, (torch.uint8,))
    _check_dtype("group_sizes", group_sizes, (torch.int32,))
    m, c = data.shape
    g = group_sizes.numel()
    rows, prows = colwise_scale_rows(m, g), colwise_prep_rows(m, g)
    if c % 8 or scale.dim() != 2 or scale.shape[1] != c or scale.shape[0] < rows:
        raise ValueError(
            f"expected data [M, C] (C % 8 == 0) and scale [>= {rows}, C], got {tuple(data.shape)}, {tuple(scale.shape)}"
        )
    if out is None:
        out = torch.empty(prows, c, dtype=torch.bfloat16, device=data.device)
    if tuple(out.shape) != (prows, c) or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be [{prows}, {c}] bf16, got {tuple(out.shape)} {out.dtype}")
    for name, t in (("data", data), ("scale", scale), ("group_sizes", group_sizes), ("out", out)):
        _check_memory(name, t, data.device)
    if g == 0 or c == 0:
        return out
    from . import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    fn = _cuda.get_function(_PREP_FILE, "mx_prepare_colwise_bf16", device=data.device.index)
    args = (_cuda.ptr(data), _cuda.ptr(scale), _cuda.ptr(group_sizes), _cuda.ptr(out), _cuda.i32(g))
    nblocks = prows // 32  # one warp per (padded 32-row block, 1024 columns), 8 per CTA
    args += (_cuda.i64(m), _cuda.i32(c), _cuda.i32(nblocks))
    _cuda.launch(fn, _cdiv(nblocks * _cdiv(c, 1024), 8), 256, args, device=data.device)
    return out


@dataclass(frozen=True)
class WeightOperands:
    """The fprop and dgrad operands of one expert weight ``W [G, N, K]`` (see the module docstring's formats).

    w: e4m3 [G, N, K] quantized along K; w_scale: u8 [G, blocked_size(N, K/32)]; w_prepared: bf16 [G, N, Kp];
    wt: e4m3 [G, K, N] = W^T quantized along N; wt_scale: u8 [G, blocked_size(K, N/32)]; wt_prepared: bf16 [G, K, Np].
    """

    w: torch.Tensor
    w_scale: torch.Tensor
    w_prepared: torch.Tensor
    wt: torch.Tensor
    wt_scale: torch.Tensor
    wt_prepared: torch.Tensor


def _weight_operands(w: torch.Tensor) -> WeightOperands:
    q = mxfp8.quantize(w, -1)
    qt = mxfp8.quantize(w.transpose(1, 2).contiguous(), -1)
    ws, wts = mxfp8.to_blocked(q.scale), mxfp8.to_blocked(qt.scale)
    return WeightOperands(q.data, ws, prepare_weight_bf16(q.data, ws), qt.data, wts, prepare_weight_bf16(qt.data, wts))


def weight_operands(w: torch.Tensor, cache=None) -> WeightOperands:
    """Quantize an expert weight for fprop and dgrad and prepare both bf16 operands of the ``wgmma4`` kernels.

    w: bf16/fp32 [G, N, K] (N, K multiples of 32), any device (CUDA: quantization and preparation kernels, no host
    sync). With ``cache`` (a ``moe_ep.weight_cache.WeightQuantCache``) the result is computed once per weight
    version (an optimizer step or an FSDP2 all-gather write recomputes it) and shared by every micro-batch.
    Memory: 2 bytes + 2 bytes (prepared) + 2 bytes (e4m3 both ways) per weight element.
    """
    if w.dim() != 3 or w.shape[1] % 32 or w.shape[2] % 32:
        raise ValueError(f"w must be [G, N, K] with N and K multiples of 32, got {tuple(w.shape)}")
    if cache is None:
        with torch.no_grad():
            return _weight_operands(w.detach())
    return cache.get(w, "gemm_operands", _weight_operands)


# ----------------------------------------------------------------------------------------------------------
# launchers (preallocated outputs) and allocating wrappers
# ----------------------------------------------------------------------------------------------------------


def grouped_mm_2d3d_out(a, a_scale, b, b_scale, group_sizes, out, zero_rest: bool = False, b_prepared=None):
    """out[rows of g] = dequant(a)[rows of g] @ dequant(b[g])^T for every group g (fprop and dgrad kernel).

    a: e4m3 [M, K]; a_scale: u8 per-group blocked along M (>= (ceil(M/128)+G) * ceil(K/128) * 512 bytes);
    b: e4m3 [G, N, K]; b_scale: u8 [G, blocked_size(N, K/32)]; group_sizes: int32 [G] (device);
    out: bf16/fp32 [M, N], written in the rows of the groups; rows sum(sizes) .. M-1 are set to zero when
    ``zero_rest`` (by the kernel, no extra pass), else left untouched. Returns ``out``.
    b_prepared: ``wgmma4`` / ``wgmma5`` only: ``prepare_weight_bf16(b, b_scale)`` computed once per weight
    version; without it the launcher prepares it on every call (one memory-bound pass over the weight).
    """
    impl = gemm_impl()
    _check_common(a, a_scale, b, b_scale, group_sizes, out)
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"expected a [M, K] and b [G, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    g, n, kb = b.shape
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
    if b_scale.numel() != g * bsz:
        raise ValueError(
            f"b_scale must hold [G, blocked_size(N, K/32)] = [{g}, {bsz}] bytes, got {tuple(b_scale.shape)}"
        )
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    bn = _WGMMA2_BN if impl in ("wgmma2", "wgmma3", *_PREPARED_IMPLS) else _TILE
    grid = (_cdiv(m, _TILE) + g) * _cdiv(n, bn) if g else 0
    if grid == 0 and zero_rest:  # G == 0: no CTA to zero-fill with (all M rows are past the groups)
        out.zero_()
    suffix = _OUT_SUFFIX[out.dtype]
    extra = ()
    threads = _THREADS
    if impl in _PREPARED_IMPLS:
        if impl == "wgmma5":  # persistent: one CTA per SM walks the tiles (host-side property, cached by torch)
            kernel, kfile, smem = f"mx_gmm_wg5_2d3d_{suffix}", _WGMMA5_FILE, _WGMMA5_SMEM_BYTES
            threads = _WGMMA5_THREADS
            grid = min(grid, torch.cuda.get_device_properties(out.device).multi_processor_count)
        else:
            kernel, kfile, smem = f"mx_gmm_wg4_2d3d_{suffix}", _WGMMA4_FILE, _WGMMA4_SMEM_BYTES
        if grid > 0:
            kp = _cdiv(k, 64) * 64
            if b_prepared is None:
                b_prepared = prepare_weight_bf16(b, b_scale)
            _check_dtype("b_prepared", b_prepared, (torch.bfloat16,))
            _check_memory("b_prepared", b_prepared, out.device)
            if tuple(b_prepared.shape) != (g, n, kp):
                raise ValueError(f"b_prepared must be [{g}, {n}, {kp}] bf16, got {tuple(b_prepared.shape)}")
            extra = (
                _tma_map_2d(a, m, k, 128, 64),
                _tma_map_2d(b_prepared, g * n, kp, 256, 64, elem_bytes=2, swizzle128=True),
            )
            if impl == "wgmma5":  # the output for the TMA-store epilogue (bf16: boxes of 64 x 64, 128-byte swizzle)
                extra += (extra[0] if out.dtype == torch.float32 else _tma_map_2d(out, m, n, 64, 64, 2, True),)
    elif impl == "wgmma3":
        kernel, kfile, smem = f"mx_gmm_wg3_2d3d_{suffix}", _WGMMA3_FILE, _WGMMA3_SMEM_BYTES
        if grid > 0:  # A [M, K] in boxes of 128 rows x 64 bytes, B [G * N, K] in boxes of 256 rows x 64 bytes
            extra = (_tma_map_2d(a, m, k, 128, 64), _tma_map_2d(b, g * n, k, 256, 64))
    elif impl == "wgmma2":
        kernel, kfile, smem = f"mx_gmm_wg2_2d3d_{suffix}", _WGMMA2_FILE, _WGMMA2_SMEM_BYTES
    elif impl == "wgmma":
        kernel, kfile, smem = f"mx_gmm_wg_2d3d_{suffix}", _WGMMA_FILE, _WGMMA_SMEM_BYTES
    else:
        kernel, kfile, smem = f"mx_gmm_2d3d_{suffix}", _KERNEL_FILE, _SMEM_BYTES
    _launch(kernel, grid, a, a_scale, b, b_scale, group_sizes, out, g, m, n, k, zero_rest, kfile, smem, extra, threads)
    return out


def grouped_mm_fprop(
    x, x_scale, w, w_scale, group_sizes, out_dtype: torch.dtype = torch.bfloat16, out=None, w_prepared=None
):
    """Forward grouped GEMM: x e4m3 [M, K] (+ grouped blocked scales) x w e4m3 [G, N, K] -> [M, N] out_dtype.

    Without ``out``, every row of the result is defined: rows past sum(group_sizes) are zero (written by the
    kernel). A given ``out`` keeps those rows as they were.
    """
    alloc = out is None
    if alloc:
        out = torch.empty(x.shape[0], w.shape[1], dtype=out_dtype, device=x.device)
    return grouped_mm_2d3d_out(x, x_scale, w, w_scale, group_sizes, out, zero_rest=alloc, b_prepared=w_prepared)


def grouped_mm_dgrad(
    dy, dy_scale, wt, wt_scale, group_sizes, out_dtype: torch.dtype = torch.bfloat16, out=None, wt_prepared=None
):
    """Input-gradient grouped GEMM: dy e4m3 [M, N] x wt e4m3 [G, K, N] (W^T, quantized along N) -> [M, K].

    Rows past sum(group_sizes) as in :func:`grouped_mm_fprop` (zero without ``out``, untouched with it).
    """
    alloc = out is None
    if alloc:
        out = torch.empty(dy.shape[0], wt.shape[1], dtype=out_dtype, device=dy.device)
    return grouped_mm_2d3d_out(dy, dy_scale, wt, wt_scale, group_sizes, out, zero_rest=alloc, b_prepared=wt_prepared)


def grouped_wgrad_out(a, a_scale, b, b_scale, group_sizes, out):
    """out[g] = dequant(a)[rows of g]^T @ dequant(b)[rows of g] (groups along the reduction).

    a: e4m3 [M, N]; b: e4m3 [M, K], both quantized column-wise per group (``colwise_operand_ref``);
    a_scale: u8 [>= ceil(M/32)+G, N]; b_scale: u8 [>= ceil(M/32)+G, K]; group_sizes int32 [G] (device);
    out: fp32/bf16 [G, N, K] (every element written; zeros for empty groups). Returns ``out``.
    """
    gemm_impl()
    impl = wgrad_impl()
    _check_common(a, a_scale, b, b_scale, group_sizes, out)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"expected a [M, N] and b [M, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    m, n = a.shape
    k = b.shape[1]
    g = group_sizes.numel()
    if n % 8 or k % 8:
        raise ValueError(f"wgrad needs N and K multiples of 8, got N={n}, K={k}")
    rows = colwise_scale_rows(m, g)
    for name, s, cols in (("a_scale", a_scale, n), ("b_scale", b_scale, k)):
        if s.dim() != 2 or s.shape[1] != cols or s.shape[0] < rows:
            raise ValueError(f"{name} must be [>= ceil(M/32) + G = {rows}, {cols}], got {tuple(s.shape)}")
    if tuple(out.shape) != (g, n, k):
        raise ValueError(f"out must be [{g}, {n}, {k}], got {tuple(out.shape)}")
    suffix = _OUT_SUFFIX[out.dtype]
    if impl == "mma":
        grid = g * _cdiv(n, _TILE) * _cdiv(k, _TILE)
        _launch(f"mx_gmm_wgrad_{suffix}", grid, a, a_scale, b, b_scale, group_sizes, out, g, m, n, k)
        return out
    tiles = g * _cdiv(n, _TILE) * _cdiv(k, _WGMMA2_BN)
    if tiles == 0:
        return out
    ap = prepare_colwise_bf16(a, a_scale, group_sizes)  # [64 (ceil(M/64) + G), N] bf16, transient
    bp = prepare_colwise_bf16(b, b_scale, group_sizes)  # [same rows, K]
    rp = ap.shape[0]
    eo = out.element_size()  # the output as [G N, K] in boxes of 64 rows x 128 bytes for the TMA-store epilogue
    extra = (
        _tma_map_2d(ap, rp, n, 64, 64, 2, True),
        _tma_map_2d(bp, rp, k, 64, 64, 2, True),
        _tma_map_2d(out, g * n, k, 64, 128 // eo, eo, True),
    )
    grid = min(tiles, torch.cuda.get_device_properties(out.device).multi_processor_count)
    _launch(
        f"mx_gmm_wgrad_wg_{suffix}",
        grid,
        a,
        a_scale,
        b,
        b_scale,
        group_sizes,
        out,
        g,
        m,
        n,
        k,
        False,
        _WGRAD_FILE,
        _WGRAD_SMEM_BYTES,
        extra,
        _WGMMA5_THREADS,
    )
    return out


def grouped_mm_wgrad(dy, dy_scale, x, x_scale, group_sizes, out_dtype: torch.dtype = torch.float32, out=None):
    """Weight-gradient grouped GEMM: dW[g] = dY_g^T @ X_g -> [G, N, K] out_dtype (fp32 by default)."""
    if out is None:
        out = torch.empty(group_sizes.numel(), dy.shape[1], x.shape[1], dtype=out_dtype, device=dy.device)
    return grouped_wgrad_out(dy, dy_scale, x, x_scale, group_sizes, out)


# ----------------------------------------------------------------------------------------------------------
# reference-side converters (pure PyTorch, any device; read group sizes on the host)
# ----------------------------------------------------------------------------------------------------------


def _host_sizes(group_sizes) -> list[int]:
    if isinstance(group_sizes, torch.Tensor):
        return [int(v) for v in group_sizes.cpu().tolist()]
    return [int(v) for v in group_sizes]


def rowwise_operand_ref(x: torch.Tensor, group_sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] -> (e4m3 [M, K], u8 per-group blocked scales along M) for fprop/dgrad's ``a``."""
    q = mxfp8.quantize_torch(x, -1)
    sizes = torch.tensor(_host_sizes(group_sizes), dtype=torch.int64)
    return q.data, mxfp8.to_blocked_grouped(q.scale, sizes, "m")


def weight_operand_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [G, N, K] -> (e4m3 [G, N, K] quantized along K, u8 [G, blocked_size(N, K/32)]) for fprop."""
    q = mxfp8.quantize_torch(w, -1)
    return q.data, mxfp8.to_blocked(q.scale)


def weight_t_operand_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [G, N, K] -> (W^T e4m3 [G, K, N] quantized along N, u8 [G, blocked_size(K, N/32)]) for dgrad.

    Dequantized, it equals ``mxfp8.fake_quantize(w, axis=-2).transpose(1, 2)`` (the reference's dgrad operand).
    """
    q = mxfp8.quantize_torch(w.transpose(1, 2).contiguous(), -1)
    return q.data, mxfp8.to_blocked(q.scale)


def colwise_operand_ref(t: torch.Tensor, group_sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """t float [M, N] -> (e4m3 [M, N], u8 [ceil(M/32) + G, N]): wgrad's grouped column-wise format.

    Blocks of 32 rows restart at each group's first row (the last one zero padded), exactly as
    ``gemm.fake_quantize_grouped_cols``; block j of group g is scale row ``sum_{h<g} ceil(n_h/32) + j``.
    Unused scale rows are zero.
    """
    sizes = _host_sizes(group_sizes)
    m, n = t.shape
    data = torch.zeros(m, n, dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.zeros(colwise_scale_rows(m, len(sizes)), n, dtype=torch.uint8, device=t.device)
    start = boff = 0
    for rows in sizes:
        if rows:
            pad = (-rows) % 32
            seg = t[start : start + rows]
            if pad:
                seg = torch.cat([seg, seg.new_zeros(pad, n)])
            q = mxfp8.quantize_torch(seg, 0)
            data[start : start + rows] = q.data[:rows]
            scale[boff : boff + q.scale.shape[0]] = q.scale
        start += rows
        boff += _cdiv(rows, 32)
    return data, scale


def colwise_dequantize_ref(data: torch.Tensor, scale: torch.Tensor, group_sizes) -> torch.Tensor:
    """Inverse of :func:`colwise_operand_ref`: e4m3 [M, N] + u8 [>= ceil(M/32)+G, N] -> fp32 [M, N]."""
    sizes = _host_sizes(group_sizes)
    idx, boff = [], 0
    for rows in sizes:
        idx.append(boff + torch.arange(rows, device=data.device) // 32)
        boff += _cdiv(rows, 32)
    rows_scale = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=data.device)
    s = scale[rows_scale].to(torch.int32)
    mult = torch.where(s == mxfp8.SCALE_NAN, float("nan"), mxfp8._exp2_int((s - 127).clamp(-127, 127)))
    return data[: rows_scale.numel()].to(torch.float32) * mult
