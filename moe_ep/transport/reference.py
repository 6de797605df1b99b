"""Reference dispatch/combine over ``torch.distributed.all_to_all_single`` (gloo on CPU, nccl on GPU).

This is the specification the NVSHMEM transport is tested against: the same rows, bytes and order.
Each token is sent once per destination rank (not once per expert) with its (local expert, weight) pairs;
the receiver expands rows into expert-sorted order. Reductions run in a fixed order (top-k slot order on the
expert side, rank order on the source side), so results are bitwise deterministic.

The reference needs split sizes on the host for ``all_to_all_single``; those reads are marked
``# NOTE: host sync`` (the CUDA transport keeps them on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import mxfp8
from ..mxfp8.reference import dequantize_blocks_torch, quantize_blocks_torch
from ..recipe import Recipe, get_recipe
from .handle import EPHandle


def _all_to_all(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """All-to-all of the rows of ``t`` ([S, ...] any dtype) -> [sum(recv_splits), ...] same dtype.

    Sent as raw bytes, so dtypes gloo lacks (fp8, int16) travel unchanged.
    """
    if group is None or dist.get_world_size(group) == 1:
        return t.clone()
    tail = t.shape[1:]
    width = t.element_size()
    for s in tail:
        width *= s
    raw = t.contiguous().view(torch.uint8).reshape(t.shape[0], width)
    out = torch.empty(sum(recv_splits), width, dtype=torch.uint8, device=t.device)
    dist.all_to_all_single(out, raw, recv_splits, send_splits, group=group)
    return out.view(t.dtype).reshape(-1, *tail)


def build_layout(topk_idx: torch.Tensor, num_experts: int, group=None, capacity: int | None = None) -> EPHandle:
    """Routing layout: which rows go where, and the expert-sorted expansion on the receiver.

    topk_idx: [T, top_k] int (global expert ids, distinct per token) -> EPHandle.
    capacity: the most expanded rows this rank keeps (None: dropless). The slots past it in the expanded order
    (local expert, then source rank, then source token) are dropped: they are not expanded, so they contribute zero
    to the output and get zero gradient; ``handle.num_dropped`` counts them.

    Example (ep_size 2, 2 local experts each, T=2, top_k=2): topk_idx [[0, 3], [1, 0]] ->
    token 0 goes to ranks 0 and 1, token 1 to rank 0 only; send_token [0, 1, 0], send_splits [2, 1];
    rank 0 receives rows (t0: slots e0), (t1: e1, e0) and expands them to experts [0, 0, 1] = rows [0, 1, 1].
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [num_tokens, top_k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32/int64, got {topk_idx.dtype}")
    ep_size = dist.get_world_size(group) if group is not None else 1
    if num_experts % ep_size:
        raise ValueError(f"num_experts {num_experts} is not divisible by the EP size {ep_size}")
    num_local = num_experts // ep_size
    num_tokens, top_k = topk_idx.shape
    device = topk_idx.device
    idx = topk_idx.to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_experts):  # NOTE: host sync (reference)
        raise ValueError(f"expert index out of range [0, {num_experts}): min {int(idx.min())}, max {int(idx.max())}")

    topk_rank = idx // num_local
    goes = torch.zeros(num_tokens, ep_size, dtype=torch.bool, device=device)
    goes.scatter_(1, topk_rank, True)
    rank_of_row, token_of_row = goes.t().nonzero(as_tuple=True)  # sorted by (rank, token)
    send_row_of = torch.full((num_tokens, ep_size), -1, dtype=torch.int64, device=device)
    send_row_of[token_of_row, rank_of_row] = torch.arange(token_of_row.numel(), device=device)
    send_counts = goes.sum(0)
    recv_counts = _all_to_all(send_counts, [1] * ep_size, [1] * ep_size, group) if ep_size > 1 else send_counts
    send_splits = send_counts.tolist()  # NOTE: host sync (reference transport needs host splits)
    recv_splits = recv_counts.tolist()  # NOTE: host sync

    # (local expert | -1) of each slot, for each sent row; it travels with the row.
    local = torch.where(topk_rank[token_of_row] == rank_of_row[:, None], idx[token_of_row] % num_local, -1)
    recv_local = _all_to_all(local, send_splits, recv_splits, group)
    expand_row, expand_slot, group_sizes, num_dropped = expand_layout(recv_local, num_local, capacity)
    return EPHandle(
        num_tokens=num_tokens,
        top_k=top_k,
        ep_size=ep_size,
        num_local_experts=num_local,
        send_token=token_of_row,
        send_row_of=send_row_of,
        topk_rank=topk_rank,
        send_splits=send_splits,
        recv_splits=recv_splits,
        send_local=local,
        recv_local=recv_local,
        expand_row=expand_row,
        expand_slot=expand_slot,
        group_sizes=group_sizes.to(torch.int32),
        group_sizes_host=group_sizes.tolist(),  # NOTE: host sync (reference expert loop)
        group=group,
        num_dropped=num_dropped,
    )


