"""moe_ep.integrations.torchtitan against torchtitan's own ``MoE`` (torchtitan 0.3.0; skipped when it does not
import: it needs triton at import time, which a CPU-only torch does not bring, so CI skips this file).

A DeepSeek-V3-like torchtitan MoE (sigmoid, groups, route_norm, route_scale, expert bias, shared experts) and a
Qwen-like one (softmax, no groups, no bias, no shared): outputs and every gradient of our swapped layer (reference
backend, fp32, 1 process and EP over 2 gloo ranks) against torchtitan's, and unswap gives back its weights.

Tolerance: torchtitan's grouped experts cast x, w1, w3, w2 and the SwiGLU output to bf16 (``GroupedExperts.forward``)
while ours compute in fp32; the routing is the same fp32 computation (same experts). So the gap is a few bf16
roundings (2^-9 relative each) per element of the routed part: compared as ||gap||_F <= 2^-6 ||ref||_F for the
outputs and gradients (measured 5e-3..7e-3 on y; swapping gate and up gives 0.7), which an indexing or routing
error exceeds by far.
"""

from __future__ import annotations

import copy

import pytest

tt_moe = pytest.importorskip("torchtitan.models.common.moe")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_ep import init_ep  # noqa: E402
from moe_ep.integrations import torchtitan as tti  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

D, F, E, K = 32, 16, 8, 2


def tt_layer(dsv3: bool, seed: int = 0) -> torch.nn.Module:
    lin = lambda i, o: tt_moe.Linear.Config(in_features=i, out_features=o)  # noqa: E731
    router = tt_moe.TokenChoiceTopKRouter.Config(
        gate=lin(D, E), num_experts=E, top_k=K, score_func="sigmoid" if dsv3 else "softmax", route_norm=True,
        route_scale=2.5 if dsv3 else 1.0, num_expert_groups=4 if dsv3 else None, num_limited_groups=2 if dsv3 else None,
    )  # fmt: skip
    cfg = tt_moe.MoE.Config(
        num_experts=E,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=tt_moe.LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=router,
        load_balance_coeff=1e-3 if dsv3 else None,
        shared_experts=tt_moe.FeedForward.Config(w1=lin(D, 24), w2=lin(24, D), w3=lin(D, 24)) if dsv3 else None,
    )
    torch.manual_seed(seed)
    m = cfg.build()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        if m.expert_bias_E is not None:
            m.expert_bias_E.copy_(torch.linspace(-0.05, 0.05, E))
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def check(dsv3: bool, rank: int, world: int, mesh) -> None:
    ref = tt_layer(dsv3)
    holder = torch.nn.ModuleDict({"moe": copy.deepcopy(ref)})
    assert tti.swap_moe_layers(holder, mesh=mesh, quantize=False, backend="reference", max_tokens_per_rank=64) == 1
    ours = holder["moe"]
    c = ours.moe.cfg
    assert (c.score_func, c.renormalize, c.expert_bias, c.num_shared_experts) == (
        ("sigmoid", True, True, 1) if dsv3 else ("softmax", True, False, 0)
    )
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 6, D, generator=gen) for _ in range(world)]
    dys = [torch.randn(2, 6, D, generator=gen) for _ in range(world)]
    x = xs[rank].clone().requires_grad_()
    y = ours(x)
    (y * dys[rank]).sum().backward()
    xr = torch.cat(xs).requires_grad_()
    yr = ref(xr)
    (yr * torch.cat(dys)).sum().backward()
    bound = 2**-6
    sl = slice(2 * rank, 2 * rank + 2)
    assert _rel(y.detach(), yr[sl].detach()) < bound, _rel(y.detach(), yr[sl].detach())
    assert _rel(x.grad, xr.grad[sl]) < bound
    inner = ref.routed_experts.inner_experts
    lo, hi = ours.moe.first_expert, ours.moe.first_expert + ours.moe.num_local_experts
    pairs = [
        (ours.moe.experts.w13.grad, torch.cat([inner.w1_EFD.grad, inner.w3_EFD.grad], 1)[lo:hi]),
        (ours.moe.experts.w2.grad, inner.w2_EDF.grad[lo:hi]),
    ]
    replicated = [(ours.moe.router.weight.grad, ref.router.gate.weight.grad)]
    if dsv3:
        s = ref.shared_experts
        replicated += [
            (ours.moe.shared_experts.w13.grad, torch.cat([s.w1.weight.grad, s.w3.weight.grad])),
            (ours.moe.shared_experts.w2.grad, s.w2.weight.grad),
        ]
    for g, w in replicated:
        if world > 1:
            g = g.clone()
            dist.all_reduce(g)
        pairs.append((g, w))
    for i, (g, w) in enumerate(pairs):
        assert _rel(g, w) < bound, (i, _rel(g, w))
    assert tti.unswap_moe_layers(holder) == 1
    back = holder["moe"]
    assert isinstance(back, tt_moe.MoE)
    sd, want = back.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    for k in sd:
        assert torch.equal(sd[k], want[k]), k


@pytest.mark.parametrize("dsv3", [True, False])
def test_swap_matches_torchtitan_one_process(dsv3):
    check(dsv3, 0, 1, None)


def _two(rank: int, world: int) -> None:
    mesh = init_ep(ep_size=world)
    for dsv3 in (True, False):
        check(dsv3, rank, world, mesh)


def test_swap_matches_torchtitan_two_ranks():
    run_distributed(_two, 2)
