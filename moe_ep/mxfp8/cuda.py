"""CUDA (CuPy RawKernel) MXFP8 quantization: the kernels of ``kernels/mxfp8/quantize.cu`` behind launchers.

Every function produces the same bytes as the reference in :mod:`moe_ep.mxfp8` (docs/design.md, "MXFP8 format" and
"Scale layouts"). Each ``*_into`` launcher takes preallocated outputs and checks them; the function without
``_into`` allocates. Kernels run on torch's current stream; nothing here synchronizes with the host.

Entry points:
  * :func:`quantize` / :func:`dequantize`: what ``moe_ep.mxfp8.quantize`` / ``dequantize`` run for CUDA tensors
    (MXFP8Tensor, plain scales, axis = last or 0).
  * :func:`quantize_grouped_dual`: both operands of a grouped GEMM input (row-wise MXFP8 with per-group blocked
    scales, and the per-group column-wise operand already prepared for the wgrad kernel as bf16), of x itself or of
    the SwiGLU forward / backward.
  * :func:`colwise_from_rows`: that column operand of MXFP8 rows (e4m3 + per-group blocked scales), in one pass.
  * :func:`quantize_weights_fused`: both MXFP8 operands of 3-D expert weights ``w: [E, N, K]``.
:mod:`moe_ep.mxfp8.plan` decides kernel, grid and shared memory.
"""

from __future__ import annotations

import torch

from .. import _cuda
from . import checks
from . import plan as qp
from .checks import check_groups, check_input, check_out
from .format import BLOCK, MXFP8Tensor, blocked_size, colwise_prep_rows, grouped_blocked_size
from .reference import dequantize_torch, quantize_torch

_SRC = "mxfp8/quantize.cu"
_THREADS = qp.THREADS  # CTA size of every kernel here but mx_quant's pipe 5 (quant_plan decides)


def _kernel(name: str, device: torch.device):
    return _cuda.get_function(_SRC, name, qp.NAMES, (), device.index)


def _launch(
    name: str, grid: int | tuple[int, int], args: tuple, shared_mem: int, device: torch.device, threads: int = _THREADS
) -> None:
    """Launch kernel ``name`` (a name expression of quantize.cu); the CPU emulator test replaces this."""
    _cuda.launch(_kernel(name, device), grid, threads, args, shared_mem=shared_mem, device=device)


def _quant_args(x, m, k, rq, rs, cq, cs, gsizes, n_groups, n_row_tiles, ctiles, x2) -> tuple:
    """The argument tuple of mx_quant, mx_quant_batch, mx_quant_dual and mx_swiglu_dual (kernels/mxfp8/quantize.cu
    MX_QUANT_PARAMS); the pointers as kernel pointer arguments (``_cuda.ptr`` or ``np.uint64``)."""
    i32, i64 = _cuda.i32, _cuda.i64
    return (x, i64(m), i32(k), rq, rs, cq, cs, gsizes, i32(n_row_tiles), i32(ctiles), i32(n_groups), x2)


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
    n_row_tiles=None,
    in_code=None,
    x2=None,
) -> None:
    """x: [M, K] (or SwiGLU's [M, 2K], in_code=3); k is the quantized width."""
    plan = qp.quant_plan(x, m, k, rs_mode, cs_mode, n_groups, n_row_tiles, in_code)
    if plan is None:
        return
    name, grid, smem, n_row_tiles, ctiles, threads = plan
    p = _cuda.ptr
    args = _quant_args(p(x), m, k, p(rq), p(rs), p(cq), p(cs), p(gsizes), n_groups, n_row_tiles, ctiles, p(x2))
    _launch(name, grid, args, smem, x.device, threads)


# ------------------------------------------------------------------------------------------------------------
# grouped dual: both operands of a grouped GEMM input
# ------------------------------------------------------------------------------------------------------------


