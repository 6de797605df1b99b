"""CPU check of the kernels' per-block MXFP8 math (kernels/common.cuh compiled as host C++) against the reference.

The same ``__host__ __device__`` functions run inside kernels/quantize.cu; here they are compiled with g++ (or
c++) and fed blocks on which the reference (moe_ep.mxfp8.quantize_torch) is the specification. Skips when no
C++ compiler is found. The device's e4m3 conversion is the hardware ``cvt.rn.satfinite.e4m3x2.f32``; the host
build uses the software conversion (``mx_f32_to_e4m3_soft``), which the GPU tests can select with
MOE_EP_MXFP8_SOFT_CVT=1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep.mxfp8 import E4M3_MAX, quantize_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_emu import CXX, KERNELS, PIPE_CASES, build_emulator, emulator  # noqa: E402

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "common.cuh"
// usage: harness MODE IN OUT.  MODE "q": IN = n*32 float32, OUT = n scale bytes then n*32 data bytes.
//                               MODE "c": IN = n float32, OUT = n e4m3 bytes (soft conversion of clamped v).
//                               MODE "d": IN = n bytes, OUT = n float32 (soft e4m3 decode).
//                               MODE "e": IN = n uint32 fp32 bit patterns, OUT = n int32 mx_block_exp.
//                               MODE "t": IN = n uint32 bf16 keys, OUT = n int32 mx_bf16_block_t - 135.
//                               MODE "x": IN ignored, OUT = int64 count of finite keys k >= 0 where
//                                 mx_block_exp != mx_block_exp_div, then the first such key (uint32).
int main(int argc, char** argv) {
    if (argc != 4) return 2;
    FILE* f = fopen(argv[2], "rb");
    fseek(f, 0, SEEK_END); long nb = ftell(f); fseek(f, 0, SEEK_SET);
    unsigned char* buf = (unsigned char*)malloc(nb);
    if (fread(buf, 1, nb, f) != (size_t)nb) return 3;
    fclose(f);
    FILE* o = fopen(argv[3], "wb");
    if (argv[1][0] == 'q') {
        long n = nb / 128;
        unsigned char* sc = (unsigned char*)malloc(n);
        unsigned char* q = (unsigned char*)malloc(n * 32);
        for (long i = 0; i < n; ++i) sc[i] = (unsigned char)mx_quantize_block((const float*)buf + i * 32, q + i * 32);
        fwrite(sc, 1, n, o); fwrite(q, 1, n * 32, o);
    } else if (argv[1][0] == 'c') {
        long n = nb / 4;
        for (long i = 0; i < n; ++i) {
            unsigned p = mx_cvt2_e4m3(((const float*)buf)[i], 0.0f);
            unsigned char b = (unsigned char)(p & 0xFF); fwrite(&b, 1, 1, o);
        }
    } else if (argv[1][0] == 'e') {
        long n = nb / 4;
        for (long i = 0; i < n; ++i) {
            int e = mx_block_exp(mx_u2f(((const unsigned*)buf)[i]));
            fwrite(&e, 4, 1, o);
        }
    } else if (argv[1][0] == 't') {
        long n = nb / 4;
        for (long i = 0; i < n; ++i) {
            int e = (int)mx_bf16_block_t(((const unsigned*)buf)[i]) - 135;
            fwrite(&e, 4, 1, o);
        }
    } else if (argv[1][0] == 'x') {
        long long bad = 0;
        unsigned first = 0xFFFFFFFFu;
        for (unsigned k = 0; k < 0x7F800000u; ++k) {
            if (mx_block_exp(mx_u2f(k)) != mx_block_exp_div(mx_u2f(k))) {
                if (!bad) first = k;
                ++bad;
            }
        }
        fwrite(&bad, 8, 1, o); fwrite(&first, 4, 1, o);
    } else {
        for (long i = 0; i < nb; ++i) { float v = mx_e4m3_to_f32_soft(buf[i]); fwrite(&v, 4, 1, o); }
    }
    fclose(o);
    return 0;
}
"""

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mxhost")
    src = d / "h.cpp"
    src.write_text(HARNESS)
    exe = d / "h"
    subprocess.run([CXX, "-O2", "-std=c++17", "-x", "c++", f"-I{KERNELS}", str(src), "-o", str(exe)], check=True)
    return exe


