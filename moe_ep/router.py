"""Top-k softmax router with the load-balancing auxiliary loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RouterOutput:
    """topk_idx: [T, top_k] int64 global expert ids; topk_w: [T, top_k] fp32; aux_loss: scalar fp32
    (unweighted); probs: [T, E] fp32 softmax."""

    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    aux_loss: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> RouterOutput:
    """logits: [T, E] float -> RouterOutput. Softmax in fp32 over all experts, then top-k.

    aux_loss = E * sum_e f_e * P_e with f_e the fraction of the T*top_k assignments that go to e and P_e the
    mean probability of e (Switch Transformer / GShard); it is 1.0 for perfectly uniform routing.
    """
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_w = topk_w / topk_w.sum(-1, keepdim=True)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, topk_idx.reshape(-1), torch.ones(topk_idx.numel(), device=logits.device))
    frac = counts / max(num_tokens * top_k, 1)
    mean_p = probs.mean(0) if num_tokens else probs.new_zeros(num_experts)
    aux = num_experts * (frac * mean_p).sum()
    return RouterOutput(topk_idx, topk_w, aux, probs)


class Router(nn.Module):
    """Linear gate without bias. weight: [E, H]; forward(x: [T, H]) -> RouterOutput."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, renormalize: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = x.to(torch.float32) @ self.weight.to(torch.float32).t()
        return route(logits, self.top_k, self.renormalize)
