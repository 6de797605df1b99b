"""CUDA (CuPy RawKernel) MXFP8 quantization: the kernels of ``kernels/quantize.cu`` behind launchers.

Every function produces the same bytes as the reference in :mod:`moe_ep.mxfp8` (DESIGN.md section 3).
Each ``*_into`` launcher takes preallocated outputs and checks them; the function without ``_into`` allocates.
Kernels run on torch's current stream; nothing here synchronizes with the host.

Layouts (``x: [M, K]``, C = K // 32):
  * row-wise ("1x32"): data ``[M, K]`` e4m3; scales ``plain`` ``[M, C]`` u8, ``blocked`` ``[blocked_size(M, C)]``
    u8 (== ``to_blocked(plain)``), ``grouped`` ``[grouped_blocked_size(M, G, C, "m")]`` u8
    (== ``to_blocked_grouped(plain, group_sizes, "m")``; group sizes stay on the GPU).
  * column-wise ("32x1", the wgrad operands): data is the TRANSPOSE ``xt: [K, M]`` e4m3, row-major, i.e. each
    row of ``xt`` holds 32-element blocks along M and a GEMM that reduces over M reads it K-major (contiguous
    along the reduction axis, like the row-wise operand). Scales ``plain`` ``[K, M // 32]`` u8 or ``blocked``
    ``[blocked_size(K, M // 32)]`` u8. Byte-for-byte this equals ``quantize_torch(x.t().contiguous(), -1)``
    (and ``to_blocked`` of its scale).
  * ``quantize(x, axis=0)`` keeps the MXFP8Tensor contract instead: data ``[M, K]`` in x's layout, scale
    ``[M // 32, K]`` plain.
  * 3-D weights ``w: [E, N, K]``: data ``[E, N, K]`` e4m3, scales ``[E, blocked_size(N, C)]`` u8
    (== ``to_blocked(plain [E, N, C])``): each expert's scales are an independent blocked matrix.

Environment: ``MOE_EP_MXFP8_SOFT_CVT=1`` compiles the kernels with the software float->e4m3 conversion instead
of the hardware ``cvt.rn.satfinite.e4m3x2.f32`` (a debugging switch; both must give identical bytes).
``MOE_EP_QUANT_PIPE`` (auto, 0-5) selects the tile pipelining of the quantization kernels
(:func:`moe_ep.mxfp8.plan.pipe_switch`); :mod:`moe_ep.mxfp8.plan` decides kernel, grid and shared memory.
"""

from __future__ import annotations

import torch

from .. import _cuda
from . import plan as qp
from .checks import check_colwise, check_groups, check_input, check_out
from .format import BLOCK, MXFP8Tensor, blocked_size, colwise_prep_rows, grouped_blocked_size
from .reference import dequantize_torch, quantize_torch

_SRC = "quantize.cu"
_THREADS = qp.THREADS  # CTA size of every kernel here but mx_quant's pipe 5 (quant_plan decides)


def _kernel(name: str, device: torch.device):
    return _cuda.get_function(_SRC, name, qp.NAMES, qp.options(), device.index)


def _sched_counter(device: torch.device) -> torch.Tensor:
    """The dynamic tile schedule's counter for a launch on torch's current stream (:func:`moe_ep._cuda.sched_counter`);
    the CPU emulator test replaces this."""
    return _cuda.sched_counter(device)


def _sched_ptr(name: str, device: torch.device):
    """The counter argument of a launch of kernel ``name``: mx_quant_dyn's per-stream counter, else a null pointer
    (the static order; mx_quant_dyn given none runs it too)."""
    return _cuda.ptr(_sched_counter(device) if name.startswith("mx_quant_dyn<") else None)


def _launch(
    name: str, grid: int | tuple[int, int], args: tuple, shared_mem: int, device: torch.device, threads: int = _THREADS
) -> None:
    """Launch kernel ``name`` (a name expression of quantize.cu); the CPU emulator test replaces this."""
    _cuda.launch(_kernel(name, device), grid, threads, args, shared_mem=shared_mem, device=device)