def _run(harness: Path, tmp: Path, mode: str, payload: bytes) -> bytes:
    (tmp / "in.bin").write_bytes(payload)
    subprocess.run([str(harness), mode, str(tmp / "in.bin"), str(tmp / "out.bin")], check=True)
    return (tmp / "out.bin").read_bytes()


def _check_blocks(harness: Path, tmp: Path, v: torch.Tensor) -> None:
    v = v.to(torch.float32).reshape(-1, 32).contiguous()
    n = v.shape[0]
    out = _run(harness, tmp, "q", v.numpy().tobytes())
    scale = torch.frombuffer(bytearray(out[:n]), dtype=torch.uint8)
    data = torch.frombuffer(bytearray(out[n:]), dtype=torch.uint8).reshape(n, 32)
    ref = quantize_torch(v, -1)
    bad_s = (scale != ref.scale.reshape(-1)).nonzero()
    assert bad_s.numel() == 0, f"scale mismatch at blocks {bad_s[:8].flatten().tolist()}"
    mism = (data != ref.data.view(torch.uint8)).any(dim=1).nonzero().flatten()
    assert mism.numel() == 0, f"data mismatch in blocks {mism[:8].tolist()}: {v[mism[0]].tolist()}"


def _special_blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    blocks = []
    base = torch.randn(32, generator=g)
    for e in (-149, -140, -133, -127, -126, -125, -100, -20, -6, 0, 8, 20, 100, 120, 126, 127):
        blocks.append(base * 2.0**e)
    fmax = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).tiny
    blocks.append(torch.full((32,), fmax))
    blocks.append(torch.linspace(-fmax, fmax, 32))
    blocks.append(torch.full((32,), tiny))
    blocks.append(torch.full((32,), tiny / 2**10))  # subnormals only
    blocks.append(torch.tensor([2.0**-149] * 32))
    blocks.append(torch.zeros(32))
    blocks.append(-torch.zeros(32))
    for special in (float("nan"), float("inf"), float("-inf")):
        b = base.clone()
        b[7] = special
        blocks.append(b)
    # amax/448 exactly a power of two, and one ulp either side
    for p in (-130, -127, -126, -10, 0, 10, 119):
        amax = torch.tensor(448.0 * 2.0**p, dtype=torch.float32)
        for delta in (-1, 0, 1):
            a = torch.nextafter(amax, torch.tensor(float("inf") if delta > 0 else 0.0)) if delta else amax
            b = base.clone() / base.abs().max() * a * 0.999
            b[3] = a
            blocks.append(b)
    # values landing exactly on e4m3 rounding ties after scaling (amax 448 -> scale 2**0)
    ties = torch.tensor(
        [448.0]
        + [(k + 0.5) * 2.0**-9 for k in range(8)]
        + [1.0625, 1.1875, 17.0, 19.0, 272.0, 464.0 - 1e-3, 0.0, -0.0]
        + [2.0**-10, -(2.0**-10), 3 * 2.0**-11, 2.0**-11]
    )
    blocks.append(torch.cat([ties, torch.zeros(32 - ties.numel())]))
    return torch.stack([b.to(torch.float32) for b in blocks])


def test_special_blocks(harness, tmp_path):
    _check_blocks(harness, tmp_path, _special_blocks())


def test_random_fp32_blocks(harness, tmp_path):
    g = torch.Generator().manual_seed(1)
    v = torch.randn(20000, 32, generator=g) * torch.exp2(torch.randint(-140, 120, (20000, 1), generator=g).float())
    _check_blocks(harness, tmp_path, v)


def test_random_bf16_blocks(harness, tmp_path):
    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 1 << 16, (40000, 32), generator=g, dtype=torch.int32).to(torch.int16)
    v = raw.view(torch.bfloat16).to(torch.float32)
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))  # keep most blocks finite
    _check_blocks(harness, tmp_path, v)


