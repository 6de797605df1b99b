"""Grouped GEMM operands from one read (moe_ep.mxfp8.cuda.quantize_grouped_dual): row-wise MXFP8 with per-group
blocked scales plus the per-group column-wise operand prepared for the wgrad (bf16), of bf16 x itself (mx_quant_dual)
and of the SwiGLU forward / backward (mx_swiglu_dual, or mx_quant where that does not run): bytes == the reference's
(``quantize_grouped_dual_torch(..., colwise="bf16")``).

Runs on the two backends of tests/test_quant_cuda.py (``cuda``, and ``emu``: the kernel source run on the CPU by
the emulator of tests/quant_emu.py). The emulator's SwiGLU uses the host ``expf``, which may differ from
torch's by an ulp, so against the reference it checks layouts with a 1 % allowance; kernel against kernel (the
register-tiled one against mx_quant, both emulated with the same ``expf``) it is exact.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.mxfp8 import colwise_prep_rows, grouped_blocked_size
from moe_ep.mxfp8 import cuda as mxfp8_cuda
from moe_ep.mxfp8 import plan as quant_plan
from tests.refs import colwise_prep_rows_used
from tests.test_quant_cuda import HAS_CUDA, _big, backend_dev, record_launches  # noqa: F401  (backend_dev: the ``dev`` fixture)

_DIV_CHECK = r"""
// For the test: out[8 i ..] = fp32 bits of swd_swiglu(g, 1), mx_swiglu(g, 1), swd_sigmoid(g), mx_sigmoid(g), then
// SwdDomain's verdict (forward, backward) for a word holding g in its low half, then in its high half (the other
// half 0, which is in both ranges), for the n bf16 values g = in[i].
extern "C" __global__ void mx_swiglu_div_check(const unsigned short* __restrict__ in, unsigned* __restrict__ out,
                                               int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = __uint_as_float((unsigned)in[i] << 16);
    SwdDomain lo, hi;
    lo.add(in[i]);
    hi.add((unsigned)in[i] << 16);
    const unsigned o[8] = {__float_as_uint(swd_swiglu(g, 1.0f)), __float_as_uint(mx_swiglu(g, 1.0f)),
                           __float_as_uint(swd_sigmoid(g)),       __float_as_uint(mx_sigmoid(g)),
                           lo.ok(true),                           lo.ok(false),
                           hi.ok(true),                           hi.ok(false)};
    for (int j = 0; j < 8; ++j) out[8LL * i + j] = o[j];
}
"""

# ------------------------------------------------------------------------------------------------------------
# grouped GEMM operands from one read: row-wise (grouped blocked scales) + prepared column-wise, plain and SwiGLU
# ------------------------------------------------------------------------------------------------------------

DUAL_SIZES = [[0, 300, 0, 77, 1, 130], [64], [33, 0, 31, 200, 0], [5]]


def _dual_input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** (torch.rand(m, 1, generator=g) * 4 - 2)
    if m > 40:
        x[37, 3] = float("nan")  # one non-finite block per axis
        x[2, 40] = float("inf")
        x[10:20, 64:96] = 0.0
    return x.to(dtype)


def _frac_ok(name: str, a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    """a == b, or (exact=False, the emulator's SwiGLU) at most 1 % of the values differ."""
    if exact:
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} values differ"
    else:
        # The emulator's host expf may differ from torch's CPU exp by an ulp, which can move an e4m3 byte by
        # one code (or, rarely, a scale): layouts and indexing are what the emulator checks here; the GPU
        # run checks the bytes exactly against torch's CUDA silu.
        frac = (a != b).float().mean().item() if a.numel() else 0.0
        assert frac <= 0.01, f"{name}: {frac:.2%} of values differ"


