"""Grouped GEMM operands from one read (moe_ep.mxfp8.cuda.quantize_grouped_dual): row-wise MXFP8 with per-group
blocked scales plus the per-group column-wise operand, of x itself (mx_quant_dual for bf16, mx_quant for fp32) and
of the SwiGLU forward / backward (mx_swiglu_dual, or mx_quant where that does not run): bytes == the reference's.

Runs on the two backends of tests/test_quant_cuda.py (``cuda``, and ``emu``: the kernel source run on the CPU by
the emulator of tests/quant_emu.py). The emulator's SwiGLU uses the host ``expf``, which may differ from
torch's by an ulp, so against the reference it checks layouts with a 1 % allowance; kernel against kernel (the
register-tiled one against mx_quant, both emulated with the same ``expf``) it is exact.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.experts.operands import colwise_prep_rows, colwise_prep_rows_used
from moe_ep.mxfp8 import cuda as mxfp8_cuda
from moe_ep.mxfp8 import grouped_blocked_size
from moe_ep.mxfp8 import plan as quant_plan
from tests.test_quant_cuda import HAS_CUDA, _big, backend_dev, record_launches  # noqa: F401  (backend_dev: the ``dev`` fixture)

# ------------------------------------------------------------------------------------------------------------
# grouped GEMM operands from one read: row-wise (grouped blocked scales) + per-group column-wise, plain and SwiGLU
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
    """Compare (data, scale, data_c, scale_c); scale_c only in its used rows (the rest is not written).

    With scale_c None (colwise="bf16"), data_c is the prepared bf16 operand, compared in its used rows: NaN
    exactly where the reference has NaN, with the reference's payload 0x7FC0, every other bit pattern equal
    (signed zeros and zero padding rows included).
    """
    pairs = [("data", got[0].view(torch.uint8), want[0].view(torch.uint8)), ("scale", got[1], want[1])]
    if want[3] is None:
        assert got[3] is None
        used = colwise_prep_rows_used(sizes)
        a, b = got[2][:used].cpu(), want[2][:used].cpu()
        assert a.shape == b.shape, f"prepared: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"prepared: NaN differs at {int((na != nb).sum())} places"
        assert (a.view(torch.int16)[na] == 0x7FC0).all(), "prepared: a NaN block's payload is not 0x7FC0"
        pairs.append(("prepared", a.view(torch.int16)[~na], b.view(torch.int16)[~nb]))
    else:
        used = sum(-(-n // 32) for n in sizes)
        pairs.append(("data_c", got[2].view(torch.uint8), want[2].view(torch.uint8)))
        pairs.append(("scale_c", got[3][:used], want[3][:used]))
    for name, a, b in pairs:
        a, b = a.cpu(), b.cpu()
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        _frac_ok(name, a, b, exact)


# bf16 runs mx_quant_dual (register-tiled), fp32 mx_quant (the tile staged in shared memory)
DUAL_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def _dual_kernel(dtype: torch.dtype, colwise: str) -> str:
    """Kernel name prefix the grouped dual of ``dtype`` launches."""
    cs = 5 if colwise == "bf16" else 4
    return f"mx_quant_dual<1,{cs}," if dtype == torch.bfloat16 else f"mx_quant<0,3,{cs}>"


@pytest.mark.parametrize("sizes", DUAL_SIZES)
@pytest.mark.parametrize("dtype", DUAL_DTYPES)
def test_grouped_dual_matches_reference(dev, sizes, dtype, monkeypatch):
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    m, k = sum(sizes), 160
    x = _dual_input(m, k, dtype, seed=len(sizes) + m)
    st = torch.tensor(sizes, dtype=torch.int32)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(x.to(dev), st.to(dev))
    assert len(names) == 1 and names[0].startswith(_dual_kernel(dtype, "mxfp8")), names
    _check_dual(got, quantize_grouped_dual_torch(x, st), sizes)


@pytest.mark.parametrize("sizes", DUAL_SIZES)
@pytest.mark.parametrize("dtype", DUAL_DTYPES)
def test_grouped_dual_prepared_matches_reference(dev, sizes, dtype, monkeypatch):
    """colwise="bf16": the row-wise pair as with MXFP8 column output, and the column operand written as the
    prepared bf16 layout (64-row group blocks, zero padding rows) == prepare_colwise_bf16_torch of the reference's
    MXFP8 column operand; nothing written past the last group's block."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    m, k = sum(sizes), 160
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
    mxfp8_cuda.quantize_grouped_dual_into(x.to(dev), st.to(dev), data, scale, prep, None, colwise="bf16")
    assert len(names) == 1 and names[0].startswith(_dual_kernel(dtype, "bf16")), names
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
@pytest.mark.parametrize("colwise", ["mxfp8", "bf16"])
def test_grouped_dual_extreme_and_persistent(dev, colwise, stages, monkeypatch):
    """bf16 grouped dual (the register-tiled kernel at each cp.async depth it runs: 2 and 4 by tiles per SM, 3 where
    4 stages do not fit next to a large group table; forced here) on extreme blocks, K % 128 = 32, with enough tiles
    that every persistent CTA runs several (GPU: 1284 tiles over at most 396 CTAs; emulator: 33 tiles over at most
    6), bytes == the reference. The emulator copies cp.async data at once: only the GPU run checks the stage ring's
    waits."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    monkeypatch.setattr(quant_plan, "dual_stages", lambda tiles, device: stages)
    if _big(dev):
        sizes, k = [0, 5000, 1, 127, 129, 0, 3000, 4097, 64], 1440
    else:
        sizes, k = [0, 200, 1, 127, 33, 0, 64], 288
    m = sum(sizes)
    x = _extreme_dual_input(m, k, seed=5)
    st = torch.tensor(sizes, dtype=torch.int32)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(x.to(dev), st.to(dev), colwise=colwise)
    assert names == [f"mx_quant_dual<1,{5 if colwise == 'bf16' else 4},{stages}>"]
    _check_dual(got, quantize_grouped_dual_torch(x, st, colwise=colwise), sizes)


@pytest.mark.parametrize("colwise", ["mxfp8", "bf16"])
def test_grouped_dual_k224(dev, colwise, monkeypatch):
    """K = 224: the last column tile holds 96 of 128 columns (3 of 4 scale columns), with a trailing empty group."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    sizes = [3, 0, 70, 129, 0]
    x = _extreme_dual_input(sum(sizes), 224, seed=9)
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(x.to(dev), st.to(dev), colwise=colwise)
    _check_dual(got, quantize_grouped_dual_torch(x, st, colwise=colwise), sizes)