def test_every_bf16_value_converts(harness, tmp_path):
    """All finite bf16 magnitudes times the scales a block can pick: soft e4m3 == torch cast (after clamp)."""
    raw = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float32)
    raw = raw[torch.isfinite(raw)]
    vals = torch.cat([raw * 2.0**k for k in (-20, -8, 0, 3, 8)])
    vals = vals[torch.isfinite(vals)]
    out = _run(harness, tmp_path, "c", vals.numpy().tobytes())
    got = torch.frombuffer(bytearray(out), dtype=torch.uint8)
    ref = vals.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    mism = (got != ref).nonzero().flatten()
    assert mism.numel() == 0, f"{mism.numel()} mismatches, first value {vals[mism[0]].item()!r}"


def test_block_exp_every_fp32_key(harness, tmp_path):
    """The integer block exponent equals ceil_log2(amax / 448) with an IEEE division for all 2**31 finite keys."""
    out = _run(harness, tmp_path, "x", b"\0" * 4)
    bad = int.from_bytes(out[:8], "little", signed=True)
    first = int.from_bytes(out[8:12], "little")
    assert bad == 0, f"{bad} keys differ, first 0x{first:08X}"


def test_bf16_block_exp_every_key(harness, tmp_path):
    """kernels/quant_dual.cuh's bf16 shortcut (mx_bf16_block_t - 135) == mx_block_exp == the torch specification's
    block exponent, for every finite bf16 amax key (0 .. 0x7F7F)."""
    k = torch.arange(0x7F80, dtype=torch.int32)
    got = torch.frombuffer(bytearray(_run(harness, tmp_path, "t", k.numpy().tobytes())), dtype=torch.int32)
    via_fp32 = torch.frombuffer(bytearray(_run(harness, tmp_path, "e", (k << 16).numpy().tobytes())), dtype=torch.int32)
    blocks = torch.zeros(k.numel(), 32, dtype=torch.float32)
    blocks[:, 0] = (k << 16).view(torch.float32)
    ref = quantize_torch(blocks.to(torch.bfloat16), -1).scale.reshape(-1).to(torch.int32) - 127
    assert torch.equal(got, via_fp32), f"first differing key 0x{int((got != via_fp32).nonzero()[0]):04X}"
    assert torch.equal(got, ref), f"first differing key 0x{int((got != ref).nonzero()[0]):04X}"


def test_block_exp_matches_reference_at_boundaries(harness, tmp_path):
    """Against the torch specification, on every exponent's edges and the subnormal-quotient window."""
    mant = [0, 1, 2, 3, 0x5FFFFE, 0x5FFFFF, 0x600000, 0x600001, 0x600002, 0x7FFFFE, 0x7FFFFF]
    keys = [(b << 23) | m for b in range(255) for m in mant]
    keys += list(range(0x04600000 - 4096, 0x04600000 + 4096)) + list(range(0x04E00000 - 4096, 0x04E00000 + 4096))
    keys += torch.randint(0, 0x7F800000, (1 << 16,), generator=torch.Generator().manual_seed(3)).tolist()
    k = torch.tensor(keys, dtype=torch.int64).to(torch.int32)
    out = _run(harness, tmp_path, "e", k.numpy().tobytes())
    got = torch.frombuffer(bytearray(out), dtype=torch.int32)
    # The specification's exponent: quantize a block whose largest |v| is the key (scale byte = E + 127).
    blocks = torch.zeros(k.numel(), 32, dtype=torch.float32)
    blocks[:, 0] = k.view(torch.float32)
    ref = quantize_torch(blocks, -1).scale.reshape(-1).to(torch.int32) - 127
    bad = (got != ref).nonzero().flatten()
    assert bad.numel() == 0, f"key 0x{int(k[bad[0]]):08X}: got {int(got[bad[0]])}, spec {int(ref[bad[0]])}"


def test_e4m3_decode(harness, tmp_path):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = _run(harness, tmp_path, "d", b.numpy().tobytes())
    got = torch.frombuffer(bytearray(out), dtype=torch.float32)
    ref = b.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok].view(torch.int32), ref[ok].view(torch.int32))


def test_emulator_builds(tmp_path):
    """The emulator compiles and reports the kernel's own choice: bf16 row-only plain scales run pipe 5 under auto
    (kernels/quantize.cu QuantCfg), blocked ones pipe 4, fp32 pipe 0."""
    so = build_emulator(tmp_path)
    assert (so.emu_pipe(1, 1, 0, -1), so.emu_pipe(1, 2, 0, -1), so.emu_pipe(0, 2, 0, -1)) == (5, 4, 0)


