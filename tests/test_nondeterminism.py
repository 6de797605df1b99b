"""launch/nondeterminism.py: the replay finder reports exactly the ops whose outputs differ between replays (CPU).

A random op (dropout's mask draw, ``bernoulli_`` on the CPU) stands in for an atomic-order GPU op: replayed on
copies of the same inputs it gives other outputs; every deterministic op of the same step replays bitwise and is not
reported, and ops that allocate without writing (``empty*``) are not replayed at all (their bytes are whatever memory
held).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))
import nondeterminism as nd  # noqa: E402


def _step(dropout: bool):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=gen, requires_grad=True)
    x = torch.randn(8, 16, generator=gen)

    def step():
        h = x @ w
        if dropout:
            h = torch.nn.functional.dropout(h, p=0.5, training=True)
        out = torch.empty(8, 16)  # uninitialized: must not be replayed
        out.copy_(h)
        out.sum().backward()

    return step


def test_finds_the_random_op_only():
    torch.manual_seed(1)
    bad, n = nd.find(_step(dropout=True), replays=3)
    assert n > 0
    assert list(bad) and all("bernoulli" in k or "dropout" in k for k in bad), dict(bad)  # the mask draw


def test_deterministic_step_reports_nothing():
    bad, n = nd.find(_step(dropout=False), replays=3)
    assert n >= 3 and not bad, dict(bad)


def test_bits_compare_nan_payloads_and_signed_zeros():
    a = torch.tensor([0.0, float("nan")])
    assert nd._same(a, a.clone())
    assert not nd._same(torch.tensor([0.0]), torch.tensor([-0.0]))