def row_scale_shape(m: int, k: int, scale_layout: str, num_groups: int = 0) -> tuple[int, ...]:
    """Shape of the row-wise scale output for ``x: [m, k]`` in ``scale_layout``."""
    c = k // BLOCK
    if scale_layout == "plain":
        return (m, c)
    if scale_layout == "blocked":
        return (blocked_size(m, c),)
    if scale_layout == "grouped":
        return (grouped_blocked_size(m, num_groups, c, "m"),)
    raise ValueError(f"scale_layout must be 'plain', 'blocked' or 'grouped', got {scale_layout!r}")


def col_scale_shape(m: int, k: int, scale_layout: str) -> tuple[int, ...]:
    """Shape of the column-wise scale output for ``x: [m, k]``: plain ``[k, m//32]`` or blocked bytes."""
    if scale_layout == "plain":
        return (k, m // BLOCK)
    if scale_layout == "blocked":
        return (blocked_size(k, m // BLOCK),)
    raise ValueError(f"column-wise scale_layout must be 'plain' or 'blocked', got {scale_layout!r}")


def _quant_args(x, m, k, rq, rs, cq, cs, gsizes, n_groups, group_rows, n_row_tiles, ctiles, x2, sched) -> tuple:
    """mx_quant's argument tuple; the pointers as kernel pointer arguments (``_cuda.ptr`` or ``np.uint64``).
    sched: the dynamic tile schedule's counter (:func:`_sched_counter`) or a null pointer (static schedule)."""
    i32, i64 = _cuda.i32, _cuda.i64
    return (
        x,
        i64(m),
        i32(k),
        rq,
        rs,
        cq,
        cs,
        gsizes,
        i32(n_groups),
        i64(group_rows),
        i32(n_row_tiles),
        i32(ctiles),
        x2,
        sched,
    )


def _launch_quant(
    x,
    m,
    k,
    rs_mode,
    cs_mode,
    rq=None,
    rs=None,
    cq=None,
    cs=None,
    gsizes=None,
    n_groups=0,
    group_rows=0,
    n_row_tiles=None,
    in_code=None,
    x2=None,
) -> None:
    """x: [M, K] (or SwiGLU's [M, 2K], in_code=3); k is the quantized width."""
    plan = qp.quant_plan(x, m, k, rs_mode, cs_mode, n_groups, n_row_tiles, in_code)
    if plan is None:
        return
    name, grid, smem, n_row_tiles, ctiles, threads = plan
    p, sched = _cuda.ptr, _sched_ptr(name, x.device)
    args = _quant_args(
        p(x), m, k, p(rq), p(rs), p(cq), p(cs), p(gsizes), n_groups, group_rows, n_row_tiles, ctiles, p(x2), sched
    )
    _launch(name, grid, args, smem, x.device, threads)


# ------------------------------------------------------------------------------------------------------------
# row-wise
# ------------------------------------------------------------------------------------------------------------


def quantize_rowwise_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    scale_layout: str = "blocked",
    group_sizes: torch.Tensor | None = None,
) -> None:
    """Row-wise (1x32) MXFP8 of ``x`` into preallocated outputs.

    x: [M, K] bf16/fp16/fp32, contiguous, K % 32 == 0.
    data: [M, K] float8_e4m3fn.
    scale: uint8, ``row_scale_shape(M, K, scale_layout, G)``: plain [M, K//32]; blocked [blocked_size(M, K//32)];
        grouped [grouped_blocked_size(M, G, K//32, "m")].
    group_sizes (grouped only): [G] int32 on x's device, non-negative, summing to M (not checked: that would
        need a host sync; rows past M are never read or written).
    """
    check_input(x, 2, "quantize_rowwise")
    m, k = x.shape
    g = 0
    if scale_layout == "grouped":
        group_sizes = check_groups(group_sizes, x.device)
        g = group_sizes.numel()
    check_out(data, "data", (m, k), torch.float8_e4m3fn, x.device)
    check_out(scale, "scale", row_scale_shape(m, k, scale_layout, g), torch.uint8, x.device)
    n_row_tiles = qp.cdiv(m, qp.TILE) + g if scale_layout == "grouped" else None
    _launch_quant(
        x,
        m,
        k,
        qp.RS[scale_layout],
        0,
        rq=data,
        rs=scale,
        gsizes=group_sizes if g else None,
        n_groups=g,
        n_row_tiles=n_row_tiles,
    )


def quantize_rowwise(
    x: torch.Tensor, scale_layout: str = "blocked", group_sizes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise (1x32) MXFP8 of ``x: [M, K]`` -> ``(data [M, K] e4m3, scale u8 in scale_layout)``.

    See :func:`quantize_rowwise_into` for the layouts; ``scale_layout`` in {"plain", "blocked", "grouped"}.
    """
    check_input(x, 2, "quantize_rowwise")
    m, k = x.shape
    g = group_sizes.numel() if (scale_layout == "grouped" and isinstance(group_sizes, torch.Tensor)) else 0
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(row_scale_shape(m, k, scale_layout, g), dtype=torch.uint8, device=x.device)
    quantize_rowwise_into(x, data, scale, scale_layout, group_sizes)
    return data, scale


# ------------------------------------------------------------------------------------------------------------
# column-wise and fused
# ------------------------------------------------------------------------------------------------------------


def grouped_colwise_scale_rows(m: int, num_groups: int) -> int:
    """Rows of the per-group column-wise scale array: ``ceil(M/32) + G`` (a static bound, no host sync)."""
    return qp.cdiv(m, BLOCK) + num_groups


def quantize_grouped_dual_into(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    data_c: torch.Tensor,
    scale_c: torch.Tensor | None,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
    colwise: str = "mxfp8",
) -> None:
    """Both MXFP8 operands of a grouped GEMM input from one read of ``x`` (or of SwiGLU's input).

    x: [M, K] bf16/fp32, or with ``apply_swiglu=True`` a: [M, 2K] bf16 = (gate | up), quantizing
        ``h = silu(gate) * up`` computed in fp32 exactly as ``moe_ep.gemm.swiglu``; or with ``swiglu_dh``
        (dh: [M, F] fp32 or bf16, the gradient of h; bf16 is read as is and widened exactly, so no fp32 copy of
        the dgrad output is needed) a: [M, 2F] bf16, quantizing ``dA = swiglu_bwd(a, dh)`` [M, 2F] (K = 2F)
        computed exactly as ``moe_ep.gemm.swiglu_bwd``.
    group_sizes: [G] int32 on x's device (rows of each group, in order; not read on the host).
    data: [M, K] e4m3, row-wise (1x32 along K); scale: u8 [grouped_blocked_size(M, G, K//32, "m")] (fprop/dgrad).
    data_c: [M, K] e4m3, column-wise in 32-row blocks that restart at each group's first row (a group's last block
        is zero padded); scale_c: u8 [ceil(M/32) + G, K], block j of group g at row sum_{h<g} ceil(n_h/32) + j
        (the wgrad operand format of :mod:`moe_ep.experts.gemm`). Rows past sum(group_sizes) and unused scale rows
        are not written.
    colwise="bf16" writes the column-wise operand already prepared for the Hopper wgrad kernel instead:
        data_c: bf16 [64 (ceil(M/64) + G), K], the exact value of every quantized element, group g from row
        64 sum_{h<g} ceil(n_h/64) and zero rows up to its next multiple of 64; scale_c must be None. These are the
        bytes ``gemm_operands.prepare_colwise_bf16`` makes of the MXFP8 pair, except a NaN block's payload (bf16
        0x7FC0 here, as in ``prepare_colwise_bf16_torch``; 0x7FFF from the CUDA preparation kernel); rows
        past the last group's block are not written. Why: the wgrad operands are transient in the backward pass,
        so writing 2 bytes here replaces the preparation pass (read 1 + 1/32, write 2 bytes per element, plus a
        launch) that :func:`moe_ep.experts.gemm.grouped_wgrad_out` runs otherwise.
    """
    if colwise not in ("mxfp8", "bf16"):
        raise ValueError(f"colwise must be 'mxfp8' or 'bf16', got {colwise!r}")
    if swiglu_dh is not None:
        if apply_swiglu:
            raise ValueError("apply_swiglu and swiglu_dh are exclusive (forward vs backward)")
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise TypeError(f"swiglu backward: a must be bf16, got {getattr(x, 'dtype', type(x).__name__)}")
        check_input(x, 2, "swiglu backward")
        m, k = x.shape
        if k % (2 * BLOCK):
            raise ValueError(f"swiglu backward: a must be [M, 2F] with F % {BLOCK} == 0, got {tuple(x.shape)}")
        if not isinstance(swiglu_dh, torch.Tensor) or swiglu_dh.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"swiglu backward: dh must be fp32 or bf16, got {getattr(swiglu_dh, 'dtype', None)}")
        check_out(swiglu_dh, "dh", (m, k // 2), swiglu_dh.dtype, x.device)
    elif apply_swiglu:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise TypeError(f"swiglu: input must be a bf16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 2 or x.shape[1] % (2 * BLOCK):
            raise ValueError(f"swiglu: input must be [M, 2F] with F % {BLOCK} == 0, got {tuple(x.shape)}")
        check_input(x, 2, "swiglu")
        m, k = x.shape[0], x.shape[1] // 2
    else:
        check_input(x, 2, "quantize_grouped_dual")
        if x.dtype == torch.float16:  # not instantiated (no fp16 producer in the MoE path)
            raise TypeError("quantize_grouped_dual: input must be bf16 or fp32, got torch.float16")
        m, k = x.shape
    group_sizes = check_groups(group_sizes, x.device)
    g = group_sizes.numel()
    check_out(data, "data", (m, k), torch.float8_e4m3fn, x.device)
    check_out(scale, "scale", row_scale_shape(m, k, "grouped", g), torch.uint8, x.device)
    if colwise == "bf16":
        if scale_c is not None:
            raise ValueError("colwise='bf16' has no column scales: pass scale_c=None")
        check_out(data_c, "data_c", (colwise_prep_rows(m, g), k), torch.bfloat16, x.device)
    else:
        check_out(data_c, "data_c", (m, k), torch.float8_e4m3fn, x.device)
        check_out(scale_c, "scale_c", (grouped_colwise_scale_rows(m, g), k), torch.uint8, x.device)
    _launch_quant(
        x,
        m,
        k,
        qp.RS["grouped"],
        qp.CS["grouped_prep" if colwise == "bf16" else "grouped_nt"],
        rq=data,
        rs=scale,
        cq=data_c,
        cs=scale_c,
        gsizes=group_sizes,
        n_groups=g,
        n_row_tiles=qp.cdiv(m, qp.TILE) + g,
        in_code=_swiglu_code(apply_swiglu, swiglu_dh),
        x2=swiglu_dh,
    )


def _swiglu_code(apply_swiglu: bool, swiglu_dh: torch.Tensor | None) -> int | None:
    """mx_quant's IN code for the SwiGLU variants (None: the input's own dtype)."""
    if swiglu_dh is not None:
        return qp.IN_SWIGLU_BWD if swiglu_dh.dtype == torch.float32 else qp.IN_SWIGLU_BWD16
    return qp.IN_SWIGLU if apply_swiglu else None


def quantize_grouped_dual(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
    colwise: str = "mxfp8",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Allocating form of :func:`quantize_grouped_dual_into` -> ``(data, scale, data_c, scale_c)`` (``scale_c``
    is None with ``colwise="bf16"``).

    The reference with the same signature is :func:`moe_ep.gemm.quantize_grouped_dual_torch`.
    """
    if colwise not in ("mxfp8", "bf16"):
        raise ValueError(f"colwise must be 'mxfp8' or 'bf16', got {colwise!r}")
    m = x.shape[0]
    k = x.shape[1] // 2 if apply_swiglu else x.shape[1]
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    dev = x.device
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty(row_scale_shape(m, k, "grouped", g), dtype=torch.uint8, device=dev)
    if colwise == "bf16":
        data_c, scale_c = torch.empty((colwise_prep_rows(m, g), k), dtype=torch.bfloat16, device=dev), None
    else:
        data_c = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
        scale_c = torch.empty((grouped_colwise_scale_rows(m, g), k), dtype=torch.uint8, device=dev)
    quantize_grouped_dual_into(x, group_sizes, data, scale, data_c, scale_c, apply_swiglu, swiglu_dh, colwise)
    return data, scale, data_c, scale_c


def quantize_colwise_into(
    x: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor, scale_layout: str = "blocked"
) -> None:
    """Column-wise (32x1) MXFP8 of ``x`` into preallocated outputs, data transposed.

    x: [M, K] bf16/fp16/fp32, contiguous, M % 32 == 0, K % 32 == 0.
    data_t: [K, M] float8_e4m3fn (x transposed, blocks of 32 consecutive bytes along each row).
    scale_t: uint8, plain [K, M//32] or blocked [blocked_size(K, M//32)].
    """
    check_colwise(x, "quantize_colwise")
    m, k = x.shape
    check_out(data_t, "data_t", (k, m), torch.float8_e4m3fn, x.device)
    check_out(scale_t, "scale_t", col_scale_shape(m, k, scale_layout), torch.uint8, x.device)
    _launch_quant(x, m, k, 0, qp.CS[scale_layout], cq=data_t, cs=scale_t)


def quantize_colwise(x: torch.Tensor, scale_layout: str = "blocked") -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise MXFP8 of ``x: [M, K]`` -> ``(data_t [K, M] e4m3, scale_t u8 plain [K, M//32] or blocked)``."""
    check_colwise(x, "quantize_colwise")
    m, k = x.shape
    data_t = torch.empty((k, m), dtype=torch.float8_e4m3fn, device=x.device)
    scale_t = torch.empty(col_scale_shape(m, k, scale_layout), dtype=torch.uint8, device=x.device)
    quantize_colwise_into(x, data_t, scale_t, scale_layout)
    return data_t, scale_t


def quantize_fused_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    data_t: torch.Tensor,
    scale_t: torch.Tensor,
    row_layout: str = "blocked",
    col_layout: str = "blocked",
) -> None:
    """Row-wise and column-wise MXFP8 of ``x`` from one read of it, into preallocated outputs.

    x: [M, K] bf16/fp16/fp32, contiguous, M % 32 == 0, K % 32 == 0.
    data: [M, K] e4m3; scale: u8 plain [M, K//32] or blocked [blocked_size(M, K//32)] (row_layout).
    data_t: [K, M] e4m3; scale_t: u8 plain [K, M//32] or blocked [blocked_size(K, M//32)] (col_layout).
    """
    check_colwise(x, "quantize_fused")
    if row_layout not in ("plain", "blocked"):
        raise ValueError(f"quantize_fused: row_layout must be 'plain' or 'blocked', got {row_layout!r}")
    m, k = x.shape
    check_out(data, "data", (m, k), torch.float8_e4m3fn, x.device)
    check_out(scale, "scale", row_scale_shape(m, k, row_layout), torch.uint8, x.device)
    check_out(data_t, "data_t", (k, m), torch.float8_e4m3fn, x.device)
    check_out(scale_t, "scale_t", col_scale_shape(m, k, col_layout), torch.uint8, x.device)
    _launch_quant(x, m, k, qp.RS[row_layout], qp.CS[col_layout], rq=data, rs=scale, cq=data_t, cs=scale_t)


def quantize_fused(x: torch.Tensor, row_layout: str = "blocked", col_layout: str = "blocked"):
    """Row-wise + column-wise MXFP8 of ``x: [M, K]`` in one pass.

    Returns ``(data [M, K] e4m3, scale u8, data_t [K, M] e4m3, scale_t u8)``; see :func:`quantize_fused_into`.
    """
    check_colwise(x, "quantize_fused")
    m, k = x.shape
    dev = x.device
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty(row_scale_shape(m, k, row_layout), dtype=torch.uint8, device=dev)
    data_t = torch.empty((k, m), dtype=torch.float8_e4m3fn, device=dev)
    scale_t = torch.empty(col_scale_shape(m, k, col_layout), dtype=torch.uint8, device=dev)
    quantize_fused_into(x, data, scale, data_t, scale_t, row_layout, col_layout)
    return data, scale, data_t, scale_t


# ------------------------------------------------------------------------------------------------------------
# 3-D weights
# ------------------------------------------------------------------------------------------------------------


def quantize_weights_into(w: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """Per-expert row-wise MXFP8 of ``w`` (blocks along K) into preallocated outputs.

    w: [E, N, K] bf16/fp16/fp32, contiguous, K % 32 == 0.
    data: [E, N, K] e4m3; scale: [E, blocked_size(N, K//32)] u8 (== to_blocked(plain [E, N, K//32])).
    """
    check_input(w, 3, "quantize_weights")
    e, n, k = w.shape
    check_out(data, "data", (e, n, k), torch.float8_e4m3fn, w.device)
    check_out(scale, "scale", (e, blocked_size(n, k // BLOCK)), torch.uint8, w.device)
    if n == 0:
        return
    _launch_quant(
        w,
        e * n,
        k,
        qp.RS["uniform"],
        0,
        rq=data,
        rs=scale,
        n_groups=e,
        group_rows=n,
        n_row_tiles=e * qp.cdiv(n, qp.TILE),
    )


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w: [E, N, K]`` -> ``(data [E, N, K] e4m3, scale [E, blocked_size(N, K//32)] u8)``."""
    check_input(w, 3, "quantize_weights")
    e, n, k = w.shape
    data = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((e, blocked_size(n, k // BLOCK)), dtype=torch.uint8, device=w.device)
    quantize_weights_into(w, data, scale)
    return data, scale


def quantize_weights_fused_into(
    w: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
) -> None:
    """Both MXFP8 operands of an expert weight from one read of it: per expert, the fused row + column pass.

    w: [E, N, K] bf16/fp16/fp32, contiguous, N % 32 == 0, K % 32 == 0.
    data: [E, N, K] e4m3, scale: [E, blocked_size(N, K//32)] u8 (what :func:`quantize_weights` writes: fprop's W);
    data_t: [E, K, N] e4m3 = W[e]^T quantized along N, scale_t: [E, blocked_size(K, N//32)] u8 (dgrad's W^T, the
    bytes of ``quantize_weights(w.transpose(1, 2).contiguous())``).
    Why: the dgrad copy otherwise needs a transposed copy of W and a second quantization pass. One launch for all
    experts (grid.y = expert).
    """
    check_input(w, 3, "quantize_weights_fused")
    e, n, k = w.shape
    if n % BLOCK:
        raise ValueError(f"quantize_weights_fused: N = {n} is not a multiple of {BLOCK} (the W^T blocks run along N)")
    check_out(data, "data", (e, n, k), torch.float8_e4m3fn, w.device)
    check_out(scale, "scale", (e, blocked_size(n, k // BLOCK)), torch.uint8, w.device)
    check_out(data_t, "data_t", (e, k, n), torch.float8_e4m3fn, w.device)
    check_out(scale_t, "scale_t", (e, blocked_size(k, n // BLOCK)), torch.uint8, w.device)
    plan = qp.batch_plan(w, e, n, k)
    if plan is None:
        return
    name, grid, smem, n_row_tiles, ctiles = plan
    null, p = _cuda.ptr(None), _cuda.ptr
    args = _quant_args(
        p(w), n, k, p(data), p(scale), p(data_t), p(scale_t), null, 0, 0, n_row_tiles, ctiles, null, null
    )
    _launch(name, grid, args, smem, w.device)


def quantize_weights_fused(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w: [E, N, K]`` -> ``(data, scale, data_t, scale_t)`` of :func:`quantize_weights_fused_into`."""
    check_input(w, 3, "quantize_weights_fused")
    e, n, k = w.shape
    dev = w.device
    data = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty((e, blocked_size(n, k // BLOCK)), dtype=torch.uint8, device=dev)
    data_t = torch.empty((e, k, n), dtype=torch.float8_e4m3fn, device=dev)
    scale_t = torch.empty((e, blocked_size(k, n // BLOCK)), dtype=torch.uint8, device=dev)
    quantize_weights_fused_into(w, data, scale, data_t, scale_t)
    return data, scale, data_t, scale_t


# ------------------------------------------------------------------------------------------------------------
# the moe_ep.mxfp8 entry points (plain scales, MXFP8Tensor)
# ------------------------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, axis: int) -> MXFP8Tensor:
    """MXFP8Tensor of ``x`` along ``axis`` (non-negative; arguments already checked by moe_ep.mxfp8.quantize).

    axis == x.dim() - 1: row-wise kernel on ``x.reshape(-1, K)``. axis == 0 (x at least 2-D): column-wise
    kernel writing data in x's layout, scale [M // 32, *x.shape[1:]]. Other axes, and axis 0 with a row size
    that is not a multiple of 16 bytes, use the reference (correct, slower; no caller needs them on a hot path).
    """
    if x.dtype not in qp.IN:
        raise TypeError(f"quantize supports bf16/fp16/fp32 inputs, got {x.dtype}")
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    shape = tuple(x.shape)
    if axis == x.dim() - 1:
        k = shape[-1]
        m = x.numel() // k if k else 0
        x2 = x.view(m, k)
        data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty((*shape[:-1], k // BLOCK), dtype=torch.uint8, device=x.device)
        _launch_quant(x2, m, k, qp.RS["plain"], 0, rq=data, rs=scale)
        return MXFP8Tensor(data, scale, axis)
    if axis == 0:
        m = shape[0]
        k = x.numel() // m if m else 0
        if k * x.element_size() % 16 == 0:
            data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
            scale = torch.empty((m // BLOCK, *shape[1:]), dtype=torch.uint8, device=x.device)
            _launch_quant(x.view(m, k), m, k, 0, qp.CS["nt"], cq=data, cs=scale)
            return MXFP8Tensor(data, scale, axis)
    # middle axes / odd row sizes: the reference (same bytes)
    return quantize_torch(x, axis)


def dequantize_into(t: MXFP8Tensor, out: torch.Tensor) -> None:
    """Dequantize ``t`` (plain scales, axis = last or 0) into ``out`` (t.shape, bf16/fp16/fp32, contiguous)."""
    check_out(out, "out", tuple(t.data.shape), out.dtype, t.data.device)
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dequantize supports bf16/fp16/fp32 outputs, got {out.dtype}")
    data, scale = t.data, t.scale
    if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
        raise TypeError(f"expected e4m3 data and uint8 scales, got {data.dtype} and {scale.dtype}")
    if scale.device != data.device:
        raise ValueError(f"data on {data.device} but scale on {scale.device}")
    nd = data.dim()
    colw = t.axis == 0 and nd >= 2
    if not colw and t.axis != nd - 1:
        raise ValueError(f"dequantize_into supports axis = last or 0, got {t.axis}")
    exp_scale = (data.shape[0] // BLOCK, *data.shape[1:]) if colw else (*data.shape[:-1], data.shape[-1] // BLOCK)
    if data.shape[t.axis] % BLOCK or tuple(scale.shape) != tuple(exp_scale):
        raise ValueError(f"data {tuple(data.shape)} and scale {tuple(scale.shape)} do not match (axis {t.axis})")
    data = data.contiguous()
    scale = scale.contiguous()
    if data.data_ptr() % 16 or (colw and scale.data_ptr() % 16):
        data, scale = data.clone(), scale.clone()
    n = data.numel()
    if n == 0:
        return
    k = data.shape[-1] if not colw else n // data.shape[0]
    if colw and k % 16:
        raise ValueError(f"column-wise dequantize_into needs rows of a multiple of 16 elements, got {k}")
    nchunks = n // 16
    grid = max(1, min(qp.cdiv(nchunks, _THREADS), qp.sm_count(data.device) * 16))
    o = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[out.dtype]
    args = (_cuda.ptr(data), _cuda.ptr(scale), _cuda.ptr(out), _cuda.i64(nchunks), _cuda.i32(k))
    _launch(f"mx_dequant<{o},{int(colw)}>", grid, args, 0, data.device)


def dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``t`` (plain scales) -> ``t.shape`` tensor of ``dtype``; scale 0xFF and e4m3 NaN give NaN."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dequantize supports bf16/fp16/fp32 outputs, got {dtype}")
    nd = t.data.dim()
    colw = t.axis == 0 and nd >= 2
    if t.axis != nd - 1 and not (colw and (t.data.numel() // max(t.data.shape[0], 1)) % 16 == 0):
        return dequantize_torch(t, dtype)  # middle axes / odd row sizes: the reference (same values)
    out = torch.empty(tuple(t.data.shape), dtype=dtype, device=t.data.device)
    dequantize_into(t, out)
    return out
