"""MXFP8 quantization kernels (kernels/mxfp8/quantize.cu via moe_ep.mxfp8.cuda): bytes == the reference's bytes.

Every test runs on two backends:
  * ``cuda``: the real kernels (CuPy/NVRTC) on the GPU; skipped without CUDA (mark ``gpu``).
  * ``emu``: the same kernel source compiled as C++ and run on the CPU by the emulator of
    tests/quant_emu.py (one fiber per CUDA thread); skipped without a C++ compiler. It checks the
    indexing, layouts, tiling and synchronization, but uses the host paths of the PTX helpers (software e4m3
    conversion); the ``cuda`` runs check the hardware conversions.
The reference (moe_ep.mxfp8 *_torch functions) always runs on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_ep.mxfp8 import MXFP8Tensor, dequantize_torch, quantize_torch, to_blocked
from moe_ep.mxfp8 import cuda as mxfp8_cuda
from moe_ep.mxfp8 import plan as quant_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_emu  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
    pytest.param("emu", marks=pytest.mark.skipif(quant_emu.CXX is None, reason="no C++ compiler")),
]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@pytest.fixture(params=BACKENDS, name="dev")
def backend_dev(request, monkeypatch, tmp_path_factory) -> torch.device:
    """Device on which the kernels run: cuda, or cpu with mxfp8_cuda routed to the emulator (test parameter
    ``dev``; tests/test_quant_dual_cuda.py imports it)."""
    junk_outputs(monkeypatch)
    if request.param == "cuda":
        return torch.device("cuda")
    quant_emu.install_emulator(monkeypatch, tmp_path_factory.getbasetemp() / "mxemu")
    return torch.device("cpu")


class _JunkTorch:
    """torch as moe_ep.mxfp8.cuda sees it, except that ``empty`` fills its tensors with 0xAB bytes."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw) -> torch.Tensor:
        t = torch.empty(*shape, **kw)
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0xAB)
        return t


def junk_outputs(monkeypatch) -> None:
    """The outputs the launchers of moe_ep.mxfp8.cuda allocate start as 0xAB bytes (every byte is the kernel's)."""
    monkeypatch.setattr(mxfp8_cuda, "torch", _JunkTorch())


def _big(dev: torch.device) -> bool:
    return dev.type == "cuda"


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------


def _special_blocks() -> list[torch.Tensor]:
    """fp32 blocks of 32 values that stress the format: non-finite, zero, extreme exponents, exact ties."""
    g = torch.Generator().manual_seed(123)
    base = torch.randn(32, generator=g)
    base = base / base.abs().max()
    fmax, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    out = []
    for special in (float("nan"), float("inf"), float("-inf")):
        b = base.clone()
        b[5] = special
        out.append(b)
    out.append(torch.full((32,), float("nan")))
    out += [torch.zeros(32), -torch.zeros(32)]
    out += [
        base * fmax,
        torch.full((32,), -fmax),
        base * tiny,
        base * tiny * 2.0**-10,
        torch.full((32,), 2.0**-149),
    ]
    mixed = base * 2.0**-140
    mixed[0] = 3.0e38
    out.append(mixed)
    for p in (-140, -133, -127, -126, -1, 0, 10, 119):
        a = torch.tensor(448.0 * 2.0**p, dtype=torch.float32)
        for up in (False, True):
            v = torch.nextafter(a, torch.tensor(float("inf"))) if up else a
            b = base * v * 0.999
            b[9] = v
            b[10] = -v
            out.append(b)
    ties = [448.0, 464.0, -464.0, 1.0625, 1.1875, 17.0, 19.0, 272.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-11]
    ties += [(k + 0.5) * 2.0**-9 for k in range(8)]
    out.append(torch.tensor(ties + [0.0] * (32 - len(ties))))
    return [b.to(torch.float32) for b in out]


