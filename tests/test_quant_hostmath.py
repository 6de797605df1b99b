"""CPU check of the kernels' per-block MXFP8 math (kernels/common/common.cuh compiled as host C++) against the
reference.

The same ``__host__ __device__`` functions run inside kernels/mxfp8/quantize.cu; here they are compiled with g++ (or
c++) and fed blocks on which the reference (moe_ep.mxfp8.quantize_torch) is the specification. Skips when no
C++ compiler is found. The device's e4m3 conversion is the hardware ``cvt.rn.satfinite.e4m3x2.f32``; the host
build uses the software conversion (``mx_f32_to_e4m3_soft``), which the CPU emulator of the kernels
(tests/quant_emu.py) runs too. The launch plans of moe_ep.mxfp8.plan are checked here as well (hand-worked).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep.mxfp8 import E4M3_MAX, quantize_torch
from moe_ep.mxfp8 import plan as quant_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_emu import CXX, INCLUDES, emulator, pipe_cases  # noqa: E402

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
    subprocess.run([CXX, "-O2", "-std=c++17", "-x", "c++", *INCLUDES, str(src), "-o", str(exe)], check=True)
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
    """kernels/mxfp8/quant_dual.cuh's bf16 shortcut (mx_bf16_block_t - 135) == mx_block_exp == the torch specification's
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


def test_emulator_builds(tmp_path_factory):
    """The emulator compiles and reports the kernel's own pipe (kernels/mxfp8/quantize.cu QuantCfg): 16-bit row-only
    plain scales 5, the fused blocked mode of mx_quant_batch and column-only on request 4, fp32 and column-only 0. (The
    session's one build, shared with test_quant_cuda.py / test_quant_dual_cuda.py: the same work directory.)"""
    so = emulator(tmp_path_factory.getbasetemp() / "mxemu")
    assert so is not None
    got = [so.emu_pipe(*c) for c in ((1, 1, 0, -1), (1, 2, 2, -1), (2, 0, 3, 4), (1, 0, 3, -1), (0, 1, 0, -1))]
    assert got == [5, 4, 4, 0, 0]


def test_kernel_pipe_matches_host(tmp_path_factory):
    """quant_plan.effective_pipe (grid, shared memory and CTA size are sized from it) == the pipe
    kernels/mxfp8/quantize.cu's QuantCfg compiles, for every mx_quant / mx_quant_batch instantiation the launchers
    can name."""
    so = emulator(tmp_path_factory.getbasetemp() / "mxemu")
    bad = []
    for i, r, c, q in pipe_cases():
        es = 4 if i in (0, 3, 4, 5) else 2  # fp32 and the SwiGLU codes stage fp32 (quant_plan.quant_plan)
        want, got = quant_plan.effective_pipe(es, r, c, q), so.emu_pipe(i, r, c, q)
        if want != got:
            bad.append(((i, r, c, q), want, got))
    assert not bad, f"(IN, RS, CS, pipe), host, kernel: {bad}"


def test_quant_plan(monkeypatch):
    """mx_quant's plans on a 132-SM GPU (hand-worked): kernel, grid (one CTA per tile), shared memory, row and
    column tiles, CTA size; the pipe-4 choice of column-only inputs; mx_quant_batch's grid."""
    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    plain, nt = quant_plan.RS["plain"], quant_plan.CS["nt"]
    x, fixed = torch.empty(0, dtype=torch.bfloat16), quant_plan.SMEM_FIXED
    stage5, stage4 = 64 * 256 + 128, 128 * 256 + 128  # one 64- or 128-row bf16 stage on 128 bytes
    plan = quant_plan.quant_plan
    # [300, 544] row-wise plain: pipe 5, ceil(300 / 64) = 5 row tiles x 5 column tiles, 128 threads
    assert plan(x, 300, 544, plain, 0, 0, None, None) == ("mx_quant<1,1,0>", 25, fixed + stage5, 5, 5, 128)
    assert plan(x.half(), 300, 544, plain, 0, 0, None, None)[0] == "mx_quant<2,1,0>"
    # fp32: pipe 0, 128-row tiles of 256 threads, no stage
    assert plan(x.float(), 300, 544, plain, 0, 0, None, None) == ("mx_quant<0,1,0>", 15, fixed, 3, 5, 256)
    # column-only: pipe 0 (the tile staged in shared memory) below 24 tiles per SM (3168), pipe 4 from there
    assert plan(x, 16384, 2048, 0, nt, 0, None, None) == ("mx_quant<1,0,3>", 2048, 32768 + fixed, 128, 16, 256)
    assert plan(x, 131072, 2048, 0, nt, 0, None, None) == ("mx_quant<1,0,3,4>", 16384, fixed + stage4, 1024, 16, 256)
    assert plan(x, 128 * 198, 2048, 0, nt, 0, None, None)[:2] == ("mx_quant<1,0,3,4>", 3168)  # exactly 24 per SM
    assert plan(x, 128 * 198 - 32, 2048, 0, nt, 0, None, None)[:2] == ("mx_quant<1,0,3,4>", 3168)
    assert plan(x, 128 * 197, 2048, 0, nt, 0, None, None)[:2] == ("mx_quant<1,0,3>", 3152)
    assert plan(x.float(), 131072, 2048, 0, nt, 0, None, None)[:3] == ("mx_quant<0,0,3>", 16384, 65536 + fixed)
    assert plan(x, 0, 2048, 0, nt, 0, None, None) is None
    # the weights: the fused blocked mode over 4 experts of [8192, 5120], one CTA per tile (pipe 4; fp32: 0)
    w = torch.empty(0, dtype=torch.bfloat16)
    assert quant_plan.batch_plan(w, 4, 8192, 5120) == ("mx_quant_batch<1>", (2560, 4), fixed + stage4, 64, 40)
    assert quant_plan.batch_plan(w.float(), 4, 8192, 5120)[:3] == ("mx_quant_batch<0>", (2560, 4), 65536 + fixed)
    assert quant_plan.batch_plan(w, 0, 8192, 5120) is None
    with pytest.raises(ValueError, match="grid.y"):
        quant_plan.batch_plan(w, 65536, 32, 32)


