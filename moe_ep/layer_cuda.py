"""The MoE layer's CUDA backend: routed tokens -> expert outputs on the fast kernels, with autograd.

Data flow of ``transport="nvshmem"``, ``quantize=True`` (one autograd node, :class:`_MoEMXFP8`):

  forward   layout (ep_layout_count / ep_layout_place)        routing -> rows, groups, offsets on the GPU
            weight operands (cached per weight version)       experts.GEMMS.prepare
            fused quantize + dispatch (ep_dispatch_mx)        e4m3 rows + per-group blocked scales, expert-sorted
            GEMM1 -> SwiGLU + quantize -> GEMM2              reading exactly those bytes (experts.cuda)
            combine (ep_combine)                              top-k weighted, deterministic order
  backward  MXFP8 dispatch of dy -> dgrad / wgrad -> combine of dx with the top-k weight gradients

Saved for the backward: the dispatched MXFP8 rows (1 byte + 1/32 per element), GEMM1's output ``a`` (bf16), the
expert outputs (bf16, for the top-k weight gradient) and the row weights.

``quantize=False`` is the bf16 path on the same transport (bf16 payloads, ``torch._grouped_mm`` experts);
``transport="nccl"`` runs the reference transport (torch.distributed all_to_all, host-synced split sizes) around
the same expert kernels. Capacity: with ``cfg.capacity_factor`` the expanded buffers have ``capacity_rows(T)`` rows
and the layout drops the slots past them on the GPU (no host sync: the whole layer is CUDA-graph capturable);
dropless reads the expanded row count once after the layout to size the buffers exactly (a host sync).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from . import profiling
from .config import MoEConfig
from .devices import cuda_unavailable_reason
from .experts.cuda import GEMMS, expert_mlp_bf16, expert_mlp_cuda, expert_mlp_mx_bwd, expert_mlp_mx_fwd
from .experts.weight_cache import WeightQuantCache
from .transport import cuda as ct
from .transport.autograd import combine, dispatch_with_layout
from .transport.layout import fit_to_count
from .transport.reference import REFERENCE


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


class _MoEMXFP8(torch.autograd.Function):
    """x [T, H], topk_w [T, K] fp32, w13 [L, 2F, H], w2 [L, H, F] -> y [T, H] bf16 over the NVSHMEM transport."""

    @staticmethod
    def forward(ctx, x, topk_w, w13, w2, handle, cache):
        w13o, w2o = GEMMS.prepare(w13, cache, dgrad=False), GEMMS.prepare(w2, cache, dgrad=False)
        profiling.mark("weight_prep")
        xq, xs, wr = ct.dispatch_fwd_mxfp8(x, topk_w, handle)
        profiling.mark("dispatch")
        out, a = expert_mlp_mx_fwd(xq, xs, w13o, w2o, handle.group_sizes)
        y = ct.combine_fwd(out, wr, handle)
        profiling.mark("combine")
        ctx.save_for_backward(w13, w2)
        # intermediates as attributes, not saved tensors: the backward frees each right after its last use
        ctx.saved = {"xq": xq, "xs": xs, "a": a, "out": out, "wr": wr}
        ctx.handle, ctx.cache, ctx.x_dtype = handle, cache, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        w13, w2 = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None
        if saved is None:
            raise RuntimeError("the MoE layer's backward ran twice (retain_graph=True): its intermediates are freed")
        h = ctx.handle
        dout, dwr = ct.combine_bwd(dy.contiguous(), saved.pop("out"), saved.pop("wr"), h, True)
        del dy
        saved["dout"] = dout
        del dout
        profiling.mark("combine_bwd")
        w13o, w2o = GEMMS.prepare(w13, ctx.cache, fprop=False), GEMMS.prepare(w2, ctx.cache, fprop=False)

        def send_dx(dxr: torch.Tensor):  # the return of dx overlaps nothing but frees dxr before the x-side wgrad
            res = ct.dispatch_bwd(dxr, dwr, h, ctx.x_dtype)
            profiling.mark("dispatch_bwd")
            return res

        (dx, dtw), dw13, dw2 = expert_mlp_mx_bwd(saved, w13, w2, w13o, w2o, h.group_sizes, send_dx)
        return dx, dtw, dw13, dw2, None, None


def _nvshmem_layout(topk_idx: torch.Tensor, cfg: MoEConfig, group, num_tokens: int) -> ct.CudaEPHandle:
    rt = ct.init_runtime(group, cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k, cfg.num_experts)
    cap = cfg.capacity_rows(num_tokens)
    if cap is not None:
        return ct.build_layout(topk_idx, cfg.num_experts, group, capacity=cap, runtime=rt)
    # dropless: the one host read of the layer (NOTE: host sync in fit_to_count; capacity_factor avoids it)
    return fit_to_count(ct.build_layout(topk_idx, cfg.num_experts, group, runtime=rt))


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
    t = x.shape[0]
    topk_w = topk_w.to(torch.float32)
    if cfg.transport == "nccl":
        transport = REFERENCE
        handle = REFERENCE.build_layout(topk_idx, cfg.num_experts, group, capacity=cfg.capacity_rows(t))
    else:
        transport = ct.CUDA
        handle = _nvshmem_layout(topk_idx, cfg, group, t)
    profiling.mark("layout")
    if cfg.quantize and transport is ct.CUDA:
        return _MoEMXFP8.apply(x, topk_w, w13, w2, handle, cache), handle.num_dropped
    # The unfused paths: dispatch (MXFP8 or bf16 payloads, dequantized rows) -> experts -> combine, each its own
    # autograd node. The nccl transport's MXFP8 rows arrive dequantized, and expert_mlp_cuda quantizes them again,
    # as the reference expert MLP does with the reference transport's rows.
    rows, w = dispatch_with_layout(_bwd_mark(x, "dispatch_bwd"), topk_w, handle, cfg.quantize, transport)
    profiling.mark("dispatch")
    rows = _bwd_mark(rows, "experts_bwd")
    gs = handle.group_sizes.to(device=x.device, dtype=torch.int32)
    out = expert_mlp_cuda(rows, w13, w2, gs, cache) if cfg.quantize else expert_mlp_bf16(rows, w13, w2, gs)
    profiling.mark("experts_fwd")
    out = _bwd_mark(out, "combine_bwd")
    y = combine(out, w, handle, cfg.quantize, transport)
    profiling.mark("combine")
    return y, handle.num_dropped