def make_input(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[m, k] CPU tensor of ``dtype``: per-block random exponents, raw random bit patterns, special blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = m * k // 32
    lo, hi = {torch.float32: (-140, 120), torch.bfloat16: (-140, 120), torch.float16: (-24, 10)}[dtype]
    e = torch.randint(lo, hi, (nb, 1), generator=g)
    scale = torch.tensor([2.0 ** int(v) for v in e.flatten()], dtype=torch.float32).reshape(nb, 1)
    x = (torch.randn(nb, 32, generator=g) * scale).reshape(m, k).to(dtype)
    if dtype != torch.float32 and m > 1:  # every 16-bit pattern, NaN/Inf/subnormals included
        rows = torch.arange(0, m, 3)
        bits = torch.randint(-(1 << 15), 1 << 15, (rows.numel(), k), generator=g, dtype=torch.int32)
        x[rows] = bits.to(torch.int16).view(dtype)
    flat = x.view(-1, 32)
    specials = _special_blocks()
    pos = torch.linspace(0, nb - 1, min(nb, len(specials))).long().tolist()
    for i, p in enumerate(pos):
        flat[p] = specials[i].to(dtype)
    return x


def _u8(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bytes(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    g, r = _u8(got), _u8(ref)
    assert g.shape == r.shape, f"{what}: shape {tuple(g.shape)} != reference {tuple(r.shape)}"
    if not torch.equal(g, r):
        bad = (g != r).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ; first at {i}: got {int(g[i])}, ref {int(r[i])}")


def assert_same_floats(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    g = got.detach().cpu()
    assert g.dtype == ref.dtype and g.shape == ref.shape, what
    assert torch.equal(torch.isnan(g), torch.isnan(ref)), f"{what}: NaN positions differ"
    ok = ~torch.isnan(ref)
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[ref.dtype]
    gi, ri = g[ok].view(ib), ref[ok].view(ib)
    if not torch.equal(gi, ri):
        j = int((gi != ri).nonzero()[0])
        raise AssertionError(f"{what}: values differ, e.g. got {g[ok][j].item()!r}, ref {ref[ok][j].item()!r}")


def _shapes(dev, small, big):
    return small + (big if _big(dev) else [])


# ------------------------------------------------------------------------------------------------------------
# quantize(x, axis): row-wise (axis = last) and column-wise in x's layout (axis = 0)
# ------------------------------------------------------------------------------------------------------------

ROW_SMALL = [(1, 32), (5, 64), (127, 96), (128, 128), (129, 160), (300, 544)]
ROW_BIG = [(300, 2080), (1000, 2048), (2304, 7168), (16384 + 7, 256)]


def record_launches(monkeypatch, plans: list | None = None) -> list[str]:
    """Names of the mxfp8_cuda kernels launched from now on (the GPU launcher or the emulator's, unchanged); with
    ``plans``, also (name, grid, threads per CTA) of each launch appended to it."""
    names: list[str] = []
    launch = mxfp8_cuda._launch

    def rec(name, grid, args, shared_mem, device, threads=quant_plan.THREADS):
        names.append(name)
        if plans is not None:
            plans.append((name, grid, threads))
        return launch(name, grid, args, shared_mem, device, threads)

    monkeypatch.setattr(mxfp8_cuda, "_launch", rec)
    return names


@pytest.mark.parametrize("dtype", DTYPES)
def test_rowwise(dev, dtype, monkeypatch):
    """quantize(x, -1): row-wise bytes and plain scales == the reference, on 64-row tiles of 128 threads for 16-bit
    inputs (pipe 5) and 128-row tiles of 256 threads for fp32 (pipe 0); n-D inputs flatten to rows."""
    plans: list = []
    names = record_launches(monkeypatch, plans)
    for i, (m, k) in enumerate(_shapes(dev, ROW_SMALL, ROW_BIG)):
        x = make_input(m, k, dtype, seed=i)
        ref = quantize_torch(x, -1)
        got = mxfp8_cuda.quantize(x.to(dev), 1)
        assert got.axis == 1
        assert_bytes(got.data, ref.data, f"data {m}x{k}")
        assert_bytes(got.scale, ref.scale, f"scale {m}x{k}")
    x = make_input(2 * 50, 64, dtype, seed=99).reshape(2, 50, 64)
    got, ref = mxfp8_cuda.quantize(x.to(dev), 2), quantize_torch(x, 2)
    assert_bytes(got.data, ref.data, "3-D data")
    assert_bytes(got.scale, ref.scale, "3-D scale")
    # the launcher's CTA size must be the kernel's (the emulator checks it; the GPU rejects a larger one)
    assert set(names) == {f"mx_quant<{quant_plan.IN[dtype]},1,0>"}
    # 300 x 544 (5 column tiles), worked by hand: 5 row tiles of 64 (25 CTAs of 128 threads); fp32: 3 of 128 rows
    # (15 CTAs of 256 threads)
    want = (15, 256) if dtype == torch.float32 else (25, 128)
    assert plans[ROW_SMALL.index((300, 544))][1:] == want, plans


COL_SMALL = [(32, 32), (96, 160), (160, 128), (288, 544)]
COL_BIG = [(2048, 2048), (288, 2080), (4096 + 32, 7168)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("many_tiles", [False, True], ids=["pipe0", "pipe4"])
def test_colwise(dev, dtype, many_tiles, monkeypatch):
    """quantize(x, 0): column-wise bytes in x's layout and [M/32, K] scales == the reference. 16-bit inputs of at
    least ONE_MIN_TILES_PER_SM tiles per SM launch mx_quant<.., 4> (one tile per CTA on the cp.async path): with
    the threshold at 0 every shape takes it; at its default none of these shapes does on the emulator's 2 SMs, and
    only 4128 x 7168 (1848 tiles) would on a GPU of fewer than 77 SMs."""
    if many_tiles:
        monkeypatch.setattr(quant_plan, "ONE_MIN_TILES_PER_SM", 0)
    names = record_launches(monkeypatch)
    shapes = _shapes(dev, COL_SMALL, COL_BIG)
    for i, (m, k) in enumerate(shapes):
        x = make_input(m, k, dtype, seed=10 + i)
        ref = quantize_torch(x, 0)
        got = mxfp8_cuda.quantize(x.to(dev), 0)
        assert got.axis == 0
        assert_bytes(got.data, ref.data, f"data {m}x{k}")
        assert_bytes(got.scale, ref.scale, f"scale {m}x{k}")
    i = quant_plan.IN[dtype]
    pipe4 = many_tiles and dtype != torch.float32  # fp32 has no cp.async path
    if pipe4 or not _big(dev):
        assert names == [f"mx_quant<{i},0,3" + (",4>" if pipe4 else ">")] * len(shapes), names


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_entry_point(dev, dtype):
    """mxfp8_cuda.quantize (what moe_ep.mxfp8.quantize calls for CUDA tensors): MXFP8Tensor, plain scales; middle
    axes and axis 0 with rows of a size not a multiple of 16 bytes go to the reference."""
    cases = [
        ((64, 24), 0),
        ((96, 160), 0),
        ((32, 7), 0),
        ((64, 3, 8), 0),
        ((2, 50, 64), 2),
        ((7, 32), 1),
        ((64, 32, 4), 1),
        ((32,), 0),
    ]
    for i, (shape, axis) in enumerate(cases):
        n = 1
        for s in shape:
            n *= s
        x = make_input(n // 32, 32, dtype, seed=30 + i).reshape(shape)
        ref = quantize_torch(x, axis)
        got = mxfp8_cuda.quantize(x.to(dev), axis)
        assert got.axis == ref.axis
        assert_bytes(got.data, ref.data, f"data {shape} axis {axis}")
        assert_bytes(got.scale, ref.scale, f"scale {shape} axis {axis}")


# ------------------------------------------------------------------------------------------------------------
# 3-D weights, dequantize
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_fused(dev, dtype, monkeypatch):
    """quantize_weights_fused: per expert, W row-wise with blocked scales and W^T quantized along N, from one fused
    pass, == the reference of W and of the transposed copy; N and K not multiples of 128. One launch for all
    experts, one CTA per tile (grid.y = expert)."""
    if dtype == torch.float16:  # master weights are fp32 or bf16: no fp16 build of the batch kernel
        with pytest.raises(TypeError, match="fp32 or bf16"):
            mxfp8_cuda.quantize_weights_fused(make_input(32, 64, dtype, seed=1).reshape(1, 32, 64).to(dev))
        return
    plans: list = []
    record_launches(monkeypatch, plans)
    shapes = [(3, 160, 96), (2, 32, 288), (1, 288, 64), (3, 384, 544), (8, 256, 512)]
    shapes += [(4, 2048, 7168), (32, 1536, 2048)] if _big(dev) else []
    for i, (e, n, k) in enumerate(shapes):
        w = make_input(e * n, k, dtype, seed=60 + i).reshape(e, n, k)
        ref, ref_t = quantize_torch(w, -1), quantize_torch(w.transpose(1, 2).contiguous(), -1)
        data, scale, data_t, scale_t = mxfp8_cuda.quantize_weights_fused(w.to(dev))
        what = f"{e}x{n}x{k}"
        assert_bytes(data, ref.data, f"data {what}")
        assert_bytes(scale, to_blocked(ref.scale), f"scale {what}")
        assert_bytes(data_t, ref_t.data, f"data_t {what}")
        assert_bytes(scale_t, to_blocked(ref_t.scale), f"scale_t {what}")
        tiles = quant_plan.cdiv(n, 128) * quant_plan.cdiv(k, 128)
        assert plans[-1] == (f"mx_quant_batch<{quant_plan.IN[dtype]}>", (tiles, e), 256), plans[-1]
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_cuda.quantize_weights_fused(make_input(2 * 48, 64, dtype, seed=1).reshape(2, 48, 64).to(dev))


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, -1])
def test_dequantize(dev, out_dtype, axis):
    g = torch.Generator().manual_seed(50)
    shapes = [(32, 32), (96, 160), (64, 2, 96)] + ([(4096, 7168)] if _big(dev) else [])
    for shape in shapes:
        ax = axis % len(shape)
        data = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
        sshape = list(shape)
        sshape[ax] //= 32
        scale = torch.randint(0, 256, sshape, generator=g, dtype=torch.int32).to(torch.uint8)
        scale.view(-1)[::7] = torch.randint(100, 150, scale.view(-1)[::7].shape, generator=g).to(torch.uint8)
        t = MXFP8Tensor(data.view(torch.float8_e4m3fn), scale, ax)
        ref = dequantize_torch(t, out_dtype)
        td = MXFP8Tensor(t.data.to(dev), t.scale.to(dev), ax)
        assert_same_floats(mxfp8_cuda.dequantize(td, out_dtype), ref, f"dequantize {shape} axis {ax} {out_dtype}")
        x = make_input(shape[0], 96, torch.float32, seed=51)[:, :96]
        q = quantize_torch(x, 0 if ax == 0 else -1)
        qd = MXFP8Tensor(q.data.to(dev), q.scale.to(dev), q.axis)
        assert_same_floats(mxfp8_cuda.dequantize(qd, out_dtype), dequantize_torch(q, out_dtype), "roundtrip")


# ------------------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------------------


def test_errors(dev):
    """The launchers' argument checks name the argument and the problem."""
    w = torch.zeros(2, 64, 64, dtype=torch.bfloat16, device=dev)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        mxfp8_cuda.quantize_weights_fused(w.to(torch.int32))
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        mxfp8_cuda.quantize(torch.zeros(64, 64, dtype=torch.int32, device=dev), 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_cuda.quantize_weights_fused(torch.zeros(2, 64, 40, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_cuda.quantize_weights_fused(torch.zeros(2, 64, 128, dtype=torch.bfloat16, device=dev)[:, :, :64])
    with pytest.raises(ValueError, match="aligned"):
        flat = torch.zeros(2 * 64 * 64 + 4, dtype=torch.bfloat16, device=dev)
        mxfp8_cuda.quantize_weights_fused(flat[4:].view(2, 64, 64))
    with pytest.raises(ValueError, match="3-D"):
        mxfp8_cuda.quantize_weights_fused(w[0])
    data, data_t = (torch.empty(2, 64, 64, dtype=torch.float8_e4m3fn, device=dev) for _ in range(2))
    scale, scale_t = (torch.empty(2, 512, dtype=torch.uint8, device=dev) for _ in range(2))
    with pytest.raises(ValueError, match="scale: expected shape"):
        mxfp8_cuda.quantize_weights_fused_into(w, data, scale[:, :256], data_t, scale_t)
    with pytest.raises(TypeError, match="data_t: expected dtype"):
        mxfp8_cuda.quantize_weights_fused_into(w, data, scale, data_t.view(torch.uint8), scale_t)
    with pytest.raises(TypeError, match="expected dtype"):
        mxfp8_cuda.quantize_weights_fused_into(w, data, scale, data_t, scale_t.view(torch.int8))
    with pytest.raises(TypeError):
        mxfp8_cuda.dequantize(MXFP8Tensor(data[0], torch.zeros(64, 2, dtype=torch.uint8, device=dev), 1), torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_mismatch_and_cpu_input():
    w = torch.zeros(2, 64, 64, dtype=torch.bfloat16, device="cuda")
    data, data_t = (torch.empty(2, 64, 64, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2))
    scale, scale_t = (torch.empty(2, 512, dtype=torch.uint8, device="cuda") for _ in range(2))
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.quantize_weights_fused_into(w, data.cpu(), scale, data_t, scale_t)
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.quantize_grouped_dual(w[0], torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match="CUDA"):
        mxfp8_cuda.quantize_weights_fused(w.cpu())


# ------------------------------------------------------------------------------------------------------------
# GPU only: public API routing, streams
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_api_on_cuda(dtype):
    from moe_ep import mxfp8  # noqa: PLC0415

    x = make_input(640, 2080, dtype, seed=60)
    for axis in (-1, 0):
        ref = quantize_torch(x, axis)
        got = mxfp8.quantize(x.cuda(), axis)
        assert_bytes(got.data, ref.data, f"mxfp8.quantize data axis {axis}")
        assert_bytes(got.scale, ref.scale, f"mxfp8.quantize scale axis {axis}")
        assert_same_floats(mxfp8.dequantize(got, torch.float32), dequantize_torch(ref, torch.float32), "dequantize")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_side_stream():
    x = make_input(4096, 2048, torch.bfloat16, seed=61)
    ref, ref0 = quantize_torch(x, -1), quantize_torch(x, 0)
    xd = x.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got, got0 = mxfp8_cuda.quantize(xd, 1), mxfp8_cuda.quantize(xd, 0)
    s.synchronize()
    assert_bytes(got.data, ref.data, "data on a side stream")
    assert_bytes(got.scale, ref.scale, "scale on a side stream")
    assert_bytes(got0.data, ref0.data, "axis 0 data on a side stream")
    assert_bytes(got0.scale, ref0.scale, "axis 0 scale on a side stream")