def test_dynamic_schedule_choice(monkeypatch):
    """MOE_EP_QUANT_SCHED: which mx_quant launches take the dynamic tile schedule (hand-worked, 396 CTA slots), and
    the kernel quant_plan names for them."""
    from moe_ep.mxfp8 import plan as quant_plan

    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    monkeypatch.delenv("MOE_EP_QUANT_SCHED", raising=False)
    monkeypatch.delenv("MOE_EP_QUANT_PIPE", raising=False)
    ds = quant_plan.dynamic_schedule
    assert ds("mx_quant<1,2,0>", 396, 14336)  # 32768 x 7168: 36.2 tiles per CTA
    assert ds("mx_quant<1,2,0>", 396, 7168)  # 16384 x 7168: 18.1
    assert ds("mx_quant<1,2,0>", 396, 12 * 396)
    assert not ds("mx_quant<1,2,0>", 396, 12 * 396 - 1)
    assert not ds("mx_quant<1,2,0>", 396, 4096)  # 32768 x 2048: 10.3
    assert not ds("mx_quant<1,3,0>", 396, 2560)  # grouped rows, 16384 x 2048 + 32 groups: 6.5
    assert ds("mx_quant<2,3,0>", 396, 8960)  # grouped rows (pipe 3, 396 CTAs), 16384 x 7168 + 32 groups: 22.6
    assert ds("mx_quant<1,2,2>", 396, 2048)  # fused: from 4 per CTA
    assert not ds("mx_quant<1,2,2>", 396, 4 * 396 - 1)
    assert not ds("mx_quant<1,0,2>", 396, 16384)  # column-only (MOE_EP_QUANT_PIPE=3): no mx_quant_dyn instantiation
    assert not ds("mx_quant<1,0,2>", 4096, 4096)  # one CTA per tile (pipe 0): nothing to hand out
    assert not ds("mx_quant<0,2,0>", 396, 100000)  # fp32: no mx_quant_dyn instantiation
    assert not ds("mx_quant<1,3,4>", 264, 100000)  # grouped dual on mx_quant (MOE_EP_QUANT_DUAL=smem): none either
    monkeypatch.setenv("MOE_EP_QUANT_SCHED", "dynamic")
    assert ds("mx_quant<1,2,0>", 396, 2048)
    assert not ds("mx_quant<1,0,2>", 4096, 4096)
    monkeypatch.setenv("MOE_EP_QUANT_SCHED", "static")
    assert not ds("mx_quant<1,2,0>", 396, 14336)
    monkeypatch.setenv("MOE_EP_QUANT_SCHED", "steal")
    with pytest.raises(ValueError, match="MOE_EP_QUANT_SCHED"):
        ds("mx_quant<1,2,0>", 396, 14336)
    monkeypatch.delenv("MOE_EP_QUANT_SCHED")
    x = torch.empty(0, dtype=torch.bfloat16)
    blocked, uniform = quant_plan.RS["blocked"], quant_plan.RS["uniform"]
    plan = quant_plan.quant_plan
    # auto: row-only blocked and fused take pipe 4 (one CTA per tile, one 32 KB stage: 3584 + 32768 + 128 bytes of
    # shared memory; row plain: pipe 5, 64-row tiles), so no schedule to choose
    assert plan(x, 32768, 7168, blocked, 0, 0, None, None)[:3] == ("mx_quant<1,2,0>", 14336, 36480)
    assert plan(x, 16384, 2048, blocked, blocked, 0, None, None)[:2] == ("mx_quant<1,2,2>", 2048)
    # grouped rows and 3-D weight scales stay persistent (pipe 3): 16384 x 7168 in 32 groups, (128 + 32) x 56 tiles;
    # 64 experts x [2048, 7168] = 57344 tiles on 396 CTAs
    grouped = quant_plan.RS["grouped"]
    assert plan(x, 16384, 7168, grouped, 0, 32, 160, None)[:2] == ("mx_quant_dyn<1,3,0>", 396)
    assert plan(x, 16384, 2048, grouped, 0, 32, 160, None)[:2] == ("mx_quant<1,3,0>", 396)
    assert plan(x, 64 * 2048, 7168, uniform, 0, 0, 64 * 16, None)[:2] == ("mx_quant_dyn<1,4,0>", 396)
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", "3")  # two stages: 3584 + 2 * 32768 + 128
    assert plan(x, 32768, 7168, blocked, 0, 0, None, None)[:3] == ("mx_quant_dyn<1,2,0>", 396, 69248)
    assert plan(x, 16384, 2048, blocked, 0, 0, None, None)[:2] == ("mx_quant<1,2,0>", 396)
    assert plan(x, 16384, 2048, blocked, blocked, 0, None, None)[0] == "mx_quant_dyn<1,2,2>"
    monkeypatch.delenv("MOE_EP_QUANT_PIPE")
    # the weights' batched launch keeps the static order (its problems share no counter)
    assert quant_plan.batch_plan(torch.empty(0, dtype=torch.bfloat16), 4, 8192, 5120)[0] == "mx_quant_batch<1>"


