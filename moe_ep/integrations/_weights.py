"""Weights of our MoE in the full form another library stores: FSDP2 shards gathered, the experts of every EP rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


def full(t: torch.Tensor) -> torch.Tensor:
    """t, or the whole tensor of an FSDP2-sharded DTensor (gathered: a collective over its mesh)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_expert_weights(moe) -> tuple[torch.Tensor, torch.Tensor]:
    """moe: a :class:`moe_ep.layer.MoE` -> (w13 [E, 2F, H], w2 [E, H, F]) of all E experts, detached: this rank's
    experts gathered from FSDP2 shards, then all-gathered over the EP group in rank order (a collective: call on every
    rank of the group)."""
    w13, w2 = full(moe.experts.w13).detach(), full(moe.experts.w2).detach()
    if moe.ep_group is None:
        return w13, w2
    parts13 = [torch.empty_like(w13) for _ in range(moe.ep_size)]
    parts2 = [torch.empty_like(w2) for _ in range(moe.ep_size)]
    dist.all_gather(parts13, w13.contiguous(), group=moe.ep_group)
    dist.all_gather(parts2, w2.contiguous(), group=moe.ep_group)
    return torch.cat(parts13), torch.cat(parts2)
