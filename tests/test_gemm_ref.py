"""Reference expert MLP (grouped GEMMs + SwiGLU + MXFP8 recipe) against plain PyTorch autograd."""

from __future__ import annotations

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.reference import expert_mlp, fake_quantize_grouped_cols, grouped_mm_torch, grouped_wgrad_torch


def _plain(x, w13, w2, sizes):
    outs, start = [], 0
    for e, n in enumerate(sizes):
        a = x[start : start + n] @ w13[e].t()
        f = a.shape[1] // 2
        outs.append((torch.nn.functional.silu(a[:, :f]) * a[:, f:]) @ w2[e].t())
        start += n
    return torch.cat(outs)


def _inputs(sizes, h=64, f=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(sizes)
    x = torch.randn(sum(sizes), h, generator=g, dtype=torch.float64).float().requires_grad_()
    w13 = (torch.randn(e, 2 * f, h, generator=g) * 0.1).requires_grad_()
    w2 = (torch.randn(e, h, f, generator=g) * 0.1).requires_grad_()
    return x, w13, w2


SIZES = [[5, 0, 37, 1], [0, 0, 40, 0], [33], [7, 64, 0, 3]]


@pytest.mark.parametrize("sizes", SIZES)
def test_unquantized_matches_autograd(sizes):
    x, w13, w2 = _inputs(sizes)
    dy = torch.randn(sum(sizes), 64)
    y = expert_mlp(x, w13, w2, sizes, quantize=False)
    gx, g13, g2 = torch.autograd.grad(y, (x, w13, w2), dy)
    yr = _plain(x, w13, w2, sizes)
    rx, r13, r2 = torch.autograd.grad(yr, (x, w13, w2), dy)
    # both fp32 with the same products; only summation order / fused kernels differ: a few fp32 ulps
    for a, b in [(y, yr), (gx, rx), (g13, r13), (g2, r2)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", SIZES)
def test_quantized_close_to_unquantized(sizes):
    x, w13, w2 = _inputs(sizes, seed=1)
    dy = torch.randn(sum(sizes), 64)
    q = torch.autograd.grad(expert_mlp(x, w13, w2, sizes, True), (x, w13, w2), dy)
    r = torch.autograd.grad(_plain(x, w13, w2, sizes), (x, w13, w2), dy)
    # each MXFP8 operand carries <= 2^-4 relative rounding per element; a product of two such operands in a
    # chain of three GEMMs accumulates a few of those, but random errors average out in the sums: the
    # relative norm error sits near 3-5%; 0.15 catches a wrong scale or axis (those give O(1) errors)
    for a, b in zip(q, r, strict=True):
        assert torch.linalg.norm(a - b) <= 0.15 * torch.linalg.norm(b) + 1e-12


def test_grouped_cols_blocks_start_per_group():
    t = torch.randn(48, 32)
    t[40] *= 1e6  # a huge row in group 1 must not coarsen group 0's scales
    out = fake_quantize_grouped_cols(t, [40, 8])
    assert torch.equal(out[:32], mxfp8.fake_quantize(t[:32], 0))
    pad = torch.cat([t[32:40], torch.zeros(24, 32)])
    assert torch.equal(out[32:40], mxfp8.fake_quantize(pad, 0)[:8])
    assert torch.equal(out[40:], mxfp8.fake_quantize(torch.cat([t[40:], torch.zeros(24, 32)]), 0)[:8])


def test_grouped_mm_helpers():
    a, b = torch.randn(10, 8), torch.randn(3, 6, 8)
    out = grouped_mm_torch(a, b, [4, 0, 6])
    torch.testing.assert_close(out, torch.cat([a[:4] @ b[0].t(), a[4:] @ b[2].t()]))
    c = torch.randn(10, 5)
    wg = grouped_wgrad_torch(a, c, [4, 0, 6])
    assert torch.equal(wg[1], torch.zeros(8, 5))
    torch.testing.assert_close(wg[2], a[4:].t() @ c[4:])


def test_bad_shapes():
    x, w13, w2 = _inputs([3, 3])
    with pytest.raises(ValueError, match="sum to"):
        expert_mlp(x, w13, w2, [3, 2])
    with pytest.raises(ValueError, match="shapes"):
        expert_mlp(x, w13, w2[:1], [3, 3])


def test_wgrad_prepared_reference_worked_example():
    """grouped_wgrad_prepared_torch reads group g at rows 64 poff_g of the prepared layout: sizes [40, 0, 8] put
    group 0 at rows 0-39 and group 2 at rows 64-71; equal to grouped_wgrad_torch on the unpadded rows."""
    from moe_ep.mxfp8 import colwise_prep_rows
    from tests.refs import colwise_prep_rows_used, grouped_wgrad_prepared_torch

    sizes = [40, 0, 8]
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 16, generator=gen), torch.randn(48, 24, generator=gen)
    rows = colwise_prep_rows(48, 3)
    assert rows == 64 * (1 + 3)
    ap, bp = torch.full((rows, 16), 7.0), torch.full((rows, 24), 7.0)  # filler outside the groups must not count
    ap[0:40], bp[0:40], ap[64:72], bp[64:72] = a[:40], b[:40], a[40:], b[40:]
    got = grouped_wgrad_prepared_torch(ap, bp, sizes, 48)
    assert torch.equal(got, grouped_wgrad_torch(a, b, sizes))
    assert torch.equal(got[1], torch.zeros(16, 24))
    with pytest.raises(ValueError, match="sum to 49, more than M = 48"):
        grouped_wgrad_prepared_torch(ap, bp, [41, 0, 8], 48)
    assert colwise_prep_rows_used(sizes) == 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dh_rounded_to_the_input_dtype(dtype, monkeypatch):
    """The recipe rounds dh to x's dtype before the SwiGLU backward, as it rounds A: bf16 in a bf16 model, which is
    what the CUDA step's dgrad writes (moe_ep.experts.sm90.mlp) and what mx_swiglu_dual reads."""
    from moe_ep.experts import reference as gemm  # noqa: PLC0415

    seen = []
    real = gemm.swiglu_bwd
    monkeypatch.setattr(gemm, "swiglu_bwd", lambda a, dh: (seen.append(dh), real(a, dh))[1])
    sizes = [5, 0, 37]
    x, w13, w2 = (t.detach().to(dtype) for t in _inputs(sizes))
    dout = torch.randn(sum(sizes), 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    _, a = gemm.expert_mlp_fwd(x, w13, w2, sizes, True)
    gemm.expert_mlp_bwd(dout, x, a, w13, w2, sizes, True)
    q = mxfp8.fake_quantize
    want = grouped_mm_torch(q(dout, -1), q(w2, -2).transpose(1, 2), sizes)
    assert len(seen) == 1 and seen[0].dtype == dtype
    assert torch.equal(seen[0], want.to(dtype))
    if dtype == torch.bfloat16:  # the rounding is real: the fp32 products are not all bf16 values
        assert not torch.equal(want, want.to(dtype).float())
