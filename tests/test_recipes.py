"""The recipe table (moe_ep/recipe.py): its rows, hand-checked; the reference quantizing generically from it (MXFP8
bitwise equal to the format's own functions, blockwise by its block shapes); and, on a GPU, the CUDA expert MLP of
every row that has an implementation against the reference of that row."""

from __future__ import annotations

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.config import MoEConfig
from moe_ep.experts import reference as ref
from moe_ep.mxfp8.reference import quantize_blocks_torch
from moe_ep.recipe import BLOCKWISE, GEMM_NAMES, MXFP8, RECIPES, Operand, get_recipe


def test_table_rows_by_hand():
    """Each row lists the six GEMMs in order; the operands' tensors, blocks and sources are the documented ones."""
    assert set(RECIPES) == {"mxfp8", "blockwise"} and RECIPES["mxfp8"] is MXFP8
    for r in RECIPES.values():
        assert tuple(g.name for g in r.gemms) == GEMM_NAMES
        assert [(g.a.tensor, g.b.tensor) for g in r.gemms] == [
            ("x", "w13"),
            ("h", "w2"),
            ("dy", "w2"),
            ("da", "w13"),
            ("dy", "h"),
            ("da", "x"),
        ]
        assert [g.out for g in r.gemms] == ["a", "o", "dh", "dx", "dw2", "dw13"]
        wg = [r.gemm("wgrad2"), r.gemm("wgrad1")]
        assert all(op.grouped for g in wg for op in (g.a, g.b))
        assert not any(op.grouped for g in r.gemms[:4] for op in (g.a, g.b))
        assert (wg[0].a.source, wg[1].b.source) == ("requantize", "requantize")  # dy^T and x^T: rounded twice
    assert MXFP8.act_block == 32 and MXFP8.weight_block == (1, 32) and MXFP8.gemm("dgrad1").b.block == (1, 32)
    assert BLOCKWISE.act_block == 128 and BLOCKWISE.weight_block == (128, 128)
    assert BLOCKWISE.gemm("dgrad2").b.block == (128, 128) and BLOCKWISE.gemm("wgrad1").a.block == (1, 128)
    assert get_recipe("bf16") is None and get_recipe("blockwise") is BLOCKWISE
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        get_recipe("fp4")
    with pytest.raises(ValueError, match="grouped"):
        Operand("x", (32, 32), True, "swiglu")


def test_config_recipe_and_quantize_switch():
    """recipe names the row; quantize=False is recipe bf16; blockwise needs multiples of 128."""
    assert MoEConfig(64, 96, 8, 2).recipe_row is MXFP8
    c = MoEConfig(64, 96, 8, 2, quantize=False)
    assert c.recipe == "bf16" and c.recipe_row is None and not c.quantize
    c = MoEConfig(128, 256, 8, 2, recipe="blockwise")
    assert c.quantize and c.recipe_row is BLOCKWISE
    with pytest.raises(ValueError, match="multiples of 128"):
        MoEConfig(128, 96, 8, 2, recipe="blockwise")
    with pytest.raises(ValueError, match="contradicts"):
        MoEConfig(128, 256, 8, 2, recipe="blockwise", quantize=False)
    with pytest.raises(ValueError, match="recipe must be one of"):
        MoEConfig(64, 96, 8, 2, recipe="mxfp4")


