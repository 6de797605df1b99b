"""FSDP2 all-gather of expert weights in the blockwise recipe's FP8 (:data:`moe_ep.recipe.BLOCKWISE`, 128x128 weight
blocks): each rank quantizes its shard once per weight version and the all-gather moves 1 byte per element plus one
scale byte per 128x128 block. The MXFP8 sibling is :mod:`.fsdp_mxfp8` (whose shard class this one extends).

Per expert weight W [L, N, K] of one EP rank (N, K multiples of 128), sharded by FSDP2 on dim 0 (whole experts) over
the "dp" ranks:

  pre-all-gather   (each rank, its shard [L/dp, N, K] in the master dtype) quantized in 128x128 blocks of each
                   expert's [N, K] (:func:`quantize_packed`: the ``data`` and ``scale`` of
                   ``blockwise.quantize_weight``), one packed u8 buffer kept until the shard changes (its version
                   counter moves at the optimizer step), so the backward's re-gather and later micro-batches reuse it
  all-gather       ``data`` (e4m3, 1 byte per element) and ``scale`` (1 byte per 128x128 block): 1 + 1/16384 bytes
                   per element against bf16's 2. dp > 1: two all-gather inputs, both views of the packed buffer, so
                   FSDP2's copy-out lays each out rank-major in a buffer of its own and the gathered ``data`` is one
                   contiguous [L, N, K] (the GEMM's TMA operand) without a copy. dp = 1: the packed buffer is the one
                   input (FSDP2's one-rank path copies only the first); ``data`` is its contiguous head
  post-all-gather  a :class:`BlockwiseExpertWeight` [L, N, K] over FSDP's gathered buffers (no copy)
  layer            forward (fprop): ``data`` and ``scale`` as gathered, views, nothing moves. Backward (dgrad):
                   ``data_t`` [L, K, N] = the gathered bytes transposed (``blockwise.transpose_weight``: 1 byte
                   read + 1 written per element, no re-quantization: a 128x128 block is a block of the transpose).
                   The bf16 gather instead quantizes the bf16 weight in the forward and again in the backward
                   (2 read + 2 written per element each)

Why ``data_t`` is made on the receiving side instead of travelling: sending it would double the wire bytes (2 per
element: bf16's) and the gathered buffer from forward to backward, to save a local transpose whose 2 bytes of HBM per
element run at several times the all-gather's bus rate (H200: ~4 TB/s HBM against ~0.4 TB/s NVLink per GPU). It is
made only when the backward asks for the dgrad operand and lives only while that GEMM runs.

The quantization reads the master weight (fp32 in mixed-precision training), not its bf16 cast: one rounding, where
the bf16 gather rounds to bf16 and then to e4m3, so the two gathers train alike but not bitwise alike (with equal
master and param dtypes they are bitwise equal: tests/test_fsdp_blockwise.py). Memory: the shard's packed bytes
(1 + 1/16384 per shard element) live from the first gather after a step to the next step; quantizing on the GPU also
writes a transposed copy of the shard into a scratch buffer (the one-pass kernel writes both) freed at once.

Shortcuts: as :mod:`.fsdp_mxfp8`: the experts of an EP rank must split evenly over "dp" (each shard holds whole
experts, so each quantizes whole 128x128 blocks), and the gathered weight supports only what the MoE layer does with
it (shape queries, autograd bookkeeping, ``operands``, ``fake_quantize``); any other op raises.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import mxfp8
from ..blockwise.reference import B, dequantize_weight_torch, quantize_weight_torch
from .fsdp_mxfp8 import MXFP8ExpertShard, gathered_weight_dispatch

aten = torch.ops.aten
U8 = torch.uint8


def _packed_parts(ls: int, n: int, k: int) -> list[tuple[int, int]]:
    """(offset, bytes) of data [ls, N, K] e4m3 and scale [ls, N/128, K/128] u8 in one rank's packed buffer (the
    scale's offset is a multiple of 16384).

    Example: ls 2, N 128, K 256 -> [(0, 65536), (65536, 4)].
    """
    return [(0, ls * n * k), (ls * n * k, ls * (n // B) * (k // B))]


def packed_bytes(ls: int, n: int, k: int) -> int:
    """Bytes of one rank's packed blockwise expert weight [ls, N, K] (data and scales)."""
    off, size = _packed_parts(ls, n, k)[-1]
    return off + size