def _dual_into_sentinel(x, sizes, m, colwise, swiglu=False, dh=None):
    """quantize_grouped_dual_into x[:m] (swiglu: of SwiGLU(x[:m]); dh: of its backward with dh[:m]) with every
    output prefilled with a sentinel byte; the outputs as bytes."""
    dev, g = x.device, len(sizes)
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    data = torch.full((m, k), 0x55, dtype=torch.uint8, device=dev)
    scale = torch.full((grouped_blocked_size(m, g, k // 32, "m"),), 0x33, dtype=torch.uint8, device=dev)
    if colwise == "bf16":
        data_c, scale_c = torch.full((colwise_prep_rows(m, g), 2 * k), 0x12, dtype=torch.uint8, device=dev), None
    else:
        data_c = torch.full((m, k), 0x66, dtype=torch.uint8, device=dev)
        scale_c = torch.full((mxfp8_cuda.grouped_colwise_scale_rows(m, g), k), 0x77, dtype=torch.uint8, device=dev)
    dc = data_c.view(torch.bfloat16) if colwise == "bf16" else data_c.view(torch.float8_e4m3fn)
    kw = {"swiglu_dh": dh[:m].contiguous()} if dh is not None else {"apply_swiglu": swiglu}
    mxfp8_cuda.quantize_grouped_dual_into(
        x[:m].contiguous(), st, data.view(torch.float8_e4m3fn), scale, dc, scale_c, colwise=colwise, **kw
    )
    return [t.cpu() for t in (data, scale, data_c, scale_c) if t is not None]


@pytest.mark.parametrize("colwise", ["mxfp8", "bf16"])
def test_grouped_dual_sizes_not_summing_to_m(dev, colwise, monkeypatch):
    """Group sizes summing to less than M (rows past the groups untouched) or more (clamped at M): the register-
    tiled kernel on bf16 x writes exactly the bytes mx_quant writes for the same values in fp32, sentinels included
    (the reference needs sum == M, so the two kernels are compared with each other)."""
    sizes = [40, 0, 90, 7]
    x = _extreme_dual_input(160, 96, seed=11).to(dev)
    names = record_launches(monkeypatch)
    for m in (sum(sizes) - 20, sum(sizes) + 23):
        got = _dual_into_sentinel(x, sizes, m, colwise)
        want = _dual_into_sentinel(x.float(), sizes, m, colwise)
        assert names[-2].startswith(_dual_kernel(torch.bfloat16, colwise)), names
        assert names[-1] == _dual_kernel(torch.float32, colwise), names
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"M = {m}, output {i}: {int((a != b).sum())} bytes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_grouped_dual_prepared_bad_input():
    x = torch.zeros(64, 96, dtype=torch.bfloat16, device="cuda")
    st = torch.tensor([64], dtype=torch.int32, device="cuda")
    data = torch.empty(64, 96, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(grouped_blocked_size(64, 1, 3, "m"), dtype=torch.uint8, device="cuda")
    prep = torch.empty(128, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="colwise must be"):
        mxfp8_cuda.quantize_grouped_dual(x, st, colwise="fp8")
    with pytest.raises(ValueError, match="scale_c=None"):
        mxfp8_cuda.quantize_grouped_dual_into(
            x, st, data, scale, prep, torch.empty(3, 96, dtype=torch.uint8, device="cuda"), colwise="bf16"
        )
    with pytest.raises(ValueError, match="data_c: expected shape"):
        mxfp8_cuda.quantize_grouped_dual_into(x, st, data, scale, prep[:64], None, colwise="bf16")
    with pytest.raises(TypeError, match="data_c: expected dtype"):
        mxfp8_cuda.quantize_grouped_dual_into(x, st, data, scale, prep.float(), None, colwise="bf16")


@pytest.mark.parametrize("sizes", DUAL_SIZES)
def test_swiglu_dual_matches_reference(dev, sizes):
    """SwiGLU fused with both quantizations == torch's swiglu (same device) then the reference quantizer."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    m, f = sum(sizes), 96
    a = _dual_input(m, 2 * f, torch.bfloat16, seed=7 + m).to(dev)
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), apply_swiglu=True)
    want = quantize_grouped_dual_torch(a, st, apply_swiglu=True)
    _check_dual(got, want, sizes, exact=dev.type == "cuda")


@pytest.mark.parametrize("mode", ["forward", "backward_f32", "backward_bf16"])
@pytest.mark.parametrize("sizes", DUAL_SIZES)
def test_swiglu_dual_prepared_matches_reference(dev, sizes, mode):
    """The fused SwiGLU forward (h) and backward (dA, with an fp32 or a bf16 dh) with the prepared column operand:
    the wgrad operand straight from the fused kernel."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    m, f = sum(sizes), 96
    a = _dual_input(m, 2 * f, torch.bfloat16, seed=17 + m).to(dev)
    if mode == "forward":
        kw = {"apply_swiglu": True}
    else:
        dh_dtype = torch.float32 if mode == "backward_f32" else torch.bfloat16
        kw = {"swiglu_dh": _dual_input(m, f, torch.float32, seed=19 + m).to(dh_dtype).to(dev)}
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), colwise="bf16", **kw)
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
    with pytest.raises(TypeError, match="fp32 or bf16"):
        mxfp8_cuda.quantize_grouped_dual(a2, st, swiglu_dh=torch.zeros(64, 64, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="dh: expected shape"):
        mxfp8_cuda.quantize_grouped_dual(a2, st, swiglu_dh=torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("dh_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", DUAL_SIZES)
def test_swiglu_bwd_dual_matches_reference(dev, sizes, dh_dtype):
    """Backward SwiGLU fused with both quantizations of dA == torch's swiglu_bwd then the reference quantizer.

    F = 96 puts the gate/up boundary of dA (column 96) inside the first 128-column tile. A bf16 dh (the dgrad
    GEMM's output) is read as is; the reference promotes it to fp32 exactly, so the bytes must match too.
    """
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    m, f = sum(sizes), 96
    a = _dual_input(m, 2 * f, torch.bfloat16, seed=11 + m).to(dev)
    dh = _dual_input(m, f, torch.float32, seed=13 + m).to(dh_dtype).to(dev)
    st = torch.tensor(sizes, dtype=torch.int32)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), swiglu_dh=dh)
    want = quantize_grouped_dual_torch(a, st, swiglu_dh=dh)
    assert got[0].shape == (m, 2 * f)
    _check_dual(got, want, sizes, exact=dev.type == "cuda")


# ------------------------------------------------------------------------------------------------------------
# the register-tiled SwiGLU quantizers (mx_swiglu_dual, kernels/quant_swiglu.cuh)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("colwise", ["mxfp8", "bf16"])
@pytest.mark.parametrize("mode", ["forward2", "forward3", "backward"])
def test_swiglu_reg_matches_mx_quant(dev, mode, colwise, monkeypatch):
    """mx_swiglu_dual (each depth it runs: the forward takes 2 where 3 do not fit next to the group table; forced
    here) writes exactly the bytes of mx_quant, which runs where mx_swiglu_dual does not fit (forced here) and for an
    fp32 dh, sentinels included: extreme blocks in a and dh (subnormals, near-overflow values whose products
    overflow to Inf, NaN/Inf, zeros), empty groups, group sizes summing to M, to less (rows past the groups
    untouched) and to more (clamped at M), several tiles per CTA, and (forward) a partial last column tile. Kernel
    against kernel, so the emulator is exact too (same host expf)."""
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
    cs = 5 if colwise == "bf16" else 4
    want_name = f"mx_swiglu_dual<{int(bwd)},{cs},{3 if mode == 'forward3' else 2}>"
    names = record_launches(monkeypatch)
    for m in (n, n - 20, n + 23):
        got = _dual_into_sentinel(a, sizes, m, colwise, swiglu=not bwd, dh=dh)
        assert names[-1] == want_name, names
        wants = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(quant_plan, "swiglu_plan", lambda *args: None)  # as where mx_swiglu_dual does not fit
            wants.append(_dual_into_sentinel(a, sizes, m, colwise, swiglu=not bwd, dh=dh))
        assert names[-1] == f"mx_quant<{5 if bwd else 3},3,{cs}>", names
        if bwd:  # an fp32 dh of the same values
            wants.append(_dual_into_sentinel(a, sizes, m, colwise, dh=dh.float()))
            assert names[-1] == f"mx_quant<4,3,{cs}>", names
        for want in wants:
            for i, (x, y) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(x, y), f"M = {m}, output {i}: {int((x != y).sum())} bytes differ"


@pytest.mark.parametrize("colwise", ["mxfp8", "bf16"])
@pytest.mark.parametrize("bwd", [False, True], ids=["forward", "backward"])
def test_swiglu_reg_matches_reference(dev, bwd, colwise, monkeypatch):
    """mx_swiglu_dual against torch's swiglu / swiglu_bwd on the same device then the reference quantizer: exact on
    the GPU (F = 128 backward, one h tile; F = 224 forward, a partial second one), extreme blocks, empty groups."""
    from moe_ep.experts.reference import quantize_grouped_dual_torch

    sizes, f = [3, 0, 70, 129, 0, 40], 128 if bwd else 224
    m = sum(sizes)
    a = _extreme_dual_input(m, 2 * f, seed=31).to(dev)
    kw = {"swiglu_dh": _extreme_dual_input(m, f, seed=32).to(dev)} if bwd else {"apply_swiglu": True}
    st = torch.tensor(sizes, dtype=torch.int32)
    names = record_launches(monkeypatch)
    got = mxfp8_cuda.quantize_grouped_dual(a, st.to(dev), colwise=colwise, **kw)
    assert names[0].startswith(f"mx_swiglu_dual<{int(bwd)},")
    want = quantize_grouped_dual_torch(a, st, colwise=colwise, **kw)
    _check_dual(got, want, sizes, exact=dev.type == "cuda")


def test_swiglu_kernel_plan(monkeypatch):
    """Which SwiGLU kernel runs, its depth, grid and shared memory (hand-worked, 132 SMs; no launch)."""
    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    grouped, gnt, gprep = quant_plan.RS["grouped"], quant_plan.CS["grouped_nt"], quant_plan.CS["grouped_prep"]
    fwd, bwd16, bwd32 = quant_plan.IN_SWIGLU, quant_plan.IN_SWIGLU_BWD16, quant_plan.IN_SWIGLU_BWD
    a = torch.empty(32768, 4096, dtype=torch.bfloat16)  # dsv3: F = 2048, 32 groups, 256 + 32 row tiles
    # forward: 288 x 16 tiles of h; 3 stages of gate + up (64 KB), table 16 * 33, two 512-byte scale tiles
    plan = quant_plan.quant_plan(a, 32768, 2048, grouped, gprep, 32, 288, fwd)
    assert plan == ("mx_swiglu_dual<0,5,3>", 132, 528 + 3 * 65536 + 1024, 288, 16, 256)
    # backward: output width 2F = 4096 (32 column tiles), 288 x 16 tiles of h; 2 stages of gate + up + dh (96 KB)
    # and two pairs (gate, up) of scale tiles
    plan = quant_plan.quant_plan(a, 32768, 4096, grouped, gnt, 32, 288, bwd16)
    assert plan == ("mx_swiglu_dual<1,4,2>", 132, 528 + 2 * 98304 + 2048, 288, 32, 256)
    # few tiles: one CTA per tile of h
    assert quant_plan.swiglu_plan(False, 256, 6, 2, torch.device("cpu")) == (3, 6, 48 + 3 * 65536 + 1024)
    # 2200 groups: 3 forward stages no longer fit next to the table (35216 + 196608 + 1024 > 232448), 2 do
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, gnt, 2200, 2456, fwd)[:3] == (
        "mx_swiglu_dual<0,4,2>",
        132,
        16 * 2201 + 2 * 65536 + 1024,
    )
    # 6300 groups: not even 2 forward stages (100816 + 131072 + 1024 > 232320): mx_quant, one CTA per fp32 tile
    # with the tile staged in shared memory (64 KB), the fixed area and the table
    assert quant_plan.quant_plan(a, 32768, 2048, grouped, gnt, 6300, 6556, fwd) == (
        "mx_quant<3,3,4>",
        6556 * 16,
        65536 + 3584 + 16 * 6301,
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
    assert quant_plan.quant_plan(a, 32768, 4096, grouped, gnt, 2200, 2456, bwd16)[0].startswith("mx_quant<5,3,4")
    # backward with F % 128 != 0 (F = 96: dA's up half starts inside a tile of the blocked scales), or fp32 dh
    a96 = torch.empty(1000, 192, dtype=torch.bfloat16)
    assert quant_plan.quant_plan(a96, 1000, 192, grouped, gnt, 4, 12, bwd16)[0].startswith("mx_quant<5,3,4")
    assert quant_plan.quant_plan(a, 32768, 4096, grouped, gnt, 32, 288, bwd32)[0].startswith("mx_quant<4,3,4")


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
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    out = torch.full((65536, 8), -1, dtype=torch.int32, device=dev)
    fn = mxfp8_cuda._kernel("mx_swiglu_div_check", dev)
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
