"""The MoE layer's CUDA backend: routed tokens -> expert outputs on the fast kernels, with autograd.

The transport is ``TRANSPORTS[cfg.transport]`` and the expert kernels ``gemms_for(device, cfg.recipe)``; this module
imports no implementation. Data flow of an FP8 recipe (one autograd node, :class:`_MoEQuantized`), e.g. MXFP8 on
the NVSHMEM transport:

  forward   layout (ep_layout_count / ep_layout_place)        routing -> rows, groups, offsets on the GPU
            weight operands (cached per weight version)       gemms.prepare
            fused quantize + dispatch (ep_dispatch_mx)        e4m3 rows + per-group blocked scales, expert-sorted
            GEMM1 -> SwiGLU + quantize -> GEMM2              reading exactly those bytes (gemms.mlp_fwd)
            combine (ep_combine)                              top-k weighted, deterministic order
  backward  MXFP8 dispatch of dy -> dgrad / wgrad -> combine of dx with the top-k weight gradients

Saved for the backward: the dispatched MXFP8 rows (1 byte + 1/32 per element), GEMM1's output ``a`` (bf16), the
expert outputs (bf16, for the top-k weight gradient) and the row weights.

Recipe "bf16" is the bf16 path on the same transport (bf16 payloads, ``torch._grouped_mm`` experts);
``transport="nccl"`` runs the reference transport (torch.distributed all_to_all, host-synced split sizes) around
the same expert kernels: its quantized dispatch delivers the same bytes in the same layout. Capacity: with
``cfg.capacity_factor`` the expanded buffers have ``capacity_rows(T)`` rows and the layout drops the slots past them on
the GPU (no host sync: the whole layer is CUDA-graph capturable); dropless at EP 1 sizes them exactly from the token
count (no host sync), at EP > 1 by ``cfg.dropless_sizing``: "exact" reads the expanded row count once after the layout
(a host sync), "worst_case" allocates the most a rank can receive (no host sync).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import profiling
from .config import MoEConfig
from .devices import cuda_unavailable_reason
from .experts.base import gemms_for
from .experts.bf16 import expert_mlp_bf16
from .experts.weight_cache import WeightQuantCache
from .transport import TRANSPORTS
from .transport.autograd import combine, dispatch_with_layout


@functools.cache
def missing_gpu_packages(transport: str) -> tuple[str, ...]:
    """The GPU packages of the cuda backend that do not import here (``moe_ep[gpu]``)."""
    missing = []
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        missing.append("cupy")
    if transport == "nvshmem":
        try:
            import nvshmem.core  # noqa: F401, PLC0415
        except ImportError:
            missing.append("nvshmem4py")
    return tuple(missing)


def resolve_backend(cfg: MoEConfig, x: torch.Tensor) -> str:
    """``cfg.backend`` for input ``x``: "auto" -> "cuda" when x is on a GPU, the GPU packages import and
    torch.distributed is initialized, else "reference". An explicit "cuda" that cannot run raises, naming why."""
    if cfg.backend == "reference":
        return "reference"
    missing = missing_gpu_packages(cfg.transport)
    if cfg.backend == "auto":
        return "cuda" if x.is_cuda and not missing and dist.is_initialized() else "reference"
    # Every blocker, the one to fix first first (no GPU before "x on the CPU" before the GPU packages); raised as
    # the first one's type, naming the others after it.
    blockers: list[tuple[type[Exception], str]] = []
    no_gpu = cuda_unavailable_reason()
    if no_gpu is not None:
        blockers.append((RuntimeError, f"a CUDA GPU: {no_gpu}"))
    if not x.is_cuda:
        blockers.append((ValueError, f"x on a CUDA device, got {x.device}"))
    if missing:
        blockers.append((ImportError, f"{', '.join(missing)} (pip install 'moe_ep[gpu]')"))
    if not dist.is_initialized():
        blockers.append((RuntimeError, "torch.distributed initialized (torchrun + moe_ep.init_ep)"))
    if blockers:
        then = "".join(f"; then also {msg}" for _, msg in blockers[1:])
        raise blockers[0][0](f"backend='cuda' needs {blockers[0][1]}{then}. backend='reference' runs on any device")
    return "cuda"


class _PhaseMark(torch.autograd.Function):
    """Identity whose backward marks a profiling phase (only inserted while phases are recorded)."""

    @staticmethod
    def forward(ctx, t, name):
        ctx.name = name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        profiling.mark(ctx.name)
        return g, None


def _bwd_mark(t: torch.Tensor, name: str) -> torch.Tensor:
    return _PhaseMark.apply(t, name) if profiling.recording() and t.requires_grad else t


class _MoEQuantized(torch.autograd.Function):
    """x [T, H], topk_w [T, K] fp32, w13 [L, 2F, H], w2 [L, H, F] -> y [T, H] bf16: the fused quantized dispatch of
    ``transport``, the expert MLP of ``gemms`` (an :class:`~moe_ep.experts.base.ExpertGemms`) on exactly those bytes,
    and the combine, as one autograd node."""

    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, handle, cache, transport, gemms):
        w13o, w2o = gemms.prepare(w13, cache, dgrad=False), gemms.prepare(w2, cache, dgrad=False)
        profiling.mark("weight_prep")
        xq, xs, wr = transport.dispatch_fwd_quantized(x, topk_w, handle, gemms.recipe.name)
        profiling.mark("dispatch")
        out, saved = gemms.mlp_fwd(xq, xs, w13o, w2o, handle.group_sizes)
        del xq, xs
        y = transport.combine_fwd(out, wr, handle)
        profiling.mark("combine")
        ctx.save_for_backward(w13, w2)
        # intermediates as attributes, not saved tensors: the backward frees each right after its last use
        ctx.saved = {**saved, "out": out, "wr": wr}
        ctx.handle, ctx.cache, ctx.x_dtype, ctx.transport, ctx.gemms = handle, cache, x.dtype, transport, gemms
        return y

    @staticmethod
    def backward(ctx, dy):
        w13, w2 = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None
        if saved is None:
            raise RuntimeError("the MoE layer's backward ran twice (retain_graph=True): its intermediates are freed")
        h, tr, gemms = ctx.handle, ctx.transport, ctx.gemms
        dout, dwr = tr.combine_bwd(dy.contiguous(), saved.pop("out"), saved.pop("wr"), h, gemms.recipe)
        del dy
        saved["dout"] = dout
        del dout
        profiling.mark("combine_bwd")
        w13o, w2o = gemms.prepare(w13, ctx.cache, fprop=False), gemms.prepare(w2, ctx.cache, fprop=False)

        def send_dx(dxr: torch.Tensor):  # the return of dx overlaps nothing but frees dxr before the x-side wgrad
            res = tr.dispatch_bwd(dxr, dwr, h, ctx.x_dtype)
            profiling.mark("dispatch_bwd")
            return res

        (dx, dtw), dw13, dw2 = gemms.mlp_bwd(saved, w13, w2, w13o, w2o, h.group_sizes, send_dx)
        return dx, dtw, dw13, dw2, None, None, None, None


def routed_experts_cuda(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    cache: WeightQuantCache | None,
    cfg: MoEConfig,
    group,
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """The cuda backend of :func:`moe_ep.layer.routed_experts`: x [T, H] bf16, topk_idx [T, K] int, topk_w [T, K]
    fp32 -> (y [T, H] bf16, slots dropped by this rank: 0-dim int32 CUDA tensor (nvshmem) or int (nccl))."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the cuda backend computes in bf16: x must be bf16, got {x.dtype}")
    transport = TRANSPORTS[cfg.transport]
    topk_w = topk_w.to(torch.float32)
    handle = transport.layer_layout(topk_idx, cfg, group, x.shape[0])
    profiling.mark("layout")
    if cfg.quantize:
        gemms = gemms_for(x.device, cfg.recipe)
        return _MoEQuantized.apply(x, topk_w, w13, w2, handle, cache, transport, gemms), handle.num_dropped
    # the bf16 path: bf16 payloads and torch._grouped_mm experts, each pass its own autograd node
    rows, w = dispatch_with_layout(_bwd_mark(x, "dispatch_bwd"), topk_w, handle, False, transport)
    profiling.mark("dispatch")
    rows = _bwd_mark(rows, "experts_bwd")
    gs = handle.group_sizes.to(device=x.device, dtype=torch.int32)
    out = expert_mlp_bf16(rows, w13, w2, gs)
    profiling.mark("experts_fwd")
    out = _bwd_mark(out, "combine_bwd")
    y = combine(out, w, handle, False, transport)
    profiling.mark("combine")
    return y, handle.num_dropped
