"""GPU tests of the operand preparation: the bf16 weight preparation kernel (kernels/experts/sm90/weight_prep.cu
mx_prepare_weight_bf16; the one-pass mx_prepare_weight_operands_* is tests/test_weight_prep_cuda.py's),
weight_operands on the GPU against the CPU, and the wgrad on operands the quantizer wrote already prepared
(``quantize_grouped_dual``).

Bytes are compared exactly with the torch references; outputs are followed by NaN guards that must stay
untouched (the guard helpers and the data generator are those of tests/test_gemm_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.sm90 import gemm as gemm_cuda
from moe_ep.experts.sm90 import operands  # noqa: E402
from tests.refs import grouped_wgrad_prepared_torch
from tests.test_gemm_cuda import _assert_close, _guarded, _guarded_out, _sizes_t, _skip_without_gpu, _varied


@pytest.mark.gpu
@pytest.mark.parametrize(("g", "n", "k"), [(2, 8, 32), (3, 136, 96), (2, 264, 160), (4, 520, 7168)])
def test_weight_prep_kernel_matches_reference(g, n, k):
    """kernels/experts/sm90/weight_prep.cu == prepare_weight_bf16_torch: bit-equal bf16 (NaN where the reference has
    NaN: the payload of a 0xFF-scale block is the hardware's canonical NaN), on every e4m3 code, scales 0 / 254 / 0xFF,
    K % 64 == 32 (zero padding), N not a multiple of 128; with no host sync; into a given ``out`` too."""
    _skip_without_gpu()
    from tests.test_gemm_emulation_kernels import _awkward_weight, assert_same_bf16  # noqa: PLC0415

    w, ws = _awkward_weight(g, n, k, seed=k + n)
    ref = operands.prepare_weight_bf16_torch(w, ws)
    wd, wsd = _guarded(w.cuda(), 0x7F), _guarded(ws.cuda(), 0xFF)
    kp = -(-k // 64) * 64
    buf = torch.full((g * n * kp + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[: g * n * kp].view(g, n, kp)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = operands.prepare_weight_bf16(wd, wsd)
        operands.prepare_weight_bf16(wd, wsd, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_same_bf16(got.cpu(), ref)
    assert_same_bf16(out.cpu(), ref)
    assert torch.isnan(buf[g * n * kp :]).all(), "written past the end of out"


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((3, 160, 96), torch.float32), ((2, 32, 288), torch.bfloat16)])
def test_weight_operands_on_gpu_match_cpu(shape, dtype):
    """weight_operands on CUDA (prepare_weight_operands: both prepared operands from one pass over W) == on CPU (two
    row-wise quantizations of W and W^T, the references, then the preparation), byte for byte; N and K not
    multiples of 128. The CUDA result has no e4m3 copies (None: the GEMMs read only the prepared operands)."""
    _skip_without_gpu()
    e, n, k = shape
    w = _varied(e * n, k, torch.Generator(device="cuda").manual_seed(5)).reshape(e, n, k).to(dtype)
    gpu, cpu = operands.weight_operands(w), operands.weight_operands(w.cpu())
    assert gpu.w is None and gpu.w_scale is None and gpu.wt is None and gpu.wt_scale is None
    for name in ("w_prepared", "wt_prepared"):
        a, b = getattr(gpu, name).cpu(), getattr(cpu, name)
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[0, 5, 300, 0, 1000, 33], [64], [31, 32, 33], [0, 0, 4096, 0]])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_from_prepared_quantizer_output(sizes, out_dtype):
    """dW from the quantizer's prepared operands (no preparation pass) == dW from the reference's prepared operands
    (``quantize_grouped_dual_torch(..., colwise="bf16")``) bit for bit: both feed the GEMM the same bytes, and the
    kernel is deterministic. Against the reference: the fp32 bound of tests/test_gemm_cuda._assert_close (2x the
    fp32 reference's own error plus the accumulation-order term). No host sync; nothing written past out."""
    _skip_without_gpu()
    from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415
    from tests.refs import quantize_grouped_dual_torch  # noqa: PLC0415

    gen = torch.Generator(device="cuda").manual_seed(3 + sum(sizes))
    g, m, n, k = len(sizes), sum(sizes), 160, 288  # multiples of 32 (the quantizer) and N % 128 != 0
    dy, x = _varied(m, n, gen).bfloat16(), _varied(m, k, gen).bfloat16()
    sz = _sizes_t(sizes)
    out, guard = _guarded_out((g, n, k), out_dtype)
    ra = quantize_grouped_dual_torch(dy, sz.cpu(), colwise="bf16")[2]
    rb = quantize_grouped_dual_torch(x, sz.cpu(), colwise="bf16")[2]
    via_ref = torch.empty(g, n, k, dtype=out_dtype, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        qa = mxfp8_cuda.quantize_grouped_dual(dy, sz)
        qb = mxfp8_cuda.quantize_grouped_dual(x, sz)
        gemm_cuda.grouped_wgrad_prepared_out(qa[2], qb[2], sz, out, m)
        gemm_cuda.grouped_wgrad_prepared_out(ra, rb, sz, via_ref, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isnan(guard.float()).all(), "written past the end of out"
    assert torch.equal(out.view(torch.uint8), via_ref.view(torch.uint8))
    a_, b_ = qa[2].double(), qb[2].double()
    ref64 = grouped_wgrad_prepared_torch(a_, b_, sizes, m, torch.float64)
    ref32 = grouped_wgrad_prepared_torch(qa[2], qb[2], sizes, m)
    abs_sum = grouped_wgrad_prepared_torch(a_.abs(), b_.abs(), sizes, m, torch.float64)
    _assert_close(out, ref64, ref32, abs_sum, out_dtype, f"prepared wgrad {sizes}", max(sizes))


@pytest.mark.gpu
def test_wgrad_prepared_errors():
    _skip_without_gpu()
    sz = _sizes_t([40, 0, 8])
    ap = torch.zeros(mxfp8.colwise_prep_rows(48, 3), 16, dtype=torch.bfloat16, device="cuda")
    bp = torch.zeros(ap.shape[0], 24, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(3, 16, 24, device="cuda")
    with pytest.raises(ValueError, match="64 \\(ceil\\(M/64\\) \\+ G\\) rows"):
        gemm_cuda.grouped_wgrad_prepared_out(ap[:64], bp, sz, out, 48)
    with pytest.raises(TypeError, match="a_prep must be"):
        gemm_cuda.grouped_wgrad_prepared_out(ap.float(), bp, sz, out, 48)
    with pytest.raises(ValueError, match="out must be"):
        gemm_cuda.grouped_wgrad_prepared_out(ap, bp, sz, out[:2], 48)
    with pytest.raises(ValueError, match="CUDA"):
        gemm_cuda.grouped_wgrad_prepared_out(ap.cpu(), bp, sz, out, 48)
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm_cuda.grouped_wgrad_prepared_out(ap[:, :12].contiguous(), bp, sz, out[:, :12].contiguous(), 48)
