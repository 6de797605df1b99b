"""CPU tests of the grouped GEMM kernels' shared arithmetic (the models are in tests/gemm_emu.py).

Hand-worked bit conversions, the group scan, the fprop / dgrad kernel's tile schedule (every group row in exactly one
tile, the rows past the groups zero-filled exactly once) on the benchmark's shapes, its k permutation, and the CPU
path of the weight preparation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.reference import fake_quantize_grouped_cols, grouped_mm_torch, grouped_wgrad_torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_emu import (  # noqa: E402
    E4M3X2_HI,
    E4M3X2_LO,
    bf16_to_f,
    cvt_words_1s,
    e4m3x2_bits,
    e4m3x2_bits_placed,
    f_to_bf16,
    mm64,
    raster,
    scan_groups,
    wgrad64,
)

from moe_ep.experts.sm90 import operands  # noqa: E402
from tests import refs  # noqa: E402


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
    """The kernels' e4m3x2_bits (sign-extending prmt, shift, mask) gives, for every pair of bytes and in both word
    halves, the bits of the direct placement (sign to bit 15, (b & 0x7F) << 4), i.e. v * 2**-120."""
    for lo in range(256):
        for hi in range(256):
            pair = lo | hi << 8
            assert e4m3x2_bits(pair, E4M3X2_LO) == e4m3x2_bits_placed(pair, 0x1404), (hex(lo), hex(hi))
            assert e4m3x2_bits(pair << 16 | 0x5AA5, E4M3X2_HI) == e4m3x2_bits_placed(pair << 16 | 0x5AA5, 0x3424)


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


def test_colwise_converter_matches_fake_quantize_grouped_cols():
    sizes = [0, 5, 33, 64, 0, 100]
    t = torch.randn(sum(sizes), 24) * 10
    d, s = refs.colwise_operand_ref(t, sizes)
    assert s.shape == (operands.colwise_scale_rows(sum(sizes), len(sizes)), 24)
    back = refs.colwise_dequantize_ref(d, s, sizes)
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


def schedule_2d3d(sizes, m_total: int, n: int, zero_rest: bool) -> np.ndarray:
    """The fprop / dgrad kernel's tile schedule (gg_tile and the zero fill of kernels/experts/sm90/grouped_gemm.cu):
    every tile t < (ceil(M/128) + G) * ceil(N/256) in gm_raster's order, each tile's row tile found by the group scan.
    Checks that the order is a bijection and that a tile's rows lie inside its group and below M; returns, per output
    row and 256-column tile, how many tiles compute it (group rows) or zero it (rows past the groups, with
    zero_rest)."""
    g_count = len(sizes)
    n_tiles, m_tiles = -(-n // 256), -(-m_total // 128) + g_count
    scans = {m_t: scan_groups(sizes, g_count, m_total, 1, m_t) for m_t in range(m_tiles)}
    cover = np.zeros((m_total + 1, n_tiles), dtype=np.int64)  # +1: difference array
    order = [raster(t, m_tiles, n_tiles) for t in range(m_tiles * n_tiles)]
    assert sorted(order) == [(a, b) for a in range(m_tiles) for b in range(n_tiles)]
    for m_t, n_t in order:
        gi = scans[m_t]
        if gi["g"] < 0:  # a tile past the groups: zero_rows at columns n0 and n0 + 128 of rows r0 .. r0 + 127
            assert m_t >= gi["total_tiles"]
            r0 = gi["total_rows"] + (m_t - gi["total_tiles"]) * 128
            if zero_rest and r0 < m_total:
                cover[r0, n_t] += 1
                cover[min(r0 + 128, m_total), n_t] -= 1
            continue
        mrows = min(128, gi["rows"] - gi["tile"] * 128)
        if mrows <= 0:  # a tile of a group clamped at M: nothing to do
            continue
        r0 = gi["row0"] + gi["tile"] * 128
        assert gi["row0"] <= r0 and r0 + mrows <= gi["row0"] + gi["rows"] <= m_total
        cover[r0, n_t] += 1
        cover[r0 + mrows, n_t] -= 1
    return np.cumsum(cover, axis=0)[:m_total]


@pytest.mark.parametrize("name", list(ADDRESS_CASES))
def test_schedule_covers_every_row_once(name):
    """At the benchmark's shapes and edge cases: every group row is computed by exactly one tile per column tile,
    and the rows past the groups are zero-filled exactly once with zero_rest (never without): there are always
    enough tiles past the groups for that."""
    sizes, m, k, n = ADDRESS_CASES[name]
    s = min(sum(max(v, 0) for v in sizes), m)
    for nn in (n, k):  # fprop [M, K] x [G, N, K] -> [M, N]; dgrad -> [M, K]
        for zero_rest in (False, True):
            cover = schedule_2d3d(sizes, m, nn, zero_rest)
            assert (cover[:s] == 1).all(), f"group rows written {cover[:s].min()}..{cover[:s].max()} times"
            assert (cover[s:] == (1 if zero_rest else 0)).all(), "rows past the groups"


def test_raster_order_worked_example_and_bijection():
    assert [raster(t, 5, 3, 2) for t in range(15)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
        (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2),
        (4, 0), (4, 1), (4, 2),
    ]  # fmt: skip
    assert [raster(t, 2, 3, 1) for t in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for m_tiles in (1, 2, 7, 8, 9, 17, 40):
        for n_tiles in (1, 3, 16):
            for band in (1, 4, 8, 16):
                got = [raster(t, m_tiles, n_tiles, band) for t in range(m_tiles * n_tiles)]
                assert sorted(got) == [(a, b) for a in range(m_tiles) for b in range(n_tiles)]
                if band > 1:  # inside a full band the row tile varies fastest
                    assert got[: min(band, m_tiles)] == [(a, 0) for a in range(min(band, m_tiles))]


def a_fragment_columns() -> dict[int, int]:
    """The kernel's A fragments (a_frags of cvt16's words): logical k = 16 s + 8 h + 2 c + e of a 64-wide k-step
    (register 4 s + 2 h, element e, lane % 4 == c: the wgmma k16 slice s, k 8 h + 2 c + e) holds the row's physical
    column 16 c + 4 s + 2 h + e (cvt16 word 2 s + h of the thread's 16-byte chunk c)."""
    cols = {}
    for c in range(4):
        for s in range(4):
            for hh in range(2):
                for e in range(2):
                    cols[16 * s + 8 * hh + 2 * c + e] = 16 * c + 2 * (2 * s + hh) + e
    return cols


def test_k_permutation_matches_the_fragment_model():
    """k_permutation (the order of the prepared weight's k columns) is the A fragments' logical -> physical map, so
    A and B meet in the same k order: the MMA sums the same products as the plain product."""
    perm = operands.k_permutation().tolist()
    cols = a_fragment_columns()
    assert [cols[lg] for lg in range(64)] == perm
    assert sorted(perm) == list(range(64))


@pytest.mark.parametrize("k", [32, 96, 128])
def test_prepare_weight_bf16_is_the_permuted_exact_dequantization(k):
    """prepare_weight_bf16 == dequantize (exact in bf16) with each 64-block of k permuted, zero past K; the blocked
    scales are read back through the same offsets as to_blocked (N = 136: two 128-row scale tiles)."""
    torch.manual_seed(k)
    w = torch.randn(3, 136, k) * torch.logspace(-4, 4, k)[torch.randperm(k)]
    wq = mxfp8.quantize_torch(w, -1)
    prep = operands.prepare_weight_bf16(wq.data, mxfp8.to_blocked(wq.scale))
    kp = -(-k // 64) * 64
    assert prep.dtype == torch.bfloat16 and prep.shape == (3, 136, kp)
    deq = mxfp8.dequantize_torch(wq, torch.float32)
    assert torch.equal(deq.bfloat16().float(), deq)  # exact in bf16 (no value below 2^-133 here)
    full = torch.zeros(3, 136, kp)
    full[..., :k] = deq
    perm = operands.k_permutation()
    for j in range(kp // 64):
        for lg in range(64):
            assert torch.equal(prep[..., 64 * j + lg].float(), full[..., 64 * j + int(perm[lg])])


def test_float64_helpers_agree_with_the_spec():
    """mm64 / wgrad64 (the GPU tests' float64 references) against the fp32 specification."""
    torch.manual_seed(1)
    sizes, n, k = [40, 0, 90], 64, 48
    a, w = torch.randn(sum(sizes), k), torch.randn(len(sizes), n, k)
    # fp32 against float64 sums of <= 90 products of N(0, 1) values: the fp32 rounding error is about
    # sqrt(n) * 2^-24 * sum |terms| (~1e-5 here); 1e-4 leaves a factor 10, and a wrong row or group (an O(1) error)
    # still fails
    torch.testing.assert_close(mm64(a, w, sizes).float(), grouped_mm_torch(a, w, sizes), rtol=1e-4, atol=1e-4)
    dy, x = torch.randn(sum(sizes), n), torch.randn(sum(sizes), k)
    torch.testing.assert_close(wgrad64(dy, x, sizes).float(), grouped_wgrad_torch(dy, x, sizes), rtol=1e-4, atol=1e-4)
