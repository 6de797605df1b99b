"""MXFP8 grouped GEMM kernels (moe_ep.experts.sm90.gemm) against the reference: dequantize exactly + float64 matmul.

Tolerance. The operands are exactly representable in bf16 (e4m3 * 2**k; we never test the < 2**-133 underflow
corner) and the tensor cores form exact products, so only the fp32 accumulation differs from an exact sum.
The tensor cores (bf16 -> fp32) add each k16 step's 16 products into the accumulator with one alignment and a
truncating (round-toward-zero) normalisation, not IEEE round-to-nearest (Fasi et al., PeerJ CS 2021, for
V100..A100; Khattak & Mikaitis, arXiv 2512.07004, for H100). One k16 step therefore loses less than 2 ulp
of the largest magnitude it touches, i.e. <= 2**-22 * (|A| @ |B|) per element, and the errors do not cancel on
average (truncation is biased). With S = ceil(K/16) steps (K = the reduction length) we require
  per element  |err| <= 2**-22 * (S + 1) * (|A| @ |B|)            (worst case; + 2**-8 |ref| for bf16 outputs),
  fp32 outputs ||err|| <= 2 ||err of torch's fp32 matmul|| + 2**-23 * (S + 2) * || |A| @ |B| ||
(the mean truncation bias is <= 2**-24 of the partial sum per step; a factor 2 of margin). For K = 512 the
per-element bound is ~8e-6 relative to |A| @ |B|; indexing, scale or conversion bugs give errors of order 1 (or
exactly-zero terms for flushed subnormals, which ``test_raw_codes`` isolates), far above these bounds.

Out-of-bounds reads: operands are copied into allocations followed by 64 KiB of poison bytes (e4m3 NaN codes,
scale 0xFF = NaN), and preallocated outputs are followed by NaN guard elements that must stay untouched, so a
read or write past the end of a tensor shows up as a wrong result instead of depending on the page layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.sm90 import gemm as gemm_cuda
from moe_ep.experts.sm90 import operands  # noqa: E402
from tests import refs  # noqa: E402
from tests.gemm_emu import mm64

CUDA = torch.cuda.is_available()


def _skip_without_gpu():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


def _sizes_t(sizes, dev="cuda"):
    return torch.tensor(sizes, dtype=torch.int32, device=dev)


GUARD = 64 * 1024  # poison bytes after every operand (see the module docstring)


def _guarded(t: torch.Tensor, poison: int) -> torch.Tensor:
    """A copy of t that is followed, in the same allocation, by GUARD bytes of ``poison``."""
    nb = t.numel() * t.element_size()
    buf = torch.full((nb + GUARD,), poison, dtype=torch.uint8, device=t.device)
    buf[:nb] = t.contiguous().view(torch.uint8).reshape(-1)
    return buf[:nb].view(t.dtype).view(t.shape)


def _guarded_out(shape, dtype):
    """(out, guard): a NaN-filled output followed by NaN guard elements in the same allocation."""
    numel = int(torch.Size(shape).numel())
    buf = torch.full((numel + GUARD // 4,), float("nan"), dtype=dtype, device="cuda")
    return buf[:numel].view(shape), buf[numel:]


def _varied(m, k, gen, dev="cuda"):
    """Random normal values with per-row and per-column magnitudes spanning 1e-3 .. 1e3."""
    x = torch.randn(m, k, generator=gen, device=dev)
    r = 10.0 ** (torch.rand(m, 1, generator=gen, device=dev) * 6 - 3)
    c = 10.0 ** (torch.rand(1, k, generator=gen, device=dev) * 6 - 3)
    return x * r * c


def _wgrad_prepared(ad, asc, bd, bsc, sizes, m, out):
    """The wgrad kernel on both grouped column-wise MXFP8 operands, prepared as the quantizer writes them
    (``prepare_colwise_bf16_torch``, on the GPU) and guarded by NaN poison: out[g] = A_g^T B_g. Returns out."""
    ap = _guarded(refs.prepare_colwise_bf16_torch(ad, asc, sizes), 0xFF)
    bp = _guarded(refs.prepare_colwise_bf16_torch(bd, bsc, sizes), 0xFF)
    sizes_t = _sizes_t(sizes)
    torch.cuda.set_sync_debug_mode("error")  # the launch must not synchronize with the host
    try:
        return gemm_cuda.grouped_wgrad_prepared_out(ap, bp, sizes_t, out, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _tc_steps(red: int) -> int:
    """Tensor-core k16 steps over a reduction of ``red`` terms."""
    return -(-red // 16)


def _assert_close(got, ref64, ref32, abs_sum, out_dtype, what, red):
    """got vs the float64 reference; ``red`` = reduction length (K, or the largest group for wgrad)."""
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    g = got.double()
    err = (g - ref64).abs()
    steps = _tc_steps(red)
    bound = 2.0**-22 * (steps + 1) * abs_sum
    if out_dtype == torch.float32:
        err32 = (ref32.double() - ref64).norm().item()
        rel = err.norm().item()
        allow = 2 * err32 + 2.0**-23 * (steps + 2) * abs_sum.norm().item()
        assert rel <= allow, f"{what}: norm error {rel:.3e} vs fp32 {err32:.3e} (allowed {allow:.3e})"
    else:
        bound = bound + 2.0**-8 * ref64.abs()
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {err.max().item():.3e}"


FPROP_CASES = [
    # (sizes, extra trailing rows outside every group, K, N)
    ([0, 300, 0, 77, 1, 1000], 0, 512, 384),
    ([1000], 0, 96, 136),  # G=1, M % 128 != 0, K % 64 == 32, N % 16 != 0
    ([0, 0, 0, 0], 5, 64, 128),  # only empty groups: nothing written
    ([0, 0, 4096, 0], 0, 256, 256),  # all rows in one group
    ([31, 33, 129, 0, 2, 255], 7, 128, 200),  # trailing rows never written
    ([0, 300, 0, 77, 1, 200], 5, 3104, 264),  # K >= 3072: the 5-stage build (register epilogue), K % 64 == 32
]


def _rand_sizes(g, total, gen):
    w = torch.rand(g, generator=gen) ** 2
    w[torch.randperm(g, generator=gen)[: g // 4]] = 0  # some empty groups
    s = (w / w.sum() * total).floor().to(torch.int64)
    s[0] += total - int(s.sum())
    return s.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(range(len(FPROP_CASES))) + ["random64"])
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_2d3d_matches_reference(case, kind):
    _skip_without_gpu()
    out_dtype = torch.bfloat16  # the kernel's only output
    seed = (len(FPROP_CASES) if case == "random64" else case) * 2 + (kind == "dgrad")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if case == "random64":
        sizes, extra, k, n = _rand_sizes(64, 5000, torch.Generator().manual_seed(3)), 3, 192, 256
    else:
        sizes, extra, k, n = FPROP_CASES[case]
    g, s = len(sizes), sum(sizes)
    m = s + extra
    x = _varied(m, k, gen)
    w = torch.randn(g, n, k, generator=gen, device="cuda") * 0.05
    xd, xs = refs.rowwise_operand_ref(x[:s], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[s:], -1).data]) if extra else xd
    need = mxfp8.grouped_blocked_size(m, g, k // 32, "m")
    xs = torch.cat([xs, xs.new_zeros(need - xs.numel())])
    xq = mxfp8.dequantize_torch(mxfp8.quantize_torch(x[:s], -1), torch.float32)
    if kind == "fprop":
        wd, ws = operands.weight_operand_ref(w)
        wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -1), torch.float32)
        fn = gemm_cuda.grouped_mm_fprop
    else:  # dgrad: x plays dY [M, N'] with N' = k, the weight is W [G, n, k] used as W^T
        w = torch.randn(g, k, n, generator=gen, device="cuda") * 0.05  # W [G, N'=k, K'=n]
        wd, ws = operands.weight_t_operand_ref(w)  # [G, n, k] quantized along k
        wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -2), torch.float32).transpose(1, 2)
        fn = gemm_cuda.grouped_mm_dgrad
    xd, xs, wd, ws = _guarded(xd, 0x7F), _guarded(xs, 0xFF), _guarded(wd, 0x7F), _guarded(ws, 0xFF)
    out, guard = _guarded_out((m, n), out_dtype)
    sizes_t = _sizes_t(sizes)  # host -> device copy: before the no-sync region
    torch.cuda.set_sync_debug_mode("error")  # the launch must not synchronize with the host
    try:
        fn(xd, xs, wd, ws, sizes_t, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ref64 = mm64(xq, wq, sizes)
    abs_sum = mm64(xq.abs(), wq.abs(), sizes)
    _assert_close(out[:s], ref64, None, abs_sum, out_dtype, f"{kind} case {case}", k)
    assert torch.isnan(out[s:].float()).all(), "rows outside every group were written (given out)"
    assert torch.isnan(guard.float()).all(), "written past the end of out"


WGRAD_CASES = [
    ([0, 5, 300, 0, 1000, 33], 256, 136),
    ([64], 128, 128),  # G=1
    ([0, 0, 0], 64, 32),  # all empty: zeros
    ([1, 2, 3, 4097], 136, 200),  # tiny groups and one long reduction
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(range(len(WGRAD_CASES))))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_matches_reference(case, out_dtype):
    """The wgrad kernel on prepared operands (grouped_wgrad_prepared_out) against the exact product of the MXFP8
    column-wise operands they hold."""
    _skip_without_gpu()
    sizes, n, k = WGRAD_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(10 + case)
    g, m = len(sizes), sum(sizes)
    dy, x = _varied(m, n, gen), _varied(m, k, gen)
    ad, asc = refs.colwise_operand_ref(dy, sizes)
    bd, bsc = refs.colwise_operand_ref(x, sizes)
    aq = refs.colwise_dequantize_ref(ad, asc, sizes)
    bq = refs.colwise_dequantize_ref(bd, bsc, sizes)
    out, guard = _guarded_out((g, n, k), out_dtype)
    _wgrad_prepared(ad, asc, bd, bsc, sizes, m, out)
    torch.cuda.synchronize()
    assert torch.isnan(guard.float()).all(), "written past the end of out"
    ref64 = torch.zeros(g, n, k, dtype=torch.float64, device="cuda")
    ref32 = torch.zeros(g, n, k, dtype=torch.float32, device="cuda")
    abs_sum = torch.zeros_like(ref64)
    start = 0
    for gi, rows in enumerate(sizes):
        a_, b_ = aq[start : start + rows], bq[start : start + rows]
        ref64[gi] = a_.double().t() @ b_.double()
        ref32[gi] = a_.t() @ b_
        abs_sum[gi] = a_.abs().double().t() @ b_.abs().double()
        start += rows
    _assert_close(out, ref64, ref32, abs_sum, out_dtype, f"wgrad case {case}", max(sizes))
    for gi, rows in enumerate(sizes):
        if rows == 0:
            assert (out[gi] == 0).all(), "empty groups must give zeros"


def _codes(shape, gen, subnormal=False):
    """Random e4m3 codes (every finite code, optionally only subnormals), no NaN codes."""
    c = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.int32)
    if subnormal:
        c = (c & 0x87) | 1  # exponent field 0: e4m3 subnormals
    c = torch.where((c & 0x7F) == 0x7F, c ^ 1, c)  # no NaN codes (the quantizer pairs them with scale 0xFF)
    return c.to(torch.uint8).view(torch.float8_e4m3fn)


def _scales(shape, gen):
    """Scale bytes 100 .. 154: both conversion paths (< 128: one multiply; >= 128: two), all finite in fp32."""
    return torch.randint(100, 155, shape, generator=gen, device="cuda", dtype=torch.int32).to(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("subnormal_a", [False, True])
def test_raw_codes(subnormal_a):
    """Every finite e4m3 code (subnormals included) and scales on both conversion paths (< 128 and >= 128).

    The reference reads the scale bytes as the kernel must: 2**(s - 127) for every s != 0xFF (docs/design.md,
    "MXFP8 format").
    """
    _skip_without_gpu()
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes, k, n = [70, 0, 200], 128, 64
    g, m = len(sizes), sum(sizes)
    a, a_s = _codes((m, k), gen, subnormal_a), _scales((m, k // 32), gen)
    b, b_s = _codes((g, n, k), gen), _scales((g, n, k // 32), gen)
    aq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(a, a_s, 1), torch.float32)
    bq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(b, b_s, 2), torch.float32)
    a_bl = _guarded(mxfp8.to_blocked_grouped(a_s, torch.tensor(sizes), "m"), 0xFF)
    b_bl = _guarded(mxfp8.to_blocked(b_s).contiguous(), 0xFF)
    out = gemm_cuda.grouped_mm_fprop(_guarded(a, 0x7F), a_bl, _guarded(b, 0x7F), b_bl, _sizes_t(sizes))
    ref64, asum = mm64(aq, bq, sizes), mm64(aq.abs(), bq.abs(), sizes)
    _assert_close(out, ref64, None, asum, torch.bfloat16, "raw codes fprop", k)
    # the same through wgrad (column-wise scales, one per 32-row block of each group and column)
    ad, bd = _codes((m, n), gen, subnormal_a), _codes((m, k), gen)
    rows = operands.colwise_scale_rows(m, g)
    asc, bsc = _scales((rows, n), gen), _scales((rows, k), gen)
    aq, bq = (refs.colwise_dequantize_ref(ad, asc, sizes), refs.colwise_dequantize_ref(bd, bsc, sizes))
    out = _wgrad_prepared(ad, asc, bd, bsc, sizes, m, torch.empty(g, n, k, device="cuda"))
    segs = [(aq[s0 : s0 + r], bq[s0 : s0 + r]) for s0, r in zip([0, 70, 70], sizes, strict=True)]
    ref64 = torch.stack([x.double().t() @ y.double() for x, y in segs])
    ref32 = torch.stack([x.t() @ y for x, y in segs])
    asum = torch.stack([x.abs().double().t() @ y.abs().double() for x, y in segs])
    _assert_close(out, ref64, ref32, asum, torch.float32, "raw codes wgrad", max(sizes))


@pytest.mark.gpu
def test_nan_scales_propagate():
    """Scale byte 0xFF means NaN (docs/design.md, "MXFP8 format"): it reaches exactly the outputs whose sums contain
    it."""
    _skip_without_gpu()
    gen = torch.Generator(device="cuda").manual_seed(8)
    sizes, k, n = [70, 0, 200], 128, 64
    g, m = len(sizes), sum(sizes)
    a, a_s = _codes((m, k), gen), _scales((m, k // 32), gen)
    b, b_s = _codes((g, n, k), gen), _scales((g, n, k // 32), gen)
    a_s[5, 1] = 0xFF  # row 5 (group 0): the whole output row is NaN
    b_s[2, 7, 3] = 0xFF  # group 2, output column 7: NaN in the rows of group 2 only
    out = gemm_cuda.grouped_mm_fprop(
        a,
        mxfp8.to_blocked_grouped(a_s, torch.tensor(sizes), "m"),
        b,
        mxfp8.to_blocked(b_s),
        _sizes_t(sizes),
    )
    nan = torch.zeros(m, n, dtype=torch.bool, device="cuda")
    nan[5] = True
    nan[70:, 7] = True
    assert torch.equal(torch.isnan(out), nan)
    aq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(a, a_s, 1), torch.float32)
    bq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(b, b_s, 2), torch.float32)
    ref64 = mm64(aq, bq, sizes)
    assert torch.equal(torch.isnan(ref64), nan)  # the reference agrees on what 0xFF means
    ok = ~nan
    err = (out.double() - ref64)[ok].abs()
    bound = 2.0**-22 * (_tc_steps(k) + 1) * mm64(aq.abs(), bq.abs(), sizes)[ok] + 2.0**-8 * ref64[ok].abs()
    assert (err <= bound).all()


@pytest.mark.gpu
def test_side_stream_and_default_outputs():
    """Same bytes on torch's default stream and on a side stream; default outputs are fully defined.

    The side stream first sleeps, then produces the operands: a kernel launched on any other stream than torch's
    current one would read them before they exist. sizes sum to 240 < M = 256: rows 240.. of an output the
    wrapper allocates are zero (written by the kernel's spare CTAs, no memset).
    """
    _skip_without_gpu()
    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes, k, n, m = [100, 0, 140], 64, 128, 256
    s_rows = sum(sizes)
    x, w = _varied(m, k, gen), torch.randn(3, n, k, generator=gen, device="cuda")
    xd, xs = refs.rowwise_operand_ref(x[:s_rows], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[s_rows:], -1).data])
    xs = torch.cat([xs, xs.new_zeros(mxfp8.grouped_blocked_size(m, 3, k // 32) - xs.numel())])
    wd, ws = operands.weight_operand_ref(w)
    ref = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, _sizes_t(sizes))
    assert ref.dtype == torch.bfloat16 and ref.shape == (m, n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sz = _sizes_t(sizes)
        torch.cuda._sleep(50_000_000)  # ~25 ms: the copies below are queued behind it on s
        xd2, xs2, wd2, ws2 = (t.view(torch.uint8).clone().view(t.dtype) for t in (xd, xs, wd, ws))
        got = gemm_cuda.grouped_mm_fprop(xd2, xs2, wd2, ws2, sz)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(got, ref), "side stream and default stream differ"
    assert (ref[s_rows:] == 0).all(), "rows past the groups of a default output must be zero"
    xq = mxfp8.dequantize_torch(mxfp8.quantize_torch(x[:s_rows], -1), torch.float32)
    wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -1), torch.float32)
    _assert_close(
        ref[:s_rows], mm64(xq, wq, sizes), None, mm64(xq.abs(), wq.abs(), sizes), torch.bfloat16, "default output", k
    )


LARGE_SIZES = [1500, 0, 700, 2300, 1, 127, 2900, 622]  # 8150 rows of M = 8192: 42 trailing rows


@pytest.mark.gpu
def test_large_uneven_groups():
    """Benchmark-like scale (M = 8192, G = 8 uneven groups, one empty, K = 2048, N = 1024): fprop (default output:
    trailing rows zero), dgrad (given output: trailing rows untouched) and wgrad (prepared operands) against the
    reference. Guarded operands turn any read past a tensor's end into a wrong result; the first device run's
    illegal address (the loader read up to 48 bytes past x) failed here, not only in the benchmark."""
    _skip_without_gpu()
    sizes, m, k, n = LARGE_SIZES, 8192, 2048, 1024
    g, s = len(sizes), sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(m, k, generator=gen, device="cuda")
    dy = torch.randn(m, n, generator=gen, device="cuda")
    w = torch.randn(g, n, k, generator=gen, device="cuda") * 0.02
    xq, dyq = mxfp8.quantize_torch(x, -1), mxfp8.quantize_torch(dy, -1)
    wq, wtq = mxfp8.quantize_torch(w, -1), mxfp8.quantize_torch(w.transpose(1, 2).contiguous(), -1)

    def grouped_scales(q):  # groups' scales + the trailing rows' scales after them (ignored by the kernel)
        bl = mxfp8.to_blocked_grouped(q.scale[:s], torch.tensor(sizes), "m")
        need = mxfp8.grouped_blocked_size(m, g, q.scale.shape[1], "m")
        return _guarded(torch.cat([bl, bl.new_zeros(need - bl.numel())]), 0xFF)

    xs, dys = grouped_scales(xq), grouped_scales(dyq)
    ws, wts = _guarded(mxfp8.to_blocked(wq.scale), 0xFF), _guarded(mxfp8.to_blocked(wtq.scale), 0xFF)
    dyc, dycs = refs.colwise_operand_ref(dy[:s], sizes)
    xc, xcs = refs.colwise_operand_ref(x[:s], sizes)
    dyc, xc = torch.cat([dyc, dyq.data[s:]]), torch.cat([xc, xq.data[s:]])  # [M, .]: trailing rows unused
    sz = _sizes_t(sizes)
    dgrad_out, guard = _guarded_out((m, k), torch.bfloat16)
    args = [_guarded(t, 0x7F) for t in (xq.data, wq.data, dyq.data, wtq.data)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        o_f = gemm_cuda.grouped_mm_fprop(args[0], xs, args[1], ws, sz)
        gemm_cuda.grouped_mm_dgrad(args[2], dys, args[3], wts, sz, out=dgrad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    o_w = _wgrad_prepared(dyc, dycs, xc, xcs, sizes, m, torch.empty(g, n, k, device="cuda"))
    torch.cuda.synchronize()

    xf, wf = mxfp8.dequantize_torch(xq, torch.float32)[:s], mxfp8.dequantize_torch(wq, torch.float32)
    _assert_close(o_f[:s], mm64(xf, wf, sizes), None, mm64(xf.abs(), wf.abs(), sizes), torch.bfloat16, "large fprop", k)
    assert (o_f[s:] == 0).all(), "rows past the groups of a default output must be zero"
    del xf, wf
    dyf, wtf = mxfp8.dequantize_torch(dyq, torch.float32)[:s], mxfp8.dequantize_torch(wtq, torch.float32)
    _assert_close(
        dgrad_out[:s],
        mm64(dyf, wtf, sizes),
        None,
        mm64(dyf.abs(), wtf.abs(), sizes),
        torch.bfloat16,
        "large dgrad",
        n,
    )
    assert torch.isnan(dgrad_out[s:]).all() and torch.isnan(guard).all(), "dgrad wrote outside the groups' rows"
    del dyf, wtf
    af = refs.colwise_dequantize_ref(dyc, dycs, sizes)
    bf = refs.colwise_dequantize_ref(xc, xcs, sizes)
    ref64 = torch.zeros(g, n, k, dtype=torch.float64, device="cuda")
    ref32 = torch.zeros(g, n, k, dtype=torch.float32, device="cuda")
    asum = torch.zeros_like(ref64)
    start = 0
    for gi, rows in enumerate(sizes):
        a_, b_ = af[start : start + rows], bf[start : start + rows]
        ref64[gi], ref32[gi] = a_.double().t() @ b_.double(), a_.t() @ b_
        asum[gi] = a_.abs().double().t() @ b_.abs().double()
        start += rows
    _assert_close(o_w, ref64, ref32, asum, torch.float32, "large wgrad", max(sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [32, 64, 160, 3104])
def test_many_tiles_per_cta(k):
    """More tiles than SMs with 1-3 k-steps each (and 49 in the 5-stage build at K = 3104): the persistent CTAs
    walk ~5 tiles each, so the ring's stage/phase counters wrap at every offset and the producer runs ahead across
    tiles. Uneven groups, empty ones, trailing rows (zero-filled by the tiles past the groups)."""
    _skip_without_gpu()
    sizes = _rand_sizes(7, 40000, torch.Generator().manual_seed(k))
    g, s, n = len(sizes), sum(sizes), 264
    m = s + 77
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = _varied(m, k, gen)
    w = torch.randn(g, n, k, generator=gen, device="cuda") * 0.05
    xd, xs = refs.rowwise_operand_ref(x[:s], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[s:], -1).data])
    xs = torch.cat([xs, xs.new_zeros(mxfp8.grouped_blocked_size(m, g, k // 32, "m") - xs.numel())])
    wd, ws = operands.weight_operand_ref(w)
    wp = operands.prepare_weight_bf16(wd, ws)
    sz = _sizes_t(sizes)
    o1 = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz, w_prepared=wp)
    o2 = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz, w_prepared=wp)
    torch.cuda.synchronize()
    xq = mxfp8.dequantize_torch(mxfp8.quantize_torch(x[:s], -1), torch.float32)
    wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -1), torch.float32)
    _assert_close(o1[:s], mm64(xq, wq, sizes), None, mm64(xq.abs(), wq.abs(), sizes), torch.bfloat16, "fprop", k)
    assert (o1[s:] == 0).all(), "rows past the groups must be zero"
    assert torch.equal(o1, o2), "not deterministic"


HALF_TILE_SIZES = [64, 1, 65, 192, 0, 127, 129, 63, 288, 193, 320, 33] * 4  # last tiles of 64 rows or fewer, and more


@pytest.mark.gpu
@pytest.mark.parametrize("k", [96, 3104])  # both builds (4 and 5 ring stages), K % 64 == 32 (a last half k-step)
def test_half_tiles(k):
    """Groups whose last 128-row tile has at most 64 rows (warpgroup 1 then only keeps its MMA turns and ring
    arrivals) next to tiles that need both warpgroups, ~5 tiles per persistent CTA so that full tiles follow
    skipped halves on the same ring."""
    _skip_without_gpu()
    out_dtype = torch.bfloat16
    sizes, n = HALF_TILE_SIZES, 2048
    g, s = len(sizes), sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = _varied(s, k, gen)
    w = torch.randn(g, n, k, generator=gen, device="cuda") * 0.05
    xd, xs = refs.rowwise_operand_ref(x, sizes)
    wd, ws = operands.weight_operand_ref(w)
    sz = _sizes_t(sizes)
    out, guard = _guarded_out((s, n), out_dtype)
    gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz, out=out)
    again = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz, out_dtype=out_dtype)
    torch.cuda.synchronize()
    xq = mxfp8.dequantize_torch(mxfp8.quantize_torch(x, -1), torch.float32)
    wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -1), torch.float32)
    _assert_close(out, mm64(xq, wq, sizes), None, mm64(xq.abs(), wq.abs(), sizes), out_dtype, "half tiles", k)
    assert torch.isnan(guard.float()).all(), "written past the end of out"
    assert torch.equal(out, again), "not deterministic"


# ------------------------------------------------------------------------------------------- argument errors
# (checked before anything touches the GPU: these run on CPU too)


def _fp8(*shape):
    return torch.zeros(*shape, dtype=torch.float8_e4m3fn)


def test_errors_dtype_and_device():
    sz = torch.tensor([4], dtype=torch.int32)
    xs = torch.zeros(mxfp8.grouped_blocked_size(4, 1, 2), dtype=torch.uint8)
    ws = torch.zeros(1, mxfp8.blocked_size(16, 2), dtype=torch.uint8)
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        gemm_cuda.grouped_mm_2d3d_out(torch.zeros(4, 64), xs, _fp8(1, 16, 64), ws, sz, out)
    with pytest.raises(TypeError, match="uint8"):
        gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 64), xs.float(), _fp8(1, 16, 64), ws, sz, out)
    for dt in (torch.float16, torch.float32):  # bf16 is the kernel's only output
        with pytest.raises(TypeError, match="out must be"):
            gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 64), xs, _fp8(1, 16, 64), ws, sz, out.to(dt))
    with pytest.raises(ValueError, match="CUDA"):
        gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 64), xs, _fp8(1, 16, 64), ws, sz, out)


@pytest.mark.gpu
def test_errors_shapes():
    _skip_without_gpu()
    d = "cuda"
    sz = torch.tensor([4], dtype=torch.int32, device=d)
    xs = torch.zeros(mxfp8.grouped_blocked_size(4, 1, 2), dtype=torch.uint8, device=d)
    ws = torch.zeros(1, mxfp8.blocked_size(16, 2), dtype=torch.uint8, device=d)
    x, w = _fp8(4, 64).to(d), _fp8(1, 16, 64).to(d)
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=d)
    with pytest.raises(ValueError, match="reduction sizes"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, _fp8(1, 16, 32).to(d), ws, sz, out)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 48).to(d), xs, _fp8(1, 16, 48).to(d), ws, sz, out)
    with pytest.raises(ValueError, match="a_scale"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs[:16], w, ws, sz, out)
    with pytest.raises(ValueError, match="b_scale"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, w, ws[:, :16], sz, out)
    with pytest.raises(ValueError, match="group_sizes"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, w, ws, torch.tensor([2, 2], dtype=torch.int32, device=d), out)
    with pytest.raises(ValueError, match="out must be"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, w, ws, sz, out[:, :8])
    with pytest.raises(ValueError, match="contiguous"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, w, ws, sz, torch.empty(16, 4, dtype=torch.bfloat16, device=d).t())


def test_kernel_args_match_the_kernel_signature():
    """The launcher's argument tuple has the types and order of GM_ARGS (kernels/experts/sm90/gemm_common.cuh): 6
    pointers, int G, long long M, int N, int K, int zero_rest (CPU only; the GPU tests launch the kernels with it)."""
    t = torch.zeros(16, dtype=torch.uint8)
    got = gemm_cuda._kernel_args(t, t, t, t, t, t, 3, 2**40, 5, 7, True)
    assert [type(v) for v in got] == [np.uint64] * 6 + [np.int32, np.int64, np.int32, np.int32, np.int32]
    assert [int(v) for v in got[:6]] == [t.data_ptr()] * 6
    assert [int(v) for v in got[6:]] == [3, 2**40, 5, 7, 1]