def test_kernel_pipe_matches_host(tmp_path):
    """quant_plan.effective_pipe (grid, shared memory and CTA size are sized from it) == the pipe kernels/quantize.cu's
    QuantCfg compiles, for every input code, row / column mode and requested pipe."""
    from moe_ep.mxfp8 import plan as quant_plan

    so = emulator(tmp_path)
    bad = []
    for i, r, c, q in PIPE_CASES:
        es = 4 if i in (0, 3, 4, 5) else 2  # fp32 and the SwiGLU codes stage fp32 (quant_plan.quant_plan)
        want, got = quant_plan.effective_pipe(es, r, c, q), so.emu_pipe(i, r, c, q)
        if want != got:
            bad.append(((i, r, c, q), want, got))
    assert not bad, f"{len(bad)} of {len(PIPE_CASES)} differ, e.g. (IN, RS, CS, pipe), host, kernel: {bad[:5]}"


def test_pipe5_plan(monkeypatch):
    """Pipe 5 (64-row tiles of 128 threads): 16-bit row plain under auto, row plain / blocked under
    MOE_EP_QUANT_PIPE=5, every other mode as pipe 4 (hand-worked plans)."""
    from moe_ep.mxfp8 import plan as quant_plan

    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    monkeypatch.delenv("MOE_EP_QUANT_PIPE", raising=False)
    plain, blocked, col = quant_plan.RS["plain"], quant_plan.RS["blocked"], quant_plan.CS["blocked"]
    x = torch.empty(0, dtype=torch.bfloat16)
    stage5, stage4 = 64 * 256 + 128, 128 * 256 + 128  # one 64- or 128-row bf16 stage on 128 bytes
    # [300, 544] plain under auto: ceil(300 / 64) = 5 row tiles x 5 column tiles, 128 threads
    assert quant_plan.quant_plan(x, 300, 544, plain, 0, 0, None, None) == (
        "mx_quant<1,1,0>",
        25,
        quant_plan.SMEM_FIXED + stage5,
        5,
        5,
        128,
    )
    # blocked stays on pipe 4 under auto; under 5 it takes both halves of its 3 scale tiles (6 row tiles)
    assert quant_plan.quant_plan(x, 300, 544, blocked, 0, 0, None, None)[1:] == (
        15,
        quant_plan.SMEM_FIXED + stage4,
        3,
        5,
        256,
    )
    assert quant_plan.quant_plan(x.float(), 300, 544, plain, 0, 0, None, None)[1:] == (
        15,
        quant_plan.SMEM_FIXED,
        3,
        5,
        256,
    )  # fp32: pipe 0, no stage
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", "5")
    assert quant_plan.quant_plan(x, 300, 544, blocked, 0, 0, None, None)[1:] == (
        30,
        quant_plan.SMEM_FIXED + stage5,
        6,
        5,
        128,
    )
    # fused and column-only run pipe 4's kernels (one 128-row tile per CTA of 256 threads)
    assert quant_plan.quant_plan(x, 16384, 2048, blocked, col, 0, None, None)[1:] == (
        2048,
        quant_plan.SMEM_FIXED + stage4,
        128,
        16,
        256,
    )
    assert quant_plan.effective_pipe(2, 0, col, 5) == 4
    assert quant_plan.effective_pipe(2, quant_plan.RS["grouped"], 0, 5) == 4
    assert quant_plan.effective_pipe(4, plain, 0, 5) == 0  # fp32: no cp.async path
    assert quant_plan.quant_ctas(4096, 2, blocked, 0, torch.device("cpu"), 5) == 4096  # one CTA per 64-row tile