def _awkward(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[1, 5] = float("nan")
    x[2] = 0.0
    return x


def test_generic_operand_quantization_matches_the_mxfp8_functions():
    """quantize_operand on MXFP8's operands == mxfp8.fake_quantize along the operand's reduction axis, bit for bit:
    activations along K, a weight along its input axis (fprop) and along its output axis (dgrad), grouped columns
    restarting at each group (sizes 40, 0, 27: blocks of rows 0-31, 32-39 and 40-66, the short ones zero padded)."""
    x = _awkward(67, 64, 0)
    w = _awkward(96, 64, 1).reshape(3, 32, 64)
    sizes = [40, 0, 27]
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    assert same(ref.quantize_operand(x, MXFP8.gemm("fprop1").a, sizes), mxfp8.fake_quantize(x, -1))
    assert same(ref.quantize_operand(w, MXFP8.gemm("fprop1").b, sizes), mxfp8.fake_quantize(w, -1))
    assert same(ref.quantize_operand(w, MXFP8.gemm("dgrad1").b, sizes, transposed=True), mxfp8.fake_quantize(w, -2))
    cols = torch.cat(
        [
            mxfp8.fake_quantize(x[:32], 0),
            mxfp8.fake_quantize(torch.cat([x[32:40], x.new_zeros(24, 64)]), 0)[:8],
            mxfp8.fake_quantize(torch.cat([x[40:67], x.new_zeros(5, 64)]), 0)[:27],
        ]
    )
    assert same(ref.quantize_operand(x, MXFP8.gemm("wgrad1").b, sizes), cols)


def test_generic_operand_quantization_blockwise_blocks():
    """Blockwise operands: activations in 1x128 blocks; one 128x128 quantization serves both weight views; grouped
    128-row blocks never straddle two groups (group 1's rows change when group 0 grows)."""
    x = _awkward(300, 256, 2)
    d, s = quantize_blocks_torch(x, (1, 128))
    assert s.shape == (300, 2)
    got = ref.quantize_operand(x, BLOCKWISE.gemm("fprop1").a, [300])
    assert torch.equal(got.nan_to_num(7.0), mxfp8.reference.dequantize_blocks_torch(d, s, (1, 128)).nan_to_num(7.0))
    w = _awkward(384, 256, 3).reshape(3, 128, 256)
    f = ref.quantize_operand(w, BLOCKWISE.gemm("fprop1").b, [])
    t = ref.quantize_operand(w, BLOCKWISE.gemm("dgrad1").b, [], transposed=True)
    assert torch.equal(f.nan_to_num(7.0), t.nan_to_num(7.0))
    y = torch.randn(260, 128)
    a = ref.quantize_operand(y, BLOCKWISE.gemm("wgrad2").b, [130, 130])
    y2 = y.clone()
    y2[0, :] *= 1000.0  # group 0's first block: its amax rises; group 1 must not move
    b = ref.quantize_operand(y2, BLOCKWISE.gemm("wgrad2").b, [130, 130])
    assert torch.equal(a[130:], b[130:]) and not torch.equal(a[1:128], b[1:128])
    assert torch.equal(a[128:130], b[128:130])  # group 0's short second block (rows 128-129) is its own block


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_reference_layer_runs_every_recipe(name):
    """The reference expert MLP of every row against fp32 math: finite, and within the recipe's rounding (e4m3 keeps
    3 mantissa bits: each operand within 2**-4 relative per element, so a product of two GEMMs within ~4 of those,
    10% of the norm as a loose bound for random data)."""
    torch.manual_seed(0)
    e, h, f = 3, 128, 256
    sizes = [40, 0, 27]
    x = torch.randn(sum(sizes), h)
    w13, w2 = torch.randn(e, 2 * f, h) * 0.05, torch.randn(e, h, f) * 0.05
    got = ref.expert_mlp(x, w13, w2, sizes, RECIPES[name])
    want = ref.expert_mlp(x, w13, w2, sizes, False)
    assert torch.isfinite(got).all()
    assert (got - want).norm() / want.norm() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_cuda_expert_mlp_matches_reference_for_every_row(name):
    """Every row of the table with an implementation on this GPU: the CUDA expert MLP (``gemms_for``) on the recipe's
    dispatch payload == the reference of that row. Bound (as tests/test_expert_mlp_cuda.py): both sides round the
    same operands the same way and differ in fp32 summation order (and, for FP8 tensor cores, in the accumulation
    inside one 128-long block), which moves an intermediate (a, dh) across a rounding boundary of the next
    quantization only now and then; so the gap must stay below 1/10 of the recipe's own error against unquantized
    math, measured here. A wrong block, axis or scale gives errors of the order of the values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    from moe_ep.experts.base import gemms_for  # noqa: PLC0415

    try:
        gemms = gemms_for(torch.device("cuda"), name)
    except NotImplementedError as e:
        pytest.skip(str(e))
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, f = 4, 256, 384
    sizes = [200, 0, 77, 1]
    dev = torch.device("cuda")
    x = torch.randn(sum(sizes), h, generator=gen, device=dev).bfloat16()
    w13 = (torch.randn(e, 2 * f, h, generator=gen, device=dev) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, f, generator=gen, device=dev) * f**-0.5).bfloat16()
    dout = torch.randn(sum(sizes), h, generator=gen, device=dev).bfloat16()
    gs = torch.tensor(sizes, dtype=torch.int32, device=dev)
    xq, xs = gemms.quantize_rows(x, gs)
    w13o, w2o = gemms.prepare(w13, None), gemms.prepare(w2, None)
    out, saved = gemms.mlp_fwd(xq, xs, w13o, w2o, gs)
    saved["dout"] = dout
    dx, dw13, dw2 = gemms.mlp_bwd(saved, w13, w2, w13o, w2o, gs, lambda d: d)

    def reference(recipe):
        xs_, w13s, w2s = (t.detach().clone().requires_grad_(True) for t in (x, w13, w2))
        o = ref.expert_mlp(xs_, w13s, w2s, sizes, recipe)
        o.backward(dout)
        return o.detach(), xs_.grad, w13s.grad, w2s.grad

    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    for what, g, r, b in zip(
        ("out", "dx", "dw13", "dw2"), (out, dx, dw13, dw2), reference(RECIPES[name]), reference(False), strict=True
    ):
        assert torch.isfinite(g).all(), f"{name} {what}: non-finite values"
        recipe_err, gap = rel(r, b), rel(g, r)
        assert recipe_err > 1e-3, f"{name} {what}: the recipe's own error {recipe_err:.2e} bounds nothing"
        assert gap <= 0.1 * recipe_err, f"{name} {what}: gap {gap:.2e} > 0.1 x recipe error {recipe_err:.2e}"