def _check_dual(got, want, sizes, exact: bool = True):
    """Compare (data, scale, data_c, None): data_c is the prepared bf16 operand, compared in its used rows (the rest
    is not written): NaN exactly where the reference has NaN, with the reference's payload 0x7FC0, every other bit
    pattern equal (signed zeros and zero padding rows included).
    """
    assert got[3] is None and want[3] is None
    pairs = [("data", got[0].view(torch.uint8), want[0].view(torch.uint8)), ("scale", got[1], want[1])]
    used = colwise_prep_rows_used(sizes)
    a, b = got[2][:used].cpu(), want[2][:used].cpu()
    assert a.shape == b.shape, f"prepared: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"prepared: NaN differs at {int((na != nb).sum())} places"
    assert (a.view(torch.int16)[na] == 0x7FC0).all(), "prepared: a NaN block's payload is not 0x7FC0"
    pairs.append(("prepared", a.view(torch.int16)[~na], b.view(torch.int16)[~nb]))
    for name, a, b in pairs:
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        _frac_ok(name, a, b, exact)


@pytest.mark.parametrize("sizes", DUAL_SIZES)
def test_grouped_dual_prepared_matches_reference(dev, sizes, monkeypatch):
    """bf16 x (mx_quant_dual): the row-wise pair, and the column operand written as the prepared bf16 layout (64-row
    group blocks, zero padding rows) == prepare_colwise_bf16_torch of the reference's MXFP8 column operand; nothing
    written past the last group's block."""
    from tests.refs import quantize_grouped_dual_torch

    m, k = sum(sizes), 160
    dtype = torch.bfloat16
    x = _dual_input(m, k, dtype, seed=len(sizes) + m)
    if m >= 64:  # whole 32-row column blocks whose dequantized values fall below bf16's smallest normal: rounded once
        x[32:64, 96:128] = (torch.randn(32, 32, generator=torch.Generator().manual_seed(m)) * 1e-40).to(dtype)
    st = torch.tensor(sizes, dtype=torch.int32)
    want = quantize_grouped_dual_torch(x, st, colwise="bf16")
    if m >= 64:  # the case is really there: nonzero prepared values below bf16's smallest normal
        mag = want[2].float().abs()
        assert ((mag > 0) & (mag < torch.finfo(torch.bfloat16).tiny)).any()
    assert want[3] is None and want[2].shape == (colwise_prep_rows(m, len(sizes)), k)
    data = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty_like(want[1], device=dev)
    prep = torch.full(want[2].shape, float("nan"), dtype=torch.bfloat16, device=dev)  # sentinel past the groups
    names = record_launches(monkeypatch)
    mxfp8_cuda.quantize_grouped_dual_into(x.to(dev), st.to(dev), data, scale, prep)
    assert len(names) == 1 and names[0].startswith("mx_quant_dual<1,5,"), names
    _check_dual((data, scale, prep, None), want, sizes)
    assert torch.isnan(prep[colwise_prep_rows_used(sizes) :]).all(), "written past the last group's 64-row block"


