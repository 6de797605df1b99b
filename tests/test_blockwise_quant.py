"""Blockwise FP8 quantizers (kernels/blockwise/quantize.cu via moe_ep.blockwise.cuda): bytes == the reference's
(moe_ep.blockwise.reference), compared with torch.equal on the data bytes and the scale bytes.

Every kernel test runs on two backends:
  * ``emu``: the kernel source compiled as C++ and run on the CPU (tests/blockwise_emu.py), tiny shapes, in CI. It
    checks indexing, layouts, the group lookup, padding, synchronization and the block math (with the host paths of
    the PTX helpers). Its SwiGLU reference values are the kernels' own host arithmetic (the host expf is not torch's);
    the quantization of those values is the reference's.
  * ``cuda`` (mark ``gpu``): the real kernels at larger shapes; SwiGLU against moe_ep.experts.reference on CUDA.
Inputs are awkward on purpose: M not a multiple of 128, zero-row groups first / middle / last, one group holding
every row, sum(sizes) < M, NaN / Inf elements, all-zero blocks, huge and tiny (subnormal) magnitudes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_ep.blockwise import cuda as bw_cuda
from moe_ep.blockwise.reference import (
    dequantize_rowwise_torch,
    quantize_colwise_prepared_torch,
    quantize_rowwise_torch,
    quantize_weight_torch,
)
from moe_ep.experts.reference import swiglu, swiglu_bwd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blockwise_emu  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
    pytest.param("emu", marks=pytest.mark.skipif(blockwise_emu.CXX is None, reason="no C++ compiler")),
]
SENT = 0xAB  # the bytes outputs start as: what a kernel does not write stays SENT


@pytest.fixture(params=BACKENDS, name="dev")
def backend(request, monkeypatch, tmp_path_factory) -> torch.device:
    if request.param == "cuda":
        return torch.device("cuda")
    blockwise_emu.install(monkeypatch, tmp_path_factory.getbasetemp())
    return torch.device("cpu")


def _big(dev: torch.device) -> bool:
    return dev.type == "cuda"


def _emu_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


# ------------------------------------------------------------------------------------------------------------
# inputs and comparisons
# ------------------------------------------------------------------------------------------------------------


def make_input(m: int, k: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, special: bool = True):
    """[m, k] CPU tensor: per-row and per-column magnitudes over 10**-30 .. 10**30 (clamped to the type), and in
    32 x 32 regions: zeros, bf16/fp32 subnormals, values near the largest finite, single huge outliers among tiny
    values; plus a few NaN / +-Inf elements (their 1x128 and 128x1 blocks become NaN blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    x *= 10.0 ** (torch.rand(m, 1, generator=g, dtype=torch.float64) * 8 - 4)
    x *= 10.0 ** (torch.rand(1, k, generator=g, dtype=torch.float64) * 4 - 2)
    if special:
        kinds = torch.randint(0, 8, ((m + 31) // 32, (k + 31) // 32), generator=g)
        for bi in range(kinds.shape[0]):
            for bj in range(kinds.shape[1]):
                blk = x[32 * bi : 32 * bi + 32, 32 * bj : 32 * bj + 32]
                kind = int(kinds[bi, bj])
                if kind == 1:
                    blk.zero_()
                elif kind == 2:
                    blk.mul_(1e-40)  # subnormal in bf16 / fp32
                elif kind == 3:
                    blk.mul_(1e37)  # near fp32 / bf16 max
                elif kind == 4:
                    blk.mul_(1e-30)
                    blk[0, 0] = 3e30  # an outlier: the rest of its blocks flushes to zero bytes
                elif kind == 5:
                    blk.neg_()
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)
        n = m * k
        idx = torch.randint(0, n, (6,), generator=g)
        flat = x.view(-1)
        flat[idx[:3]] = float("nan")
        flat[idx[3:5]] = float("inf")
        flat[idx[5]] = float("-inf")
    return x.to(dtype)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_bytes(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = _u8(got), _u8(want)
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{name}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
                             f"{int(a[tuple(bad[0])]):#x} vs {int(b[tuple(bad[0])]):#x}")  # fmt: skip


def _sentinel(shape, dtype, dev) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=dev)
    t.view(torch.uint8).fill_(SENT)
    return t


def check_prepared(got, want, sizes, what: str) -> None:
    """The prepared bf16 operand: bytes equal on each group's rows and the zero rows padding it to a multiple of 64;
    every other row untouched (still SENT)."""
    written = torch.zeros(got.shape[0], dtype=torch.bool)
    poff = 0
    for n in sizes:
        written[poff : poff + 64 * ((n + 63) // 64)] = True
        poff += 64 * ((n + 63) // 64)
    assert_bytes(f"{what} data_c", got.cpu()[written], want[written])
    assert (_u8(got.cpu()[~written]) == SENT).all(), f"{what}: data_c written outside the groups' padded rows"


# group sizes: (M, sizes): zero-row groups first / middle / last, all rows in one group, sum(sizes) < M
SIZES_EMU = [
    (230, [0, 130, 0, 5, 0, 65]),
    (131, [131]),
    (300, [40, 0, 77]),
    (1, [0, 1, 0]),
]
SIZES_GPU = [
    (5000, [0, 1300, 0, 1, 127, 129, 2000, 0, 1443]),
    (4100, [4100]),
    (4096, [513, 0, 1000, 0]),
]


def _sizes(dev, swiglu: bool = False):
    """The group-size cases of a backend (the SwiGLU kernels' emulation, 256 / 512 threads a tile, runs two)."""
    if _big(dev):
        return SIZES_GPU
    return [SIZES_EMU[0], SIZES_EMU[3]] if swiglu else SIZES_EMU


# ------------------------------------------------------------------------------------------------------------
# 1x128 row-wise
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rowwise(dev, dtype):
    m, k = (3001, 2048) if _big(dev) else (7, 384)
    x = make_input(m, k, dtype, seed=1)
    data = _sentinel((m, k), torch.float8_e4m3fn, dev)
    scale = _sentinel((m, k // 128), torch.uint8, dev)
    bw_cuda.quantize_rowwise_into(x.to(dev), data, scale)
    want = quantize_rowwise_torch(x)
    assert_bytes("data", data, want[0])
    assert_bytes("scale", scale, want[1])
    d2, s2 = bw_cuda.quantize_rowwise(x.to(dev))  # the allocating form
    assert_bytes("data (alloc)", d2, want[0])
    assert_bytes("scale (alloc)", s2, want[1])


# ------------------------------------------------------------------------------------------------------------
# 128x1 grouped column-wise
# ------------------------------------------------------------------------------------------------------------


def _prep_run(dev, x, sizes, m, k):
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    data_c = _sentinel((64 * ((m + 63) // 64 + len(sizes)), k), torch.bfloat16, dev)
    bw_cuda.quantize_colwise_prepared_into(x, st, data_c)
    return data_c


def test_colwise_prepared_bf16(dev):
    """The prepared bf16 operand (exactly dequantized 128x1 blocks, 64-row group padding) from bf16 rows: NaN / Inf
    blocks (bf16 0x7FC0 on the group's rows, zero pad rows), values near bf16's largest (their blocks dequantize to
    Inf, as the fp32 reference), subnormal blocks (values below 2**-133 rounded as .to(bfloat16))."""
    k = 1024 if _big(dev) else 256
    for i, (m, sizes) in enumerate(_sizes(dev)):
        x = make_input(m, k, torch.bfloat16, seed=10 + i)
        got = _prep_run(dev, x.to(dev), sizes, m, k)
        check_prepared(got, quantize_colwise_prepared_torch(x, sizes), sizes, f"M={m} sizes={sizes}")
    want = quantize_colwise_prepared_torch(make_input(*SIZES_EMU[0][:1], k, torch.bfloat16, seed=10), SIZES_EMU[0][1])
    bits = want.view(torch.int16)
    assert (bits == 0x7FC0).any() and (bits == 0x7F80).any(), "the input lacks a NaN block or an overflowing block"
    if not _big(dev):  # the allocating form (rows past the groups' padded rows uninitialized)
        m, sizes = SIZES_EMU[2]
        x = make_input(m, k, torch.bfloat16, seed=12)
        got = bw_cuda.quantize_colwise_prepared(x, torch.tensor(sizes, dtype=torch.int32))
        n = 64 * sum((v + 63) // 64 for v in sizes)
        assert_bytes("alloc data_c", got[:n], quantize_colwise_prepared_torch(x, sizes)[:n])


def test_colwise_prepared_requantized(dev):
    """The prepared operand from the dispatch's 1x128 bytes (x^T): dequantized exactly, requantized 128x1 and
    dequantized again; a NaN scale byte and an e4m3 NaN byte included."""
    k = 768 if _big(dev) else 256
    for i, (m, sizes) in enumerate(_sizes(dev)):
        x = make_input(m, k, torch.float32, seed=20 + i)
        d, s = quantize_rowwise_torch(x)
        if m > 3:
            s[3, 0] = 0xFF
            d.view(torch.uint8)[m - 1, 5] = 0x7F
        got = _prep_run(dev, (d.to(dev), s.to(dev)), sizes, m, k)
        want = quantize_colwise_prepared_torch(dequantize_rowwise_torch(d, s), sizes)
        check_prepared(got, want, sizes, f"M={m} sizes={sizes}")


def test_grouped_many_groups(dev, tmp_path_factory):
    """More groups than a CTA has threads (the device-side scan of the sizes takes two rounds): mostly empty groups,
    1-row groups, one large group late; the colwise kernel's group table and (GPU) the column-only SwiGLU forward's
    per-tile lookup."""
    g = torch.Generator().manual_seed(7)
    sizes = [0] * 300
    for i in torch.randint(0, 300, (40,), generator=g).tolist():
        sizes[i] = 1
    sizes[290] = 200
    m, k = sum(sizes) + 9, 128
    x = make_input(m, k, torch.bfloat16, seed=80)
    got = _prep_run(dev, x.to(dev), sizes, m, k)
    check_prepared(got, quantize_colwise_prepared_torch(x, sizes), sizes, "300 groups")
    if not _big(dev):  # the SwiGLU grid has a CTA per tile bound (303 here): too slow to emulate in CI
        return
    a = _swiglu_input(m, 128, seed=81)
    st = torch.tensor(sizes, dtype=torch.int32, device=dev)
    h = _swiglu_ref_vals(dev, tmp_path_factory, a)
    check_prepared(bw_cuda.swiglu_colwise_prepared(a.to(dev), st), quantize_colwise_prepared_torch(h, sizes),
                   sizes, "swiglu prepared")  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# 128x128 weights
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_weight(dev, dtype):
    g, n, k = (3, 512, 768) if _big(dev) else (2, 256, 128)
    w = make_input(g * n, k, dtype, seed=40).view(g, n, k)
    w[0, :128, :128] = 0.0  # an all-zero tile
    data = _sentinel((g, n, k), torch.float8_e4m3fn, dev)
    data_t = _sentinel((g, k, n), torch.float8_e4m3fn, dev)
    scale = _sentinel((g, n // 128, k // 128), torch.uint8, dev)
    bw_cuda.quantize_weight_into(w.to(dev), data, data_t, scale)
    want = quantize_weight_torch(w)
    assert int(want[2][0, 0, 0]) == 0 and (want[2] == 0xFF).any(), "the input lacks a zero tile or a NaN tile"
    for name, a, b in zip(("data", "data_t", "scale"), (data, data_t, scale), want, strict=True):
        assert_bytes(name, a, b)


def test_transpose_weight(dev):
    """The byte transpose of quantized 128x128 bytes (a weight gathered as data + scales) is quantize_weight's data_t,
    byte for byte; every byte value (NaN 0x7F / 0xFF, zeros) travels unchanged."""
    g, n, k = (3, 512, 768) if _big(dev) else (2, 256, 384)
    w = make_input(g * n, k, torch.float32, seed=41).view(g, n, k)
    data, data_t, _ = quantize_weight_torch(w)
    raw = torch.randint(0, 256, (g, n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(41))
    for src, want in ((data, data_t), (raw.view(torch.float8_e4m3fn), raw.transpose(1, 2).contiguous())):
        out = _sentinel((g, k, n), torch.float8_e4m3fn, dev)
        bw_cuda.transpose_weight_into(src.to(dev), out)
        assert_bytes("data_t", out, want.view(torch.float8_e4m3fn))
    assert_bytes("data_t", bw_cuda.transpose_weight(data.to(dev)), data_t)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        bw_cuda.transpose_weight(torch.zeros(1, 128, 96, dtype=torch.float8_e4m3fn, device=dev))


# ------------------------------------------------------------------------------------------------------------
# fused SwiGLU
# ------------------------------------------------------------------------------------------------------------


def _swiglu_input(m: int, f: int, seed: int) -> torch.Tensor:
    """a: [m, 2F] bf16 of moderate magnitude (silu's range), with extreme blocks (make_input's), which also take the
    kernel's IEEE-division path (|g| > 69, tiny g, NaN/Inf)."""
    a = make_input(m, 2 * f, torch.bfloat16, seed=seed).float()
    mild = make_input(m, 2 * f, torch.bfloat16, seed=seed + 1, special=False).float().clamp(-8, 8)
    keep = (torch.arange(m) % 5 == 0).unsqueeze(1)  # every fifth row keeps the extreme values
    return torch.where(keep, a, mild).to(torch.bfloat16)


def _swiglu_ref_vals(dev, tmp_path_factory, a, dh=None) -> torch.Tensor:
    """The fp32 values the kernel quantizes: torch's swiglu / swiglu_bwd on CUDA, the kernels' host math on emu."""
    if _big(dev):
        return (swiglu(a.to(dev)) if dh is None else swiglu_bwd(a.to(dev), dh.to(dev))).cpu()
    return blockwise_emu.swiglu_vals(_emu_dir(tmp_path_factory), a, dh)


def test_swiglu_fwd(dev, tmp_path_factory):
    """The forward kernel (h in 1x128 rows, every row written) in its launch configuration (SWIGLU_CFG)."""
    f = 512 if _big(dev) else 256
    for i, (m, _) in enumerate(_sizes(dev, swiglu=True)):
        a = _swiglu_input(m, f, seed=50 + i)
        h = _swiglu_ref_vals(dev, tmp_path_factory, a)
        want_d, want_s = quantize_rowwise_torch(h)
        data = _sentinel((m, f), torch.float8_e4m3fn, dev)
        scale = _sentinel((m, f // 128), torch.uint8, dev)
        bw_cuda.swiglu_quantize_into(a.to(dev), data, scale)
        assert_bytes(f"M={m} data", data, want_d)
        assert_bytes(f"M={m} scale", scale, want_s)
        d2, s2 = bw_cuda.swiglu_quantize(a.to(dev))  # the allocating form
        assert_bytes(f"M={m} data (alloc)", d2, want_d)
        assert_bytes(f"M={m} scale (alloc)", s2, want_s)


def test_swiglu_prepared(dev, tmp_path_factory):
    """The prepared bf16 column operands of the SwiGLU kernels: h alone (forward, no row-wise byte written) and dA
    with its 1x128 rows (backward: every row written, also those past sum(sizes)); and their allocating forms."""
    f = 256 if _big(dev) else 128
    for i, (m, sizes) in enumerate(_sizes(dev, swiglu=True)):
        a = _swiglu_input(m, f, seed=90 + i)
        dh = _swiglu_input(m, f // 2, seed=95 + i)
        st = torch.tensor(sizes, dtype=torch.int32, device=dev)
        rows = 64 * ((m + 63) // 64 + len(sizes))
        h = _swiglu_ref_vals(dev, tmp_path_factory, a)
        data_c = _sentinel((rows, f), torch.bfloat16, dev)
        bw_cuda.swiglu_colwise_prepared_into(a.to(dev), st, data_c)
        check_prepared(data_c, quantize_colwise_prepared_torch(h, sizes), sizes, f"fwd M={m} sizes={sizes}")
        da = _swiglu_ref_vals(dev, tmp_path_factory, a, dh)
        data = _sentinel((m, 2 * f), torch.float8_e4m3fn, dev)
        scale = _sentinel((m, 2 * f // 128), torch.uint8, dev)
        data_c = _sentinel((rows, 2 * f), torch.bfloat16, dev)
        bw_cuda.swiglu_bwd_quantize_prepared_into(a.to(dev), dh.to(dev), st, data, scale, data_c)
        want_d, want_s = quantize_rowwise_torch(da)
        assert_bytes(f"bwd M={m} data", data, want_d)
        assert_bytes(f"bwd M={m} scale", scale, want_s)
        check_prepared(data_c, quantize_colwise_prepared_torch(da, sizes), sizes, f"bwd M={m} sizes={sizes}")
        if i == 0:  # the allocating forms (rows past the groups' padded rows uninitialized)
            n = 64 * sum((v + 63) // 64 for v in sizes)
            got = bw_cuda.swiglu_colwise_prepared(a.to(dev), st)
            assert_bytes("alloc fwd data_c", got[:n], quantize_colwise_prepared_torch(h, sizes)[:n])
            got = bw_cuda.swiglu_bwd_quantize_prepared(a.to(dev), dh.to(dev), st)
            assert_bytes("alloc bwd data", got[0], want_d)
            assert_bytes("alloc bwd scale", got[1], want_s)
            assert_bytes("alloc bwd data_c", got[2][:n], quantize_colwise_prepared_torch(da, sizes)[:n])


# ------------------------------------------------------------------------------------------------------------
# argument checks (no launch)
# ------------------------------------------------------------------------------------------------------------


def test_bad_input(monkeypatch):
    monkeypatch.setattr(bw_cuda, "_on_gpu", lambda t: True)
    monkeypatch.setattr(bw_cuda, "_launch", lambda *a: pytest.fail("launched"))
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    st = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 128"):
        bw_cuda.quantize_rowwise(torch.zeros(4, 96, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        bw_cuda.quantize_rowwise(x.half())
    with pytest.raises(ValueError, match="scale: expected shape"):
        bw_cuda.quantize_rowwise_into(
            x, torch.empty(4, 256, dtype=torch.float8_e4m3fn), torch.empty(4, 3, dtype=torch.uint8)
        )
    with pytest.raises(TypeError, match="int32"):
        bw_cuda.quantize_colwise_prepared(x, st.long())
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        bw_cuda.quantize_colwise_prepared((x, torch.zeros(4, 2, dtype=torch.uint8)), st)
    with pytest.raises(ValueError, match="x scale"):
        bw_cuda.quantize_colwise_prepared((x.to(torch.float8_e4m3fn), torch.zeros(4, 3, dtype=torch.uint8)), st)
    with pytest.raises(ValueError, match="N = 96"):
        bw_cuda.quantize_weight(torch.zeros(2, 96, 128))
    with pytest.raises(ValueError, match="F % 128"):
        bw_cuda.swiglu_quantize(torch.zeros(4, 384, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="data_c: expected shape"):
        bw_cuda.quantize_colwise_prepared_into(x, st, torch.empty(64, 256, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        bw_cuda.swiglu_colwise_prepared_into(x, st, torch.empty(128, 128, dtype=torch.float32))
    with pytest.raises(ValueError, match="dh: expected shape"):
        bw_cuda.swiglu_bwd_quantize_prepared(x, torch.zeros(4, 256, dtype=torch.bfloat16), st)
    monkeypatch.setattr(bw_cuda, "_on_gpu", lambda t: t.device.type == "cuda")
    with pytest.raises(ValueError, match="CUDA tensor"):
        bw_cuda.quantize_rowwise(x)