def test_dual_kernel_plan(monkeypatch):
    """Which grouped-dual kernel a bf16 input gets, its depth, grid and shared memory (hand-worked, 132 SMs)."""
    monkeypatch.setattr(quant_plan, "sm_count", lambda d: 132)
    dev = torch.device("cpu")
    grouped, gprep = quant_plan.RS["grouped"], quant_plan.CS["grouped_prep"]
    # depth: 4 stages from 32 tiles per SM (4224 on 132 SMs), else 2
    assert [quant_plan.dual_stages(t, dev) for t in (16128, 4224, 4223, 2560)] == [4, 4, 2, 2]
    # [32768, 7168] in 32 groups: (256 + 32) row tiles x 56 column tiles; 4 stages, one CTA per SM;
    # shared memory = 4 stages of 32 KB + two 512-byte row-scale tiles + group table 16 * 33
    x = torch.empty(32768, 7168, dtype=torch.bfloat16)
    plan = quant_plan.quant_plan(x, 32768, 7168, grouped, gprep, 32, 288, None)
    assert plan == ("mx_quant_dual<1,5,4>", 132, 528 + 4 * 32768 + 1024, 288, 56, 256)
    # [16384, 2048]: 160 x 16 = 2560 tiles -> 2 stages, 3 CTAs per SM
    x = torch.empty(16384, 2048, dtype=torch.bfloat16)
    assert quant_plan.quant_plan(x, 16384, 2048, grouped, gprep, 32, 160, None)[:3] == (
        "mx_quant_dual<1,5,2>",
        396,
        528 + 2 * 32768 + 1024,
    )
    # many groups: the table takes shared memory; 700 groups leave room for 2 CTAs per SM, not 3
    assert quant_plan.dual_plan(2560, 700, dev) == (2, 264, 16 * 701 + 2 * 32768 + 1024)
    # 7000 groups: 4 stages would exceed 227 KiB per CTA (112016 + 131072 + 1024), 3 fit: one CTA per SM
    assert quant_plan.dual_plan(100000, 7000, dev) == (3, 132, 16 * 7001 + 3 * 32768 + 1024)
    # static shared memory (128 bytes) counts too: 6264 groups at 4 stages need 232336 dynamic bytes, under 227 KiB
    # (232448) but over 232448 - 128; 6263 groups need exactly 232320
    assert quant_plan.dual_plan(100000, 6263, dev)[0] == 4
    assert quant_plan.dual_plan(100000, 6264, dev)[0] == 3
    # not even 2 stages next to the table: no kernel can take it
    assert quant_plan.dual_plan(2560, 20000, dev) is None
    with pytest.raises(ValueError, match="20000 groups"):
        quant_plan.quant_plan(x, 16384, 2048, grouped, gprep, 20000, 20128, None)
    # fp32 x: no grouped-dual kernel (the MoE path quantizes bf16 activations)
    with pytest.raises(ValueError, match="grouped dual takes"):
        quant_plan.quant_plan(x.float(), 16384, 2048, grouped, gprep, 32, 160, None)
