"""Routing options (score_func, norm_topk_prob / renormalize, route_scale, n_group / topk_group, expert_bias,
aux_loss_coef=0) against hand-worked tables, the expert-bias update, and the layer with every option against the
dense oracle. The bias update all-reduced over 2 EP ranks: tests/test_shared_experts.py (one spawn for both).

Tables: logits are chosen so the scores are round numbers (softmax of log(p) is p when sum(p) = 1; sigmoid of
log(p / (1 - p)) is p), and the expected ids / weights were worked out by hand in the comments. Tolerance: fp32
round-off of exp / log / division on values of order 1 (1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_ep import MoE, MoEConfig, update_expert_bias
from moe_ep.router import group_limited_mask, route
from tests.moe_dense import dense_moe

TOL = dict(rtol=1e-6, atol=1e-6)


def _softmax_logits(p: list[list[float]]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log().float()


def _sigmoid_logits(p: list[list[float]]) -> torch.Tensor:
    t = torch.tensor(p, dtype=torch.float64)
    return (t / (1 - t)).log().float()


# (options, scores (softmax probs or sigmoid values), bias, expected ids, expected weights)
TABLE = [
    # softmax [.1 .2 .3 .4], top-2 -> experts 3, 2 with .4, .3; not renormalized
    (dict(top_k=2, renormalize=False), "softmax", [[0.1, 0.2, 0.3, 0.4]], None, [[3, 2]], [[0.4, 0.3]]),
    # renormalized: .4 / .7, .3 / .7
    (dict(top_k=2, renormalize=True), "softmax", [[0.1, 0.2, 0.3, 0.4]], None, [[3, 2]], [[4 / 7, 3 / 7]]),
    # route_scale 2.5 after the renormalization: 10/7, 7.5/7
    (
        dict(top_k=2, renormalize=True, route_scale=2.5),
        "softmax",
        [[0.1, 0.2, 0.3, 0.4]],
        None,
        [[3, 2]],
        [[10 / 7, 7.5 / 7]],
    ),
    # sigmoid [.2 .9 .5 .7]: top-2 experts 1, 3 with .9, .7; renormalized .5625, .4375
    (dict(top_k=2, renormalize=False), "sigmoid", [[0.2, 0.9, 0.5, 0.7]], None, [[1, 3]], [[0.9, 0.7]]),
    (dict(top_k=2, renormalize=True), "sigmoid", [[0.2, 0.9, 0.5, 0.7]], None, [[1, 3]], [[0.5625, 0.4375]]),
    # bias [.6 0 0 -.3] picks on [.8 .9 .5 .4] -> experts 1, 0; the weights are the UNBIASED .9, .2 (/1.1 renormalized)
    (
        dict(top_k=2, renormalize=True),
        "sigmoid",
        [[0.2, 0.9, 0.5, 0.7]],
        [0.6, 0.0, 0.0, -0.3],
        [[1, 0]],
        [[0.9 / 1.1, 0.2 / 1.1]],
    ),
    # softmax with a bias: choice [.1+.35 .2 .3 .4] = [.45 .2 .3 .4] -> experts 0, 3 with unbiased .1, .4
    (dict(top_k=2, renormalize=False), "softmax", [[0.1, 0.2, 0.3, 0.4]], [0.35, 0, 0, 0], [[0, 3]], [[0.1, 0.4]]),
    # group-limited, E=8 in 4 groups of 2, topk_group 2, top-2, sigmoid:
    # token 0 [.9 .1 | .8 .7 | .6 .6 | .2 .95]: group scores (sum of the 2 best) 1.0, 1.5, 1.2, 1.15 -> groups 1, 2
    #   -> experts 2..5 -> 2 (.8), 3 (.7)   (without the limit: 7 (.95), 0 (.9))
    # token 1 [.3 .3 | .1 .2 | .9 .05 | .5 .4]: 0.6, 0.3, 0.95, 0.9 -> groups 2, 3 -> experts 4..7 -> 4 (.9), 6 (.5)
    (
        dict(top_k=2, renormalize=False, n_group=4, topk_group=2),
        "sigmoid",
        [[0.9, 0.1, 0.8, 0.7, 0.6, 0.6, 0.2, 0.95], [0.3, 0.3, 0.1, 0.2, 0.9, 0.05, 0.5, 0.4]],
        None,
        [[2, 3], [4, 6]],
        [[0.8, 0.7], [0.9, 0.5]],
    ),
    # the same token 0 with a bias of +.5 on expert 0: choice [1.4 .1 | .8 .7 | .6 .6 | .2 .95] -> group scores 1.5,
    # 1.5, 1.2, 1.15; topk_group 3 opens groups 0, 1, 2 -> top-2 of the choice: 0 (1.4), 2 (.8); the weights are the
    # unbiased .9, .8, times route_scale 2
    (
        dict(top_k=2, renormalize=False, n_group=4, topk_group=3, route_scale=2.0),
        "sigmoid",
        [[0.9, 0.1, 0.8, 0.7, 0.6, 0.6, 0.2, 0.95]],
        [0.5, 0, 0, 0, 0, 0, 0, 0],
        [[0, 2]],
        [[1.8, 1.6]],
    ),
]


@pytest.mark.parametrize("opts,score_func,scores,bias,ids,weights", TABLE)
def test_route_table(opts, score_func, scores, bias, ids, weights):
    opts = dict(opts)
    top_k, renorm = opts.pop("top_k"), opts.pop("renormalize")
    logits = _softmax_logits(scores) if score_func == "softmax" else _sigmoid_logits(scores)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float32)
    r = route(logits, top_k, renorm, score_func=score_func, bias=b, **opts)
    assert r.topk_idx.tolist() == ids
    torch.testing.assert_close(r.topk_w, torch.tensor(weights, dtype=torch.float32), **TOL)
    assert r.topk_w.dtype == torch.float32 and r.topk_idx.dtype == torch.int64
    # counts: one per (token, slot)
    want = torch.zeros(logits.shape[1], dtype=torch.int64)
    for row in ids:
        for e in row:
            want[e] += 1
    assert torch.equal(r.counts, want)


def test_group_mask_single_expert_groups_and_example():
    # the docstring example
    m = group_limited_mask(torch.tensor([[0.1, 0.2, 0.9, 0.0]]), 2, 1)
    assert m.tolist() == [[False, False, True, True]]
    # one expert per group: a group's score is its expert's score -> plain top-k over topk_group experts
    m = group_limited_mask(torch.tensor([[0.3, 0.1, 0.7, 0.5]]), 4, 2)
    assert m.tolist() == [[False, False, True, True]]


def test_aux_loss_sigmoid_and_off():
    # sigmoid .5 for all 4 experts: normalized P_e = 1/4; 2 tokens top-1 on experts 0 (ties: topk takes the first)
    r = route(torch.zeros(2, 4), 1, True, score_func="sigmoid")
    assert abs(float(r.aux_loss) - 1.0) < 1e-6  # E * sum_e f_e / 4 = 4 * (1 / 4) = 1
    # p = [.2 .9 .5 .7] -> normalized .2/2.3 ...; top-1 -> expert 1 (f_1 = 1): aux = 4 * .9 / 2.3
    r = route(_sigmoid_logits([[0.2, 0.9, 0.5, 0.7]]), 1, False, score_func="sigmoid")
    assert abs(float(r.aux_loss) - 4 * 0.9 / 2.3) < 1e-6
    r = route(torch.randn(5, 4), 2, True, compute_aux=False)
    assert float(r.aux_loss) == 0.0 and r.aux_loss.shape == ()


def test_defaults_are_todays_router():
    """Default options: the former router (softmax over all experts, top-k, renormalized) bit for bit."""
    logits = torch.randn(33, 8, generator=torch.Generator().manual_seed(0))
    r = route(logits, 3, True)
    probs = torch.softmax(logits, -1)
    w, i = torch.topk(probs, 3, -1)
    assert torch.equal(r.topk_idx, i) and torch.equal(r.topk_w, w / w.sum(-1, keepdim=True))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(score_func="relu"), "score_func"),
        (dict(route_scale=0.0), "route_scale"),
        (dict(n_group=3), "must divide num_experts"),
        (dict(n_group=4, topk_group=5), "topk_group .5. exceeds n_group"),
        (dict(n_group=4, topk_group=1, top_k=3), "top_k .3. exceeds the experts"),
        (dict(n_group=0), "n_group must be a positive int"),
        (dict(bias_update_rate=-1.0), "bias_update_rate"),
        (dict(expert_bias=1), "expert_bias must be a bool"),
        (dict(norm_topk_prob=1), "norm_topk_prob"),
        (dict(num_shared_experts=-1), "num_shared_experts"),
        (dict(shared_ffn_hidden=64), "num_shared_experts is 0"),
    ],
)
def test_routing_config_errors(kwargs, match):
    base = dict(hidden=64, ffn_hidden=32, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_norm_topk_prob_alias():
    base = dict(hidden=64, ffn_hidden=32, num_experts=8, top_k=2)
    assert MoEConfig(**base).renormalize is True
    c = MoEConfig(**base, norm_topk_prob=False)
    assert c.renormalize is False and c.norm_topk_prob is None
    import dataclasses

    assert dataclasses.replace(c, renormalize=True).renormalize is True


def _tiny(**kw) -> MoEConfig:
    base = dict(hidden=32, ffn_hidden=32, num_experts=8, top_k=2, quantize=False, backend="reference")
    return MoEConfig(**{**base, **kw})


def test_layer_with_every_option_matches_dense_oracle():
    """sigmoid + groups + bias + route_scale + shared experts, reference backend: y and all gradients equal the
    oracle built from route() + the dense MoE + the shared SwiGLU written out (same fp32 math, different summation
    order: 1e-5)."""
    cfg = _tiny(score_func="sigmoid", n_group=4, topk_group=2, route_scale=2.5, expert_bias=True,
                num_shared_experts=1, shared_ffn_hidden=48, aux_loss_coef=0.0)  # fmt: skip
    moe = MoE(cfg, seed=3)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 32, generator=gen, requires_grad=True)
    dy = torch.randn(19, 32, generator=gen)
    y, aux = moe(x)
    assert float(aux) == 0.0
    (y * dy).sum().backward()

    xd = x.detach().clone().requires_grad_()
    wr = moe.router.weight.detach().clone().requires_grad_()
    w13, w2 = (moe.experts.w13.detach().clone().requires_grad_(), moe.experts.w2.detach().clone().requires_grad_())
    s13, s2 = (moe.shared_experts.w13.detach().clone().requires_grad_(),
               moe.shared_experts.w2.detach().clone().requires_grad_())  # fmt: skip
    r = route(xd @ wr.t(), 2, True, score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2,
              bias=moe.router.expert_bias)  # fmt: skip
    gate, up = (xd @ s13.t()).chunk(2, -1)
    yd = dense_moe(xd, r.topk_idx, r.topk_w, w13, w2, quantize=False) + (torch.nn.functional.silu(gate) * up) @ s2.t()
    (yd * dy).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, yd, **tol)
    for mine, want in [(x.grad, xd.grad), (moe.router.weight.grad, wr.grad), (moe.experts.w13.grad, w13.grad),
                       (moe.experts.w2.grad, w2.grad), (moe.shared_experts.w13.grad, s13.grad),
                       (moe.shared_experts.w2.grad, s2.grad)]:  # fmt: skip
        torch.testing.assert_close(mine, want, **tol)


def test_expert_bias_counts_and_update_one_process():
    cfg = _tiny(num_experts=4, top_k=1, expert_bias=True, bias_update_rate=0.01)
    moe = MoE(cfg)
    with torch.no_grad():  # router: token t goes to expert argmax(x_t[:4]) (one-hot weight rows)
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = torch.eye(4) * 10
    x = torch.zeros(8, 32)
    for t, e in enumerate([0, 0, 0, 0, 0, 1, 2, 2]):
        x[t, e] = 1.0
    moe.train()
    moe(x)
    moe(x[:2])  # counts accumulate over forwards: [5+2, 1, 2, 0]
    assert moe.router.expert_counts.tolist() == [7, 1, 2, 0]
    moe.eval()
    moe(x)  # eval forwards do not count
    assert moe.router.expert_counts.tolist() == [7, 1, 2, 0]
    assert update_expert_bias(moe) == 1
    # load [7 1 2 0], mean 2.5 -> sign(mean - load) = [-1 +1 +1 +1] -> bias = 0.01 * that
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert moe.router.expert_counts.tolist() == [0, 0, 0, 0]
    # a load exactly at the mean does not move: load [1 1 1 1] -> no change
    moe.train()
    moe(torch.nn.functional.pad(torch.eye(4), (0, 28)))  # token t -> expert t
    assert moe.router.expert_counts.tolist() == [1, 1, 1, 1]
    moe.update_expert_bias()
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert moe.router.expert_bias.dtype == torch.float32 and not moe.router.expert_bias.requires_grad
    assert "router.expert_bias" in moe.state_dict() and "router.expert_counts" not in moe.state_dict()


def test_aux_loss_coef_zero_trains():
    moe = MoE(_tiny(aux_loss_coef=0.0))
    x = torch.randn(6, 32, requires_grad=True)
    y, aux = moe(x)
    (y.sum() + aux).backward()
    assert float(aux) == 0.0 and torch.isfinite(x.grad).all() and moe.router.weight.grad.abs().sum() > 0
    assert math.isfinite(float(y.detach().sum()))
