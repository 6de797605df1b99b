"""Routing layout of the CUDA transport (kernels/transport/nvshmem/layout.cu): the device-resident
:class:`CudaEPHandle` and :func:`build_layout`. See :mod:`moe_ep.transport.nvshmem.buffer` for the
contracts; everything here stays on the GPU (no host sync except the handle's documented host helpers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ... import _cuda
from .kernels import fn, i32, i64, p
from .runtime import EPRuntime, get_runtime

_LAYOUT_FILE = "transport/nvshmem/layout.cu"
_LAYOUT_WARPS = _cuda.kernel_constant(_LAYOUT_FILE, "LAYOUT_WARPS")  # warps per CTA of the layout kernels
_LAYOUT_TOKENS_PER_CTA = 128
# info[] slots (kernels/transport/nvshmem/ep_sync.cuh, read from the source)
_I_R, _I_N, _I_GSTART = (_cuda.kernel_constant(_LAYOUT_FILE, k) for k in ("I_R", "I_N", "I_GSTART"))


def _i_dropped(num_local: int) -> int:
    """info[] slot of the dropped-row count: the formula of I_DROPPED(L) in kernels/transport/nvshmem/ep_sync.cuh
    (after the group starts [L+1] and the tile offsets [L+1])."""
    return _I_GSTART + 2 * num_local + 2


@dataclass
class CudaEPHandle:
    """Device-resident layout (the CUDA counterpart of :class:`moe_ep.transport.handle.EPHandle`).

    Source side: topk_idx [T, K] int32; tok_dst [T, W] int32 row in rank r's receive buffer (-1: not sent);
      send_row_of [T, W] int32 (the reference's sent-row order, -1: none); slot_pos [T, K] int32 expanded row of
      each slot at its rank (-1: invalid id, or past this rank's expand_capacity when dropless; unclamped in drop
      mode, where ranks' capacities differ and each receiver drops the rows past its own).
    Both: counts [W, W + E] int32, row s = rank s's [rows per dest rank | (token, slot) pairs per global expert].
    Receiver: info int32 (R at [0], N at [1], recv_off at [2:2+W+1], group starts at [36:36+L+1], tile offsets
      [L+1] after them, then the dropped count); group_sizes [L] int32; recv_pos [recv_capacity, K] int32 expanded
      row of each received slot (-1: none or dropped), expand_row / expand_slot [expand_capacity] int32 (filled by
      the forward dispatch; -1 past N).
    Capacity: the receiver keeps the expanded rows < expand_capacity (N = min(total, expand_capacity)); group
      sizes, group starts and tile offsets count the kept rows only. ``capacity`` is that bound in drop mode
      (``build_layout(capacity=)``), None when dropless (rows past expand_capacity are an overflow error).
    """

    num_tokens: int
    top_k: int
    ep_size: int
    num_local_experts: int
    num_experts: int
    recv_capacity: int
    expand_capacity: int
    topk_idx: torch.Tensor
    tok_dst: torch.Tensor
    send_row_of: torch.Tensor
    slot_pos: torch.Tensor
    counts: torch.Tensor
    info: torch.Tensor
    group_sizes: torch.Tensor
    recv_pos: torch.Tensor
    expand_row: torch.Tensor
    expand_slot: torch.Tensor
    runtime: EPRuntime
    group: object = None
    capacity: int | None = None

    @property
    def num_dropped(self) -> torch.Tensor:
        """Expanded slots routed to this rank's experts past its capacity: a 0-dim int32 CUDA tensor (a view of
        ``info``, written by the layout kernel; no host sync until it is read). 0 when nothing overflowed;
        in dropless mode a nonzero count comes with the overflow error."""
        return self.info[_i_dropped(self.num_local_experts)]

    @property
    def num_expanded(self) -> int:
        """Rows of every expanded tensor (the capacity, not the device count N)."""
        return self.expand_capacity

    @property
    def num_recv(self) -> int:
        return self.recv_capacity

    @property
    def topk_rank(self) -> torch.Tensor:
        return (self.topk_idx // self.num_local_experts).long()

    @property
    def send_splits(self) -> list[int]:  # NOTE: host sync (the reference handle's field; here a device read)
        return self.host_counts()["send_splits"]

    @property
    def recv_splits(self) -> list[int]:  # NOTE: host sync
        return self.host_counts()["recv_splits"]

    @property
    def group_sizes_host(self) -> list[int]:  # NOTE: host sync
        return self.host_counts()["group_sizes"]


def _check_capacity(rt: EPRuntime, h: int, elem: int, top_k: int, num_tokens: int | None = None) -> None:
    cfg = rt.cfg
    if h > cfg.hidden:
        raise ValueError(f"hidden {h} exceeds the runtime's hidden {cfg.hidden} (init_runtime with the larger size)")
    if h * elem > cfg.hidden * max(2, cfg.wire_bytes):
        raise ValueError(f"{elem}-byte payload rows need init_runtime(..., wire_bytes={elem})")
    if top_k > cfg.top_k:
        raise ValueError(f"top_k {top_k} exceeds the runtime's top_k {cfg.top_k}")
    if num_tokens is not None and num_tokens > cfg.max_tokens_per_rank:
        raise ValueError(
            f"{num_tokens} tokens exceed max_tokens_per_rank={cfg.max_tokens_per_rank} (it sizes the "
            "receive buffers); raise it in init_runtime / MoEConfig"
        )


def build_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    group=None,
    *,
    expand_capacity: int | None = None,
    capacity: int | None = None,
    runtime: EPRuntime | None = None,
) -> CudaEPHandle:
    """Routing layout on the GPU: topk_idx [T, K] int32/int64 global expert ids -> :class:`CudaEPHandle`.

    expand_capacity: rows of this rank's expanded tensors (None: ``ep_size * max_tokens_per_rank * min(top_k,
    num_local_experts)``, the true worst case). Dropless: more expanded rows than that is an overflow error
    (EPTransportError from the next transport call); the rows past it are never written, and group sizes / tile
    offsets / N are clamped to it all the same.
    capacity: drop mode, the reference's ``build_layout(capacity=)``: this rank keeps at most ``capacity`` expanded
    rows (the buffers have exactly that many rows; ``expand_capacity`` must be None or equal). The slots past it
    in the expert-major order (local expert, source rank, token, slot) are dropped without an error: no expanded
    row, zero contribution to combine, zero gradient (dx and d topk_w); ``handle.num_dropped`` counts them on the
    device. Ranks may pass different capacities (each sizes only its own buffers). ``capacity=0`` gives expanded
    tensors of zero rows (every slot routed here is dropped).
    Invalid ids are reported (ValueError) by the next transport call / ``runtime.check_errors()``; their slots
    are dropped meanwhile. Collective over the EP group (every rank calls it, in the same order as the others).
    No host sync (CUDA-graph capturable).
    """
    rt = runtime or get_runtime(group)
    rt.raise_pending()
    if capacity is not None:
        # the reference's check (expand_layout), so both transports accept the same values
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int or None, got {capacity!r}")
        if expand_capacity is not None and expand_capacity != capacity:
            raise ValueError(
                f"capacity={capacity} sizes the expanded buffers itself; expand_capacity must be None or equal, "
                f"got {expand_capacity!r}"
            )
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [num_tokens, top_k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32/int64, got {topk_idx.dtype}")
    if topk_idx.device != rt.device:
        raise ValueError(f"topk_idx must be on {rt.device}, got {topk_idx.device}")
    w, me = rt.ep_size, rt.rank
    if num_experts % w:
        raise ValueError(f"num_experts {num_experts} is not divisible by the EP size {w}")
    if num_experts > rt.cfg.num_experts:
        raise ValueError(f"num_experts {num_experts} exceeds the runtime's {rt.cfg.num_experts}")
    t, k = topk_idx.shape
    _check_capacity(rt, 32, 1, k, t)
    lcl = num_experts // w
    recv_cap = w * rt.cfg.max_tokens_per_rank
    if capacity is not None:
        ncap = capacity
    elif expand_capacity is not None:
        ncap = int(expand_capacity)
    else:
        ncap = recv_cap * min(k, lcl)
    if not 0 <= ncap < 2**31:  # an int32 kernel argument
        raise ValueError(f"expand capacity must be in [0, 2**31), got {ncap}")
    dev = rt.device
    idx = topk_idx.to(torch.int32).contiguous()
    tok_dst = torch.empty(t, w, dtype=torch.int32, device=dev)
    send_row_of = torch.empty(t, w, dtype=torch.int32, device=dev)
    slot_pos = torch.empty(t, k, dtype=torch.int32, device=dev)
    counts = torch.empty(w, w + num_experts, dtype=torch.int32, device=dev)
    info = torch.zeros(_i_dropped(lcl) + 1, dtype=torch.int32, device=dev)
    group_sizes = torch.empty(lcl, dtype=torch.int32, device=dev)
    # both kernels use the same grid (the token split decides the deterministic order); part: per-CTA counts
    nb = max(1, min(-(-t // _LAYOUT_TOKENS_PER_CTA), rt.num_sms))
    rw = w + num_experts
    part = torch.empty(nb * rw, dtype=torch.int32, device=dev)
    head = (
        p(idx),
        i32(t),
        i32(k),
        i32(num_experts),
        i32(w),
        i32(me),
        p(rt.peers),
        i64(rt.region("counts")),
        rt.epoch_ptr("layout"),
    )
    _cuda.launch(
        fn("transport/nvshmem/layout.cu", "ep_layout_count"),
        nb,
        _LAYOUT_WARPS * 32,
        (*head, p(part), *rt.ctl_args()),
        shared_mem=(_LAYOUT_WARPS * num_experts + rw) * 4,
        device=dev,
    )
    args = (
        *head,
        i32(recv_cap),
        i32(ncap),
        i32(1 if capacity is not None else 0),  # drop: no overflow error, senders leave slot_pos unclamped
        p(part),
        p(tok_dst),
        p(send_row_of),
        p(slot_pos),
        p(counts),
        p(info),
        p(group_sizes),
        *rt.ctl_args(),
    )
    _cuda.launch(
        fn("transport/nvshmem/layout.cu", "ep_layout_place"),
        nb,
        _LAYOUT_WARPS * 32,
        args,
        shared_mem=(_LAYOUT_WARPS + 2) * num_experts * 4,
        device=dev,
    )
    return CudaEPHandle(
        num_tokens=t,
        top_k=k,
        ep_size=w,
        num_local_experts=lcl,
        num_experts=num_experts,
        recv_capacity=recv_cap,
        expand_capacity=ncap,
        topk_idx=idx,
        tok_dst=tok_dst,
        send_row_of=send_row_of,
        slot_pos=slot_pos,
        counts=counts,
        info=info,
        group_sizes=group_sizes,
        recv_pos=torch.empty(recv_cap, k, dtype=torch.int32, device=dev),
        expand_row=torch.empty(ncap, dtype=torch.int32, device=dev),
        expand_slot=torch.empty(ncap, dtype=torch.int32, device=dev),
        runtime=rt,
        group=group,
        capacity=capacity,
    )


def fit_to_count(handle: CudaEPHandle) -> CudaEPHandle:
    """A dropless handle whose expanded tensors get exactly the N rows routed to this rank (at least 1), instead of
    the worst case its layout was built for: the activations of a layer are [N, H] / [N, 2F] per tensor, while the
    layout's own per-row arrays (int32) are small enough to stay worst-case. Safe only without ``capacity``: the
    layout placed every slot below N, so the smaller bound drops nothing (with a capacity the bound is the drop
    rule itself). Raises the layout's pending errors (invalid ids, receive overflow), known once N is read.
    """
    if handle.capacity is not None:
        raise ValueError("fit_to_count is for dropless handles; a capacity already sizes the expanded tensors")
    n = int(handle.info[_I_N].item())  # NOTE: host sync (dropless mode only; a capacity avoids it)
    handle.runtime.raise_pending()
    return replace(handle, expand_capacity=max(n, 1))
