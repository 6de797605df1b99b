"""CUDA transport: layout, fused FP8 dispatch and combine over NVSHMEM peer pointers (kernels/*.cu).

Same contracts as :mod:`moe_ep.transport.reference` / :mod:`moe_ep.transport.autograd` (the specification), with
every count kept on the GPU: nothing here waits for the GPU (safe under ``torch.cuda.set_sync_debug_mode("error")``).

Differences a caller must know (shapes cannot depend on device counts without a host sync):
  * expanded tensors have ``handle.expand_capacity`` rows (default ``ep_size * max_tokens_per_rank *
    min(top_k, num_local_experts)``, the true worst case; pass a tighter ``expand_capacity``). Rows past the real
    count N (``handle.info[1]`` on the device) are zero in the compat functions; in the fused quantized dispatch
    their data rows are unspecified (grouped GEMMs read only ``group_sizes`` rows) and their scales zero.
  * ``handle.group_sizes`` is int32 on the GPU; host lists (``send_splits`` ...) are properties that sync.
  * H must be a multiple of 32, and of the payload's scale block (blockwise: 128); x / y rows bf16 or fp32 (fp32
    unquantized payloads need ``wire_bytes=4``).
  * The payload of every pass is a recipe (:func:`~moe_ep.transport.reference.payload_recipe`: a Recipe, its name,
    or None for raw rows): MXFP8 ships 1x32 blocks, blockwise 1x128 blocks (e4m3 bytes + one E8M0 byte per block),
    quantized in the sender warp by the same kernels (their block size QB is a template parameter).

Phases and kernels (build_layout and CudaEPHandle live in layout.py and are importable from here; stream-ordered;
flags with release/acquire and timeouts, kernels/transport/nvshmem/ep_sync.cuh; docs/design-transport.md):
  build_layout        ep_layout_count   per-CTA counts, last CTA: prefix over CTAs + count row to every rank
                      ep_layout_place   counts matrix -> all offsets, per token / slot rows   (LAYOUT epoch)
  dispatch_fwd_mxfp8  ep_dispatch_mx    quantize once, store to every dest rank, and expand each received row
  dispatch_fwd_       <IN, QB>          into expert-sorted order as its flags land (DISP epoch); scales in the
    blockwise                           blocked layout (QB = 32) or row-major [rows, H/128] (QB = 128)
  dispatch_fwd        ep_dispatch       quantize once (or raw rows), store to every dest rank (DISP epoch)
                      ep_expand         MODE_VAL: expert-sorted rows, dequantized (or raw) in x's dtype
  combine_fwd         ep_combine        slot-ordered weighted sum sent as one row per (token, rank), rows
                                        interleaved over destination ranks; rank-ordered sum as rows land (COMB)
  combine_bwd = quantized (MXFP8 / 1x128, or raw) dispatch of dy: ep_dispatch without metadata + ep_expand in
                MODE_BWD (dequantized on arrival, dy * w and dw = dot(dy, y))
  dispatch_bwd = combine of dx: ep_combine with BWD = 1 (also returns the top-k weight gradients)
The fused kernels' work split is the runtime's :class:`~moe_ep.transport.nvshmem.schedule.TransportSchedule`
(:func:`init_runtime`'s ``schedule``, :meth:`EPRuntime.set_schedule`).
Errors found on the GPU are raised by the next transport call (see :mod:`moe_ep.transport.nvshmem.runtime`).
"""

from __future__ import annotations

import torch

from ... import _cuda
from ...mxfp8 import grouped_blocked_size
from ...recipe import Recipe
from ..reference import check_payload_hidden, payload_recipe
from .kernels import COMBINE_NAMES, DISPATCH_NAMES, MODE_BWD, MODE_VAL, PAYLOAD_BLOCKS, fn, i32, i64, p
from .layout import CudaEPHandle, _check_capacity, build_layout, fit_to_count
from .runtime import EPRuntime, init_runtime  # noqa: F401  (init_runtime: the transport's entry point, re-exported)
from .schedule import CTA_WARPS

