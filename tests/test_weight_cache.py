"""WeightQuantCache: recompute exactly when the weight changes (CPU; the quantizer is the reference one)."""

from __future__ import annotations

import gc

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.sm90 import operands  # noqa: E402
from moe_ep.experts.weight_cache import WeightQuantCache


def _q(w: torch.Tensor):
    t = mxfp8.quantize_torch(w, -1)
    return t.data, t.scale


def _same(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_cached_until_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(4, 64, 96))
    cache = WeightQuantCache()
    first = cache.get(w, "fprop", _q)
    assert cache.get(w, "fprop", _q) is first and cache.misses == 1
    opt = torch.optim.SGD([w], lr=0.5)
    w.grad = torch.randn_like(w)
    opt.step()  # in-place update: the version counter moves
    second = cache.get(w, "fprop", _q)
    assert cache.misses == 2 and second is not first
    assert _same(second, _q(w.detach()))  # the new value, not the stale one
    assert not _same(second, first)


def test_kinds_are_separate_and_new_tensors_miss():
    w = torch.randn(2, 32, 64)
    cache = WeightQuantCache()
    a = cache.get(w, "fprop", _q)
    b = cache.get(w, "dgrad", lambda t: _q(t.transpose(-1, -2).contiguous()))
    assert cache.misses == 2 and a[0].shape == (2, 32, 64) and b[0].shape == (2, 64, 32)
    w2 = w.clone()  # same values, another tensor: recomputed (identity, not value, is the key)
    cache.get(w2, "fprop", _q)
    assert cache.misses == 3


def test_dead_weights_are_released():
    cache = WeightQuantCache()
    w = torch.randn(1, 32, 32)
    keep = torch.randn(1, 32, 32)  # allocated while w lives: a different id, so no slot is simply overwritten
    cache.get(w, "fprop", _q)
    del w
    gc.collect()
    cache.get(keep, "fprop", _q)  # a miss on another weight prunes the dead entry
    assert len(cache._entries) == 1
    assert all(e.ref() is keep for e in cache._entries.values())


def test_weight_operands_match_the_reference_and_are_cached():
    """operands.weight_operands: fprop and dgrad operands (the reference converters' bytes) and both prepared bf16
    weights; with a cache, computed once per weight version."""

    w = torch.nn.Parameter(torch.randn(2, 64, 96) * 0.1)
    cache = WeightQuantCache()
    ops = operands.weight_operands(w, cache)
    wd, ws = operands.weight_operand_ref(w.detach())
    wtd, wts = operands.weight_t_operand_ref(w.detach())
    assert _same((ops.w, ops.w_scale), (wd, ws)) and _same((ops.wt, ops.wt_scale), (wtd, wts))
    assert torch.equal(ops.w_prepared, operands.prepare_weight_bf16_torch(wd, ws))
    assert torch.equal(ops.wt_prepared, operands.prepare_weight_bf16_torch(wtd, wts))
    assert ops.w_prepared.shape == (2, 64, 128) and ops.wt_prepared.shape == (2, 96, 64)
    assert operands.weight_operands(w, cache) is ops and cache.misses == 1
    with torch.no_grad():
        w.mul_(2.0)  # the version moves: new operands (every scale one higher, the same e4m3 codes)
    ops2 = operands.weight_operands(w, cache)
    assert cache.misses == 2 and torch.equal(ops2.w_prepared, 2 * ops.w_prepared)
    with pytest.raises(ValueError, match="multiples of 32"):
        operands.weight_operands(torch.randn(2, 48, 96))


def test_stale_value_released_before_recompute():
    """A weight change drops the stale value before the new one is computed (no transient of both)."""
    import weakref

    w = torch.nn.Parameter(torch.randn(2, 32, 64))
    cache = WeightQuantCache()
    old = weakref.ref(cache.get(w, "fprop", lambda t: t.clone()))
    with torch.no_grad():
        w.add_(1.0)
    seen = []

    def fn(t):
        gc.collect()
        seen.append(old() is None)
        return t.clone()

    cache.get(w, "fprop", fn)
    assert seen == [True], "the stale value was still alive while the new one was computed"


def test_prepare_holds_only_the_direction_asked_for():
    """The Hopper MXFP8 gemms' prepare without a cache keeps only the operand of the pass that reads it (fprop in
    the forward, dgrad in the backward); with a cache, both (shared by every micro-batch)."""
    from moe_ep.experts.sm90.mlp import GEMMS

    w = torch.randn(2, 64, 96) * 0.1
    fwd = GEMMS.prepare(w, None, dgrad=False)
    assert fwd.w_prepared is not None and fwd.w is not None
    assert fwd.wt_prepared is None and fwd.wt is None and fwd.wt_scale is None
    bwd = GEMMS.prepare(w, None, fprop=False)
    assert bwd.wt_prepared is not None and bwd.w_prepared is None and bwd.w is None
    assert torch.equal(bwd.wt_prepared, operands.weight_operands(w).wt_prepared)
    cached = GEMMS.prepare(w, WeightQuantCache(), dgrad=False)
    assert cached.w_prepared is not None and cached.wt_prepared is not None