def test_quant_grid_full_and_balanced(monkeypatch):
    """MOE_EP_QUANT_GRID: the persistent grid of the row-wise kernels on a 132-SM GPU (hand-worked numbers)."""
    from moe_ep.mxfp8 import plan as quant_plan

    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    monkeypatch.delenv("MOE_EP_QUANT_PIPE", raising=False)
    dev = torch.device("cpu")
    blocked, grouped = quant_plan.RS["blocked"], quant_plan.RS["grouped"]
    monkeypatch.delenv("MOE_EP_QUANT_GRID", raising=False)
    # blocked bf16 and fused: pipe 4, one CTA per tile; on pipe 3 (grouped rows' auto), 3 CTAs per SM = 396 slots;
    # pipe 2: 2 per SM = 264
    col, fused = quant_plan.CS["blocked"], (blocked, quant_plan.CS["blocked"])
    assert quant_plan.quant_ctas(2048, 2, blocked, 0, dev) == 2048
    assert quant_plan.quant_ctas(2048, 2, blocked, 0, dev, 3) == 396
    assert quant_plan.quant_ctas(100, 2, blocked, 0, dev, 3) == 100
    assert quant_plan.quant_ctas(2048, 2, grouped, 0, dev) == 396
    assert quant_plan.quant_ctas(2048, 2, grouped, 0, dev, 2) == 264
    assert quant_plan.quant_ctas(2048, 2, 0, col, dev) == 2048  # column-only: pipe 0
    assert quant_plan.quant_ctas(2048, 2, *fused, dev) == 2048  # fused: pipe 4
    assert quant_plan.quant_ctas(2048, 2, *fused, dev, 3) == 396
    assert quant_plan.quant_ctas(2048, 4, *fused, dev) == 2048  # fp32: pipe 0
    assert quant_plan.effective_pipe(4, blocked, 0, 4) == 0  # fp32: no cp.async path
    # column-only bf16 under auto: pipe 4 from 24 * 132 = 3168 tiles, else the kernel's auto (0)
    assert quant_plan.requested_pipe(2, 0, col, 16384, dev) == 4  # [131072, 2048]
    assert quant_plan.requested_pipe(2, 0, col, 3168, dev) == 4  # the boundary: exactly 24 tiles per SM
    assert quant_plan.requested_pipe(2, 0, col, 3167, dev) == -1
    assert quant_plan.requested_pipe(2, 0, col, 2048, dev) == -1  # [16384, 2048]: the kernel's auto, pipe 0
    assert quant_plan.quant_ctas(16384, 2, 0, col, dev, 4) == 16384
    assert quant_plan.requested_pipe(2, grouped, 0, 16128, dev) == -1  # grouped rows: the kernel's auto, pipe 3
    assert quant_plan.requested_pipe(4, 0, col, 16384, dev) == -1  # fp32: no pipe 4
    assert quant_plan.requested_pipe(2, *fused, 16384, dev) == -1  # fused: already 4 by the kernel's auto
    assert quant_plan.requested_pipe(2, quant_plan.RS["uniform"], 0, 16384, dev) == -1  # 3-D weights: pipe 3
    monkeypatch.setenv("MOE_EP_QUANT_PIPE", "0")
    assert quant_plan.requested_pipe(2, 0, col, 16384, dev) == 0  # an explicit switch wins
    monkeypatch.delenv("MOE_EP_QUANT_PIPE")
    monkeypatch.setenv("MOE_EP_QUANT_GRID", "balanced")
    assert quant_plan.quant_ctas(2048, 2, blocked, 0, dev, 3) == 342  # ceil(2048 / 6): 6 tiles per CTA
    assert quant_plan.quant_ctas(2048, 2, grouped, 0, dev) == 342  # pipe 3: ceil(2048 / 6)
    assert quant_plan.quant_ctas(2048, 2, grouped, 0, dev, 2) == 256  # pipe 2: ceil(2048 / 8)
    assert quant_plan.quant_ctas(2048, 2, blocked, 0, dev) == 2048  # pipe 4 has no persistent grid to balance


