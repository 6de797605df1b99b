"""The expert MLP on the CUDA kernels (moe_ep.experts.sm90.mlp) against the reference recipe
(moe_ep.experts.reference.expert_mlp).

Tolerance. Both sides run the same MXFP8 recipe: every GEMM operand quantized along its reduction axis, products of
exactly dequantized operands, fp32 sums. They differ only in the fp32 summation order inside the GEMMs, and an
intermediate (A, h, dh, dA) that lands on the other side of a bf16 or e4m3 rounding boundary then takes the
neighbouring value. So the gap is a few rounding steps on a few elements, while the recipe's own error against
unquantized bf16 math is one e4m3 rounding (up to 2**-4 relative) on every element. We require the gap (relative
Frobenius norm) to be at most 1/10 of the recipe's error on the same inputs, measured in the test. Indexing, scale or
layout bugs give errors of the order of the values themselves, far above it.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.experts import reference as gemm
from moe_ep.experts.sm90.mlp import expert_mlp_cuda
from moe_ep.experts.weight_cache import WeightQuantCache

CUDA = torch.cuda.is_available()


def _skip_without_gpu():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _problem(sizes, hdim, ffn, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, e = sum(sizes), len(sizes)
    x = torch.randn(m, hdim, generator=gen, device="cuda").bfloat16()
    w13 = (torch.randn(e, 2 * ffn, hdim, generator=gen, device="cuda") * hdim**-0.5).bfloat16()
    w2 = (torch.randn(e, hdim, ffn, generator=gen, device="cuda") * ffn**-0.5).bfloat16()
    dout = torch.randn(m, hdim, generator=gen, device="cuda").bfloat16()
    return x, w13, w2, dout


def _run(fn, x, w13, w2, dout, *args):
    xs, w13s, w2s = (t.detach().clone().requires_grad_(True) for t in (x, w13, w2))
    out = fn(xs, w13s, w2s, *args)
    out.backward(dout)
    return out.detach(), xs.grad, w13s.grad, w2s.grad


SIZES = [
    [300, 0, 77, 1, 1000, 129],  # empty expert, sizes neither multiples of 32 nor of 128
    [0, 0, 2048, 0],  # every row on one expert
    [64, 33, 31, 200, 5, 400, 0, 96],  # half tiles (<= 64 rows in a last 128-row tile) next to full ones
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(SIZES)))
@pytest.mark.parametrize("hdim", [256, 3072])  # 3072: the GEMMs reducing over it run the long-reduction build
# F = 96: the SwiGLU backward quantizer falls back to mx_quant (F % 128 != 0); F = 128: mx_swiglu_dual runs it
@pytest.mark.parametrize("ffn", [96, 128])
def test_matches_reference_recipe(case, hdim, ffn):
    _skip_without_gpu()
    sizes = SIZES[case]
    x, w13, w2, dout = _problem(sizes, hdim, ffn, seed=case)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    got = _run(expert_mlp_cuda, x, w13, w2, dout, sz)
    ref = _run(gemm.expert_mlp, x, w13, w2, dout, sizes, True)
    bf16 = _run(gemm.expert_mlp, x, w13, w2, dout, sizes, False)

    def check(name, g, r, b):
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        recipe = _rel(r, b)
        assert recipe > 1e-3, f"{name}: the recipe's own error {recipe:.2e} is too small to bound anything"
        gap = _rel(g, r)
        assert gap <= 0.1 * recipe, f"{name}: gap to the reference recipe {gap:.2e} > 0.1 x recipe error {recipe:.2e}"

    for name, g, r, b in zip(("out", "dx", "dw13", "dw2"), got, ref, bf16, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, f"{name}: {g.shape} {g.dtype} vs {r.shape} {r.dtype}"
        check(name, g, r, b)
    for e, n in enumerate(sizes):  # per expert too: a small expert's error would vanish in the whole norm
        for name, i in (("dw13", 2), ("dw2", 3)):
            if n:
                check(f"{name}[{e}] ({n} rows)", got[i][e], ref[i][e], bf16[i][e])
            else:  # empty experts get exactly zero weight gradients
                assert not got[i][e].any(), f"{name}[{e}]: an empty expert got a nonzero gradient"


@pytest.mark.gpu
def test_deterministic_cached_and_sync_free():
    """The same inputs give the same bits; the weight cache quantizes once per weight version; the second forward
    and backward (weights' operands cached) run with no host synchronization."""
    _skip_without_gpu()
    sizes, hdim, ffn = [500, 0, 300, 700], 128, 64
    x, w13, w2, dout = _problem(sizes, hdim, ffn, seed=7)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    w13p, w2p = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())
    cache = WeightQuantCache()
    outs, dxs, grads = [], [], []
    for it in range(2):
        xs = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        if it == 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = expert_mlp_cuda(xs, w13p, w2p, sz, cache)
            out.backward(dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append(out.detach())
        dxs.append(xs.grad)
        grads.append((w13p.grad.clone(), w2p.grad.clone()))
        assert cache.misses == 2  # w13 and w2 once each: the backward and the second call reuse them
    assert torch.equal(outs[0], outs[1]) and torch.equal(dxs[0], dxs[1])
    assert torch.equal(grads[1][0], 2 * grads[0][0]) and torch.equal(grads[1][1], 2 * grads[0][1])  # accumulated
    uncached = _run(expert_mlp_cuda, x, w13, w2, dout, sz)  # no cache: the same bits
    assert torch.equal(uncached[0], outs[0]) and torch.equal(uncached[1], dxs[0])
    assert torch.equal(uncached[2], grads[0][0]) and torch.equal(uncached[3], grads[0][1])
    w13n, w2n = torch.nn.Parameter(w13.clone()), torch.nn.Parameter(w2.clone())
    expert_mlp_cuda(x, w13n, w2n, sz).backward(dout)  # x needs no gradient: the backward skips the dx GEMM
    assert torch.equal(w13n.grad, grads[0][0]) and torch.equal(w2n.grad, grads[0][1])
    with torch.no_grad():  # an optimizer step: the next call quantizes the new W2 (only)
        w2p.mul_(0.5)
    out2 = expert_mlp_cuda(x, w13p, w2p, sz, cache)
    assert cache.misses == 3
    # W2 / 2 has the same e4m3 elements and scales one lower: every product and sum halves exactly
    assert torch.equal(out2, 0.5 * outs[0])


def test_rejects_bad_inputs():
    """Checked before any kernel runs (also on CPU)."""
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(2, 64, 64), torch.zeros(2, 64, 32)
    sz = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="shapes"):
        expert_mlp_cuda(x, w13, torch.zeros(2, 64, 64), sz)
    with pytest.raises(TypeError, match="bf16"):
        expert_mlp_cuda(x.float(), w13, w2, sz)
    with pytest.raises(ValueError, match="multiples of 32"):
        expert_mlp_cuda(torch.zeros(8, 48, dtype=torch.bfloat16), torch.zeros(2, 64, 48), torch.zeros(2, 48, 32), sz)
    with pytest.raises(TypeError, match="int32"):
        expert_mlp_cuda(x, w13, w2, sz.long())
    with pytest.raises(TypeError, match="int32"):
        expert_mlp_cuda(x, w13, w2, [4, 4])
    with pytest.raises(ValueError, match="CUDA"):
        expert_mlp_cuda(x, w13, w2, sz)