def expand_layout(
    recv_local: torch.Tensor, num_local: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Expert-sorted expansion of received rows, the first ``capacity`` kept (None: all).

    recv_local: [R, top_k] int64 local expert per slot (-1: not for this rank) ->
    (expand_row [N] int64, expand_slot [N] int64, group_sizes [num_local] int64, dropped slots: int).

    Example: recv_local [[1, -1], [0, 1]] -> rows [1, 0, 1], slots [0, 0, 1], group_sizes [1, 2], 0 dropped;
    with capacity 2 -> rows [1, 0], slots [0, 0], group_sizes [1, 1], 1 dropped (row 1's slot 1, the last).
    """
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be a non-negative int or None, got {capacity!r}")
    rows, top_k = recv_local.shape
    flat = recv_local.reshape(-1)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]
    # position in (row, slot) order breaks ties, so the sort is unique and deterministic
    key = flat[valid] * (rows * top_k) + valid
    order = torch.argsort(key)
    pos = valid[order]
    dropped = 0
    if capacity is not None and pos.numel() > capacity:
        dropped = pos.numel() - capacity
        pos = pos[:capacity]
    group_sizes = torch.bincount(flat[pos], minlength=num_local)
    return pos // top_k, pos % top_k, group_sizes, dropped


@dataclass
class RecvBuffers:
    """What a rank receives in dispatch, before expansion (the transport contract, byte for byte).

    data:  [R, H] e4m3 (quantized) or the input dtype;  scale: [R, H // block] uint8 row-major (block: the
    recipe's act_block, MXFP8 32, blockwise 128) or None;
    local: [R, top_k] int64 local expert per slot (-1 none); weight: [R, top_k] fp32 (0 where local is -1).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    local: torch.Tensor
    weight: torch.Tensor


def payload_recipe(recipe: Recipe | str | None) -> Recipe | None:
    """The recipe of a dispatch payload, as every transport pass takes it: a :class:`moe_ep.recipe.Recipe`, its name
    ("mxfp8", "blockwise"), or None / "bf16" (raw rows) -> the table row or None. The payload is the recipe's
    "dispatch" operand: 1 x ``act_block`` blocks along the hidden axis (MXFP8 32, blockwise 128), E4M3 elements and
    E8M0 scales (RCEIL). A bool is refused (TypeError): only the public :func:`moe_ep.transport.dispatch` /
    ``combine`` keep ``quantize=True / False`` and translate it."""
    if isinstance(recipe, bool):
        raise TypeError(
            f"the transport passes take a recipe (a moe_ep.recipe.Recipe, 'mxfp8', 'blockwise') or None, got {recipe}"
        )
    if recipe is not None and not isinstance(recipe, (Recipe, str)):
        raise TypeError(f"recipe must be a moe_ep.recipe.Recipe, a recipe name or None, got {type(recipe).__name__}")
    return get_recipe(recipe)


def check_payload_hidden(hidden: int, recipe: Recipe | None, what: str = "x") -> None:
    """Clear error for a hidden size the payload's scale blocks do not tile (blockwise needs hidden % 128 == 0)."""
    if recipe is not None and hidden % recipe.act_block:
        raise ValueError(
            f"{what}: hidden ({hidden}) must be a multiple of {recipe.act_block} for the {recipe.name} payload "
            f"(1x{recipe.act_block} scale blocks)"
        )


def send_rows(
    x: torch.Tensor, handle: EPHandle, recipe: Recipe | str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize each token once (1 x ``recipe.act_block`` blocks) and send it once per destination rank.

    x: [T, H] bf16/fp32, recipe: see :func:`payload_recipe` -> (data [R, H] e4m3 or x.dtype, scale [R, H // block]
    uint8 or None) on the receiver.
    """
    grp, ss, rs, tok = handle.group, handle.send_splits, handle.recv_splits, handle.send_token
    r = payload_recipe(recipe)
    if r is None:
        return _all_to_all(x[tok], ss, rs, grp), None
    check_payload_hidden(x.shape[1], r)
    if r.act_block == mxfp8.BLOCK:
        q = mxfp8.quantize(x, axis=-1)
        data, scale = q.data, q.scale
    else:
        data, scale = quantize_blocks_torch(x, (1, r.act_block))
    return _all_to_all(data[tok], ss, rs, grp), _all_to_all(scale[tok], ss, rs, grp)


def dispatch_send(x: torch.Tensor, topk_w: torch.Tensor, handle: EPHandle, recipe: Recipe | str | None) -> RecvBuffers:
    """Rows plus their top-k weights: x [T, H], topk_w [T, top_k] fp32 -> RecvBuffers on the receiver.

    The (local expert) ids already travelled in :func:`build_layout`, which needed them to size the expansion.
    """
    data, scale = send_rows(x, handle, recipe)
    weight = torch.where(handle.send_local >= 0, topk_w[handle.send_token].to(torch.float32), 0.0)
    recv_w = _all_to_all(weight, handle.send_splits, handle.recv_splits, handle.group)
    return RecvBuffers(data, scale, handle.recv_local, recv_w)


def slot_reduce(vals: torch.Tensor, handle: EPHandle, num_rows: int) -> torch.Tensor:
    """Sum expanded rows into their received row in top-k slot order (deterministic), in fp32.

    vals: [N, H] float -> [num_rows, H] fp32.
    """
    out = torch.zeros(num_rows, vals.shape[1], dtype=torch.float32, device=vals.device)
    for j in range(handle.top_k):
        sel = (handle.expand_slot == j).nonzero(as_tuple=True)[0]
        out[handle.expand_row[sel]] += vals[sel].to(torch.float32)  # rows are unique within one slot
    return out


def rank_reduce(rows: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """Sum the rows returned by each rank into their source token, in rank order, in fp32.

    rows: [S, H] float (sent-row order) -> [T, H] fp32.
    """
    out = torch.zeros(handle.num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    for r in range(handle.ep_size):
        row = handle.send_row_of[:, r]
        has = (row >= 0).nonzero(as_tuple=True)[0]
        out[has] += rows[row[has]].to(torch.float32)
    return out


# ---------------------------------------------------------------------------------------------- the four passes


def _rows(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Received payload -> values: [R, H] e4m3 + [R, H // block] scales (or plain rows) -> [R, H] dtype."""
    if scale is None:
        return data
    if data.shape[1] == scale.shape[1] * mxfp8.BLOCK:
        return mxfp8.dequantize(mxfp8.MXFP8Tensor(data, scale, 1), dtype)
    return dequantize_blocks_torch(data, scale, (1, data.shape[1] // scale.shape[1])).to(dtype)


def dispatch_fwd(
    x: torch.Tensor, topk_w: torch.Tensor, handle: EPHandle, recipe: Recipe | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H], topk_w: [T, top_k] fp32 -> (expanded x [N, H] x.dtype: the recipe's payload dequantized, or the
    raw rows for None; expanded weights [N] fp32)."""
    recv: RecvBuffers = dispatch_send(x, topk_w, handle, recipe)
    rows = _rows(recv.data, recv.scale, x.dtype)
    return rows[handle.expand_row], recv.weight[handle.expand_row, handle.expand_slot]


def dispatch_bwd(
    grad_rows: torch.Tensor, grad_w: torch.Tensor, handle: EPHandle, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine of dx: grad_rows [N, H], grad_w [N] fp32 -> (dx [T, H] dtype, d topk_w [T, top_k] fp32)."""
    grp, ss, rs = handle.group, handle.send_splits, handle.recv_splits
    per_row = slot_reduce(grad_rows, handle, handle.num_recv).to(dtype)  # the wire carries `dtype`
    dx = rank_reduce(_all_to_all(per_row, rs, ss, grp), handle).to(dtype)
    gw = torch.zeros(handle.num_recv, handle.top_k, dtype=torch.float32, device=grad_w.device)
    gw[handle.expand_row, handle.expand_slot] = grad_w.to(torch.float32)
    gw_src = _all_to_all(gw, rs, ss, grp)  # [S, top_k]
    row_of_slot = handle.send_row_of.gather(1, handle.topk_rank)  # [T, top_k]: each slot's sent row
    slots = torch.arange(handle.top_k, device=gw_src.device).expand_as(row_of_slot)
    return dx, gw_src[row_of_slot, slots]


def combine_fwd(y: torch.Tensor, w: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """y: [N, H] expert outputs, w: [N] fp32 -> [T, H] y.dtype (fp32 sums, y.dtype on the wire)."""
    if y.dim() != 2 or y.shape[0] != handle.num_expanded or w.shape != (handle.num_expanded,):
        raise ValueError(
            f"combine expects y [{handle.num_expanded}, H] and w [{handle.num_expanded}], "
            f"got {tuple(y.shape)} and {tuple(w.shape)}"
        )
    per_row = slot_reduce(y.to(torch.float32) * w[:, None], handle, handle.num_recv).to(y.dtype)
    back = _all_to_all(per_row, handle.recv_splits, handle.send_splits, handle.group)
    return rank_reduce(back, handle).to(y.dtype)


def combine_bwd(
    dy: torch.Tensor, y: torch.Tensor, w: torch.Tensor, handle: EPHandle, recipe: Recipe | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch of dy in the recipe's payload (None: raw rows): dy [T, H], y [N, H], w [N] fp32 -> (d y = v * w
    [N, H] y.dtype, d w = sum_h v * y [N] fp32), v the received dy rows dequantized to dy.dtype."""
    data, scale = send_rows(dy.contiguous(), handle, recipe)
    dy_rows = _rows(data, scale, dy.dtype)[handle.expand_row].to(torch.float32)
    return (dy_rows * w[:, None]).to(y.dtype), (dy_rows * y.to(torch.float32)).sum(-1)


def dispatch_fwd_quantized(
    x: torch.Tensor, topk_w: torch.Tensor, handle: EPHandle, recipe: Recipe | str = "mxfp8"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized payload as the expert GEMMs read it: x [T, H] -> (data [N, H] e4m3 expert-sorted, scales in the
    recipe's dispatch layout, row weights [N] fp32). MXFP8: ``to_blocked_grouped`` of the rows' [N, H/32] scales along
    the groups (the layout :func:`moe_ep.transport.nvshmem.buffer.dispatch_fwd_mxfp8` writes); blockwise: the plain
    row-major [N, H/128] scales (:func:`moe_ep.transport.nvshmem.buffer.dispatch_fwd_blockwise`). recipe: a
    :class:`~moe_ep.recipe.Recipe` or its name. Host-synced splits, as every pass of this transport."""
    r = payload_recipe(recipe)
    if r is None:
        raise ValueError("dispatch_fwd_quantized needs an FP8 recipe; the bf16 rows come from dispatch_fwd(..., None)")
    recv: RecvBuffers = dispatch_send(x, topk_w, handle, r)
    scale = recv.scale[handle.expand_row]
    if r.act_block == mxfp8.BLOCK:  # the MXFP8 GEMMs read per-group blocked scales; blockwise reads them row-major
        scale = mxfp8.to_blocked_grouped(scale, handle.group_sizes, "m")
    return recv.data[handle.expand_row], scale, recv.weight[handle.expand_row, handle.expand_slot]


def layer_layout(topk_idx: torch.Tensor, cfg, group, num_tokens: int) -> EPHandle:
    """The layout of one MoE layer call (cfg: :class:`moe_ep.config.MoEConfig`)."""
    return build_layout(topk_idx, cfg.num_experts, group, capacity=cfg.capacity_rows(num_tokens))


class ReferenceTransport:
    """The reference transport (``torch.distributed.all_to_all_single``) as a :class:`~.autograd.Transport`."""

    build_layout = staticmethod(build_layout)
    layer_layout = staticmethod(layer_layout)
    dispatch_fwd = staticmethod(dispatch_fwd)
    dispatch_fwd_quantized = staticmethod(dispatch_fwd_quantized)
    dispatch_bwd = staticmethod(dispatch_bwd)
    combine_fwd = staticmethod(combine_fwd)
    combine_bwd = staticmethod(combine_bwd)


REFERENCE = ReferenceTransport()