def test_dual_kernel_plan(monkeypatch):
    """Which grouped-dual kernel a bf16 input gets, its depth, grid and shared memory (hand-worked, 132 SMs)."""
    from moe_ep.mxfp8 import plan as quant_plan

    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    monkeypatch.delenv("MOE_EP_QUANT_DUAL", raising=False)
    monkeypatch.delenv("MOE_EP_QUANT_DUAL_STAGES", raising=False)
    dev = torch.device("cpu")
    grouped, gnt, gprep = quant_plan.RS["grouped"], quant_plan.CS["grouped_nt"], quant_plan.CS["grouped_prep"]
    # auto depth: 4 stages from 32 tiles per SM (4224 on 132 SMs), else 2
    assert [quant_plan.dual_stages(t, dev) for t in (16128, 4224, 4223, 2560)] == [4, 4, 2, 2]
    # [32768, 7168] in 32 groups: (256 + 32) row tiles x 56 column tiles; 4 stages, one CTA per SM;
    # shared memory = 4 stages of 32 KB + two 512-byte row-scale tiles + group table 16 * 33
    x = torch.empty(32768, 7168, dtype=torch.bfloat16)
    plan = quant_plan.quant_plan(x, 32768, 7168, grouped, gnt, 32, 288, None)
    assert plan == ("mx_quant_dual<1,4,4>", 132, 528 + 4 * 32768 + 1024, 288, 56, 256)
    # [16384, 2048]: 160 x 16 = 2560 tiles -> 2 stages, 3 CTAs per SM
    x = torch.empty(16384, 2048, dtype=torch.bfloat16)
    assert quant_plan.quant_plan(x, 16384, 2048, grouped, gprep, 32, 160, None)[:3] == (
        "mx_quant_dual<1,5,2>",
        396,
        528 + 2 * 32768 + 1024,
    )
    monkeypatch.setenv("MOE_EP_QUANT_DUAL_STAGES", "3")
    assert quant_plan.quant_plan(x, 16384, 2048, grouped, gnt, 32, 160, None)[:2] == ("mx_quant_dual<1,4,3>", 264)
    monkeypatch.setenv("MOE_EP_QUANT_DUAL_STAGES", "7")
    with pytest.raises(ValueError, match="MOE_EP_QUANT_DUAL_STAGES"):
        quant_plan.quant_plan(x, 16384, 2048, grouped, gnt, 32, 160, None)
    monkeypatch.delenv("MOE_EP_QUANT_DUAL_STAGES")
    # many groups: the table takes shared memory; 700 groups leave room for 2 CTAs per SM, not 3
    assert quant_plan.dual_plan(2560, 700, dev) == (2, 264, 16 * 701 + 2 * 32768 + 1024)
    # 2500 groups at 6 stages would exceed 227 KiB per CTA: the depth comes down to 5
    monkeypatch.setenv("MOE_EP_QUANT_DUAL_STAGES", "6")
    assert quant_plan.dual_plan(100000, 2500, dev) == (5, 132, 16 * 2501 + 5 * 32768 + 1024)
    # static shared memory (128 bytes) counts too: 2168 groups at 6 stages need 232336 dynamic bytes, under 227 KiB
    # (232448) but over 232448 - 128
    assert quant_plan.dual_plan(100000, 2168, dev)[0] == 5
    assert quant_plan.dual_plan(100000, 2167, dev)[0] == 6
    monkeypatch.delenv("MOE_EP_QUANT_DUAL_STAGES")
    assert quant_plan.dual_plan(2560, 20000, dev) is None  # not even 2 stages: the launcher takes mx_quant
    monkeypatch.setenv("MOE_EP_QUANT_DUAL", "smem")  # the shared-memory transpose of mx_quant
    assert quant_plan.quant_plan(x, 16384, 2048, grouped, gnt, 32, 160, None)[0].startswith("mx_quant<1,3,4")
    monkeypatch.setenv("MOE_EP_QUANT_DUAL", "reg")
    assert quant_plan.quant_plan(x.float(), 16384, 2048, grouped, gnt, 32, 160, None)[0].startswith("mx_quant<0,3,4")
