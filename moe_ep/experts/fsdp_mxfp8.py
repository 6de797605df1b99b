"""FSDP2 all-gather of expert weights in MXFP8: each rank quantizes its shard once per weight version and the
all-gather moves the e4m3 bytes and their scales (FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

Per expert weight W [L, N, K] of one EP rank, sharded by FSDP2 on dim 0 (whole experts) over the "dp" ranks:

  pre-all-gather   (each rank, its shard [L/dp, N, K] in the master dtype)
                   W along K (the fprop operand's bytes) and W^T along N (the dgrad operand's), from one read of the
                   shard (``operands.quantize_weight_mxfp8``); kept until the shard changes (its version counter
                   moves at the optimizer step), so a re-gather for the backward or the next micro-batch reuses it
  all-gather       those four byte buffers: 2 + 1/16 bytes per element (two e4m3 copies and their E8M0 scales),
                   against 2 for bf16. The wire carries about what bf16 does: the dgrad copy is a second
                   quantization, which per-32 scaling along the other axis cannot derive from the first
  post-all-gather  an :class:`MXFP8ExpertWeight` [L, N, K] over FSDP's gathered buffers (no copy)
  layer            forward: the fprop operand dequantized from its bytes (``prepare_weight_bf16``: 3 bytes of HBM
                   per element); backward: the dgrad operand likewise. The bf16 gather instead prepares both
                   operands from the bf16 weight in the forward and again in the backward (6 bytes per element each)

The quantization reads the master weight (fp32 in mixed-precision training), not its bf16 cast: one rounding,
where the bf16 gather rounds to bf16 and then to e4m3. So the two gathers train alike but not bitwise alike.
Memory: the shard's quantized copy (about 2.06 bytes per shard element) lives from the first gather after a step to
the next step.

Shortcuts: the experts of an EP rank must split evenly over "dp" (FSDP pads uneven shards, and a padded expert
has no per-expert scale layout); the gathered weight supports only what the MoE layer does with it (shape
queries, autograd bookkeeping, ``operands``, ``fake_quantize``); any other op raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import mxfp8
from .sm90.operands import WeightOperands, prepare_weight_bf16, quantize_weight_mxfp8

aten = torch.ops.aten

# Ops FSDP2 applies to a parameter while sharding it and padding its shard (chunk, new_zeros, narrow, copy_,
# view, as_strided) and the optimizer's and nn.Module's bookkeeping (detach, alias, clone, moves): their results
# stay shards (so the shard FSDP keeps still has the hooks); everything else (math, zeros_like for optimizer
# state) returns plain tensors.
_KEEP = {
    aten.new_zeros,
    aten.new_empty,
    aten.slice,
    aten.view,
    aten.as_strided,
    aten.split,
    aten.split_with_sizes,
    aten.clone,
    aten.detach,
    aten.alias,
    aten._to_copy,
    aten._pin_memory,
}


class MXFP8ExpertShard(torch.Tensor):
    """An expert weight (then FSDP2's shard of it) whose FSDP2 all-gather moves MXFP8 bytes.

    Wraps the weight ``data`` ([L, N, K] float, the master dtype); behaves as ``data`` for every op (FSDP2's
    sharding, the optimizer's in-place updates, ``state_dict``). ``quantizations`` counts the shard's
    quantizations (once per weight version; tests read it).
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> MXFP8ExpertShard:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, layout=data.layout, requires_grad=False,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data
        self._quantized: tuple[tuple, tuple[torch.Tensor, ...]] | None = None
        self.quantizations = 0

    def __repr__(self) -> str:
        return f"MXFP8ExpertShard({self._data!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers = {}

        def unwrap(t):
            if isinstance(t, MXFP8ExpertShard):
                wrappers[id(t._data)] = t
                return t._data
            return t

        kwargs = kwargs or {}
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        # Below autograd an in-place op does not move the inner tensor's version counter, and the shard's cached
        # quantization is keyed on it: move it for every shard the op wrote (the optimizer's updates).
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in pytree.tree_leaves(val):
                    if isinstance(t, MXFP8ExpertShard):
                        torch.autograd.graph.increment_version(t._data)
        keep = func.overloadpacket in _KEEP

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in wrappers:  # an in-place op or out= returned its (unwrapped) argument
                return wrappers[id(t)]
            return cls(t) if keep else t  # (cls: a subclass's results stay of the subclass)

        return pytree.tree_map(wrap, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    # ------------------------------------------------------------------------------------- FSDP2's extension
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """-> ((this shard's packed MXFP8 bytes, u8 [packed_bytes(L/dp, N, K)]), metadata); quantized once per
        version of the shard. One buffer, not four: FSDP2 gathers a one-rank group's first input only."""
        return (self._quantized_shard(quantize_packed),), (tuple(outer_size), mesh.size())

    def _quantized_shard(self, quantize) -> torch.Tensor:
        """``quantize(shard)`` (its packed bytes), computed once per version of the shard and kept until it changes."""
        d = self._data
        key = (d._version, d.data_ptr(), tuple(d.shape), d.dtype)
        if self._quantized is None or self._quantized[0] != key:
            with torch.no_grad():
                packed = quantize(d)
            self._quantized = (key, packed)
            self.quantizations += 1
        return self._quantized[1]

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        """FSDP's gathered buffer (u8 [dp * packed_bytes(L/dp, N, K)], rank-major) -> (MXFP8ExpertWeight [L, N, K]
        param_dtype over it, the buffers FSDP frees at reshard). With ``out`` (every gather after the first) the
        weight already views the re-allocated buffer."""
        (buf,) = all_gather_outputs
        if out is not None:
            if out._buf.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                raise RuntimeError("MXFP8 expert all-gather: the unsharded weight no longer views FSDP's buffer")
            return None
        shape, ranks = metadata
        return MXFP8ExpertWeight(buf, shape, param_dtype, ranks), (buf,)


def _packed_parts(ls: int, n: int, k: int) -> list[tuple[int, int]]:
    """(offset, bytes) of w [ls, N, K] e4m3, w_scale [ls, blocked_size(N, K/32)], wt [ls, K, N] e4m3 and wt_scale
    [ls, blocked_size(K, N/32)] in one rank's packed buffer (every offset a multiple of 16: N, K multiples of 32).

    Example: ls 2, N 64, K 32 -> [(0, 4096), (4096, 1024), (5120, 4096), (9216, 1024)].
    """
    sizes = [ls * n * k, ls * mxfp8.blocked_size(n, k // 32), ls * n * k, ls * mxfp8.blocked_size(k, n // 32)]
    offs = [sum(sizes[:i]) for i in range(4)]
    return list(zip(offs, sizes, strict=True))


def packed_bytes(ls: int, n: int, k: int) -> int:
    """Bytes of one rank's packed MXFP8 expert weight [ls, N, K] (both quantizations with their scales)."""
    off, size = _packed_parts(ls, n, k)[-1]
    return off + size


def _unpack(chunk: torch.Tensor, ls: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    (o0, s0), (o1, s1), (o2, s2), (o3, s3) = _packed_parts(ls, n, k)
    e4m3 = torch.float8_e4m3fn
    return (
        chunk[o0 : o0 + s0].view(e4m3).view(ls, n, k),
        chunk[o1 : o1 + s1].view(ls, -1),
        chunk[o2 : o2 + s2].view(e4m3).view(ls, k, n),
        chunk[o3 : o3 + s3].view(ls, -1),
    )


def quantize_packed(w: torch.Tensor) -> torch.Tensor:
    """An expert weight [ls, N, K] (float) -> its packed MXFP8 bytes u8 [packed_bytes(ls, N, K)]: the four outputs of
    ``operands.quantize_weight_mxfp8`` back to back (CUDA: written in place by one launch)."""
    ls, n, k = w.shape
    buf = torch.empty(packed_bytes(ls, n, k), dtype=torch.uint8, device=w.device)
    parts = _unpack(buf, ls, n, k)
    if mxfp8.use_reference(w):
        for dst, src in zip(parts, quantize_weight_mxfp8(w), strict=True):
            dst.copy_(src)
    else:
        from ..mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415

        mxfp8_cuda.quantize_weights_fused_into(w.contiguous(), *parts)
    return buf


def gathered_weight_dispatch(func, args, kwargs, same, what: str):
    """``__torch_dispatch__`` of a weight gathered in FP8 (MXFP8 or blockwise): detach / alias and FSDP2's
    as_strided or view to the parameter's own (contiguous) shape give ``same()`` (the same bytes), zeros_like /
    empty_like a plain zero tensor of its shape and dtype; any other op raises naming ``what``."""
    me = args[0]
    packet = func.overloadpacket
    if packet in (aten.detach, aten.alias) or (
        packet in (aten.as_strided, aten.view) and tuple(args[1]) == tuple(me.shape)
    ):
        return same()
    if packet in (aten.zeros_like, aten.empty_like):
        return torch.zeros(me.shape, dtype=(kwargs or {}).get("dtype") or me.dtype, device=me.device)
    raise NotImplementedError(f"{func} on {what}")


class MXFP8ExpertWeight(torch.Tensor):
    """An expert weight W [L, N, K] as gathered in MXFP8: both quantizations, no high-precision copy.

    buf: u8 [ranks * packed_bytes(L/ranks, N, K)], rank r's packed bytes at r * packed_bytes (:func:`quantize_packed`:
    W along K and W^T along N, each e4m3 with 128x4-blocked scales, for experts r * L/ranks ...). Its dtype is the
    param dtype (its gradient's dtype).
    """

    @staticmethod
    def __new__(cls, buf: torch.Tensor, shape, dtype: torch.dtype, ranks: int) -> MXFP8ExpertWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=buf.device, requires_grad=False)

    def __init__(self, buf: torch.Tensor, shape, dtype: torch.dtype, ranks: int) -> None:
        g, n, k = shape
        if g % ranks or buf.numel() != packed_bytes(g, n, k):
            raise ValueError(
                f"MXFP8 expert weight {tuple(shape)} over {ranks} shards: {buf.numel()} bytes, expected "
                f"{packed_bytes(g, n, k)}"
            )
        self._buf, self._ranks = buf, ranks

    def __repr__(self) -> str:
        return f"MXFP8ExpertWeight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    def chunks(self) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
        """[(first expert, (w, w_scale, wt, wt_scale) of the experts of one rank's shard))] in rank order."""
        g, n, k = self.shape
        ls = g // self._ranks
        per = packed_bytes(ls, n, k)
        return [(r * ls, _unpack(self._buf[r * per : (r + 1) * per], ls, n, k)) for r in range(self._ranks)]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = args[0]
        return gathered_weight_dispatch(
            func, args, kwargs, lambda: MXFP8ExpertWeight(me._buf, me.shape, me.dtype, me._ranks),
            "an MXFP8-gathered expert weight: it holds e4m3 bytes only and is read by the MoE layer's expert GEMMs "
            "(moe_ep.experts.sm90.mlp.GEMMS.prepare, mxfp8.fake_quantize in the reference)",
        )  # fmt: skip

    def operands(self, fprop: bool = True, dgrad: bool = True) -> WeightOperands:
        """The GEMM operands: ``prepare_weight_bf16`` of the wanted copies, one launch per rank's shard; the others
        None (the e4m3 fields too: the kernels read only the prepared operands)."""
        g, n, k = self.shape
        wp = torch.empty(g, n, -(-k // 64) * 64, dtype=torch.bfloat16, device=self.device) if fprop else None
        wtp = torch.empty(g, k, -(-n // 64) * 64, dtype=torch.bfloat16, device=self.device) if dgrad else None
        for e0, (w, ws, wt, wts) in self.chunks():
            if fprop:
                prepare_weight_bf16(w, ws, out=wp[e0 : e0 + w.shape[0]])
            if dgrad:
                prepare_weight_bf16(wt, wts, out=wtp[e0 : e0 + w.shape[0]])
        return WeightOperands(None, None, wp, None, None, wtp)

    def fake_quantize(self, axis: int) -> torch.Tensor:
        """``mxfp8.fake_quantize(W, axis)`` of the weight it was gathered from (axis -1: along K, -2: along N):
        [L, N, K] in self.dtype, from the stored bytes."""
        g, n, k = self.shape
        parts = []
        for _, (w, ws, wt, wts) in self.chunks():
            if axis % 3 == 2:
                q = mxfp8.MXFP8Tensor(w, mxfp8.from_blocked(ws, n, k // 32), 2)
                parts.append(mxfp8.dequantize(q, self.dtype))
            elif axis % 3 == 1:
                q = mxfp8.MXFP8Tensor(wt, mxfp8.from_blocked(wts, k, n // 32), 2)
                parts.append(mxfp8.dequantize(q, self.dtype).transpose(1, 2))
            else:
                raise ValueError(f"an expert weight is quantized along K (axis -1) or N (axis -2), not axis {axis}")
        return torch.cat(parts)


def use_mxfp8_all_gather(module: torch.nn.Module, dp_size: int) -> None:
    """Wrap ``module``'s 3-D expert weights (``w13`` / ``w2``: [L, N, K]) as :class:`MXFP8ExpertShard` before
    ``fully_shard(module, ...)`` over ``dp_size`` ranks. Raises ValueError when L does not split evenly."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() != 3:
            continue
        if p.shape[0] % dp_size:
            raise ValueError(
                f"MXFP8 all-gather of {name} {tuple(p.shape)}: its {p.shape[0]} experts do not split evenly over "
                f"{dp_size} dp ranks (a padded shard has no per-expert scale layout)"
            )
        if p.shape[1] % 32 or p.shape[2] % 32:
            raise ValueError(f"MXFP8 all-gather of {name} {tuple(p.shape)}: N and K must be multiples of 32")
        if not isinstance(p.data, MXFP8ExpertShard):
            setattr(module, name, torch.nn.Parameter(MXFP8ExpertShard(p.data), requires_grad=p.requires_grad))