def quantize_grouped_dual_into(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    data_c: torch.Tensor | None,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
) -> None:
    """Both operands of a grouped GEMM input from one read of ``x`` (or of SwiGLU's input).

    x: [M, K] bf16, or with ``apply_swiglu=True`` a: [M, 2K] bf16 = (gate | up), quantizing
        ``h = silu(gate) * up`` computed in fp32 exactly as ``moe_ep.experts.reference.swiglu``; or with ``swiglu_dh``
        (dh: [M, F] bf16, the gradient of h, the dgrad GEMM's output; widened exactly) a: [M, 2F] bf16, quantizing
        ``dA = swiglu_bwd(a, dh)`` [M, 2F] (K = 2F) computed exactly as ``moe_ep.experts.reference.swiglu_bwd``.
    group_sizes: [G] int32 on x's device (rows of each group, in order; not read on the host).
    data: [M, K] e4m3, row-wise (1x32 along K); scale: u8 [grouped_blocked_size(M, G, K//32, "m")] (fprop/dgrad).
    data_c: bf16 [64 (ceil(M/64) + G), K], the column-wise operand (32-row blocks that restart at each group's
        first row, a group's last block zero padded) already prepared for the Hopper wgrad kernel: the exact value
        of every quantized element, group g from row 64 sum_{h<g} ceil(n_h/64) and zero rows up to its next
        multiple of 64 (NaN blocks: bf16 0x7FC0), the bytes of
        ``prepare_colwise_bf16_torch`` (tests/refs.py) of the MXFP8 column-wise pair. Rows past
        sum(group_sizes) and past the last group's block are not written. Why: the wgrad operands are transient in the
        backward pass, so writing 2 bytes here saves a preparation pass over an MXFP8 copy (read 1 + 1/32, write 2
        bytes per element, plus a launch).
        None (with ``apply_swiglu`` only): row-wise h alone, the forward's GEMM2 operand; the kernel then computes
        and writes no column-wise byte (the backward rebuilds h's column operand from ``a``).
    """
    if swiglu_dh is not None:
        if apply_swiglu:
            raise ValueError("apply_swiglu and swiglu_dh are exclusive (forward vs backward)")
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise TypeError(f"swiglu backward: a must be bf16, got {getattr(x, 'dtype', type(x).__name__)}")
        check_input(x, 2, "swiglu backward")
        m, k = x.shape
        if k % (2 * BLOCK):
            raise ValueError(f"swiglu backward: a must be [M, 2F] with F % {BLOCK} == 0, got {tuple(x.shape)}")
        if not isinstance(swiglu_dh, torch.Tensor) or swiglu_dh.dtype != torch.bfloat16:
            raise TypeError(f"swiglu backward: dh must be bf16, got {getattr(swiglu_dh, 'dtype', None)}")
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
        if x.dtype != torch.bfloat16:  # the MoE path's activations are bf16 (mx_quant_dual reads bf16 only)
            raise TypeError(f"quantize_grouped_dual: input must be bf16, got {x.dtype}")
        m, k = x.shape
    group_sizes = check_groups(group_sizes, x.device)
    g = group_sizes.numel()
    check_out(data, "data", (m, k), torch.float8_e4m3fn, x.device)
    check_out(scale, "scale", (grouped_blocked_size(m, g, k // BLOCK, "m"),), torch.uint8, x.device)
    if data_c is None and not apply_swiglu:
        raise ValueError("data_c=None (row-only) is compiled for the SwiGLU forward only (apply_swiglu=True)")
    if data_c is not None:
        check_out(data_c, "data_c", (colwise_prep_rows(m, g), k), torch.bfloat16, x.device)
    if swiglu_dh is not None:
        in_code = qp.IN_SWIGLU_BWD16
    else:
        in_code = qp.IN_SWIGLU if apply_swiglu else None
    _launch_quant(
        x,
        m,
        k,
        qp.RS["grouped"],
        qp.CS["grouped_prep"] if data_c is not None else qp.CS["none"],
        rq=data,
        rs=scale,
        cq=data_c,
        gsizes=group_sizes,
        n_groups=g,
        n_row_tiles=qp.cdiv(m, qp.TILE) + g,
        in_code=in_code,
        x2=swiglu_dh,
    )


def quantize_grouped_dual(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
    colwise: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
    """Allocating form of :func:`quantize_grouped_dual_into` -> ``(data, scale, data_c, None)``.

    ``colwise``: "bf16" (the prepared column operand; the MXFP8 column-wise output was removed, no default path
    used it), or "none" with ``apply_swiglu`` (row-wise h only: data_c is None; the forward's GEMM2 reads nothing
    else). The trailing None stands for the column scales the prepared operand does not have. The reference with
    the same signature is :func:`tests.refs.quantize_grouped_dual_torch`.
    """
    if colwise not in ("bf16", "none"):
        raise ValueError(f"colwise must be 'bf16' (the wgrad's prepared operand) or 'none', got {colwise!r}")
    if colwise == "none" and not apply_swiglu:
        raise ValueError("colwise='none' (row-only) is compiled for the SwiGLU forward only (apply_swiglu=True)")
    m = x.shape[0]
    k = x.shape[1] // 2 if apply_swiglu else x.shape[1]
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    dev = x.device
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty(grouped_blocked_size(m, g, k // BLOCK, "m"), dtype=torch.uint8, device=dev)
    data_c = torch.empty((colwise_prep_rows(m, g), k), dtype=torch.bfloat16, device=dev) if colwise == "bf16" else None
    quantize_grouped_dual_into(x, group_sizes, data, scale, data_c, apply_swiglu, swiglu_dh)
    return data, scale, data_c, None


def colwise_from_rows_into(xq: torch.Tensor, xs: torch.Tensor, group_sizes: torch.Tensor, data_c: torch.Tensor) -> None:
    """The prepared column operand of MXFP8 rows, in one pass (no bf16 copy of the rows).

    xq: [M, K] e4m3 row-wise data, xs: u8 [grouped_blocked_size(M, G, K//32, "m")] its per-group blocked scales
    (what ``quantize_grouped_dual`` and the fused dispatch write), group_sizes: [G] int32 on their device.
    data_c: bf16 [64 (ceil(M/64) + G), K], written as :func:`quantize_grouped_dual_into` writes its ``data_c`` for
    the rows' exact bf16 values: the bytes of ``quantize_grouped_dual(dequantize(xq, plain scales) as bf16)[2]``,
    each element dequantized in registers (e4m3 value times 2**(s - 127), rounded once to bf16; scale 0xFF: NaN).
    Why: the backward's x column operand (the wgrad of W13) from the saved dispatch payload; the two-pass form
    wrote and read back 2 bytes per element of a bf16 copy.
    """
    if not isinstance(xq, torch.Tensor) or xq.dtype != torch.float8_e4m3fn:
        raise TypeError(f"colwise_from_rows: xq must be float8_e4m3fn, got {getattr(xq, 'dtype', type(xq).__name__)}")
    if xq.dim() != 2 or not xq.is_contiguous() or xq.shape[1] % BLOCK:
        raise ValueError(f"colwise_from_rows: xq must be contiguous [M, K], K % {BLOCK} == 0, got {tuple(xq.shape)}")
    m, k = xq.shape
    dev = xq.device
    group_sizes = check_groups(group_sizes, dev)
    g = group_sizes.numel()
    if not checks.on_gpu(xq) or xq.data_ptr() % 16:
        raise ValueError(f"colwise_from_rows: xq must be a 16-byte aligned CUDA tensor, got {xq.device}")
    check_out(xs, "xs", (grouped_blocked_size(m, g, k // BLOCK, "m"),), torch.uint8, dev)
    check_out(data_c, "data_c", (colwise_prep_rows(m, g), k), torch.bfloat16, dev)
    _launch_quant(
        xq,
        m,
        k,
        qp.RS["none"],
        qp.CS["grouped_prep"],
        cq=data_c,
        gsizes=group_sizes,
        n_groups=g,
        n_row_tiles=qp.cdiv(m, qp.TILE) + g,
        in_code=qp.IN_MXROWS,
        x2=xs,
    )


def colwise_from_rows(xq: torch.Tensor, xs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Allocating form of :func:`colwise_from_rows_into` -> data_c bf16 [64 (ceil(M/64) + G), K]."""
    g = group_sizes.numel() if isinstance(group_sizes, torch.Tensor) else 0
    data_c = torch.empty((colwise_prep_rows(xq.shape[0], g), xq.shape[1]), dtype=torch.bfloat16, device=xq.device)
    colwise_from_rows_into(xq, xs, group_sizes, data_c)
    return data_c


# ------------------------------------------------------------------------------------------------------------
# 3-D weights
# ------------------------------------------------------------------------------------------------------------


def quantize_weights_fused_into(
    w: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
) -> None:
    """Both MXFP8 operands of an expert weight from one read of it: per expert, the fused row + column pass.

    w: [E, N, K] bf16/fp16/fp32, contiguous, N % 32 == 0, K % 32 == 0.
    data: [E, N, K] e4m3, scale: [E, blocked_size(N, K//32)] u8 (fprop's W: per expert, the bytes of
    ``quantize_torch(w, -1)`` with ``to_blocked`` scales); data_t: [E, K, N] e4m3 = W[e]^T quantized along N,
    scale_t: [E, blocked_size(K, N//32)] u8 (dgrad's W^T: the same of ``w.transpose(1, 2).contiguous()``).
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
    args = _quant_args(p(w), n, k, p(data), p(scale), p(data_t), p(scale_t), null, 0, n_row_tiles, ctiles, null)
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


def quantize(x: torch.Tensor, axis: int = -1) -> MXFP8Tensor:
    """MXFP8Tensor of ``x`` along ``axis`` (the signature of ``moe_ep.mxfp8.reference.quantize_torch``; arguments
    already checked by moe_ep.mxfp8.quantize; a negative axis counts from the end).

    axis == x.dim() - 1: row-wise kernel on ``x.reshape(-1, K)``. axis == 0 (x at least 2-D): column-wise
    kernel writing data in x's layout, scale [M // 32, *x.shape[1:]]. Other axes, and axis 0 with a row size
    that is not a multiple of 16 bytes, use the reference (correct, slower; no caller needs them on a hot path).
    """
    if x.dtype not in qp.IN:
        raise TypeError(f"quantize supports bf16/fp16/fp32 inputs, got {x.dtype}")
    axis = axis % x.dim() if x.dim() else axis
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