def _extreme_dual_input(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 [m, k] whose 32x32 blocks (in both directions) carry awkward exponents: bf16 subnormals, values near
    bf16's largest finite, single huge outliers among tiny values, zeros, NaN and +-Inf, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** (torch.rand(m, 1, generator=g) * 8 - 4)
    kinds = torch.randint(0, 7, ((m + 31) // 32, (k + 31) // 32), generator=g)
    for (bi, bj), kind in zip(
        torch.cartesian_prod(torch.arange(kinds.shape[0]), torch.arange(kinds.shape[1])).tolist(),
        kinds.flatten().tolist(),
        strict=True,
    ):
        blk = x[32 * bi : 32 * bi + 32, 32 * bj : 32 * bj + 32]
        if kind == 1:
            blk.mul_(1e-40)  # bf16 subnormals (and fp32 products below them)
        elif kind == 2:
            blk.copy_(torch.sign(blk) * 3.0e38)  # near bf16's largest finite
        elif kind == 3:
            blk.mul_(1e-30)
            blk[0, 0] = 1e30  # one outlier: the rest underflows to signed e4m3 zeros
        elif kind == 4:
            blk.zero_()
            blk[::2].neg_()  # -0.0 rows
        elif kind == 5:
            blk[min(5, blk.shape[0] - 1), 7] = float("nan") if (bi + bj) % 2 else float("-inf")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("stages", quant_plan.DUAL_STAGES)
def test_grouped_dual_extreme_and_persistent(dev, stages, monkeypatch):
    """bf16 grouped dual (the register-tiled kernel at each cp.async depth it runs: 2 and 4 by tiles per SM, 3 where
    4 stages do not fit next to a large group table; forced here) on extreme blocks, K % 128 = 32, with enough tiles
    that every persistent CTA runs several (GPU: 1284 tiles over at most 396 CTAs; emulator: 33 tiles over at most
    6), bytes == the reference. The emulator copies cp.async data at once: only the GPU run checks the stage ring's
    waits."""
    from tests.refs import quantize_grouped_dual_torch

    monkeypatch.setattr(quant_plan, "dual_stages", lambda tiles, device: stages)
    if _big(dev):
        sizes, k = [0, 5000, 1, 127, 129, 0, 3000, 4097, 64], 1440
    else:
        sizes, k = [0, 200, 1, 127, 33, 0, 64], 288
    m = sum(sizes)
    x = _extreme_dual_input(m, k, seed=5)
    st = torch.tensor(sizes, dtype=torch.int32)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(x.to(dev), st.to(dev))
    assert names == [f"mx_quant_dual<1,5,{stages}>"]
    _check_dual(got, quantize_grouped_dual_torch(x, st, colwise="bf16"), sizes)


def test_grouped_dual_k224(dev, monkeypatch):
    """K = 224: the last column tile holds 96 of 128 columns (3 of 4 scale columns), with a trailing empty group."""
    from tests.refs import quantize_grouped_dual_torch

    sizes = [3, 0, 70, 129, 0]
    x = _extreme_dual_input(sum(sizes), 224, seed=9)
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(x.to(dev), st.to(dev))
    _check_dual(got, quantize_grouped_dual_torch(x, st, colwise="bf16"), sizes)


def _dual_into_sentinel(x, sizes, m, swiglu=False, dh=None):
    """quantize_grouped_dual_into x[:m] (swiglu: of SwiGLU(x[:m]); dh: of its backward with dh[:m]) with every
    output prefilled with a sentinel byte; the outputs as bytes."""
    dev, g = x.device, len(sizes)
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    data = torch.full((m, k), 0x55, dtype=torch.uint8, device=dev)
    scale = torch.full((grouped_blocked_size(m, g, k // 32, "m"),), 0x33, dtype=torch.uint8, device=dev)
    data_c = torch.full((colwise_prep_rows(m, g), 2 * k), 0x12, dtype=torch.uint8, device=dev)
    kw = {"swiglu_dh": dh[:m].contiguous()} if dh is not None else {"apply_swiglu": swiglu}
    mxfp8_cuda.quantize_grouped_dual_into(
        x[:m].contiguous(), st, data.view(torch.float8_e4m3fn), scale, data_c.view(torch.bfloat16), **kw
    )
    return [t.cpu() for t in (data, scale, data_c)]


def test_grouped_dual_sizes_not_summing_to_m(dev, monkeypatch):
    """Group sizes summing to less than M (rows past the groups untouched) or more (clamped at M): the register-
    tiled kernel writes the reference's bytes for the groups clamped to M (the reference needs sum == M), zero
    scale tiles past them, and leaves every other output byte (the sentinels) untouched."""
    from tests.refs import quantize_grouped_dual_torch

    sizes = [40, 0, 90, 7]
    x = _extreme_dual_input(160, 96, seed=11)
    names = record_launches(monkeypatch)
    for m in (sum(sizes) - 20, sum(sizes) + 23):
        data, scale, prep = _dual_into_sentinel(x.to(dev), sizes, m)
        assert names[-1].startswith("mx_quant_dual<1,5,"), names
        eff, left = [], m  # the groups as the kernel clamps them to M
        for n in sizes:
            eff.append(min(n, left))
            left -= eff[-1]
        s = sum(eff)
        want = quantize_grouped_dual_torch(x[:s], torch.tensor(eff, dtype=torch.int32), colwise="bf16")
        used = colwise_prep_rows_used(eff)
        got = (data[:s].view(torch.float8_e4m3fn), scale[: want[1].numel()], prep.view(torch.bfloat16), None)
        _check_dual(got, want, eff)
        assert (data[s:] == 0x55).all(), f"M = {m}: data rows past the groups written"
        assert (scale[want[1].numel() :] == 0).all(), f"M = {m}: scale tiles past the groups are not zero"
        assert (prep[used:] == 0x12).all(), f"M = {m}: prepared rows past the last group's block written"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_grouped_dual_prepared_bad_input():
    x = torch.zeros(64, 96, dtype=torch.bfloat16, device="cuda")
    st = torch.tensor([64], dtype=torch.int32, device="cuda")
    data = torch.empty(64, 96, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(grouped_blocked_size(64, 1, 3, "m"), dtype=torch.uint8, device="cuda")
    prep = torch.empty(128, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="colwise must be"):
        mxfp8_cuda.quantize_grouped_dual(x, st, colwise="mxfp8")
    with pytest.raises(TypeError, match="must be bf16"):
        mxfp8_cuda.quantize_grouped_dual(x.float(), st)
    with pytest.raises(ValueError, match="data_c: expected shape"):
        mxfp8_cuda.quantize_grouped_dual_into(x, st, data, scale, prep[:64])
    with pytest.raises(TypeError, match="data_c: expected dtype"):
        mxfp8_cuda.quantize_grouped_dual_into(x, st, data, scale, prep.float())


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("sizes", DUAL_SIZES)
def test_swiglu_dual_prepared_matches_reference(dev, sizes, mode):
    """The fused SwiGLU forward (h) and backward (dA from a bf16 dh, the dgrad GEMM's output, read as is; the
    reference promotes it to fp32 exactly) with the prepared column operand: the wgrad operand straight from the
    fused kernel. F = 96 puts the gate/up boundary of dA (column 96) inside the first 128-column tile (and takes
    mx_quant in the backward: F % 128 != 0)."""
    from tests.refs import quantize_grouped_dual_torch

    m, f = sum(sizes), 96
    a = _dual_input(m, 2 * f, torch.bfloat16, seed=17 + m).to(dev)
    if mode == "forward":
        kw = {"apply_swiglu": True}
    else:
        kw = {"swiglu_dh": _dual_input(m, f, torch.float32, seed=19 + m).to(torch.bfloat16).to(dev)}
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), **kw)
    want = quantize_grouped_dual_torch(a, st, colwise="bf16", **kw)
    _check_dual(got, want, sizes, exact=dev.type == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_grouped_dual_bad_input():
    a = torch.zeros(64, 96, dtype=torch.bfloat16, device="cuda")
    st = torch.tensor([64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="2F"):
        mxfp8_cuda.quantize_grouped_dual(a, st, apply_swiglu=True)  # F = 48 is not a multiple of 32
    with pytest.raises(TypeError, match="bf16"):
        mxfp8_cuda.quantize_grouped_dual(a.float(), st, apply_swiglu=True)
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.quantize_grouped_dual(a[:, :64].contiguous(), st.cpu())
    a2 = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    for dt in (torch.float16, torch.float32):
        with pytest.raises(TypeError, match="dh must be bf16"):
            mxfp8_cuda.quantize_grouped_dual(a2, st, swiglu_dh=torch.zeros(64, 64, dtype=dt, device="cuda"))
    with pytest.raises(ValueError, match="dh: expected shape"):
        mxfp8_cuda.quantize_grouped_dual(a2, st, swiglu_dh=torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda"))


# ------------------------------------------------------------------------------------------------------------
# the register-tiled SwiGLU quantizers (mx_swiglu_dual, kernels/mxfp8/quant_swiglu.cuh)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["forward2", "forward3", "backward"])
def test_swiglu_reg_matches_mx_quant(dev, mode, monkeypatch):
    """mx_swiglu_dual (each depth it runs: the forward takes 2 where 3 do not fit next to the group table; forced
    here) writes exactly the bytes of mx_quant, which runs where mx_swiglu_dual does not fit (forced here) and for
    a backward with F % 128 != 0, sentinels included: extreme blocks in a and dh (subnormals, near-overflow values
    whose products overflow to Inf, NaN/Inf, zeros), empty groups, group sizes summing to M, to less (rows past the
    groups untouched) and to more (clamped at M), several tiles per CTA, and (forward) a partial last column tile.
    Kernel against kernel, so the emulator is exact too (same host expf)."""
    bwd = mode == "backward"
    if _big(dev):  # 4 (backward) / 5 (forward) column tiles of h x 106-107 row tiles over 132 CTAs
        sizes, f = [0, 5000, 1, 127, 129, 0, 3000, 4097, 64], 512 if bwd else 608
    else:
        sizes, f = [0, 200, 1, 127, 33, 0, 64], 256 if bwd else 160
    n = sum(sizes)
    a = _extreme_dual_input(n + 23, 2 * f, seed=21).to(dev)
    dh = _extreme_dual_input(n + 23, f, seed=22).to(dev) if bwd else None
    if mode == "forward2":
        monkeypatch.setattr(quant_plan, "SWIGLU_STAGES", {False: 2, True: 2})
    want_name = f"mx_swiglu_dual<{int(bwd)},5,{3 if mode == 'forward3' else 2}>"
    names = record_launches(monkeypatch)
    for m in (n, n - 20, n + 23):
        got = _dual_into_sentinel(a, sizes, m, swiglu=not bwd, dh=dh)
        assert names[-1] == want_name, names
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(quant_plan, "swiglu_plan", lambda *args: None)  # as where mx_swiglu_dual does not fit
            want = _dual_into_sentinel(a, sizes, m, swiglu=not bwd, dh=dh)
        assert names[-1] == f"mx_quant<{5 if bwd else 3},3,5>", names
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(x, y), f"M = {m}, output {i}: {int((x != y).sum())} bytes differ"


@pytest.mark.parametrize("stages", quant_plan.DUAL_STAGES)
def test_colwise_from_rows_matches_two_pass(dev, stages, monkeypatch):
    """colwise_from_rows (mx_quant_dual<6,5,S>, each depth; forced here): the column operand of MXFP8 rows in one
    pass == the two-pass form it replaces in the backward (from_blocked_grouped + dequantize to bf16 +
    quantize_grouped_dual(rows)[2]), every byte of sentinel-filled buffers: extreme blocks (NaN/Inf: scale 0xFF,
    subnormal products, signed zeros), empty groups, a group of 1 row, K % 128 = 32, group sizes summing to M and to
    less (rows past the groups, as in a capacity buffer: not read, nothing written past the last group's block)."""
    from moe_ep.mxfp8 import MXFP8Tensor
    from moe_ep.mxfp8.format import from_blocked_grouped

    monkeypatch.setattr(quant_plan, "dual_stages", lambda tiles, device: stages)
    if _big(dev):
        sizes, k = [0, 5000, 1, 127, 129, 0, 3000, 4097, 64], 1440
    else:
        sizes, k = [0, 200, 1, 127, 33, 0, 64], 288
    n = sum(sizes)
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    names = record_launches(monkeypatch)
    for m in (n, n + 23):
        xq, xs, _, _ = mxfp8_cuda.quantize_grouped_dual(_extreme_dual_input(m, k, seed=51).to(dev), st)
        rows = mxfp8_cuda.dequantize(MXFP8Tensor(xq, from_blocked_grouped(xs, st, m, k // 32), 1), torch.bfloat16)
        shape = (colwise_prep_rows(m, len(sizes)), k)
        want = torch.full(shape, 0x1234, dtype=torch.int16, device=dev)
        mxfp8_cuda.quantize_grouped_dual_into(
            rows, st, torch.empty_like(xq), torch.empty_like(xs), want.view(torch.bfloat16)
        )
        got = torch.full(shape, 0x1234, dtype=torch.int16, device=dev)
        mxfp8_cuda.colwise_from_rows_into(xq, xs, st, got.view(torch.bfloat16))
        assert names[-1] == f"mx_quant_dual<6,5,{stages}>", names
        assert torch.isnan(got.view(torch.bfloat16)).any(), "the case is really there: NaN blocks"
        assert torch.equal(got.cpu(), want.cpu()), f"M = {m}: {int((got != want).sum())} of {got.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_colwise_from_rows_bad_input():
    xq = torch.zeros(64, 96, dtype=torch.float8_e4m3fn, device="cuda")
    st = torch.tensor([64], dtype=torch.int32, device="cuda")
    xs = torch.zeros(grouped_blocked_size(64, 1, 3, "m"), dtype=torch.uint8, device="cuda")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mxfp8_cuda.colwise_from_rows(xq.view(torch.uint8), xs, st)
    with pytest.raises(ValueError, match="xs: expected shape"):
        mxfp8_cuda.colwise_from_rows(xq, xs[:512], st)
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.colwise_from_rows(xq, xs, st.cpu())


def _rows_into_sentinel(a, sizes, m):
    """The SwiGLU forward's row-only mode (data_c=None) on a[:m] with sentinel-filled outputs; (data, scale) bytes."""
    dev, g, k = a.device, len(sizes), a.shape[1] // 2
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    data = torch.full((m, k), 0x55, dtype=torch.uint8, device=dev)
    scale = torch.full((grouped_blocked_size(m, g, k // 32, "m"),), 0x33, dtype=torch.uint8, device=dev)
    mxfp8_cuda.quantize_grouped_dual_into(
        a[:m].contiguous(), st, data.view(torch.float8_e4m3fn), scale, None, apply_swiglu=True
    )
    return [t.cpu() for t in (data, scale)]


@pytest.mark.parametrize("kernel", ["swiglu2", "swiglu3", "mx_quant"])
def test_swiglu_rows_only_matches_dual(dev, kernel, monkeypatch):
    """The forward's row-only mode (mx_swiglu_dual<0,0,S> at both depths, and mx_quant<3,3,0> where that does not fit;
    forced here) writes exactly the row-wise bytes and scales of the dual mode (kernel against kernel: exact on the
    emulator too), sentinels included: extreme blocks, empty groups, group sizes summing to M, to less (rows past
    the groups untouched) and to more (clamped at M), a partial last column tile; and no column operand."""
    if _big(dev):
        sizes, f = [0, 5000, 1, 127, 129, 0, 3000, 4097, 64], 608
    else:
        sizes, f = [0, 200, 1, 127, 33, 0, 64], 160
    n = sum(sizes)
    a = _extreme_dual_input(n + 23, 2 * f, seed=41).to(dev)
    if kernel == "swiglu2":
        monkeypatch.setattr(quant_plan, "SWIGLU_STAGES", {False: 2, True: 2})
    if kernel == "mx_quant":
        monkeypatch.setattr(quant_plan, "swiglu_plan", lambda *args: None)
    want_name = {"swiglu2": "mx_swiglu_dual<0,0,2>", "swiglu3": "mx_swiglu_dual<0,0,3>", "mx_quant": "mx_quant<3,3,0>"}
    names = record_launches(monkeypatch)
    for m in (n, n - 20, n + 23):
        got = _rows_into_sentinel(a, sizes, m)
        assert names[-1] == want_name[kernel], names
        want = _dual_into_sentinel(a, sizes, m, swiglu=True)[:2]
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(x, y), f"M = {m}, output {i}: {int((x != y).sum())} bytes differ"


def test_swiglu_rows_only_matches_reference(dev, monkeypatch):
    """quantize_grouped_dual(a, apply_swiglu=True, colwise="none") -> (data, scale, None, None) == the reference's
    row-wise pair (exact on the GPU; the emulator's host expf: 1 % allowance), extreme blocks, empty groups."""
    from tests.refs import quantize_grouped_dual_torch

    sizes, f = [3, 0, 70, 129, 0, 40], 224
    st = torch.tensor(sizes, dtype=torch.int32)
    a = _extreme_dual_input(sum(sizes), 2 * f, seed=43).to(dev)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), apply_swiglu=True, colwise="none")
    assert names == ["mx_swiglu_dual<0,0,3>"] and got[2] is None and got[3] is None
    want = quantize_grouped_dual_torch(a, st, apply_swiglu=True)
    _frac_ok("data", got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8).cpu(), dev.type == "cuda")
    _frac_ok("scale", got[1].cpu(), want[1].cpu(), dev.type == "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_swiglu_rows_only_bad_input():
    """Row-only is compiled for the SwiGLU forward only: bf16 x and the backward are refused, with a clear error."""
    x = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda")
    st = torch.tensor([64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="SwiGLU forward only"):
        mxfp8_cuda.quantize_grouped_dual(x, st, colwise="none")
    with pytest.raises(ValueError, match="SwiGLU forward only"):
        mxfp8_cuda.quantize_grouped_dual(
            x, st, swiglu_dh=torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda"), colwise="none"
        )


@pytest.mark.parametrize("bwd", [False, True], ids=["forward", "backward"])
def test_swiglu_reg_matches_reference(dev, bwd, monkeypatch):
    """mx_swiglu_dual against torch's swiglu / swiglu_bwd on the same device then the reference quantizer: exact on
    the GPU (F = 128 backward, one h tile; F = 224 forward, a partial second one), extreme blocks, empty groups."""
    from tests.refs import quantize_grouped_dual_torch

    sizes, f = [3, 0, 70, 129, 0, 40], 128 if bwd else 224
    m = sum(sizes)
    a = _extreme_dual_input(m, 2 * f, seed=31).to(dev)
    kw = {"swiglu_dh": _extreme_dual_input(m, f, seed=32).to(dev)} if bwd else {"apply_swiglu": True}
    st = torch.tensor(sizes, dtype=torch.int32)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), **kw)
    assert names[0].startswith(f"mx_swiglu_dual<{int(bwd)},5,")
    want = quantize_grouped_dual_torch(a, st, colwise="bf16", **kw)
    _check_dual(got, want, sizes, exact=dev.type == "cuda")


def test_swiglu_kernel_plan(monkeypatch):
    """Which SwiGLU kernel runs, its depth, grid and shared memory (hand-worked, 132 SMs; no launch)."""
    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    grouped, gprep = quant_plan.RS["grouped"], quant_plan.CS["grouped_prep"]
    fwd, bwd16 = quant_plan.IN_SWIGLU, quant_plan.IN_SWIGLU_BWD16
    a = torch.empty(32768, 4096, dtype=torch.bfloat16)  # dsv3: F = 2048, 32 groups, 256 + 32 row tiles
    # forward: 288 x 16 tiles of h; 3 stages of gate + up (64 KB), table 16 * 33, two 512-byte scale tiles
    plan = quant_plan.quant_plan(a, 32768, 2048, grouped, gprep, 32, 288, fwd)
    assert plan == ("mx_swiglu_dual<0,5,3>", 132, 528 + 3 * 65536 + 1024, 288, 16, 256)
    # backward: output width 2F = 4096 (32 column tiles), 288 x 16 tiles of h; 2 stages of gate + up + dh (96 KB)
    # and two pairs (gate, up) of scale tiles
    plan = quant_plan.quant_plan(a, 32768, 4096, grouped, gprep, 32, 288, bwd16)
    assert plan == ("mx_swiglu_dual<1,5,2>", 132, 528 + 2 * 98304 + 2048, 288, 32, 256)
    # few tiles: one CTA per tile of h
    assert quant_plan.swiglu_plan(False, 256, 6, 2, torch.device("cpu")) == (3, 6, 48 + 3 * 65536 + 1024)
    # 2200 groups: 3 forward stages no longer fit next to the table (35216 + 196608 + 1024 > 232448), 2 do
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, gprep, 2200, 2456, fwd)[:3] == (
        "mx_swiglu_dual<0,5,2>",
        132,
        16 * 2201 + 2 * 65536 + 1024,
    )
    # 6300 groups: not even 2 forward stages (100816 + 131072 + 1024 > 232320): mx_quant, one CTA per fp32 tile
    # with the tile staged in shared memory (64 KB), the fixed area, the prepared operand's multipliers and the table
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, gprep, 6300, 6556, fwd) == (
        "mx_quant<3,3,5>",
        6556 * 16,
        65536 + 3584 + 2048 + 16 * 6301,
        6556,
        16,
        256,
    )
    # The 128 bytes of static shared memory (the group scan's partials) count against the 227 KiB too: 2170 groups
    # forward, 16 * 2171 + 3 * 65536 + 1024 = 232368 bytes, would pass a dynamic-only check (232448) but not
    # 232448 - 128, so 2 stages; 2106 groups backward, 16 * 2107 + 2 * 98304 + 2048 = 232368: mx_quant.
    assert quant_plan.swiglu_plan(False, 2048, 5000, 2170, torch.device("cpu")) == (2, 132, 16 * 2171 + 131072 + 1024)
    assert quant_plan.swiglu_plan(True, 4096, 5000, 2106, torch.device("cpu")) is None
    assert quant_plan.swiglu_plan(True, 4096, 5000, 2100, torch.device("cpu"))[0] == 2  # 232272 bytes fit
    # 2200 groups leave no room for the backward's 2 stages of 96 KB: mx_quant
    assert quant_plan.quant_plan(a, 32768, 4096, grouped, gprep, 2200, 2456, bwd16)[0] == "mx_quant<5,3,5>"
    # backward with F % 128 != 0 (F = 96: dA's up half starts inside a tile of the blocked scales)
    a96 = torch.empty(1000, 192, dtype=torch.bfloat16)
    assert quant_plan.quant_plan(a96, 1000, 192, grouped, gprep, 4, 12, bwd16)[0] == "mx_quant<5,3,5>"
    # the forward's row-only h: the same depth and shared memory (the column operand had no smem of its own), or
    # mx_quant without its staged tile and multipliers (a row-only mode stages nothing)
    none = quant_plan.CS["none"]
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, none, 32, 288, fwd) == (
        "mx_swiglu_dual<0,0,3>",
        132,
        528 + 3 * 65536 + 1024,
        288,
        16,
        256,
    )
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, none, 6300, 6556, fwd) == (
        "mx_quant<3,3,0>",
        6556 * 16,
        3584 + 16 * 6301,
        6556,
        16,
        256,
    )
    with pytest.raises(ValueError, match="SwiGLU forward only"):
        quant_plan.quant_plan(a, 32768, 4096, grouped, none, 32, 288, bwd16)
    # the grouped dual of other inputs (fp32 x) has no kernel
    with pytest.raises(ValueError, match="grouped dual takes"):
        quant_plan.quant_plan(a.float(), 32768, 4096, grouped, gprep, 32, 288, None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_swiglu_branch_free_division_every_bf16():
    """mx_swiglu_dual's branch-free division (swd_div) == div.rn.f32 for every division the kernel does with it:
    g / d (forward) and 1 / d (backward), d = 1 + expf(-g), over every bf16 g of the range its per-thread check
    (SwdDomain) admits; that check admits exactly the documented range (|g| <= 69; forward also g zero or
    |g| >= 2**-100) with g in either half of a word, hand-counted: 2 + 2 * (0x428A - 0x0D80 + 1) forward,
    2 * (0x428A + 1) backward values."""
    from moe_ep import _cuda

    dev = torch.device("cuda")
    # the check kernel is test code: compiled here, after the quantizer's source (which defines the functions it calls)
    code = _cuda.read_source("mxfp8/quantize.cu") + "\n" + _DIV_CHECK
    fn = _cuda.cupy().RawModule(code=code, options=_cuda.compile_options()).get_function("mx_swiglu_div_check")
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    out = torch.full((65536, 8), -1, dtype=torch.int32, device=dev)
    _cuda.launch(fn, 256, 256, (_cuda.ptr(bits.to(dev)), _cuda.ptr(out), _cuda.i32(65536)), device=dev)
    out = out.cpu()
    a = bits.to(torch.int32) & 0x7FFF
    want_fwd = (a == 0) | ((a >= 0x0D80) & (a <= 0x428A))
    want_bwd = a <= 0x428A
    assert torch.equal(out[:, 4].bool(), want_fwd) and torch.equal(out[:, 5].bool(), want_bwd)
    assert torch.equal(out[:, 6].bool(), want_fwd) and torch.equal(out[:, 7].bool(), want_bwd)  # g in the high half
    assert int(want_fwd.sum()) == 2 + 2 * (0x428A - 0x0D80 + 1) and int(want_bwd.sum()) == 2 * (0x428A + 1)
    g = bits.view(torch.bfloat16).float()
    for what, fast, ieee, dom in (("silu", 0, 1, want_fwd), ("sigmoid", 2, 3, want_bwd)):
        x, y = out[dom, fast], out[dom, ieee]
        assert torch.equal(x, y), f"{what}: {int((x != y).sum())} differ from div.rn, e.g. g = {g[dom][x != y][:4]}"
