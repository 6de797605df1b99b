"""MXFP8 quantization kernels (kernels/quantize.cu via moe_ep.mxfp8.cuda): bytes == the reference's bytes.

Every test runs on two backends:
  * ``cuda``: the real kernels (CuPy/NVRTC) on the GPU; skipped without CUDA (mark ``gpu``).
  * ``emu``: the same kernel source compiled as C++ and run on the CPU by the emulator of
    tests/quant_emu.py (one OS thread per CUDA thread); skipped without a C++ compiler. It checks the
    indexing, layouts, tiling and synchronization, but uses the host paths of the PTX helpers (software e4m3
    conversion); the ``cuda`` runs check the hardware conversions.
The reference (moe_ep.mxfp8 *_torch functions) always runs on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_ep.mxfp8 import (
    MXFP8Tensor,
    dequantize_torch,
    quantize_torch,
    to_blocked,
    to_blocked_grouped,
)
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
    if request.param == "cuda":
        return torch.device("cuda")
    quant_emu.install_emulator(monkeypatch, tmp_path_factory.getbasetemp() / "mxemu")
    return torch.device("cpu")


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
# row-wise
# ------------------------------------------------------------------------------------------------------------

ROW_SMALL = [(1, 32), (5, 64), (127, 96), (128, 128), (129, 160), (300, 544)]
ROW_BIG = [(300, 2080), (1000, 2048), (2304, 7168), (16384 + 7, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["plain", "blocked"])
@pytest.mark.parametrize("pipe", ["auto", "5"])
def test_rowwise(dev, dtype, layout, pipe, monkeypatch):
    """Row-wise bytes under the auto pipe (5 for plain scales, 4 for blocked) and under MOE_EP_QUANT_PIPE=5
    (64-row tiles of 128 threads for 16-bit inputs: each CTA writes half of every 16-byte word of a blocked scale
    tile, the padding rows' zeros included; fp32 falls back to pipe 0). The outputs start as 0xAB bytes, so a byte
    the kernel leaves unwritten fails."""
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", pipe)
    plans: list = []
    names = record_launches(monkeypatch, plans)
    for i, (m, k) in enumerate(_shapes(dev, ROW_SMALL, ROW_BIG)):
        x = make_input(m, k, dtype, seed=i)
        ref = quantize_torch(x, -1)
        data = torch.full((m, k), 0xAB, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        scale = torch.full(mxfp8_cuda.row_scale_shape(m, k, layout), 0xAB, dtype=torch.uint8, device=dev)
        mxfp8_cuda.quantize_rowwise_into(x.to(dev), data, scale, layout)
        assert_bytes(data, ref.data, f"data {m}x{k}")
        assert_bytes(scale, ref.scale if layout == "plain" else to_blocked(ref.scale), f"scale {m}x{k} {layout}")
    # the launcher's CTA size must be the kernel's (the emulator checks it; the GPU rejects a larger one)
    assert set(names) == {f"mx_quant<{quant_plan.IN[dtype]},{quant_plan.RS[layout]},0>"}
    # 300 x 544 (5 column tiles), worked by hand: 3 row tiles of 128 (15 CTAs of 256 threads) or, on pipe 5, 5 of
    # 64 rows for plain scales (25 x 128) and both 64-row halves of the 3 blocked tiles (30 x 128); fp32: pipe 0
    half = dtype != torch.float32 and (layout == "plain" or pipe == "5")
    want = (25 if layout == "plain" else 30, 128) if half else (15, 256)
    assert plans[ROW_SMALL.index((300, 544))][1:] == want, plans


GROUP_CASES = [
    (300, 64, [0, 300, 0]),
    (300, 64, [300]),
    (300, 160, [100, 0, 28, 172]),
    (129, 32, [1, 128]),
    (257, 96, [128, 1, 0, 128]),
    (0, 64, [0, 0, 0]),
    (1000, 32, "random300"),  # G > 256: the device-side scan runs more than one chunk
]


def _sizes(m: int, spec, seed: int) -> torch.Tensor:
    if isinstance(spec, list):
        return torch.tensor(spec, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    n = int(spec.removeprefix("random"))
    cuts = torch.sort(torch.randint(0, m + 1, (n - 1,), generator=g)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([m])]))
    return sizes.to(torch.int32)


@pytest.mark.parametrize(
    "dtype,pipe",
    [(d, "auto") for d in DTYPES] + [(torch.bfloat16, "4"), (torch.bfloat16, "2")],
)
def test_rowwise_grouped(dev, dtype, pipe, monkeypatch):
    """Grouped row scales on the kernel's auto pipe (3 for 16-bit inputs, persistent, with the dynamic schedule from
    12 tiles per CTA; 0 for fp32), and under MOE_EP_QUANT_PIPE=4 (one CTA per tile, each scanning the group table)
    and 2 (register prefetch)."""
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", pipe)
    cases = GROUP_CASES if (_big(dev) or dtype == torch.bfloat16) else GROUP_CASES[:-1]  # the emulator is slow
    cases = cases + ([(32768 + 100, 256, "random64")] if _big(dev) else [])
    for i, (m, k, spec) in enumerate(cases):
        sizes = _sizes(m, spec, i)
        assert int(sizes.sum()) == m
        x = make_input(m, k, dtype, seed=i) if m else torch.zeros(0, k, dtype=dtype)
        ref = quantize_torch(x, -1)
        data, scale = mxfp8_cuda.quantize_rowwise(x.to(dev), "grouped", sizes.to(dev))
        assert_bytes(data, ref.data, f"data {m}x{k} groups {spec}")
        assert_bytes(scale, to_blocked_grouped(ref.scale, sizes, "m"), f"grouped scale {m}x{k} groups {spec}")


def test_into_writes_every_byte(dev):
    """Outputs prefilled with 0xAB: the kernels must write all padding of blocked tiles themselves."""
    x = make_input(200, 96, torch.bfloat16, seed=7)
    ref, reft = quantize_torch(x, -1), quantize_torch(x[:192].t().contiguous(), -1)
    xd = x.to(dev)

    def junk(shape, dtype=torch.uint8):
        return torch.full(shape, 0xAB, dtype=torch.uint8, device=dev).view(dtype)

    data, scale = junk((200, 96), torch.float8_e4m3fn), junk(mxfp8_cuda.row_scale_shape(200, 96, "blocked"))
    mxfp8_cuda.quantize_rowwise_into(xd, data, scale, "blocked")
    assert_bytes(data, ref.data, "data")
    assert_bytes(scale, to_blocked(ref.scale), "blocked scale")
    sizes = torch.tensor([0, 3, 197], dtype=torch.int32)
    scale = junk(mxfp8_cuda.row_scale_shape(200, 96, "grouped", 3))
    mxfp8_cuda.quantize_rowwise_into(xd, data, scale, "grouped", sizes.to(dev))
    assert_bytes(scale, to_blocked_grouped(ref.scale, sizes, "m"), "grouped scale")
    x2 = xd[:192]
    dt, st = junk((96, 192), torch.float8_e4m3fn), junk(mxfp8_cuda.col_scale_shape(192, 96, "blocked"))
    d2, s2 = junk((192, 96), torch.float8_e4m3fn), junk(mxfp8_cuda.row_scale_shape(192, 96, "blocked"))
    mxfp8_cuda.quantize_fused_into(x2, d2, s2, dt, st, "blocked", "blocked")
    assert_bytes(dt, reft.data, "colwise data")
    assert_bytes(st, to_blocked(reft.scale), "colwise blocked scale")
    assert_bytes(s2, to_blocked(quantize_torch(x[:192], -1).scale), "fused row scale")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_schedule(dev, dtype, monkeypatch):
    """The persistent pipe under MOE_EP_QUANT_SCHED=dynamic (tiles from the ticket counter; MOE_EP_QUANT_PIPE=3, as
    auto gives these modes one CTA per tile): row-wise plain / blocked, grouped and fused, three launches each into
    outputs refilled with 0xAB, so a tile
    that no CTA took (or a counter left non-zero by the previous launch) shows as junk; bytes == the reference, and
    the counter is zero after each round of four launches (one left non-zero in between would show as junk in the
    next launch's output). GPU: 4128 x 7168 is 1848 tiles over 396 CTAs (4.7 per CTA);
    emulator: 288 x 544, 15 tiles over 6."""
    monkeypatch.setenv("MOE_EP_QUANT_SCHED", "dynamic")
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", "3")
    counters = []
    get = mxfp8_cuda._sched_counter
    monkeypatch.setattr(mxfp8_cuda, "_sched_counter", lambda d: counters.append(get(d)) or counters[-1])
    names = record_launches(monkeypatch)
    m, k = (4096 + 32, 7168) if _big(dev) else (288, 544)
    x = make_input(m, k, dtype, seed=71)
    ref, reft = quantize_torch(x, -1), quantize_torch(x.t().contiguous(), -1)
    sizes = _sizes(m, "random40", 71)
    xd = x.to(dev)

    def junk(shape, dt=torch.uint8):
        return torch.full(shape, 0xAB, dtype=torch.uint8, device=dev).view(dt)

    for rep in range(3):
        counters.clear()
        for layout, want in (("plain", ref.scale), ("blocked", to_blocked(ref.scale))):
            data, scale = junk((m, k), torch.float8_e4m3fn), junk(mxfp8_cuda.row_scale_shape(m, k, layout))
            mxfp8_cuda.quantize_rowwise_into(xd, data, scale, layout)
            assert_bytes(data, ref.data, f"data, {layout}, launch {rep}")
            assert_bytes(scale, want, f"{layout} scale, launch {rep}")
        data, scale = (
            junk((m, k), torch.float8_e4m3fn),
            junk(mxfp8_cuda.row_scale_shape(m, k, "grouped", sizes.numel())),
        )
        mxfp8_cuda.quantize_rowwise_into(xd, data, scale, "grouped", sizes.to(dev))
        assert_bytes(data, ref.data, f"grouped data, launch {rep}")
        assert_bytes(scale, to_blocked_grouped(ref.scale, sizes, "m"), f"grouped scale, launch {rep}")
        data, scale = junk((m, k), torch.float8_e4m3fn), junk(mxfp8_cuda.row_scale_shape(m, k, "blocked"))
        dt, st = junk((k, m), torch.float8_e4m3fn), junk(mxfp8_cuda.col_scale_shape(m, k, "blocked"))
        mxfp8_cuda.quantize_fused_into(xd, data, scale, dt, st, "blocked", "blocked")
        assert_bytes(data, ref.data, f"fused data, launch {rep}")
        assert_bytes(scale, to_blocked(ref.scale), f"fused scale, launch {rep}")
        assert_bytes(dt, reft.data, f"fused data_t, launch {rep}")
        assert_bytes(st, to_blocked(reft.scale), f"fused scale_t, launch {rep}")
        assert len(counters) == 4 and all(n.startswith("mx_quant_dyn<") for n in names), names
        assert all(c.cpu().tolist() == [0, 0] for c in counters)
        names.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_dynamic_schedule_two_streams(monkeypatch):
    """Two streams quantizing at the same time under the dynamic schedule: each stream has its own counter (a shared
    one would hand tiles of one launch to the other's CTAs), and both outputs, prefilled with 0xAB, are the
    reference's bytes. (The two launches overlap only as far as the GPU runs them side by side.)"""
    monkeypatch.setenv("MOE_EP_QUANT_SCHED", "dynamic")
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", "3")
    names = record_launches(monkeypatch)
    xs = [make_input(4096, 7168, torch.bfloat16, seed=s) for s in (81, 82)]
    refs = [quantize_torch(x, -1) for x in xs]
    xds = [x.cuda() for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    assert mxfp8_cuda._sched_counter(torch.device("cuda")) is mxfp8_cuda._sched_counter(torch.device("cuda"))
    outs = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(4):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                data = torch.full((4096, 7168), 0xAB, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
                scale = torch.full(
                    mxfp8_cuda.row_scale_shape(4096, 7168, "blocked"), 0xAB, dtype=torch.uint8, device="cuda"
                )
                mxfp8_cuda.quantize_rowwise_into(xds[i], data, scale, "blocked")
                outs[i].append((data, scale))
    assert names == ["mx_quant_dyn<1,2,0>"] * 8, names
    counters = []
    for s in streams:
        with torch.cuda.stream(s):
            counters.append(mxfp8_cuda._sched_counter(torch.device("cuda")))
    assert counters[0] is not counters[1]
    torch.cuda.synchronize()
    for i in range(2):
        for data, scale in outs[i]:
            assert_bytes(data, refs[i].data, f"stream {i} data")
            assert_bytes(scale, to_blocked(refs[i].scale), f"stream {i} scale")


# ------------------------------------------------------------------------------------------------------------
# column-wise, fused, axis=0
# ------------------------------------------------------------------------------------------------------------

COL_SMALL = [(32, 32), (96, 160), (160, 128), (288, 544)]
COL_BIG = [(2048, 2048), (288, 2080), (4096 + 32, 7168)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_colwise(dev, dtype, layout):
    for i, (m, k) in enumerate(_shapes(dev, COL_SMALL, COL_BIG)):
        x = make_input(m, k, dtype, seed=10 + i)
        reft = quantize_torch(x.t().contiguous(), -1)  # == quantize_torch(x, 0) transposed
        data_t, scale_t = mxfp8_cuda.quantize_colwise(x.to(dev), layout)
        assert_bytes(data_t, reft.data, f"data_t {m}x{k}")
        want = reft.scale if layout == "plain" else to_blocked(reft.scale)
        assert_bytes(scale_t, want, f"scale_t {m}x{k} {layout}")


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


@pytest.mark.parametrize("dtype,pipe", [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.bfloat16, "3")])
def test_colwise_large_input_pipe(dev, dtype, pipe, monkeypatch):
    """Column-only modes of 16-bit inputs launch mx_quant<.., 4> (one CTA per tile on the cp.async path) when the
    input has at least ONE_MIN_TILES_PER_SM tiles per SM: with the threshold at 0 every shape here takes it; bytes
    equal to the reference for plain, blocked and axis 0. At 1 tile per SM a 1-tile input stays on the kernel's auto
    pipe (0). pipe "3": the same under MOE_EP_QUANT_PIPE=3 (persistent, which auto no longer takes for these)."""
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", pipe)
    monkeypatch.setattr(quant_plan, "ONE_MIN_TILES_PER_SM", 0)
    plans: list = []
    names = record_launches(monkeypatch, plans)
    for i, (m, k) in enumerate(_shapes(dev, COL_SMALL, COL_BIG)):
        x = make_input(m, k, dtype, seed=30 + i)
        reft = quantize_torch(x.t().contiguous(), -1)
        for layout in ("plain", "blocked"):
            data_t, scale_t = mxfp8_cuda.quantize_colwise(x.to(dev), layout)
            assert_bytes(data_t, reft.data, f"data_t {m}x{k}")
            assert_bytes(scale_t, reft.scale if layout == "plain" else to_blocked(reft.scale), f"scale {m}x{k}")
        got = mxfp8_cuda.quantize(x.to(dev), 0)
        ref = quantize_torch(x, 0)
        assert_bytes(got.data, ref.data, f"axis 0 data {m}x{k}")
        assert_bytes(got.scale, ref.scale, f"axis 0 scale {m}x{k}")
    if pipe == "3":
        # persistent: at most 3 CTAs per SM, which the pipe-4 grid (one CTA per tile) exceeds on 288x544 (15 tiles)
        # under the emulator's 2 SMs and on 4128x7168 (1848 tiles) on an H200
        slots = quant_plan.PIPE3_CTAS_PER_SM * quant_plan.sm_count(dev)  # the emulator: 2 SMs
        assert names and all(not n.endswith(",4>") and g <= slots for n, g, _ in plans), plans
        return
    assert names and all(n.endswith(",4>") for n in names), names
    monkeypatch.setattr(quant_plan, "ONE_MIN_TILES_PER_SM", 1)
    names.clear()
    mxfp8_cuda.quantize_colwise(make_input(32, 32, dtype).to(dev), "plain")
    assert names == [f"mx_quant<{quant_plan.IN[dtype]},0,1>"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_layout", ["plain", "blocked"])
@pytest.mark.parametrize("col_layout", ["plain", "blocked"])
def test_fused(dev, dtype, row_layout, col_layout):
    for i, (m, k) in enumerate(_shapes(dev, COL_SMALL, COL_BIG[:1])):
        x = make_input(m, k, dtype, seed=20 + i)
        ref, reft = quantize_torch(x, -1), quantize_torch(x.t().contiguous(), -1)
        data, scale, data_t, scale_t = mxfp8_cuda.quantize_fused(x.to(dev), row_layout, col_layout)
        assert_bytes(data, ref.data, f"data {m}x{k}")
        assert_bytes(scale, ref.scale if row_layout == "plain" else to_blocked(ref.scale), f"scale {m}x{k}")
        assert_bytes(data_t, reft.data, f"data_t {m}x{k}")
        assert_bytes(scale_t, reft.scale if col_layout == "plain" else to_blocked(reft.scale), f"scale_t {m}x{k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_entry_point(dev, dtype):
    """mxfp8_cuda.quantize (what moe_ep.mxfp8.quantize calls for CUDA tensors): MXFP8Tensor, plain scales."""
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
def test_weights(dev, dtype):
    shapes = [(3, 200, 96), (2, 128, 32), (4, 1, 64), (1, 300, 544)]
    shapes += [(1, 300, 2080), (8, 2048, 7168)] if _big(dev) else []
    for i, (e, n, k) in enumerate(shapes):
        w = make_input(e * n, k, dtype, seed=40 + i).reshape(e, n, k)
        ref = quantize_torch(w, -1)
        data, scale = mxfp8_cuda.quantize_weights(w.to(dev))
        assert_bytes(data, ref.data, f"data {e}x{n}x{k}")
        assert_bytes(scale, to_blocked(ref.scale), f"scale {e}x{n}x{k}")


@pytest.mark.parametrize("dtype,pipe", [(d, "auto") for d in DTYPES] + [(torch.bfloat16, "3")])
def test_weights_fused(dev, dtype, pipe, monkeypatch):
    """quantize_weights_fused: per expert, W row-wise (the bytes of quantize_weights) and W^T quantized along N (the
    bytes of quantize_weights on the transposed copy) from one fused pass; N and K not multiples of 128. One launch
    for all experts: one CTA per tile under auto (pipe 4); with MOE_EP_QUANT_PIPE=3, on the emulator (2 SMs) the
    last two shapes share a persistent grid smaller than one expert's tiles between the experts (3 x 15 tiles, then
    8 x 8 tiles with fewer CTAs than experts)."""
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", pipe)
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
    x = torch.zeros(64, 64, dtype=torch.bfloat16, device=dev)
    with pytest.raises(TypeError):
        mxfp8_cuda.quantize_rowwise(torch.zeros(64, 64, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_cuda.quantize_rowwise(torch.zeros(64, 40, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_cuda.quantize_colwise(torch.zeros(40, 64, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_cuda.quantize_rowwise(torch.zeros(64, 128, dtype=torch.bfloat16, device=dev)[:, :64])
    with pytest.raises(ValueError, match="aligned"):
        mxfp8_cuda.quantize_rowwise(torch.zeros(64 * 64 + 4, dtype=torch.bfloat16, device=dev)[4:].view(64, 64))
    with pytest.raises(ValueError, match="2-D"):
        mxfp8_cuda.quantize_rowwise(torch.zeros(2, 64, 64, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="group_sizes"):
        mxfp8_cuda.quantize_rowwise(x, "grouped")
    with pytest.raises(TypeError):
        mxfp8_cuda.quantize_rowwise(x, "grouped", torch.zeros(2, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="scale_layout"):
        mxfp8_cuda.quantize_rowwise(x, "swizzled")
    data = torch.empty(64, 64, dtype=torch.float8_e4m3fn, device=dev)
    with pytest.raises(ValueError, match="shape"):
        mxfp8_cuda.quantize_rowwise_into(x, data, torch.empty(64, 3, dtype=torch.uint8, device=dev), "plain")
    with pytest.raises(TypeError, match="dtype"):
        mxfp8_cuda.quantize_rowwise_into(x, data, torch.empty(64, 2, dtype=torch.int8, device=dev), "plain")
    with pytest.raises(TypeError, match="dtype"):
        mxfp8_cuda.quantize_rowwise_into(
            x, data.view(torch.uint8), torch.empty(64, 2, dtype=torch.uint8, device=dev), "plain"
        )
    with pytest.raises(TypeError):
        mxfp8_cuda.dequantize(MXFP8Tensor(data, torch.zeros(64, 2, dtype=torch.uint8, device=dev), 1), torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_mismatch_and_cpu_input():
    x = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.quantize_rowwise(x, "grouped", torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match="device"):
        mxfp8_cuda.quantize_rowwise_into(
            x,
            torch.empty(64, 64, dtype=torch.float8_e4m3fn),
            torch.empty(64, 2, dtype=torch.uint8, device="cuda"),
            "plain",
        )
    with pytest.raises(ValueError, match="CUDA"):
        mxfp8_cuda.quantize_rowwise(x.cpu())


# ------------------------------------------------------------------------------------------------------------
# GPU only: public API routing, streams, software conversion switch
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
    ref = quantize_torch(x, -1)
    xd = x.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        data, scale = mxfp8_cuda.quantize_rowwise(xd, "blocked")
    s.synchronize()
    assert_bytes(data, ref.data, "data on a side stream")
    assert_bytes(scale, to_blocked(ref.scale), "scale on a side stream")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_soft_conversion_switch(monkeypatch):
    """MOE_EP_MXFP8_SOFT_CVT=1 (software e4m3 rounding) gives the same bytes as the hardware cvt."""
    x = make_input(1000, 2080, torch.float32, seed=62)
    ref, reft = quantize_torch(x, -1), quantize_torch(x[:992].t().contiguous(), -1)
    monkeypatch.setenv("MOE_EP_MXFP8_SOFT_CVT", "1")
    data, scale = mxfp8_cuda.quantize_rowwise(x.cuda(), "blocked")
    assert_bytes(data, ref.data, "soft-cvt data")
    assert_bytes(scale, to_blocked(ref.scale), "soft-cvt scale")
    data_t, _ = mxfp8_cuda.quantize_colwise(x[:992].cuda(), "plain")
    assert_bytes(data_t, reft.data, "soft-cvt colwise data")
