"""Tests of the CPU emulation of kernels/grouped_gemm.cu (the model itself is tests/gemm_emu.py).

Hand-worked bit conversions, the group scan, emulated kernels against the float64 reference on awkward group
sizes, and address-only runs on the benchmark's shapes (every load in bounds, every output row written once).
"""

# ruff: noqa: B023
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts import gemm as gemm_cuda
from moe_ep.experts.reference import fake_quantize_grouped_cols, grouped_mm_torch, grouped_wgrad_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_emu import (  # noqa: E402
    E4M3X2_HI,
    E4M3X2_LO,
    _check_loads,
    _u8,
    addresses_2d3d,
    addresses_wgrad,
    bf16_to_f,
    check_emulated_2d3d,
    cta_2d3d,
    cvt_words_1s,
    cvt_words_ps,
    e4m3x2_bits,
    e4m3x2_bits_placed,
    emu_2d3d,
    emu_wgrad,
    f_to_bf16,
    load_2d3d,
    mm64,
    pair_mults8,
    scan_groups,
    wgrad64,
)


def test_bit_conversion_exact_for_all_codes_and_scales():
    """e4m3 bytes x every scale byte through the bit trick + bf16 multiplies == exact value (when bf16 can)."""
    codes = [c for c in range(256) if c not in (0x7F, 0xFF)]
    vals = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).tolist()
    for s in list(range(0, 255, 3)) + [7, 126, 127, 128, 134, 135, 200, 254]:
        for j in range(0, len(codes), 4):
            cs = (codes[j : j + 4] + [0, 0, 0])[:4]
            w = cs[0] | cs[1] << 8 | cs[2] << 16 | cs[3] << 24
            got = cvt_words_1s([w, 0, 0, 0], s)[:2]
            got = [bf16_to_f((got[j // 2] >> (16 * (j % 2))) & 0xFFFF) for j in range(4)]
            for c, gv in zip(cs, got, strict=True):
                exact = vals[codes.index(c)] * 2.0 ** (s - 127) if c in codes else 0.0
                want = bf16_to_f(f_to_bf16(exact))  # exact unless below bf16's range (s small)
                assert gv == want or (np.isinf(want) and np.isinf(gv)), (hex(c), s, gv, want)
                if abs(exact) >= 2.0**-133 * 8 and abs(exact) < 2.0**127:
                    assert gv == exact, (hex(c), s, gv, exact)
    # NaN scale gives NaN
    got = cvt_words_1s([0x38383838, 0, 0, 0], 0xFF)[0]
    assert np.isnan(bf16_to_f(got & 0xFFFF))


def test_sign_extended_pair_form_equals_the_bit_placement():
    """kernels/grouped_gemm.cu's e4m3x2_bits (sign-extending prmt, shift, mask) gives, for every pair of bytes and in
    both word halves, the bits of the direct placement (sign to bit 15, (b & 0x7F) << 4), i.e. v * 2**-120."""
    from moe_ep import _cuda

    src = _cuda.read_source("grouped_gemm.cu")
    assert f"#define E4M3X2_LO 0x{E4M3X2_LO:04X}u" in src and f"#define E4M3X2_HI 0x{E4M3X2_HI:04X}u" in src
    assert "return (d << 4) & 0x87F087F0u;" in src
    for lo in range(256):
        for hi in range(256):
            pair = lo | hi << 8
            assert e4m3x2_bits(pair, E4M3X2_LO) == e4m3x2_bits_placed(pair, 0x1404), (hex(lo), hex(hi))
            assert e4m3x2_bits(pair << 16 | 0x5AA5, E4M3X2_HI) == e4m3x2_bits_placed(pair << 16 | 0x5AA5, 0x3424)


def test_pair_multipliers_match_scalar_path():
    rng = np.random.default_rng(0)
    for fast_only in (True, False):
        for _ in range(20):
            hi = 128 if fast_only else 255
            s = rng.integers(0, hi, size=8).tolist()
            sv = [s[0] | s[1] << 8 | s[2] << 16 | s[3] << 24, s[4] | s[5] << 8 | s[6] << 16 | s[7] << 24]
            m, fast = pair_mults8(sv)
            assert fast == all(v < 128 for v in s)
            w = [0x4C3A2B1C, 0xB5C4D3E2]
            got = cvt_words_ps(w, m, fast)
            bytes_ = [(w[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(8)]
            for e in range(8):
                h = (got[e // 2] >> (16 * (e % 2))) & 0xFFFF
                ref = cvt_words_1s([bytes_[e], 0, 0, 0], s[e])[0] & 0xFFFF
                assert h == ref, (e, s[e])


def test_scan_groups_matches_tile_offsets():
    sizes = [0, 130, 5, 0, 128, 1] + [3] * 40
    m = sum(sizes)
    offs = mxfp8.group_tile_offsets(torch.tensor(sizes)).tolist()
    for t in range(offs[-1] + 3):
        gi = scan_groups(sizes, len(sizes), m, 1, t)
        assert gi["total_rows"] == m and gi["total_tiles"] == offs[-1]
        if t >= offs[-1]:
            assert gi["g"] == -1
            continue
        g = gi["g"]
        assert offs[g] <= t < offs[g + 1] and gi["toff"] == offs[g] and gi["row0"] == sum(sizes[:g])
    for g in range(len(sizes)):
        gi = scan_groups(sizes, len(sizes), m, 0, g)
        assert gi["boff"] == sum((v + 31) // 32 for v in sizes[:g]) and gi["rows"] == sizes[g]


def test_scan_groups_negative_and_clamped_sizes():
    sizes = [-7, 100, 2**31 - 1, 5]  # negative counts as 0; the third group runs past M = 300: clamped
    gi = scan_groups(sizes, 4, 300, 0, 2)
    assert gi["row0"] == 100 and gi["rows"] == 200 and gi["boff"] == 4
    gi = scan_groups(sizes, 4, 300, 0, 3)
    assert gi["rows"] == 0  # starts past M
    gi = scan_groups(sizes, 4, 300, 1, 1)
    assert gi["g"] == 2 and gi["tile"] == 0 and gi["toff"] == 1
    assert scan_groups(sizes, 4, 300, 1, 0)["g"] == 1


CASES_2D3D = [  # (sizes, trailing rows outside every group, K, N, fp32 out, zero_rest)
    ([5, 0, 37, 130], 3, 96, 136, False, False),  # K % 64 == 32 (last k-step half empty), N % 128 != 0
    ([0, 0, 0], 3, 64, 16, True, True),  # only empty groups: zero fill only
    ([200], 3, 32, 8, True, False),
    ([1, 127, 0, 64], 130, 128, 264, True, True),  # 130 trailing rows: two zero-fill tiles
    ([3, 40], 3, 64, 24, False, True),
    ([0, 129, 0], 0, 64, 8, True, True),  # 2 tiles of one group, last one 1 row; rows end with the groups
]


@pytest.mark.parametrize("sizes,extra,k,n,out_f32,zero_rest", CASES_2D3D)
def test_emulated_2d3d_matches_reference(sizes, extra, k, n, out_f32, zero_rest):
    check_emulated_2d3d(emu_2d3d, sizes, extra, k, n, out_f32, zero_rest, seed=sum(sizes) + k + n)


def test_emulated_dgrad_transposed_weights():
    sizes, n, k = [40, 0, 90], 64, 48  # dgrad: dy [M, N] x W [G, N, K] -> [M, K]
    torch.manual_seed(1)
    g, m = len(sizes), sum(sizes)
    dy, w = torch.randn(m, n), torch.randn(g, n, k)
    dd, ds = gemm_cuda.rowwise_operand_ref(dy, sizes)
    wtd, wts = gemm_cuda.weight_t_operand_ref(w)
    out = np.full(m * k, np.nan)
    emu_2d3d(_u8(dd), _u8(ds), _u8(wtd), _u8(wts), sizes, out, g, m, k, n, True)
    ref = mm64(mxfp8.fake_quantize(dy, -1), mxfp8.fake_quantize(w, -2).transpose(1, 2), sizes)
    spec = grouped_mm_torch(mxfp8.fake_quantize(dy, -1), mxfp8.fake_quantize(w, -2).transpose(1, 2), sizes)
    # the fp64 helper agrees with the fp32 spec: fp32 sums of n <= 64 unit-scale products carry ~n * 2^-24 ~ 4e-6
    # absolute error; 1e-4 leaves room for cancellation
    torch.testing.assert_close(ref.float(), spec, rtol=1e-4, atol=1e-4)
    # the emulation sums in float64 and rounds once to fp32 (<= 2^-24 relative); twice that
    torch.testing.assert_close(torch.from_numpy(out).reshape(m, k), ref, rtol=2.0**-23, atol=1e-30)


def test_emulated_raw_codes_and_scales():
    """The GPU test_raw_codes scenario (random e4m3 codes incl. subnormals, scale bytes 100..154: both
    conversion paths) through the emulated fprop: the last row tile of the last group is partial."""
    gen = torch.Generator().manual_seed(7)
    sizes, k, n = [70, 0, 200], 128, 64
    g, m = len(sizes), sum(sizes)
    c = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.int32)
    c[:, :32] = (c[:, :32] & 0x87) | 1  # one block of e4m3 subnormals per row
    a = torch.where((c & 0x7F) == 0x7F, c ^ 1, c).to(torch.uint8).view(torch.float8_e4m3fn)
    c = torch.randint(0, 256, (g, n, k), generator=gen, dtype=torch.int32)
    b = torch.where((c & 0x7F) == 0x7F, c ^ 1, c).to(torch.uint8).view(torch.float8_e4m3fn)
    a_s = torch.randint(100, 155, (m, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    b_s = torch.randint(100, 155, (g, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    aq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(a, a_s, 1), torch.float32)
    bq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(b, b_s, 2), torch.float32)
    xs = mxfp8.to_blocked_grouped(a_s, torch.tensor(sizes), "m")
    out = np.full(m * n, np.nan)
    emu_2d3d(_u8(a), _u8(xs), _u8(b), _u8(mxfp8.to_blocked(b_s)), sizes, out, g, m, n, k, True, True)
    torch.testing.assert_close(torch.from_numpy(out).reshape(m, n), mm64(aq, bq, sizes), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("sizes,n,k", [([5, 0, 70, 33], 24, 136), ([0, 0], 8, 8), ([64], 128, 16)])
def test_emulated_wgrad_matches_reference(sizes, n, k):
    torch.manual_seed(len(sizes) + n)
    g, m = len(sizes), sum(sizes)
    dy = torch.randn(m, n) * torch.logspace(-2, 2, m).reshape(m, 1)
    x = torch.randn(m, k)
    ad, asc = gemm_cuda.colwise_operand_ref(dy, sizes)
    bd, bsc = gemm_cuda.colwise_operand_ref(x, sizes)
    out = np.full(g * n * k, np.nan)
    emu_wgrad(_u8(ad), _u8(asc), _u8(bd), _u8(bsc), sizes, out, g, m, n, k, True)
    ref = wgrad64(fake_quantize_grouped_cols(dy, sizes), fake_quantize_grouped_cols(x, sizes), sizes)
    torch.testing.assert_close(
        ref.float(),
        grouped_wgrad_torch(fake_quantize_grouped_cols(dy, sizes), fake_quantize_grouped_cols(x, sizes), sizes),
        rtol=1e-4,
        atol=1e-4,
    )  # the fp64 helper agrees with the fp32 spec (fp32 sums over a group's rows, as above)
    # float64 sums rounded once to fp32 (<= 2^-24 relative); twice that
    torch.testing.assert_close(torch.from_numpy(out).reshape(g, n, k), ref, rtol=2.0**-23, atol=1e-30)


def test_colwise_converter_matches_fake_quantize_grouped_cols():
    sizes = [0, 5, 33, 64, 0, 100]
    t = torch.randn(sum(sizes), 24) * 10
    d, s = gemm_cuda.colwise_operand_ref(t, sizes)
    assert s.shape == (gemm_cuda.colwise_scale_rows(sum(sizes), len(sizes)), 24)
    back = gemm_cuda.colwise_dequantize_ref(d, s, sizes)
    assert torch.equal(back, fake_quantize_grouped_cols(t, sizes))


def _bench_sizes(m, g, seed, align=16):
    """benchmarks/bench_gemm.py's uneven_sizes (random, some groups large, possibly empty, multiples of align)."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2 * (m // g) + 1, (g,), generator=gen).double()
    v = (v * (m / max(v.sum().item(), 1.0)) / align).floor().long() * align
    v[-1] += m - int(v.sum())
    return [int(x) for x in v]


ADDRESS_CASES = {  # name: (sizes, M, K, N): the benchmark's shapes (fprop K x N, dgrad N x K) and edge cases
    "dsv3_up": (_bench_sizes(32768, 32, sum(map(ord, "dsv3_up"))), 32768, 7168, 4096),
    "dsv3_down": (_bench_sizes(32768, 32, sum(map(ord, "dsv3_down"))), 32768, 2048, 7168),
    "small": (_bench_sizes(32768, 16, sum(map(ord, "small"))), 32768, 2048, 1536),
    "llama4": (_bench_sizes(16384, 4, sum(map(ord, "llama4"))), 16384, 5120, 8192),
    "gpu_large": ([1500, 0, 700, 2300, 1, 127, 2900, 622], 8192, 2048, 1024),  # tests/test_gemm_cuda.py
    "one_group_all_rows": ([0, 0, 8191, 0], 8191, 96, 200),
    "trailing_rows": ([129, 0, 1, 255, 0, 128], 1000, 64, 72),
    "g64_uneven": (_bench_sizes(5000, 64, 3), 5003, 192, 256),
    "clamped": ([-3, 700, 2**31 - 1, 9], 1000, 64, 136),  # negative = 0; sum > M: rows past M are never touched
}


@pytest.mark.parametrize("name", list(ADDRESS_CASES))
def test_addresses_in_bounds_and_rows_covered_once(name):
    sizes, m, k, n = ADDRESS_CASES[name]
    s = min(sum(max(v, 0) for v in sizes), m)
    for kk, nn in ((k, n), (n, k)):  # fprop [M, K] x [G, N, K]; dgrad [M, N] x [G, K, N]
        if kk % 32:
            continue
        for zero_rest in (False, True):
            cover = addresses_2d3d(sizes, m, nn, kk, zero_rest)
            assert (cover[:s] == 1).all(), f"group rows written {cover[:s].min()}..{cover[:s].max()} times"
            assert (cover[s:] == (1 if zero_rest else 0)).all(), "rows past the groups"
    addresses_wgrad(sizes, m, n, k)


def test_address_check_catches_the_double_column_offset():
    """Sanity check of the address-only run: the loader bug of the first device run (ck added to the row
    pointers and again to the column) reads past the end of x on its last rows (and wrong columns elsewhere)."""
    sizes, m, k, n = [100, 0, 156], 256, 64, 128
    sizes_of = {
        "a": m * k,
        "a_sc": mxfp8.grouped_blocked_size(m, 3, k // 32),
        "b": 3 * n * k,
        "b_sc": 3 * mxfp8.blocked_size(n, k // 32),
    }
    c = cta_2d3d(scan_groups(sizes, 3, m, 1, 2), [0], n, k)  # the last row tile of x (rows 228..255)
    _check_loads(load_2d3d(c, 0, k), sizes_of)
    bad = {
        name: (ok, buf, off + (c["ck"] if buf in ("a", "b") else 0), nb)
        for name, (ok, buf, off, nb) in load_2d3d(c, 0, k).items()
    }
    with pytest.raises(IndexError):
        _check_loads(bad, sizes_of)