@pytest.mark.gpu
def test_rows_past_the_groups_cost_nothing_and_change_nothing():
    """A buffer with rows past the groups (capacity mode, dropless worst-case sizing): HOPPER_MXFP8's forward and
    backward on M = S + 300 rows (junk past S, as a worst-case buffer holds) give bitwise the results of M = S on the
    groups' rows and weight gradients, with no host sync; the forward's h is row-only (colwise="none") and x's column
    operand comes from the saved rows in one pass (colwise_from_rows)."""
    _skip_without_gpu()
    from moe_ep.experts.sm90.mlp import HOPPER_MXFP8

    sizes, hdim, ffn = [500, 0, 300, 1, 0, 77], 256, 128
    x, w13, w2, dout = _problem(sizes, hdim, ffn, seed=9)
    s = sum(sizes)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    res = []
    for pad in (0, 300):
        xp = torch.cat([x, torch.full((pad, hdim), float("nan"), device="cuda").bfloat16()])
        dp = torch.cat([dout, torch.full((pad, hdim), 3e38, device="cuda").bfloat16()])
        w13o, w2o = HOPPER_MXFP8.prepare(w13, None, dgrad=False), HOPPER_MXFP8.prepare(w2, None, dgrad=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            xq, xs = HOPPER_MXFP8.quantize_rows(xp, sz)
            out, saved = HOPPER_MXFP8.mlp_fwd(xq, xs, w13o, w2o, sz)
            saved["dout"] = dp
            w13b, w2b = HOPPER_MXFP8.prepare(w13, None, fprop=False), HOPPER_MXFP8.prepare(w2, None, fprop=False)
            dx, dw13, dw2 = HOPPER_MXFP8.mlp_bwd(saved, w13, w2, w13b, w2b, sz, lambda d: d)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        res.append((out[:s], dx[:s], dw13, dw2))
    for name, a, b in zip(("out", "dx", "dw13", "dw2"), *res, strict=True):
        assert torch.equal(a, b), f"{name}: rows past the groups changed the result"


@pytest.mark.gpu
def test_forward_writes_no_column_operand_of_h():
    """expert_mlp_mx_fwd launches the row-only SwiGLU quantizer; the backward builds x's column operand in one pass."""
    _skip_without_gpu()
    from moe_ep.mxfp8 import cuda as mxfp8_cuda

    sizes, hdim, ffn = [64, 0, 200], 128, 128
    x, w13, w2, dout = _problem(sizes, hdim, ffn, seed=11)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    names = []
    launch = mxfp8_cuda._launch

    def rec(name, *a, **k):
        names.append(name)
        return launch(name, *a, **k)

    mxfp8_cuda._launch = rec
    try:
        xs = x.clone().requires_grad_(True)
        expert_mlp_cuda(xs, w13, w2, sz).backward(dout)
    finally:
        mxfp8_cuda._launch = launch
    assert any(n.startswith("mx_swiglu_dual<0,0,") for n in names), names  # forward: row-only h
    assert any(n.startswith("mx_swiglu_dual<0,5,") for n in names), names  # backward: h's column operand
    assert any(n.startswith("mx_quant_dual<6,5,") for n in names), names  # backward: x's, from the saved rows
    assert not any(n.startswith("mx_dequant") for n in names), names  # no bf16 copy of x
