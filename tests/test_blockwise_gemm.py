"""Blockwise grouped GEMMs: fprop / dgrad on FP8 tensor cores (moe_ep.experts.sm90.blockwise_gemm;
kernels/experts/sm90/blockwise_gemm.cu) and the recipe's wgrad on the MXFP8 recipe's bf16 wgrad kernel over the
exactly dequantized 128x1 operands (moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out).

CPU: the launchers' argument checks, the host-side plan (tile counts, the kernel's tile schedule emulated, padded
group offsets) against hand-worked tables, the E8M0 decode, and an emulation of the kernels' promotion schedule
against the fp64 reference. GPU (marker ``gpu``): every kernel against ``moe_ep.blockwise.reference`` (fp64
accumulation) with awkward groups, capacity rows, NaN blocks, dgrad through the transposed weight view, and
determinism.

Error bound of a kernel output (``_bound``): inside one 128-long block the FP8 tensor cores add the exact e4m3
products with limited alignment precision -- Hopper's FP8 wgmma keeps only ~13-14 mantissa bits of the running sum
(DeepSeek-V3 technical report, section 3.3.2, "around 14 bits"): terms are aligned to the largest exponent and
bits below ~2**-13 of it are dropped, once per k32 instruction step and in the fp32 accumulator hand-over between
the 4 k32 slices. That is at most ~2**-13 of the block's sum |a_i b_i| per alignment, and fewer than 16 such
alignments happen per block, so the block's partial sum is off by <= 2**-9 * sum_block |a b| (c = 1, k = 9:
16 x 2**-13). The promotion (one fp32 FMA per block, exact scale products: powers of two) adds K/128 roundings of
2**-24 relative to the running sum, also covered by that term. The bf16 output rounds once more: 2**-9 |ref|
(nearest), taken as 2**-8 |ref|; fp32 outputs 2**-20 |ref|. So |out - ref| <= 2**-9 (|A| @ |B|^T) + r |ref|.
The bf16 wgrad's bound is tests/test_gemm_cuda.py's (``_bf16_acc_rel``): exact products, fp32 accumulation
truncating < 2 ulp per k16 step.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_ep.blockwise.reference import (
    colwise_cols,
    dequantize_rowwise_torch,
    grouped_mm_torch,
    grouped_wgrad_torch,
    padded_group_offsets,
    quantize_colwise_grouped_torch,
    quantize_colwise_prepared_torch,
    quantize_rowwise_torch,
    quantize_weight_torch,
)
from moe_ep.experts.sm90 import blockwise_gemm as bw
from moe_ep.experts.sm90 import gemm as mx_gemm

E4 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def _abs_e4m3(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) & 0x7F).view(E4)


def _bound(err_abs_ref: torch.Tensor, ref: torch.Tensor, out_rel: float, acc_rel: float = 2.0**-9) -> torch.Tensor:
    """acc_rel (|A| @ |B|^T) + out_rel |ref| (module docstring) plus a tiny absolute floor."""
    return acc_rel * err_abs_ref + out_rel * ref.abs() + 1e-30


def _check_close(
    got: torch.Tensor, ref: torch.Tensor, absref: torch.Tensor, out_rel: float, what: str, acc_rel: float = 2.0**-9
) -> None:
    got = got.double()
    nan_ref, nan_got = torch.isnan(ref), torch.isnan(got)
    if not torch.equal(nan_ref, nan_got):
        idx = torch.nonzero(nan_ref != nan_got)[:5].tolist()
        raise AssertionError(
            f"{what}: NaN positions differ (first {idx}; ref NaNs {int(nan_ref.sum())}, got {int(nan_got.sum())})"
        )
    ok = ~nan_ref
    err = (got - ref).abs()
    lim = _bound(absref, ref, out_rel, acc_rel)
    bad = ok & ~(err <= lim)
    ratio = (err[ok] / lim[ok]).max().item() if ok.any() else 0.0
    if bad.any():
        idx = torch.nonzero(bad)[:5].tolist()
        first = tuple(idx[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements out of bound (max err/bound {ratio:.3g}); first {idx}: "
            f"got {got[first].item()!r} ref {ref[first].item()!r} bound {lim[first].item()!r}"
        )
    print(f"{what}: max |err| {err[ok].max().item() if ok.any() else 0:.3g}, max err/bound {ratio:.3g}")


def _mm_inputs(m, k, n, sizes, seed=0, device="cpu", dgrad=False):
    """Quantized fprop (or dgrad) operands: a [M, K'] rowwise, b [G, N', K'] (+ its scale view)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = len(sizes)
    x = torch.randn(m, k, generator=gen) * 3.0
    x[: m // 3] *= 1e-3  # a spread of block scales
    w = torch.randn(g, n, k, generator=gen) * 0.02
    if dgrad:  # dgrad: dy [M, N_w] x W [G, N_w, K_w] -> [M, K_w]; the weight is quantized once as [G, N_w, K_w]
        w = torch.randn(g, k, n, generator=gen) * 0.02  # [G, N_w = k, K_w = n]
        data, data_t, scale = quantize_weight_torch(w)
        b, bs = data_t, scale.transpose(1, 2)  # [G, K_w, N_w], [G, K_w/128, N_w/128] (non-contiguous view)
    else:
        data, _, scale = quantize_weight_torch(w)
        b, bs = data, scale
    a, a_s = quantize_rowwise_torch(x)
    dev = torch.device(device)
    return a.to(dev), a_s.to(dev), b.to(dev), bs.to(dev), torch.tensor(sizes, dtype=torch.int32, device=dev)


def _emulate_mm(a, a_s, b, b_s, sizes) -> torch.Tensor:
    """The kernels' promotion schedule on the CPU: per group, per 128-block of K, the exact integer-valued e4m3
    products summed in fp64 (an idealized tensor core), rounded to fp32 (the block's partial sum), then
    acc = fma(partial, sa * sb, acc) in fp32, block by block."""
    m, k = a.shape
    out = torch.zeros(m, b.shape[1], dtype=torch.float32)
    af, bf = a.float(), b.float()
    sa, sb = bw.e8m0_to_float(a_s), bw.e8m0_to_float(b_s)
    r0 = 0
    for g, nrows in enumerate(sizes):
        rows = slice(r0, r0 + nrows)
        acc = torch.zeros(nrows, b.shape[1], dtype=torch.float32)
        for kb in range(k // 128):
            ks = slice(128 * kb, 128 * kb + 128)
            part = (af[rows, ks].double() @ bf[g, :, ks].double().t()).float()
            scale = sa[rows, kb][:, None] * sb[g, :, kb].repeat_interleave(128)[None, :]
            acc = torch.addcmul(acc, part, scale)
        out[rows] = acc
        r0 += nrows
    return out


# ----------------------------------------------------------------------------------------------------------
# CPU: plan math, decode, emulation, argument checks
# ----------------------------------------------------------------------------------------------------------


def test_tile_counts():
    assert bw.fprop_tiles(300, 256, 3) == (3 + 3) * 2
    assert bw.fprop_tiles(128, 128, 1) == 2
    assert bw.fprop_tiles(1000, 128, 0) == 0


def test_tile_schedule_table():
    # sizes [130, 0, 5], M = 140: row tiles g0 rows 0-127, g0 rows 128-129, g2 rows 130-134; tiles past the groups
    # start at row 135 (= sum) and step by 128; ceil(140/128) + 3 = 5 row tiles
    assert bw.tile_schedule([130, 0, 5], 140, 128) == [
        ("mm", 0, 0, 128, 0),
        ("mm", 0, 128, 2, 0),
        ("mm", 2, 130, 5, 0),
        ("zero", 135, 0),
        ("zero", 263, 0),
    ]
    # two column tiles: rows vary fastest inside a band of 8 row tiles (gm_raster)
    s = bw.tile_schedule([130, 0, 5], 140, 256)
    assert s[:3] == [("mm", 0, 0, 128, 0), ("mm", 0, 128, 2, 0), ("mm", 2, 130, 5, 0)]
    assert s[5:8] == [("mm", 0, 0, 128, 128), ("mm", 0, 128, 2, 128), ("mm", 2, 130, 5, 128)]


@pytest.mark.parametrize(
    "sizes,m", [([130, 0, 5], 140), ([0, 0, 700, 0], 700), ([1, 127, 128, 129, 0], 400), ([0, 0], 50)]
)
def test_tile_schedule_covers_rows(sizes, m):
    """Every row of every group is computed exactly once per column tile, and the zero tiles cover every row past
    sum(sizes) (the zero_rest guarantee)."""
    n = 384
    sched = bw.tile_schedule(sizes, m, n)
    assert len(sched) == bw.fprop_tiles(m, n, len(sizes))
    starts = [0]
    for v in sizes:
        starts.append(starts[-1] + v)
    for n0 in range(0, n, 128):
        hit = torch.zeros(m, dtype=torch.int32)
        zero = torch.zeros(m, dtype=torch.bool)
        for e in sched:
            if e[0] == "mm" and e[4] == n0:
                _, g, r0, rows, _ = e
                assert starts[g] <= r0 and r0 + rows <= starts[g + 1]
                hit[r0 : r0 + rows] += 1
            elif e[0] == "zero" and e[2] == n0 and e[1] < m:
                zero[e[1] : min(e[1] + 128, m)] = True
        total = starts[-1]
        assert torch.equal(hit[:total], torch.ones(total, dtype=torch.int32))
        assert bool(zero[total:].all()) and not bool(zero[:total].any())


def test_padded_offsets_table():
    assert padded_group_offsets([130, 0, 5]) == [0, 256, 256, 384]
    assert padded_group_offsets([0, 128, 1]) == [0, 0, 128, 256]
    assert colwise_cols(300, 4) == 128 * (3 + 4)


def test_e8m0_decode():
    s = torch.arange(256, dtype=torch.uint8)
    f = bw.e8m0_to_float(s)
    assert f[0].item() == 2.0**-127 and f[0].item() > 0  # subnormal, not flushed
    for v in (1, 100, 127, 128, 254):
        assert f[v].item() == math.ldexp(1.0, v - 127)
    assert math.isnan(f[255].item())


@pytest.mark.parametrize("dgrad", [False, True])
def test_emulated_promotion_matches_reference(dgrad):
    """The kernels' arithmetic (fp32 partial sum per 128-block, promoted with sa * sb) is within the stated bound of
    the fp64 reference; capacity rows past the groups are zero in both."""
    sizes = [0, 70, 1, 0, 130]
    a, a_s, b, b_s, sz = _mm_inputs(256, 256, 256, sizes, dgrad=dgrad)
    ref = grouped_mm_torch(a, a_s, b, b_s, sizes, acc=torch.float64)
    absref = grouped_mm_torch(_abs_e4m3(a), a_s, _abs_e4m3(b), b_s, sizes, acc=torch.float64)
    emu = _emulate_mm(a, a_s, b, b_s, sizes)
    _check_close(emu, ref, absref, 2.0**-20, "emulated fprop" if not dgrad else "emulated dgrad")
    assert not emu[sum(sizes) :].any()


def _valid_mm(m=256, k=256, n=128, g=2):
    return (
        torch.zeros(m, k, dtype=E4),
        torch.zeros(m, k // 128, dtype=torch.uint8),
        torch.zeros(g, n, k, dtype=E4),
        torch.zeros(g, n // 128, k // 128, dtype=torch.uint8),
        torch.zeros(g, dtype=torch.int32),
        torch.zeros(m, n, dtype=torch.bfloat16),
    )


def _with(args, i, v):
    args = list(args)
    args[i] = v
    return args


def test_mm_argument_checks():
    args = _valid_mm()
    with pytest.raises(TypeError, match="a must be torch.float8_e4m3fn"):
        bw.grouped_mm_blockwise_out(*_with(args, 0, args[0].view(torch.uint8)))
    with pytest.raises(TypeError, match="a_scale must be torch.uint8"):
        bw.grouped_mm_blockwise_out(*_with(args, 1, args[1].float()))
    with pytest.raises(TypeError, match="group_sizes must be torch.int32"):
        bw.grouped_mm_blockwise_out(*_with(args, 4, args[4].long()))
    with pytest.raises(TypeError, match="out must be torch.bfloat16"):
        bw.grouped_mm_blockwise_out(*_with(args, 5, args[5].float()))
    with pytest.raises(ValueError, match=r"K \(192\) must be a positive multiple of 128"):
        bw.grouped_mm_blockwise_out(*_mm_k(192))
    with pytest.raises(ValueError, match=r"N \(96\) must be a positive multiple of 128"):
        bw.grouped_mm_blockwise_out(*_with(_with(args, 2, torch.zeros(2, 96, 256, dtype=E4)), 3, args[3][:, :1]))
    with pytest.raises(ValueError, match="reduction sizes differ"):
        bw.grouped_mm_blockwise_out(*_with(args, 2, torch.zeros(2, 128, 384, dtype=E4)))
    with pytest.raises(ValueError, match=r"a_scale must have shape \[256, 2\]"):
        bw.grouped_mm_blockwise_out(*_with(args, 1, torch.zeros(256, 1, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"b_scale must have shape \[2, 1, 2\]"):
        bw.grouped_mm_blockwise_out(*_with(args, 3, torch.zeros(2, 2, 1, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"group_sizes must be \[G\] = \[2\]"):
        bw.grouped_mm_blockwise_out(*_with(args, 4, torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"out must have shape \[256, 128\]"):
        bw.grouped_mm_blockwise_out(*_with(args, 5, torch.zeros(256, 256, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # every shape right: the device is checked last
        bw.grouped_mm_blockwise_out(*args)
    with pytest.raises(TypeError, match="writes bf16 only"):
        bw.grouped_mm_blockwise(*args[:5], out_dtype=torch.float32)


def _mm_k(k):
    a = _valid_mm()
    return (
        torch.zeros(256, k, dtype=E4),
        a[1],
        torch.zeros(2, 128, k, dtype=E4),
        a[3],
        a[4],
        a[5],
    )


# ----------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------

MM_CASES = [  # (M, K, N, sizes): awkward groups, capacity rows (sum < M), one expert holding every row
    (512, 256, 256, [0, 130, 1, 0, 255, 0]),
    (640, 384, 128, [0, 0, 640, 0]),
    (300, 128, 384, [7, 64, 65, 128, 0, 36]),
    (1024, 1024, 512, [129] * 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("case", MM_CASES, ids=lambda c: f"M{c[0]}K{c[1]}N{c[2]}G{len(c[3])}")
def test_mm_gpu(case, dgrad):
    m, k, n, sizes = case
    a, a_s, b, b_s, sz = _mm_inputs(m, k, n, sizes, seed=m + k, device="cuda", dgrad=dgrad)
    ref = grouped_mm_torch(a, a_s, b, b_s, sizes, acc=torch.float64)
    absref = grouped_mm_torch(_abs_e4m3(a), a_s, _abs_e4m3(b), b_s, sizes, acc=torch.float64)
    total = sum(sizes)
    sentinel = torch.full((m, b.shape[1]), 7.0, dtype=torch.bfloat16, device="cuda")
    out = bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, sentinel.clone())
    what = f"{'dgrad' if dgrad else 'fprop'} M{m} K{k} N{n} sizes {sizes}"
    _check_close(out[:total], ref[:total], absref[:total], 2.0**-8, what)
    assert bool((out[total:] == 7.0).all()), "rows past sum(sizes) must be left alone"
    out_z = bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, sentinel.clone(), zero_rest=True)
    assert bool((out_z[total:] == 0).all()), "zero_rest must zero rows past sum(sizes)"
    assert torch.equal(out_z[:total].view(torch.int16), out[:total].view(torch.int16)), "not deterministic"


@pytest.mark.gpu
def test_mm_gpu_nan_blocks():
    m, k, n, sizes = 384, 384, 256, [100, 0, 200]
    a, a_s, b, b_s, sz = _mm_inputs(m, k, n, sizes, device="cuda")
    a_s[5, 1] = 255  # one activation block: row 5 all NaN
    b_s[2, 1, 2] = 255  # one weight block of group 2: its rows, columns 128-255 NaN
    ref = grouped_mm_torch(a, a_s, b, b_s, sizes, acc=torch.float64)
    out = bw.grouped_mm_blockwise(a, a_s, b, b_s, sz, zero_rest=True)
    assert bool(torch.isnan(out[5]).all()) and bool(torch.isnan(out[100:300, 128:]).all())
    absref = grouped_mm_torch(_abs_e4m3(a), a_s, _abs_e4m3(b), b_s, sizes, acc=torch.float64)
    _check_close(out, ref, absref, 2.0**-8, "fprop NaN blocks")


@pytest.mark.gpu
def test_mm_gpu_dsv3_like():
    m, k, n = 4096, 7168, 1024
    sizes = [0, 1000, 3, 517, 0, 1300, 1, 1200]  # sum 4021 < M
    a, a_s, b, b_s, sz = _mm_inputs(m, k, n, sizes, device="cuda")
    ref = grouped_mm_torch(a, a_s, b, b_s, sizes, acc=torch.float64)
    absref = grouped_mm_torch(_abs_e4m3(a), a_s, _abs_e4m3(b), b_s, sizes, acc=torch.float64)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, out, zero_rest=True)
    _check_close(out, ref, absref, 2.0**-8, "fprop dsv3-like")
    out2 = bw.grouped_mm_blockwise(a, a_s, b, b_s, sz, zero_rest=True)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)), "two runs differ"


WG_CASES = [  # (M rows, N, K, sizes): empty groups, 1-row groups, one group holding every row, sizes % 64 != 0
    (600, 256, 384, [0, 130, 1, 0, 300, 0]),
    (700, 128, 256, [700]),
    (1000, 384, 128, [0, 0, 1000]),
    (2048, 512, 1024, [127, 129, 0, 512, 1, 1279]),
]


# ----------------------------------------------------------------------------------------------------------
# GPU: the recipe's wgrad on bf16 tensor cores (the prepared operands, the MXFP8 recipe's wgrad kernel)
# ----------------------------------------------------------------------------------------------------------


def _bf16_acc_rel(sizes) -> float:
    """The bf16 wgrad's accumulation bound relative to |A| @ |B|^T (tests/test_gemm_cuda.py's module docstring): the
    operands are exact in bf16, the products exact, and each k16 step of the fp32 accumulation truncates by < 2 ulp
    of the largest magnitude it touches: 2**-22 (S + 1) with S = ceil(largest group / 16) steps."""
    return 2.0**-22 * (-(-max(sizes) // 16) + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", WG_CASES, ids=lambda c: f"M{c[0]}N{c[1]}K{c[2]}G{len(c[3])}")
def test_wgrad_bf16_gpu(case, out_dtype):
    """grouped_wgrad_prepared_out on the prepared bf16 operands of the recipe's 128x1 blocks
    (quantize_colwise_prepared_torch) == grouped_wgrad_torch on the e4m3 blocks (fp64), within fp32 summation order;
    a NaN block (its dW row / column NaN) included."""
    m, n, k, sizes = case
    gen = torch.Generator().manual_seed(m)
    dy, x = torch.randn(m, n, generator=gen), torch.randn(m, k, generator=gen) * 5
    dy[: m // 4] *= 1e-2
    dy[3, 7] = float("nan")  # a NaN block (row 3 is in the first non-empty group): row 7 of that dW NaN
    a_t, a_st = quantize_colwise_grouped_torch(dy, sizes)
    b_t, b_st = quantize_colwise_grouped_torch(x, sizes)
    ref = grouped_wgrad_torch(a_t.cuda(), a_st.cuda(), b_t.cuda(), b_st.cuda(), sizes, acc=torch.float64)
    absref = grouped_wgrad_torch(_abs_e4m3(a_t).cuda(), a_st.cuda(), _abs_e4m3(b_t).cuda(), b_st.cuda(), sizes,
                                 acc=torch.float64)  # fmt: skip
    ap, bp = quantize_colwise_prepared_torch(dy, sizes).cuda(), quantize_colwise_prepared_torch(x, sizes).cuda()
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    out = torch.full((len(sizes), n, k), float("nan"), dtype=out_dtype, device="cuda")
    mx_gemm.grouped_wgrad_prepared_out(ap, bp, sz, out, m)
    rel = 2.0**-20 if out_dtype == torch.float32 else 2.0**-8
    what = f"bf16 wgrad {out_dtype} M{m} N{n} K{k} sizes {sizes}"
    _check_close(out, ref, absref, rel, what, _bf16_acc_rel(sizes))
    assert bool(torch.isnan(ref).any()), "the NaN block is there"
    for g, sz_g in enumerate(sizes):
        if sz_g == 0:
            assert bool((out[g] == 0).all()), f"empty group {g} must be zeros"


@pytest.mark.gpu
def test_wgrad_bf16_pipeline_dsv3_like():
    """The backward's wgrad1 as the MLP runs it, at a dsv3-like width: dA's column operand from bf16 rows and x's from
    its 1x128 dispatch bytes, both written by the quantizer kernels straight into the prepared layout, then the bf16
    wgrad kernel; against the reference's 128x1 blocks and grouped_wgrad_torch (fp64). Deterministic."""
    from moe_ep.blockwise import cuda as bwq  # noqa: PLC0415

    m, n, k = 4096, 1024, 7168
    sizes = [0, 900, 3, 517, 0, 1400, 1, 1275]  # sum 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    da = (torch.randn(m, n, generator=gen, device="cuda") * 1e-3).bfloat16()
    xq, xs = quantize_rowwise_torch(torch.randn(m, k, generator=gen, device="cuda") * 4)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    ap, bp = bwq.quantize_colwise_prepared(da, sz), bwq.quantize_colwise_prepared((xq, xs), sz)
    out = mx_gemm.grouped_wgrad_prepared_out(ap, bp, sz, torch.empty(len(sizes), n, k, device="cuda"), m)
    a_t, a_st = quantize_colwise_grouped_torch(da.float(), sizes)
    b_t, b_st = quantize_colwise_grouped_torch(dequantize_rowwise_torch(xq, xs), sizes)
    ref = grouped_wgrad_torch(a_t, a_st, b_t, b_st, sizes, acc=torch.float64)
    absref = grouped_wgrad_torch(_abs_e4m3(a_t), a_st, _abs_e4m3(b_t), b_st, sizes, acc=torch.float64)
    _check_close(out, ref, absref, 2.0**-20, "bf16 wgrad pipeline dsv3-like", _bf16_acc_rel(sizes))
    out2 = mx_gemm.grouped_wgrad_prepared_out(ap, bp, sz, torch.empty_like(out), m)
    assert torch.equal(out.view(torch.int32), out2.view(torch.int32)), "two runs differ"
