"""torchtitan: swap the ``MoE`` modules of a torchtitan model (``torchtitan.models.common.moe.MoE``) for ours.

    from moe_ep.integrations.torchtitan import swap_moe_layers
    swap_moe_layers(model, mesh=moe_ep.init_ep(ep_size=8))   # in place; every rank keeps its share of the experts

Mapping (torchtitan 0.3.0): the router's ``score_func`` / ``route_norm`` (our ``renormalize``) / ``route_scale`` /
``num_expert_groups`` (``n_group``) / ``num_limited_groups`` (``topk_group``) / ``top_k``; ``expert_bias_E`` (present
when ``load_balance_coeff`` is set) -> our ``expert_bias`` with ``bias_update_rate = load_balance_coeff``; experts
``w1_EFD`` (gate) and ``w3_EFD`` (up) -> our ``w13`` [E, 2F, D] = [w1; w3] per expert, ``w2_EDF`` -> ``w2``; the
shared ``FeedForward`` (w1, w2, w3) -> our shared experts (``w13`` = [w1; w3], ``w2``). torchtitan has no auxiliary
loss: ``aux_loss_coef = 0``.
Differences: torchtitan updates the bias in an optimizer pre-hook with the update centred (``delta - mean(delta)``);
ours is ``bias += rate * sign(mean - load)`` from :func:`moe_ep.update_expert_bias`, called after the optimizer step.
torchtitan's grouped experts compute in bf16 (they cast x and the weights); ours compute in x's dtype (reference
backend) or bf16 / MXFP8 (cuda backend).

Needs the ``torchtitan`` package importable (0.3.0 imports triton at module level; on a CPU-only torch install triton
separately, e.g. ``pip install --no-deps --target DIR triton`` and ``PYTHONPATH=DIR``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import MoEConfig
from ..layer import MoE
from ._weights import all_expert_weights, full


def _tt_moe_class() -> type[nn.Module]:
    from torchtitan.models.common.moe import MoE as TTMoE  # noqa: PLC0415

    return TTMoE


def moe_config_from_torchtitan(m: nn.Module, **overrides: Any) -> MoEConfig:
    """The :class:`MoEConfig` of a torchtitan ``MoE`` module, then ``overrides``."""
    inner, r = m.routed_experts.inner_experts, m.router
    e, f, d = inner.w1_EFD.shape
    if getattr(r.gate, "bias", None) is not None:
        raise ValueError("moe_ep's router has no bias: this torchtitan router's gate has one")
    groups = r.num_expert_groups or 1
    kw: dict[str, Any] = dict(
        hidden=d, ffn_hidden=f, num_experts=e, top_k=r.top_k, score_func=r.score_func, renormalize=bool(r.route_norm),
        route_scale=float(r.route_scale), n_group=groups, topk_group=(r.num_limited_groups or 1) if groups > 1 else 1,
        aux_loss_coef=0.0, expert_bias=m.expert_bias_E is not None,
    )  # fmt: skip
    if m.expert_bias_E is not None:
        kw["bias_update_rate"] = float(m.load_balance_coeff)
    if m.shared_experts is not None:
        kw.update(num_shared_experts=1, shared_ffn_hidden=m.shared_experts.w1.weight.shape[0])
    kw.update(overrides)
    return MoEConfig(**kw)


class TorchtitanMoEBlock(nn.Module):
    """A torchtitan ``MoE`` replaced: forward(x_BLD [B, L, D]) -> [B, L, D] x's dtype, as torchtitan's MoE.
    ``aux_loss``: our layer's weighted aux loss of the last forward (0 unless ``aux_loss_coef`` is overridden)."""

    def __init__(self, moe: MoE, template: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self._template = [template]  # the torchtitan module on the meta device (not a submodule), for unswap
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:  # noqa: N803  (torchtitan's shape-suffix names)
        y, self.aux_loss = self.moe(x_BLD)
        return y


@torch.no_grad()
def _load(moe: MoE, m: nn.Module) -> None:
    inner = m.routed_experts.inner_experts
    lo, hi = moe.first_expert, moe.first_expert + moe.num_local_experts
    w1, w3, w2 = (full(inner.w1_EFD), full(inner.w3_EFD), full(inner.w2_EDF))
    moe.experts.w13.copy_(torch.cat([w1[lo:hi], w3[lo:hi]], dim=1))
    moe.experts.w2.copy_(w2[lo:hi])
    moe.router.weight.copy_(full(m.router.gate.weight))
    if m.expert_bias_E is not None:
        moe.router.expert_bias.copy_(m.expert_bias_E)
    if m.shared_experts is not None:
        s = m.shared_experts
        moe.shared_experts.w13.copy_(torch.cat([full(s.w1.weight), full(s.w3.weight)], dim=0))
        moe.shared_experts.w2.copy_(full(s.w2.weight))


def swap_moe_layers(model: nn.Module, mesh: DeviceMesh | None = None, **moe_config_overrides: Any) -> int:
    """Replace every torchtitan ``MoE`` of ``model`` by a :class:`TorchtitanMoEBlock` on ``mesh`` (("dp", "ep"); None:
    this process owns every expert), in place, with its weights; returns the number replaced. Swap before
    torchtitan's own parallelization (its EP / FSDP); use :func:`moe_ep.parallel.apply_fsdp` instead."""
    cls = _tt_moe_class()
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
    for name, m in targets:
        p = m.routed_experts.inner_experts.w1_EFD
        cfg = moe_config_from_torchtitan(m, **moe_config_overrides)
        moe = MoE(cfg, mesh, device=p.device, dtype=p.dtype)
        _load(moe, m)
        block = TorchtitanMoEBlock(moe, m.to("meta"))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
    return len(targets)


@torch.no_grad()
def unswap_moe_layers(model: nn.Module) -> int:
    """The reverse of :func:`swap_moe_layers`: torchtitan ``MoE`` modules with the current weights (experts
    all-gathered over the EP group: call on every rank). Returns the number restored."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, TorchtitanMoEBlock)]
    for name, block in targets:
        moe = block.moe
        w13, w2 = all_expert_weights(moe)
        m = block._template[0].to_empty(device=w13.device)
        m._init_self_buffers(buffer_device=w13.device)
        inner, f = m.routed_experts.inner_experts, moe.cfg.ffn_hidden
        inner.w1_EFD.copy_(w13[:, :f])
        inner.w3_EFD.copy_(w13[:, f:])
        inner.w2_EDF.copy_(w2)
        m.router.gate.weight.copy_(full(moe.router.weight))
        if m.expert_bias_E is not None:
            m.expert_bias_E.copy_(moe.router.expert_bias)
        if moe.shared_experts is not None:
            gate, up = full(moe.shared_experts.w13).chunk(2, dim=0)
            m.shared_experts.w1.weight.copy_(gate)
            m.shared_experts.w3.weight.copy_(up)
            m.shared_experts.w2.weight.copy_(full(moe.shared_experts.w2))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, m)
    return len(targets)
