"""MXFP8 grouped GEMM kernels (moe_ep.gemm_cuda) against the reference: dequantize exactly + float64 matmul.

Tolerance. The operands are exactly representable in bf16 (e4m3 * 2**k; we never test the < 2**-133 underflow
corner), the tensor cores form exact products, so only the fp32 summation order differs from an exact sum.
Measured: plain fp32 torch matmul of the same operands (random data with per-row/column magnitudes spanning
1e-3..1e3, K = 96..4096) has a relative Frobenius error of ~2e-7 and |err| / (|A| @ |B|) <= 6e-7 per element.
We require (fp32 outputs) relative-norm error <= 2x what torch's fp32 matmul gives on the same operands on the
device (plus 5e-7 for accumulation-order differences inside the tensor cores), and per element
|err| <= 2**-18 (~4e-6) * (|A| @ |B|); bf16 outputs may differ by one more bf16 rounding (2**-8 relative).
Indexing, scale or conversion bugs give errors of order 1 (or exactly-zero terms for flushed subnormals, which
``test_raw_codes`` isolates), far above these bounds.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep import gemm_cuda, mxfp8

CUDA = torch.cuda.is_available()


def _skip_without_gpu():
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


def _sizes_t(sizes, dev="cuda"):
    return torch.tensor(sizes, dtype=torch.int32, device=dev)


def _varied(m, k, gen, dev="cuda"):
    """Random normal values with per-row and per-column magnitudes spanning 1e-3 .. 1e3."""
    x = torch.randn(m, k, generator=gen, device=dev)
    r = 10.0 ** (torch.rand(m, 1, generator=gen, device=dev) * 6 - 3)
    c = 10.0 ** (torch.rand(1, k, generator=gen, device=dev) * 6 - 3)
    return x * r * c


def _mm64(a, b, sizes):
    out, start = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = a[start : start + n].double() @ b[g].double().t()
        start += n
    return out


def _mm32(a, b, sizes):
    out, start = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = a[start : start + n].float() @ b[g].float().t()
        start += n
    return out


def _assert_close(got, ref64, ref32, abs_sum, out_dtype, what):
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    g = got.double()
    err = (g - ref64).abs()
    if out_dtype == torch.float32:
        err32 = (ref32.double() - ref64).norm().item()
        rel = err.norm().item()
        assert rel <= 2 * err32 + 5e-7 * ref64.norm().item(), f"{what}: norm error {rel:.3e} vs fp32 {err32:.3e}"
        bound = 2.0**-18 * abs_sum
    else:
        bound = 2.0**-8 * ref64.abs() + 2.0**-18 * abs_sum
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {err.max().item():.3e}"


FPROP_CASES = [
    # (sizes, extra trailing rows outside every group, K, N)
    ([0, 300, 0, 77, 1, 1000], 0, 512, 384),
    ([1000], 0, 96, 136),  # G=1, M % 128 != 0, K % 64 == 32, N % 16 != 0
    ([0, 0, 0, 0], 5, 64, 128),  # only empty groups: nothing written
    ([0, 0, 4096, 0], 0, 256, 256),  # all rows in one group
    ([31, 33, 129, 0, 2, 255], 7, 128, 200),  # trailing rows never written
]


def _rand_sizes(g, total, gen):
    w = torch.rand(g, generator=gen) ** 2
    w[torch.randperm(g, generator=gen)[: g // 4]] = 0  # some empty groups
    s = (w / w.sum() * total).floor().to(torch.int64)
    s[0] += total - int(s.sum())
    return s.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(range(len(FPROP_CASES))) + ["random64"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_2d3d_matches_reference(case, out_dtype, kind):
    _skip_without_gpu()
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
    xd, xs = gemm_cuda.rowwise_operand_ref(x[:s], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[s:], -1).data]) if extra else xd
    need = mxfp8.grouped_blocked_size(m, g, k // 32, "m")
    xs = torch.cat([xs, xs.new_zeros(need - xs.numel())])
    xq = mxfp8.dequantize_torch(mxfp8.quantize_torch(x[:s], -1), torch.float32)
    if kind == "fprop":
        wd, ws = gemm_cuda.weight_operand_ref(w)
        wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -1), torch.float32)
        fn = gemm_cuda.grouped_mm_fprop
    else:  # dgrad: x plays dY [M, N'] with N' = k, the weight is W [G, n, k] used as W^T
        w = torch.randn(g, k, n, generator=gen, device="cuda") * 0.05  # W [G, N'=k, K'=n]
        wd, ws = gemm_cuda.weight_t_operand_ref(w)  # [G, n, k] quantized along k
        wq = mxfp8.dequantize_torch(mxfp8.quantize_torch(w, -2), torch.float32).transpose(1, 2)
        fn = gemm_cuda.grouped_mm_dgrad
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    sizes_t = _sizes_t(sizes)  # host -> device copy: before the no-sync region
    torch.cuda.set_sync_debug_mode("error")  # the launch must not synchronize with the host
    try:
        fn(xd, xs, wd, ws, sizes_t, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ref64 = _mm64(xq, wq, sizes)
    ref32 = _mm32(xq, wq, sizes)
    abs_sum = _mm64(xq.abs(), wq.abs(), sizes)
    _assert_close(out[:s], ref64, ref32, abs_sum, out_dtype, f"{kind} case {case}")
    assert torch.isnan(out[s:].float()).all(), "rows outside every group were written"


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
    _skip_without_gpu()
    sizes, n, k = WGRAD_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(10 + case)
    g, m = len(sizes), sum(sizes)
    dy, x = _varied(m, n, gen), _varied(m, k, gen)
    ad, asc = gemm_cuda.colwise_operand_ref(dy, sizes)
    bd, bsc = gemm_cuda.colwise_operand_ref(x, sizes)
    aq = gemm_cuda.colwise_dequantize_ref(ad, asc, sizes)
    bq = gemm_cuda.colwise_dequantize_ref(bd, bsc, sizes)
    out = torch.full((g, n, k), float("nan"), dtype=out_dtype, device="cuda")
    sizes_t = _sizes_t(sizes)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gemm_cuda.grouped_mm_wgrad(ad, asc, bd, bsc, sizes_t, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
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
    _assert_close(out, ref64, ref32, abs_sum, out_dtype, f"wgrad case {case}")
    for gi, rows in enumerate(sizes):
        if rows == 0:
            assert (out[gi] == 0).all(), "empty groups must give zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("subnormal_a", [False, True])
def test_raw_codes(subnormal_a):
    """Every finite e4m3 code (subnormals included) and scales on both conversion paths (< 128 and >= 128)."""
    _skip_without_gpu()
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes, k, n = [70, 0, 200], 128, 64
    g, m = len(sizes), sum(sizes)

    def codes(shape, subnormal=False):
        c = torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=torch.int32)
        if subnormal:
            c = (c & 0x87) | 1  # exponent field 0: e4m3 subnormals
        c = torch.where((c & 0x7F) == 0x7F, c ^ 1, c)  # no NaN codes
        return c.to(torch.uint8).view(torch.float8_e4m3fn)

    def scales(shape):
        return torch.randint(100, 155, shape, generator=gen, device="cuda", dtype=torch.int32).to(torch.uint8)

    a, a_s = codes((m, k), subnormal_a), scales((m, k // 32))
    b, b_s = codes((g, n, k)), scales((g, n, k // 32))
    aq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(a, a_s, 1), torch.float32)
    bq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(b, b_s, 2), torch.float32)
    out = gemm_cuda.grouped_mm_fprop(a, mxfp8.to_blocked_grouped(a_s, torch.tensor(sizes), "m").contiguous(), b,
                                     mxfp8.to_blocked(b_s).contiguous(), _sizes_t(sizes), torch.float32)
    _assert_close(out, _mm64(aq, bq, sizes), _mm32(aq, bq, sizes), _mm64(aq.abs(), bq.abs(), sizes),
                  torch.float32, "raw codes fprop")
    # the same through wgrad (column-wise scales, one per 32-row block of each group and column)
    ad, bd = codes((m, n), subnormal_a), codes((m, k))
    rows = gemm_cuda.colwise_scale_rows(m, g)
    asc, bsc = scales((rows, n)), scales((rows, k))
    aq, bq = (gemm_cuda.colwise_dequantize_ref(ad, asc, sizes), gemm_cuda.colwise_dequantize_ref(bd, bsc, sizes))
    out = gemm_cuda.grouped_mm_wgrad(ad, asc, bd, bsc, _sizes_t(sizes))
    segs = [(aq[s0 : s0 + r], bq[s0 : s0 + r]) for s0, r in zip([0, 70, 70], sizes, strict=True)]
    ref64 = torch.stack([x.double().t() @ y.double() for x, y in segs])
    ref32 = torch.stack([x.t() @ y for x, y in segs])
    asum = torch.stack([x.abs().double().t() @ y.abs().double() for x, y in segs])
    _assert_close(out, ref64, ref32, asum, torch.float32, "raw codes wgrad")


@pytest.mark.gpu
def test_side_stream_and_default_outputs():
    _skip_without_gpu()
    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes, k, n = [100, 0, 156], 64, 128
    x, w = _varied(256, k, gen), torch.randn(3, n, k, generator=gen, device="cuda")
    xd, xs = gemm_cuda.rowwise_operand_ref(x, sizes)
    wd, ws = gemm_cuda.weight_operand_ref(w)
    ref = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, _sizes_t(sizes))
    assert ref.dtype == torch.bfloat16 and ref.shape == (256, n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, _sizes_t(sizes))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)


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
    with pytest.raises(TypeError, match="out must be"):
        gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 64), xs, _fp8(1, 16, 64), ws, sz, out.half())
    with pytest.raises(ValueError, match="CUDA"):
        gemm_cuda.grouped_mm_2d3d_out(_fp8(4, 64), xs, _fp8(1, 16, 64), ws, sz, out)


def test_errors_env_switch(monkeypatch):
    monkeypatch.setenv("MOE_EP_GEMM_IMPL", "nope")
    with pytest.raises(ValueError, match="MOE_EP_GEMM_IMPL"):
        gemm_cuda.gemm_impl()
    monkeypatch.setenv("MOE_EP_GEMM_IMPL", "mma")
    assert gemm_cuda.gemm_impl() == "mma"


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
    with pytest.raises(ValueError, match="a_scale must be"):
        gemm_cuda.grouped_wgrad_out(x, torch.zeros(1, 64, dtype=torch.uint8, device=d), x,
                                    torch.zeros(2, 64, dtype=torch.uint8, device=d), sz,
                                    torch.empty(1, 64, 64, device=d))