_THREADS = 32 * CTA_WARPS  # the fused kernels' CTA (the schedule's warp counts are checked against it)
_DT = {torch.float32: 0, torch.bfloat16: 1}
# CTAs per SM of the fused kernels (their register counts at 512 threads let 2 fit)
_FUSED_CTAS_PER_SM = 2


def _payload(recipe: Recipe | str | None) -> tuple[Recipe | None, int]:
    """(the payload's recipe or None, its scale block QB: 0 for raw rows)."""
    r = payload_recipe(recipe)
    if r is None:
        return None, 0
    if r.act_block not in PAYLOAD_BLOCKS:
        raise NotImplementedError(f"the NVSHMEM dispatch has no payload of 1x{r.act_block} blocks ({r.name!r})")
    return r, r.act_block


def _grid(work_rows: int, rt: EPRuntime, per_cta: int = _THREADS // 32) -> int:
    return max(1, min(-(-work_rows // per_cta), rt.num_sms * 4))


def _fused_grid(work_rows: int, rt: EPRuntime) -> int:
    # any grid is deadlock-free (work tickets, see kernels/transport/nvshmem/ep_sync.cuh); this one is about one wave
    return max(1, min(-(-work_rows // (_THREADS // 32)), rt.num_sms * _FUSED_CTAS_PER_SM))


def _check_rows(x: torch.Tensor, what: str, h: int | None = None, recipe: Recipe | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        raise ValueError(f"{what} must be a CUDA tensor")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(x.shape)}")
    if x.dtype not in _DT:
        raise TypeError(f"{what} must be bf16 or fp32 for the CUDA transport, got {x.dtype}")
    if h is not None and x.shape[1] != h:
        raise ValueError(f"{what} has {x.shape[1]} columns, expected {h}")
    if x.shape[1] % 32:
        raise ValueError(f"{what}: hidden ({x.shape[1]}) must be a multiple of 32")
    check_payload_hidden(x.shape[1], recipe, what)
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


# ----------------------------------------------------------------------------------------------------- dispatch
def _send_prep(x: torch.Tensor, topk_w: torch.Tensor | None, h: CudaEPHandle, qb: int):
    """Checks of a send (qb: the payload's scale block, 0 for raw rows); returns the fp32 top-k weights (None: no
    metadata). A quantized row takes H bytes of the receive buffer's data region and H / qb of its scale region,
    which holds H / 32 bytes per row: both fit whenever H fits the runtime's hidden."""
    rt = h.runtime
    _check_capacity(rt, x.shape[1], 1 if qb else x.element_size(), h.top_k, x.shape[0])
    if x.shape[0] != h.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows, the handle {h.num_tokens} tokens")
    tw = None
    if topk_w is not None:
        if tuple(topk_w.shape) != (h.num_tokens, h.top_k):
            raise ValueError(f"topk_w {tuple(topk_w.shape)} does not match topk_idx {(h.num_tokens, h.top_k)}")
        tw = topk_w.to(torch.float32).contiguous()
    return tw


def _send_args(x: torch.Tensor, tw: torch.Tensor | None, h: CudaEPHandle) -> tuple:
    """The kernel arguments that ep_dispatch and ep_dispatch_mx share (their first 15 parameters, dispatch.cu)."""
    rt = h.runtime
    return (
        p(x),
        p(tw),
        p(h.topk_idx),
        p(h.tok_dst),
        p(h.slot_pos),
        i32(h.num_tokens),
        i32(x.shape[1]),
        i32(h.top_k),
        i32(h.num_local_experts),
        i32(h.ep_size),
        i32(rt.rank),
        p(rt.peers),
        i64(rt.region("disp_data")),
        i64(rt.region("disp_scale")),
        i64(rt.region("disp_meta")),
    )


def _send(x: torch.Tensor, topk_w: torch.Tensor | None, h: CudaEPHandle, qb: int) -> None:
    """Launch ep_dispatch<IN, qb> (rows of x, quantized in 1 x qb blocks or raw for qb = 0, to every destination
    rank, with the routing metadata when topk_w is given); the :func:`_expand` that follows ends the same DISP use."""
    rt = h.runtime
    es = x.element_size()
    tw = _send_prep(x, topk_w, h, qb)
    name = f"ep_dispatch<{_DT[x.dtype]},{qb}>" if qb else "ep_dispatch<0,0>"
    args = (
        *_send_args(x, tw, h),
        i32(x.shape[1] * es),
        i32(1 if tw is not None else 0),
        rt.epoch_ptr("disp"),
        *rt.ctl_args(),
    )
    _cuda.launch(
        fn("transport/nvshmem/dispatch.cu", name, DISPATCH_NAMES),
        _grid(h.num_tokens, rt),
        _THREADS,
        args,
        device=x.device,
    )


def _expand(
    h: CudaEPHandle,
    mode: int,
    qb: int,
    hid: int,
    out: torch.Tensor,
    w_out=None,
    y=None,
    w_in=None,
    dw=None,
) -> None:
    """Launch ep_expand<mode, qb>: the rows of the DISP use that :func:`_send` started (qb: its payload's scale block,
    0 for raw rows), into ``out`` ([expand_capacity, hid], its dtype; rows past the device count N zeroed); it ends
    that use."""
    rt = h.runtime
    name = f"ep_expand<{mode},{qb},{_DT[out.dtype]}>"
    fwd = mode != MODE_BWD
    args = (
        p(rt.peers),
        i32(rt.rank),
        i32(h.ep_size),
        i64(rt.region("disp_data")),
        i64(rt.region("disp_scale")),
        i64(rt.region("disp_meta")),
        p(h.info),
        i32(hid),
        i32(h.top_k),
        i32(h.num_local_experts),
        i32(h.recv_capacity),
        i32(h.expand_capacity),
        p(h.recv_pos),
        p(out),
        p(w_out),
        p(h.expand_row if fwd else None),
        p(h.expand_slot if fwd else None),
        p(y),
        p(w_in),
        p(dw),
        rt.epoch_ptr("disp"),
        *rt.ctl_args(),
    )
    grid = _grid(max(h.recv_capacity, h.expand_capacity), rt)
    _cuda.launch(fn("transport/nvshmem/dispatch.cu", name, DISPATCH_NAMES), grid, _THREADS, args, device=out.device)


def dispatch_fwd(
    x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle, recipe: Recipe | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], topk_w [T, K] -> (expanded rows [expand_capacity, H] x.dtype, weights [expand_capacity] fp32).

    Rows are the recipe's payload dequantized (MXFP8 1x32 or blockwise 1x128 blocks) or, for recipe None, x's rows,
    in the reference's expanded order; rows past the device count N are zero.
    """
    handle.runtime.raise_pending()
    r, qb = _payload(recipe)
    x = _check_rows(x, "x", recipe=r)
    # every allocation before the use starts: a failure between _send and _expand would leave this rank's epoch
    # behind its peers'
    out = torch.empty(handle.expand_capacity, x.shape[1], dtype=x.dtype, device=x.device)
    w_out = torch.empty(handle.expand_capacity, dtype=torch.float32, device=x.device)
    _send(x, topk_w, handle, qb)
    _expand(handle, MODE_VAL, qb, x.shape[1], out, w_out=w_out)
    return out, w_out


def dispatch_fwd_mxfp8(
    x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast path: x [T, H] -> (data [expand_capacity, H] e4m3, scales u8 in the per-group blocked layout
    ``[grouped_blocked_size(expand_capacity, L, H // 32, "m")]`` (== ``to_blocked_grouped(plain, group_sizes)``
    on its used tiles, zero elsewhere), weights [expand_capacity] fp32). Group sizes: ``handle.group_sizes``.
    """
    return _dispatch_fused(x, topk_w, handle, "mxfp8")


def dispatch_fwd_blockwise(
    x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blockwise recipe's fast path (the same kernel as :func:`dispatch_fwd_mxfp8`, 1x128 blocks): x [T, H]
    (H % 128 == 0) -> (data [expand_capacity, H] e4m3, scales [expand_capacity, H // 128] u8 row-major, as the
    blockwise GEMMs read them, weights [expand_capacity] fp32). Rows below the device count N are
    ``moe_ep.blockwise.reference.quantize_rowwise_torch`` of their token's row, byte for byte; past N the scale
    rows are zero and the data rows unspecified (the GEMMs read only ``group_sizes`` rows). Group sizes:
    ``handle.group_sizes``."""
    return _dispatch_fused(x, topk_w, handle, "blockwise")


def _dispatch_fused(x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle, recipe: Recipe | str):
    handle.runtime.raise_pending()
    r, qb = _payload(recipe)
    x = _check_rows(x, "x", recipe=r)
    if topk_w is None:
        raise ValueError("the fused dispatch needs topk_w: the receivers expand rows by the routing metadata")
    n, hid, lcl = handle.expand_capacity, x.shape[1], handle.num_local_experts
    data = torch.empty(n, hid, dtype=torch.float8_e4m3fn, device=x.device)
    if qb == 32:  # the blocked tiles' padding rows are read by the MXFP8 GEMMs: zero, not unspecified
        scale = torch.zeros(grouped_blocked_size(n, lcl, hid // 32, "m"), dtype=torch.uint8, device=x.device)
    else:  # every row written by the kernel: rows < N by the expansion, the rest zeroed
        scale = torch.empty(n, hid // qb, dtype=torch.uint8, device=x.device)
    w_out = torch.empty(n, dtype=torch.float32, device=x.device)
    _dispatch_mx(x, topk_w, handle, qb, data, scale, w_out)
    return data, scale, w_out


def dispatch_fwd_quantized(
    x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle, recipe: Recipe | str = "mxfp8"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The :class:`~moe_ep.transport.autograd.Transport` entry of the fused quantize + dispatch: the recipe's payload
    as its GEMMs read it (MXFP8: :func:`dispatch_fwd_mxfp8`; blockwise: :func:`dispatch_fwd_blockwise`); recipe: a
    :class:`~moe_ep.recipe.Recipe` or its name."""
    if payload_recipe(recipe) is None:
        raise ValueError("dispatch_fwd_quantized needs an FP8 recipe; the bf16 rows come from dispatch_fwd(..., None)")
    return _dispatch_fused(x, topk_w, handle, recipe)


def _dispatch_mx(
    x: torch.Tensor,
    topk_w: torch.Tensor,
    h: CudaEPHandle,
    qb: int,
    data: torch.Tensor,
    scale: torch.Tensor,
    w_out: torch.Tensor,
) -> None:
    """ep_dispatch_mx<IN, qb>: the send of ep_dispatch<IN, qb> and the expansion in one kernel (per-row flags), split
    by the runtime's schedule."""
    rt = h.runtime
    tw = _send_prep(x, topk_w, h, qb)
    args = (
        *_send_args(x, tw, h),
        i64(rt.region("disp_flag")),
        p(h.info),
        i32(h.recv_capacity),
        i32(h.expand_capacity),
        p(h.recv_pos),
        p(data),
        p(scale),
        p(w_out),
        p(h.expand_row),
        p(h.expand_slot),
        i32(rt.schedule.dispatch_send_warps),
        i32(rt.schedule.pieces("dispatch", x.shape[1])),
        rt.epoch_ptr("disp"),
        *rt.ctl_args(),
    )
    grid = _fused_grid(max(h.num_tokens, h.recv_capacity), rt)
    _cuda.launch(
        fn("transport/nvshmem/dispatch.cu", f"ep_dispatch_mx<{_DT[x.dtype]},{qb}>", DISPATCH_NAMES),
        grid,
        _THREADS,
        args,
        device=x.device,
    )


def combine_bwd(
    dy: torch.Tensor, y: torch.Tensor, w: torch.Tensor, handle: CudaEPHandle, recipe: Recipe | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch of dy [T, H] in the recipe's payload (MXFP8 1x32 / blockwise 1x128 blocks, quantized in the
    sender warp and dequantized on arrival; None: raw rows), y [expand_capacity, H], w [expand_capacity] -> (v * w
    [expand_capacity, H] y.dtype, dw = sum_h v * y [expand_capacity] fp32), v the received dy rows in y.dtype."""
    handle.runtime.raise_pending()
    r, qb = _payload(recipe)
    y = _check_rows(y, "y", None)
    dy = _check_rows(dy.to(y.dtype), "dy", y.shape[1], recipe=r)
    out = torch.empty_like(y)  # allocations before the use starts (see dispatch_fwd)
    dw = torch.empty(handle.expand_capacity, dtype=torch.float32, device=y.device)
    w_in = w.to(torch.float32).contiguous()
    _send(dy, None, handle, qb)
    _expand(handle, MODE_BWD, qb, y.shape[1], out, y=y, w_in=w_in, dw=dw)
    return out, dw


# ------------------------------------------------------------------------------------------------------ combine
def _combine(rows: torch.Tensor, wv: torch.Tensor, h: CudaEPHandle, bwd: bool):
    """ep_combine<YT, BWD> (one kernel, split by the runtime's schedule) -> (out [T, H], d topk_w [T, K] or None)."""
    rt = h.runtime
    _check_capacity(rt, rows.shape[1], rows.element_size(), h.top_k)
    if rows.shape[0] != h.expand_capacity or wv.shape != (h.expand_capacity,):
        raise ValueError(
            f"combine expects [{h.expand_capacity}, H] rows and [{h.expand_capacity}] weights, got "
            f"{tuple(rows.shape)} and {tuple(wv.shape)}"
        )
    wv = wv.to(torch.float32).contiguous()
    yt, b = _DT[rows.dtype], int(bwd)
    hid = rows.shape[1]
    out = torch.empty(h.num_tokens, hid, dtype=rows.dtype, device=rows.device)
    dtw = torch.empty(h.num_tokens, h.top_k, dtype=torch.float32, device=rows.device) if bwd else None
    args = (
        p(rows),
        p(wv),
        p(h.recv_pos),
        p(h.info),
        i32(h.recv_capacity),
        p(out),
        p(dtw),
        p(h.send_row_of),
        p(h.tok_dst),
        p(h.topk_idx),
        i32(h.num_tokens),
        i32(hid),
        i32(h.top_k),
        i32(h.num_local_experts),
        i32(h.ep_size),
        i32(rt.rank),
        p(rt.peers),
        i64(rt.region("comb_data")),
        i64(rt.region("comb_meta")),
        i64(rt.region("comb_flag")),
        i32(rt.schedule.combine_send_warps),
        i32(rt.schedule.pieces("combine", hid)),
        rt.epoch_ptr("comb"),
        *rt.ctl_args(),
    )
    grid = _fused_grid(max(h.recv_capacity, h.num_tokens), rt)
    _cuda.launch(
        fn("transport/nvshmem/combine.cu", f"ep_combine<{yt},{b}>", COMBINE_NAMES),
        grid,
        _THREADS,
        args,
        device=rows.device,
    )
    return out, dtw


def combine_fwd(y: torch.Tensor, w: torch.Tensor, handle: CudaEPHandle) -> torch.Tensor:
    """y [expand_capacity, H] expert outputs, w [expand_capacity] fp32 -> [T, H] y.dtype (fp32 sums)."""
    handle.runtime.raise_pending()
    out, _ = _combine(_check_rows(y, "y"), w, handle, False)
    return out


def dispatch_bwd(
    grad_rows: torch.Tensor, grad_w: torch.Tensor, handle: CudaEPHandle, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine of dx: grad_rows [expand_capacity, H], grad_w [expand_capacity] -> (dx [T, H] dtype, d topk_w
    [T, K] fp32)."""
    handle.runtime.raise_pending()
    return _combine(_check_rows(grad_rows.to(dtype), "grad_rows"), grad_w, handle, True)


class Buffer:
    """The NVSHMEM transport of one EP group as one object (DeepEP's ``Buffer``): the runtime that owns the symmetric
    memory, the flags and the epochs (:class:`~.runtime.EPRuntime`), and the passes over it.

    ``Buffer.for_group(group, max_tokens_per_rank, hidden, top_k, num_experts)`` creates or grows the group's runtime
    (collective; one per (group, device) per process, since the NVSHMEM heap is per process) and wraps it.

    Example::

        buf = Buffer.for_group(group, 4096, 7168, 8, 256)
        handle = buf.layout(topk_idx, 256, capacity=None)
        xq, xs, w = buf.dispatch(x, topk_w, handle)          # fused MXFP8 quantize + dispatch
        y = buf.combine(expert_out, w, handle)
    """

    def __init__(self, runtime: EPRuntime) -> None:
        self.runtime = runtime

    @classmethod
    def for_group(cls, group, max_tokens_per_rank: int, hidden: int, top_k: int, num_experts: int, **kw) -> Buffer:
        return cls(init_runtime(group, max_tokens_per_rank, hidden, top_k, num_experts, **kw))

    def layout(self, topk_idx: torch.Tensor, num_experts: int, **options) -> CudaEPHandle:
        """topk_idx [T, K] -> the routing layout (:func:`~.layout.build_layout`: ``capacity`` / ``expand_capacity``)."""
        return build_layout(topk_idx, num_experts, self.runtime.group, runtime=self.runtime, **options)

    def dispatch(
        self, x: torch.Tensor, topk_w: torch.Tensor, handle: CudaEPHandle, recipe: Recipe | str | None = "mxfp8"
    ):
        """x [T, H] -> the quantized payload (:func:`dispatch_fwd_quantized`), or with ``recipe=None`` the
        expert-sorted bf16 rows and row weights (:func:`dispatch_fwd`)."""
        if payload_recipe(recipe) is None:
            return dispatch_fwd(x, topk_w, handle, None)
        return dispatch_fwd_quantized(x, topk_w, handle, recipe)

    def combine(self, y: torch.Tensor, w: torch.Tensor, handle: CudaEPHandle) -> torch.Tensor:
        return combine_fwd(y, w, handle)

    def combine_backward(self, dy, y, w, handle: CudaEPHandle, recipe: Recipe | str | None = "mxfp8"):
        return combine_bwd(dy, y, w, handle, recipe)

    def dispatch_backward(self, grad_rows, grad_w, handle: CudaEPHandle, dtype: torch.dtype):
        return dispatch_bwd(grad_rows, grad_w, handle, dtype)


def layer_layout(topk_idx: torch.Tensor, cfg, group, num_tokens: int) -> CudaEPHandle:
    """The layout of one MoE layer call (cfg: :class:`moe_ep.config.MoEConfig`): the group's buffer sized from the
    config, then the expanded buffers: the capacity mode's fixed rows; dropless rows known on the host
    (``cfg.dropless_rows``: ep_size 1, exact; ``dropless_sizing="worst_case"``, the most a rank can receive), with
    the group sizes on the device and no host read; else (``"exact"`` at ep_size > 1) sized exactly by reading the
    row count (NOTE: host sync in fit_to_count, the one of the layer)."""
    buf = Buffer.for_group(group, cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k, cfg.num_experts)
    cap = cfg.capacity_rows(num_tokens)
    if cap is not None:
        return buf.layout(topk_idx, cfg.num_experts, capacity=cap)
    rows = cfg.dropless_rows(num_tokens, buf.runtime.ep_size)
    if rows is not None:
        return buf.layout(topk_idx, cfg.num_experts, expand_capacity=rows)
    return fit_to_count(buf.layout(topk_idx, cfg.num_experts))  # NOTE: host sync (dropless_sizing="exact")


class CudaTransport:
    """The NVSHMEM transport as a :class:`~.autograd.Transport` (handles are :class:`CudaEPHandle`); use it through
    ``moe_ep.transport.dispatch(..., transport=CUDA, expand_capacity=...)`` / ``combine(..., transport=CUDA)``."""

    build_layout = staticmethod(build_layout)
    layer_layout = staticmethod(layer_layout)
    dispatch_fwd = staticmethod(dispatch_fwd)
    dispatch_fwd_quantized = staticmethod(dispatch_fwd_quantized)
    dispatch_bwd = staticmethod(dispatch_bwd)
    combine_fwd = staticmethod(combine_fwd)
    combine_bwd = staticmethod(combine_bwd)


CUDA = CudaTransport()
