"""The router: scores (softmax | sigmoid), optional group-limited top-k and expert bias, top-k weights, aux loss.

The one routing code of both backends (:class:`moe_ep.MoE` routes before it picks the backend). All math in fp32;
the top-k ids and weights and the per-expert counts stay on the device (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import SCORE_FUNCS, MoEConfig


@dataclass
class RouterOutput:
    """topk_idx: [T, top_k] int64 global expert ids; topk_w: [T, top_k] fp32; aux_loss: scalar fp32 (unweighted;
    zero when not computed); probs: [T, E] fp32 (softmax probabilities, or sigmoid scores); counts: [E] int64, the
    top-k assignments per expert (device)."""

    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    aux_loss: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor | None = None


def group_limited_mask(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice: [T, E] fp32 selection scores -> [T, E] bool, True on the experts of each token's ``topk_group`` best
    groups (E / n_group consecutive experts per group; a group's score = the sum of its two best choice scores, or
    its best one when a group has a single expert: DeepSeek-V3, torchtitan).

    Example: E=4, n_group=2, topk_group=1, choice [[.1, .2, .9, .0]]: group scores .3, .9 -> [[F, F, T, T]].
    """
    t, e = choice.shape
    per = e // n_group
    grouped = choice.view(t, n_group, per)
    group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, n_group]
    best = group_score.topk(topk_group, dim=-1).indices
    gmask = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return gmask[:, :, None].expand(t, n_group, per).reshape(t, e)


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    score_func: str = "softmax",
    route_scale: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
    compute_aux: bool = True,
) -> RouterOutput:
    """logits: [T, E] float -> RouterOutput, in fp32:

    1. scores = softmax(logits) over the experts, or sigmoid(logits) per expert (``score_func``);
    2. choice = scores + bias (bias: [E], the aux-loss-free balancing bias; selection only);
    3. with n_group > 1, the experts outside each token's topk_group best groups are masked (see
       :func:`group_limited_mask`);
    4. topk_idx = top_k of choice; topk_w = the UNBIASED scores of those experts;
    5. renormalize: topk_w / (sum + 1e-20) (the 1e-20 of DeepSeek-V3 / torchtitan; a no-op for sums >= 1e-12);
    6. topk_w *= route_scale.

    aux_loss = E * sum_e f_e * P_e with f_e the fraction of the T*top_k assignments that go to e and P_e the mean
    over tokens of e's probability (the softmax, or the sigmoid scores normalized to sum 1 per token) (Switch
    Transformer / GShard); it is 1.0 for perfectly uniform routing. ``compute_aux=False`` returns a zero instead.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    num_tokens, num_experts = logits.shape
    logits = logits.to(torch.float32)
    probs = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = probs if bias is None else probs + bias.to(torch.float32)
    if n_group > 1:
        choice = choice.masked_fill(~group_limited_mask(choice, n_group, topk_group), float("-inf"))
    if bias is None and n_group == 1:
        topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)
    else:
        topk_idx = torch.topk(choice, top_k, dim=-1).indices
        topk_w = probs.gather(1, topk_idx)
    if renormalize:
        topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20)
    if route_scale != 1.0:
        topk_w = topk_w * route_scale
    counts = torch.zeros(num_experts, dtype=torch.int64, device=logits.device)
    counts.scatter_add_(0, topk_idx.reshape(-1), torch.ones_like(topk_idx.reshape(-1)))
    if compute_aux:
        frac = counts.to(torch.float32) / max(num_tokens * top_k, 1)
        p = probs if score_func == "softmax" else probs / (probs.sum(-1, keepdim=True) + 1e-20)
        mean_p = p.mean(0) if num_tokens else probs.new_zeros(num_experts)
        aux = num_experts * (frac * mean_p).sum()
    else:
        aux = torch.zeros((), dtype=torch.float32, device=logits.device)
    return RouterOutput(topk_idx, topk_w, aux, probs, counts)


class Router(nn.Module):
    """Linear gate without bias. weight: [E, H]; forward(x: [T, H]) -> RouterOutput (see :func:`route`).

    With ``expert_bias=True`` it holds two buffers: ``expert_bias`` [E] fp32 (persistent, not trainable; keep it in
    fp32 when casting the model) and ``expert_counts`` [E] int64 (not persistent): the top-k assignments of every
    forward in training mode since the last :meth:`update_bias` (with activation checkpointing the recomputed forward
    counts again: the load doubles uniformly, the sign update does not change).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = True,
        device=None,
        dtype=None,
        *,
        score_func: str = "softmax",
        route_scale: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        expert_bias: bool = False,
        compute_aux: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        self.top_k, self.renormalize = top_k, renormalize
        self.score_func, self.route_scale = score_func, route_scale
        self.n_group, self.topk_group, self.compute_aux = n_group, topk_group, compute_aux
        self.expert_bias: torch.Tensor | None
        self.expert_counts: torch.Tensor | None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer(
                "expert_counts", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
            )
        else:
            self.expert_bias = self.expert_counts = None

    @classmethod
    def from_config(cls, cfg: MoEConfig, device=None, dtype=None) -> Router:
        """The router of ``cfg`` (its routing options; the aux loss is skipped when ``cfg.aux_loss_coef == 0``)."""
        return cls(
            cfg.hidden,
            cfg.num_experts,
            cfg.top_k,
            cfg.renormalize,
            device=device,
            dtype=dtype,
            score_func=cfg.score_func,
            route_scale=cfg.route_scale,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            expert_bias=cfg.expert_bias,
            compute_aux=cfg.aux_loss_coef != 0,
        )

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = x.to(torch.float32) @ self.weight.to(torch.float32).t()
        r = route(
            logits,
            self.top_k,
            self.renormalize,
            score_func=self.score_func,
            route_scale=self.route_scale,
            n_group=self.n_group,
            topk_group=self.topk_group,
            bias=self.expert_bias,
            compute_aux=self.compute_aux,
        )
        if self.expert_counts is not None and self.training:
            self.expert_counts.add_(r.counts)  # device-side accumulation; read by update_bias
        return r

    @torch.no_grad()
    def update_bias(self, rate: float, group: dist.ProcessGroup | None = None) -> None:
        """One aux-loss-free balancing step: load = the accumulated counts, summed over ``group`` (the ranks that
        route: every rank of the layer's mesh; None: this process only); ``expert_bias += rate * sign(mean(load) -
        load)``; the counts restart from zero. Device ops and one all-reduce: no host sync."""
        if self.expert_bias is None or self.expert_counts is None:
            raise RuntimeError("update_bias: this router has no expert bias (MoEConfig.expert_bias=False)")
        load = self.expert_counts.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)  # int64: exact at any token count
        load = load.to(torch.float64)
        self.expert_bias.add_(torch.sign(load.mean() - load).to(self.expert_bias.dtype), alpha=rate)
        self.expert_counts.zero_()
