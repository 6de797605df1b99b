"""The expert-parallel MoE module."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from . import profiling
from .config import MoEConfig
from .devices import check_device
from .experts.reference import expert_mlp
from .experts.weight_cache import WeightQuantCache
from .router import Router
from .shared_experts import SharedExperts, with_shared_experts
from .transport import combine, dispatch


class Experts(nn.Module):
    """This rank's experts. w13: [E_local, 2F, H] (gate rows, then up rows); w2: [E_local, H, F].

    ``weight_cache``: the MXFP8 operands of w13 / w2 the cuda backend's GEMMs read, recomputed only when a weight
    changes (an in-place update bumps its version; FSDP2's all-gather does not: see :meth:`MoE.forward`).
    """

    def __init__(self, num_local: int, hidden: int, ffn_hidden: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * ffn_hidden, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn_hidden, device=device, dtype=dtype))
        self.weight_cache = WeightQuantCache()

    def forward(self, x: torch.Tensor, group_sizes: list[int], quantize) -> torch.Tensor:
        """x: [N, H] expert-sorted rows, group_sizes: E_local host ints, quantize: the recipe (a
        :class:`moe_ep.recipe.Recipe`, True: MXFP8, False / None: bf16) -> [N, H] x.dtype (reference math)."""
        return expert_mlp(x, self.w13, self.w2, group_sizes, quantize)

    def run(self, fn, *args):
        """``fn(*args)``; on an FSDP2 unit it is registered as an FSDP forward method (:meth:`MoE.forward`), so the
        weights are gathered around a computation that reads them without calling this module."""
        return fn(*args)


def _is_fsdp_unit(m: nn.Module) -> bool:
    return isinstance(m, FSDPModule)


def update_expert_bias(model: nn.Module) -> int:
    """:meth:`MoE.update_expert_bias` on every MoE of ``model`` with ``cfg.expert_bias``; returns how many. Call it
    once after each ``optimizer.step()``, on every rank."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.cfg.expert_bias]
    for m in layers:
        m.update_expert_bias()
    return len(layers)


def routed_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    experts: Experts,
    cfg: MoEConfig,
    group=None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Dispatch -> experts -> combine for a routing the caller gives (the layer without its router).

    x: [T, H] bf16 (fp32 too on the reference backend); topk_idx: [T, K] int32/int64 global expert ids; topk_w:
    [T, K] float; experts: this rank's :class:`Experts`; group: the EP process group (None: one process owns every
    expert); backend: "reference" / "cuda" (None: resolve ``cfg.backend`` for x) -> (y [T, H] x.dtype, slots this
    rank dropped at its capacity: int on the reference backend and the nccl transport, a 0-dim int32 CUDA tensor on
    nvshmem (reading it is a host sync)). Differentiable in x, topk_w, experts.w13, experts.w2.
    With an FSDP2-wrapped ``experts`` on the cuda backend, call it inside the unit's forward (as :class:`MoE` does).
    """
    from . import layer_cuda  # noqa: PLC0415  (GPU packages load lazily)

    backend = backend or layer_cuda.resolve_backend(cfg, x)
    if backend == "cuda":
        w13, w2, cache = experts.w13, experts.w2, experts.weight_cache
        if _is_fsdp_unit(experts):
            if isinstance(w13, DTensor):
                raise RuntimeError(
                    "routed_experts: experts is an FSDP2 unit whose weights are sharded here; on the cuda backend call "
                    "it through MoE (its forward gathers them) or inside the unit's forward"
                )
            # Inside MoE's FSDP forward method: the weights are gathered, but FSDP2 writes them keeping their version
            # counter (and often their address), so a cache could not see an optimizer step; and a cache would hold
            # 4 bytes per gathered weight element from forward to backward, undoing the reshard. Without it the
            # operands are prepared in the forward and again in the backward, and live only while used.
            cache = None
        return layer_cuda.routed_experts_cuda(x, topk_idx, topk_w, w13, w2, cache, cfg, group)
    cap = cfg.capacity_rows(x.shape[0])
    recipe = cfg.recipe_row  # None for bf16
    rows, w, handle = dispatch(x, topk_idx, topk_w, cfg.num_experts, group, recipe, capacity=cap)
    out = experts(rows, handle.group_sizes_host, recipe)
    return combine(out, w, handle, recipe), handle.num_dropped


class MoE(nn.Module):
    """Expert-parallel MoE layer: router -> quantized dispatch (``cfg.recipe``) -> SwiGLU experts -> combine.

    cfg: MoEConfig; mesh: a ("dp", "ep") DeviceMesh from :func:`moe_ep.init_ep`, or None for one process
    owning every expert. This rank owns global experts [ep_rank * E_local, (ep_rank + 1) * E_local).
    forward(x: [..., H] bf16/fp32) -> (y: same shape and dtype, aux_loss: scalar fp32, already weighted by
    cfg.aux_loss_coef). Nothing the next call or the backward reads is kept on the module: the dispatch handle lives
    in autograd (``experts.weight_cache`` is a cache keyed by the weights' versions). ``num_dropped`` (int) is a
    statistic of the last forward for logs: the slots this rank dropped at its capacity (``cfg.capacity_factor``;
    always 0 when dropless); on the cuda backend reading it is a host sync.
    Backends (``cfg.backend``, resolved per call): see :class:`MoEConfig`; the cuda backend is
    :mod:`moe_ep.layer_cuda`. Routing options: :mod:`moe_ep.router` (shared by both backends); with
    ``cfg.expert_bias`` call :meth:`update_expert_bias` after each optimizer step. ``cfg.num_shared_experts``:
    ``shared_experts`` (:mod:`moe_ep.shared_experts`), overlapped with the dispatch on the cuda backend.
    """

    def __init__(self, cfg: MoEConfig, mesh: DeviceMesh | None = None, device=None, dtype=None, seed: int = 0) -> None:
        super().__init__()
        check_device(device, f"MoE(device={device!r})")  # names the blocker, not torch's "not compiled with CUDA"
        self.cfg = cfg
        if mesh is not None and mesh.mesh_dim_names and "ep" in mesh.mesh_dim_names:
            ep_mesh = mesh["ep"]
            self.ep_size, self.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
            self.ep_group = ep_mesh.get_group() if self.ep_size > 1 else None
        elif mesh is not None:
            raise ValueError(f"mesh must have an 'ep' dimension, got dims {mesh.mesh_dim_names}")
        else:
            self.ep_size, self.ep_rank, self.ep_group = 1, 0, None
        if cfg.num_experts % self.ep_size:
            raise ValueError(f"num_experts {cfg.num_experts} is not divisible by the EP size {self.ep_size}")
        self.num_local_experts = cfg.num_experts // self.ep_size
        self.mesh = mesh
        self.router = Router.from_config(cfg, device=device, dtype=dtype)
        self.experts = Experts(self.num_local_experts, cfg.hidden, cfg.ffn_hidden, device=device, dtype=dtype)
        self.shared_experts = (
            SharedExperts(cfg.hidden, cfg.shared_width, device=device, dtype=dtype) if cfg.shared_width else None
        )
        self._num_dropped: torch.Tensor | int = 0
        self.reset_parameters(seed)

    @property
    def num_dropped(self) -> int:
        """Slots this rank dropped at its capacity in the last forward (log statistic)."""
        return int(self._num_dropped)  # NOTE: host sync on the cuda backend (a device counter); logs only

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Normal(0, init_std) weights drawn per global expert, so any EP size gives the same global model."""
        if self.router.weight.device.type == "meta":
            return
        std = self.cfg.init_std
        gen = torch.Generator().manual_seed(seed)
        self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=gen) * std)
        for i in range(self.num_local_experts):
            gen.manual_seed(seed + 1 + self.first_expert + i)
            self.experts.w13[i].copy_(torch.randn(self.experts.w13[i].shape, generator=gen) * std)
            self.experts.w2[i].copy_(torch.randn(self.experts.w2[i].shape, generator=gen) * std)
        if self.shared_experts is not None:  # drawn after every expert's seed: the same on every rank
            gen.manual_seed(seed + 1 + self.cfg.num_experts)
            for w in (self.shared_experts.w13, self.shared_experts.w2):
                w.copy_(torch.randn(w.shape, generator=gen) * std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
            self.router.expert_counts.zero_()

    def update_expert_bias(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        """The aux-loss-free balancing step (``cfg.expert_bias``): call once after each optimizer step, on every rank.
        The counts are summed over ``group``, default: every rank of the layer's mesh (all of them route their tokens
        through this router); no host sync. See :meth:`moe_ep.router.Router.update_bias`."""
        if group is None and self.mesh is not None and self.mesh.size() > 1:
            # = moe_ep.parallel.world_mesh(mesh) (not imported: parallel imports this module)
            mesh = self.mesh if self.mesh.ndim == 1 else self.mesh._flatten("dp_ep")
            group = mesh.get_group()
        self.router.update_bias(self.cfg.bias_update_rate, group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if x.shape[-1] != cfg.hidden:
            raise ValueError(f"x has hidden size {x.shape[-1]}, the layer expects {cfg.hidden}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"x must be bf16 or fp32, got {x.dtype}")
        from .layer_cuda import resolve_backend  # noqa: PLC0415  (GPU packages load lazily)

        backend = resolve_backend(cfg, x)
        num_tokens = x.numel() // cfg.hidden
        if num_tokens > cfg.max_tokens_per_rank:
            raise ValueError(
                f"{num_tokens} tokens exceed max_tokens_per_rank={cfg.max_tokens_per_rank} (it sizes the receive "
                "buffers); raise it in MoEConfig"
            )
        if backend == "cuda" and _is_fsdp_unit(self.experts):
            # The kernels read experts.w13 / w2 directly, so FSDP2's hooks on experts.forward would never gather
            # them: the layer runs as an FSDP forward method of the experts unit instead (all-gather before,
            # reshard after, unshard / reduce-scatter around its backward). The whole layer, router included, so
            # that FSDP's cast of floating inputs to param_dtype sees only x (the fp32 top-k weights are made inside).
            if not getattr(self.experts, "_moe_ep_run_registered", False):
                register_fsdp_forward_method(self.experts, "run")
                self.experts._moe_ep_run_registered = True
            return self.experts.run(self._forward, x, backend)
        return self._forward(x, backend)

    def _forward(self, x: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer for a resolved backend: x [..., H] -> (y [..., H] x.dtype, aux loss fp32 scalar). Under FSDP2
        mixed precision x arrives already cast to the param dtype (FSDP casts a unit's floating inputs)."""
        cfg = self.cfg
        shape = x.shape
        x2 = x.reshape(-1, cfg.hidden)
        xe = x2.to(torch.bfloat16) if backend == "cuda" else x2  # the cuda backend computes in bf16
        aux = []

        def routed() -> torch.Tensor:
            r = self.router(x2)
            aux.append(r.aux_loss)
            profiling.mark("router")
            y, self._num_dropped = routed_experts(xe, r.topk_idx, r.topk_w, self.experts, cfg, self.ep_group, backend)
            return y

        if self.shared_experts is None:
            y = routed()
        else:  # on the cuda backend the shared SwiGLU runs on a side stream, overlapping router .. combine
            y, ys = with_shared_experts(self.shared_experts, xe, routed, overlap=backend == "cuda")
            y = y + ys
        return y.to(x.dtype).reshape(shape), aux[0] * cfg.aux_loss_coef