def _check_shape(what: str, shape) -> None:
    if len(shape) != 3 or shape[1] % B or shape[2] % B:
        raise ValueError(f"{what}: a blockwise expert weight is [L, N, K] with N and K multiples of {B}, got {shape}")


def quantize_packed(w: torch.Tensor) -> torch.Tensor:
    """An expert weight [ls, N, K] (fp32 / bf16; N, K % 128 == 0) -> its packed blockwise bytes u8
    [packed_bytes(ls, N, K)]: ``data`` then ``scale`` of ``quantize_weight`` (CUDA: one launch writing them in place,
    its transposed copy into a scratch buffer)."""
    _check_shape("quantize_packed", tuple(w.shape))
    ls, n, k = w.shape
    buf = torch.empty(packed_bytes(ls, n, k), dtype=torch.uint8, device=w.device)
    (o0, s0), (o1, s1) = _packed_parts(ls, n, k)
    data = buf[o0 : o0 + s0].view(torch.float8_e4m3fn).view(ls, n, k)
    scale = buf[o1 : o1 + s1].view(ls, n // B, k // B)
    if mxfp8.use_reference(w):
        d, _, s = quantize_weight_torch(w)
        data.copy_(d)
        scale.copy_(s)
    else:
        from ..blockwise import cuda as bw  # noqa: PLC0415

        scratch_t = torch.empty(ls, k, n, dtype=torch.float8_e4m3fn, device=w.device)
        bw.quantize_weight_into(w.contiguous(), data, scratch_t, scale)
    return buf


class BlockwiseExpertShard(MXFP8ExpertShard):
    """An expert weight (then FSDP2's shard of it) whose FSDP2 all-gather moves blockwise FP8 bytes.

    Wraps the weight ``data`` ([L, N, K] float, the master dtype; N, K multiples of 128) and behaves as it for every op,
    as :class:`MXFP8ExpertShard` does (whose version tracking it shares); ``quantizations`` counts the shard's
    quantizations (once per weight version; tests read it).
    """

    def __repr__(self) -> str:
        return f"BlockwiseExpertShard({self._data!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """-> (all-gather inputs, metadata): dp > 1: (data u8 [L/dp * N * K], scale u8 [L/dp * N/128 * K/128]), views
        of the packed bytes; dp = 1: (packed u8 [packed_bytes(L, N, K)],). Quantized once per version of the shard."""
        packed = self._quantized_shard(quantize_packed)
        ranks = mesh.size()
        if ranks == 1:
            inputs = (packed,)
        else:
            (o0, s0), (o1, s1) = _packed_parts(*self._data.shape)
            inputs = (packed[o0 : o0 + s0], packed[o1 : o1 + s1])
        return inputs, (tuple(outer_size), ranks)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        """FSDP's gathered buffers (dp > 1: data u8 [L * N * K] and scale u8 [L * N/128 * K/128], rank-major; dp = 1:
        the packed bytes) -> (BlockwiseExpertWeight [L, N, K] param_dtype over them, the buffers FSDP frees at
        reshard). With ``out`` (every gather after the first) the weight already views the re-allocated buffers."""
        if out is not None:
            if out._data_u8.untyped_storage().data_ptr() != all_gather_outputs[0].untyped_storage().data_ptr():
                raise RuntimeError("blockwise expert all-gather: the unsharded weight no longer views FSDP's buffer")
            return None
        shape, ranks = metadata
        if len(all_gather_outputs) == 1:
            (buf,) = all_gather_outputs
            (o0, s0), (o1, s1) = _packed_parts(*shape)
            data, scale = buf[o0 : o0 + s0], buf[o1 : o1 + s1]
        else:
            data, scale = all_gather_outputs
        return BlockwiseExpertWeight(data, scale, shape, param_dtype), tuple(all_gather_outputs)


class BlockwiseExpertWeight(torch.Tensor):
    """An expert weight W [L, N, K] as gathered in blockwise FP8: 128x128 blocks, no high-precision copy.

    data_u8: u8 [L * N * K] (the e4m3 bytes of ``quantize_weight``'s ``data``, experts in order), scale_u8: u8
    [L * N/128 * K/128] (its ``scale``); both contiguous. Its dtype is the param dtype (its gradient's dtype).
    """

    @staticmethod
    def __new__(cls, data_u8: torch.Tensor, scale_u8: torch.Tensor, shape, dtype: torch.dtype) -> BlockwiseExpertWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data_u8.device, requires_grad=False)

    def __init__(self, data_u8: torch.Tensor, scale_u8: torch.Tensor, shape, dtype: torch.dtype) -> None:
        _check_shape("BlockwiseExpertWeight", tuple(shape))
        g, n, k = shape
        if data_u8.numel() != g * n * k or scale_u8.numel() != g * (n // B) * (k // B):
            raise ValueError(
                f"blockwise expert weight {tuple(shape)}: {data_u8.numel()} data and {scale_u8.numel()} scale bytes, "
                f"expected {g * n * k} and {g * (n // B) * (k // B)}"
            )
        self._data_u8, self._scale_u8 = data_u8, scale_u8

    def __repr__(self) -> str:
        return f"BlockwiseExpertWeight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = args[0]
        return gathered_weight_dispatch(
            func, args, kwargs, lambda: BlockwiseExpertWeight(me._data_u8, me._scale_u8, me.shape, me.dtype),
            "a blockwise-gathered expert weight: it holds e4m3 bytes only and is read by the MoE layer's blockwise "
            "expert GEMMs (HopperBlockwise.prepare, the reference's quantize_operand)",
        )  # fmt: skip

    def operands(self, dgrad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(data e4m3 [L, N, K] (a view of the gathered bytes), data_t e4m3 [L, K, N] (their transpose, a new buffer;
        None unless ``dgrad``), scale u8 [L, N/128, K/128] (a view)): the ``quantize_weight`` operands of the weight it
        was gathered from, bitwise."""
        g, n, k = self.shape
        data = self._data_u8.view(torch.float8_e4m3fn).view(g, n, k)
        data_t = None
        if dgrad:  # the bytes transposed, not re-quantized (2 bytes of HBM per element)
            if mxfp8.use_reference(data):
                data_t = data.view(U8).transpose(1, 2).contiguous().view(torch.float8_e4m3fn)
            else:
                from ..blockwise import cuda as bw  # noqa: PLC0415

                data_t = bw.transpose_weight(data)  # one pass through shared memory, 128x128 tiles
        return data, data_t, self._scale_u8.view(g, n // B, k // B)

    def fake_quantize(self) -> torch.Tensor:
        """The 128x128 fake quantization of the weight it was gathered from, [L, N, K] in self.dtype (contiguous), from
        the stored bytes; also that of its transpose, transposed back (a square block is a block of the transpose)."""
        g, n, k = self.shape
        data = self._data_u8.view(torch.float8_e4m3fn).view(g, n, k)
        return dequantize_weight_torch(data, self._scale_u8.view(g, n // B, k // B)).to(self.dtype)


def use_blockwise_all_gather(module: torch.nn.Module, dp_size: int) -> None:
    """Wrap ``module``'s 3-D expert weights (``w13`` / ``w2``: [L, N, K]) as :class:`BlockwiseExpertShard` before
    ``fully_shard(module, ...)`` over ``dp_size`` ranks. Raises ValueError when L does not split evenly over the ranks,
    when N or K is not a multiple of 128, or when a weight is already wrapped for another recipe's gather."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() != 3:
            continue
        if p.shape[0] % dp_size:
            raise ValueError(
                f"blockwise all-gather of {name} {tuple(p.shape)}: its {p.shape[0]} experts do not split evenly over "
                f"{dp_size} dp ranks (each shard must hold whole experts)"
            )
        if p.shape[1] % B or p.shape[2] % B:
            raise ValueError(
                f"blockwise all-gather of {name} {tuple(p.shape)}: N and K must be multiples of {B} (128x128 blocks)"
            )
        if type(p.data) is BlockwiseExpertShard:
            continue
        if isinstance(p.data, MXFP8ExpertShard):
            raise ValueError(f"{name} is already wrapped for the MXFP8 all-gather")
        setattr(module, name, torch.nn.Parameter(BlockwiseExpertShard(p.data), requires_grad=p.requires_grad))
