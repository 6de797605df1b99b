"""MXFP8 reference: hand-worked cases and an independent scalar oracle (numpy fp32 + exhaustive E4M3 table)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_ep.mxfp8 import MXFP8Tensor, dequantize, quantize
from moe_ep.mxfp8 import reference as mxfp8_reference

# ---------------------------------------------------------------------------------------------------------
# Independent oracle: every finite E4M3 value, nearest with ties to the even code, saturating at 448.
# ---------------------------------------------------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


_POS = [(c, _e4m3_value(c)) for c in range(0x7F)]  # 0x00..0x7E, ascending values, 0x7F is NaN


def oracle_e4m3(v: float) -> int:
    mag = min(abs(v), 448.0)
    best = min(_POS, key=lambda cv: (abs(cv[1] - mag), cv[0] & 1))  # ties: even mantissa code
    code = best[0]
    return code | (0x80 if math.copysign(1.0, v) < 0 else 0)


def oracle_block(vals: np.ndarray) -> tuple[int, list[int]]:
    """vals: 32 float32 -> (scale byte, 32 element bytes) following docs/design.md ("MXFP8 format") literally."""
    if not np.all(np.isfinite(vals)):
        return 0xFF, [0x7F] * 32
    amax = np.float32(np.max(np.abs(vals)))
    d = np.float32(amax / np.float32(448.0))
    if d == 0:
        e = -127
    else:
        m, ex = math.frexp(float(d))  # d = m * 2**ex, m in [0.5, 1)
        e = ex - 1 if m == 0.5 else ex
    e = max(-127, min(127, e))
    q = [oracle_e4m3(float(np.float32(v) * np.float32(2.0**-e))) for v in vals]
    return e + 127, q


def _bytes(t: MXFP8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.data.view(torch.uint8), t.scale


def _check_against_oracle(x: torch.Tensor) -> None:
    t = quantize(x)
    data, scale = _bytes(t)
    xf = x.to(torch.float32).numpy().reshape(-1, 32)
    for i, blk in enumerate(xf):
        s, q = oracle_block(blk)
        assert int(scale.reshape(-1)[i]) == s, (i, blk)
        assert data.reshape(-1, 32)[i].tolist() == q, (i, blk)


# ---------------------------------------------------------------------------------------------------------


def test_oracle_table_sanity():
    assert _e4m3_value(0x7E) == 448.0 and _e4m3_value(0x01) == 2.0**-9 and _e4m3_value(0x38) == 1.0


def test_rceil_exact_power_of_two_and_one_ulp_above():
    for k in (-20, -3, 0, 5, 30):
        amax = np.float32(448.0 * 2.0**k)
        x = torch.zeros(1, 32)
        x[0, 0] = float(amax)
        t = quantize(x)
        assert int(t.scale[0, 0]) == 127 + k  # d == 2**k exactly -> E = k
        assert int(t.data.view(torch.uint8)[0, 0]) == 0x7E  # 448
        x[0, 0] = float(np.nextafter(np.float32(2.0**k), np.float32(np.inf)) * np.float32(448.0))
        _check_against_oracle(x)
        t = quantize(x)
        assert int(t.scale[0, 0]) == 127 + k + 1  # one ulp above -> next power of two
        assert int(t.data.view(torch.uint8)[0, 0]) == 0x76  # 224


def test_zero_block():
    t = quantize(torch.zeros(2, 64))
    assert torch.equal(t.scale, torch.zeros(2, 2, dtype=torch.uint8))
    assert torch.equal(t.data.view(torch.uint8), torch.zeros(2, 64, dtype=torch.uint8))


def test_signed_zero_and_ties_to_even():
    x = torch.zeros(1, 32)
    x[0, :7] = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -(2.0**-11), -1.0625])
    data = quantize(x).data.view(torch.uint8)[0, :7].tolist()
    # 1.0625: tie between 1.0 (0x38) and 1.125 (0x39) -> even 0x38; 1.1875 -> 1.25 (0x3A);
    # 2^-10: tie between 0 and 2^-9 -> 0; 3*2^-10: tie between 2^-9 (0x01) and 2^-8 (0x02) -> 0x02;
    # -2^-11 underflows to -0 (0x80)
    assert data == [0x7E, 0x38, 0x3A, 0x00, 0x02, 0x80, 0xB8]


def test_near_max_never_overflows_to_nan():
    # values within a few ulps of 448 * 2**k: RCEIL keeps |v / 2**E| <= 448 (the cast saturates as a safety
    # net); no finite input may produce the NaN code 0x7F/0xFF
    base = np.float32(448.0)
    vals = [base]
    for _ in range(4):
        vals.append(np.nextafter(vals[-1], np.float32(np.inf)))
    vals += [np.nextafter(base, np.float32(0)), np.float32(463.9), np.float32(479.0), np.float32(3.3e38)]
    x = torch.tensor([float(v) for v in vals] + [0.0] * (32 - len(vals)), dtype=torch.float32)[None]
    x = torch.cat([x, -x])
    _check_against_oracle(x)
    codes = quantize(x).data.view(torch.uint8)
    assert not ((codes & 0x7F) == 0x7F).any()


def test_fp32_subnormals_and_extremes():
    x = torch.zeros(4, 32)
    x[0] = torch.tensor(1e-40).expand(32) * torch.arange(32)  # subnormal d
    x[1, 0] = 1.1754942e-38  # smallest normal
    x[2] = torch.finfo(torch.float32).max / 2 * torch.linspace(-1, 1, 32)
    x[3, 5] = 2.0**-149  # smallest subnormal alone
    _check_against_oracle(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_blocks(bad):
    x = torch.randn(2, 96)
    x[1, 40] = bad
    t = quantize(x)
    assert t.scale[1].tolist()[1] == 0xFF and t.data.view(torch.uint8)[1, 32:64].eq(0x7F).all()
    # the other blocks are untouched by the bad one
    ref = quantize(torch.cat([x[:1], x[1:, :32].repeat(1, 3)]))
    assert int(t.scale[1, 0]) == int(ref.scale[1, 0])
    assert torch.isnan(dequantize(t)[1, 32:64]).all() and torch.isfinite(dequantize(t)[1, :32]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_blocks_match_oracle(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g) * torch.exp2(torch.randint(-40, 40, (6, 1), generator=g).float())
    _check_against_oracle(x.to(dtype))


def test_round_trip_exact_for_representable_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 0x7F, (8, 64), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, (8, 64), generator=g, dtype=torch.uint8) << 7
    scale = torch.randint(90, 160, (8, 2), generator=g, dtype=torch.uint8)
    v = dequantize(MXFP8Tensor(codes.view(torch.float8_e4m3fn), scale, 1), torch.float32)
    assert torch.equal(dequantize(quantize(v), torch.float32), v)


def test_error_bound_per_block():
    g = torch.Generator().manual_seed(2)
    mag = torch.exp2(torch.randint(-20, 20, (64, 4), generator=g).float()).repeat_interleave(32, 1)
    x = torch.randn(64, 128, generator=g) * mag
    t = quantize(x)
    err = (dequantize(t, torch.float32) - x).abs()
    pow2e = torch.exp2(t.scale.float() - 127).repeat_interleave(32, 1)
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normals; 2^-10 * 2^E in the subnormal range
    bound = torch.maximum(x.abs() * 2.0**-4, pow2e * 2.0**-10)
    assert (err <= bound).all()


def test_axis0_is_transpose_of_rowwise():
    x = torch.randn(64, 48)
    t0, t1 = quantize(x, axis=0), quantize(x.t().contiguous(), axis=-1)
    assert t0.scale.shape == (2, 48)
    assert torch.equal(t0.data.view(torch.uint8), t1.data.view(torch.uint8).t())
    assert torch.equal(t0.scale, t1.scale.t())
    assert torch.equal(dequantize(t0), dequantize(t1).t())


def test_3d_weights_per_expert():
    w = torch.randn(3, 16, 64)
    t = quantize(w)
    assert t.scale.shape == (3, 16, 2)
    for e in range(3):
        assert torch.equal(t.data[e].view(torch.uint8), quantize(w[e]).data.view(torch.uint8))


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(40, 64), axis=0)
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError):
        dequantize(quantize(torch.randn(2, 32)), torch.int8)


def test_exp2_helpers_exact():
    e = torch.arange(-127, 128, dtype=torch.int32)
    assert torch.equal(mxfp8_reference._exp2_int(e).double(), torch.exp2(e.double()))
    d = torch.tensor([0.0, 1.0, 1.0000001, 0.75, 2.0**-127, 2.0**-126 * 0.75, 2.0**-149], dtype=torch.float32)
    assert mxfp8_reference._ceil_log2_pow(d).tolist() == [-127, 0, 1, 0, -127, -126, -127]


def test_from_blocked_grouped_hand_worked_and_roundtrip():
    """from_blocked_grouped (device group sizes, no host read) inverts to_blocked_grouped along m; rows past the
    groups come back 0. Hand-worked: sizes [2, 1], one scale column -> bytes 0 and 16 (rows 0, 1 of tile 0: row r
    of a tile sits at (r % 32) * 16 + (r // 32) * 4) and byte 512 (group 1 starts on a fresh tile)."""
    from moe_ep.mxfp8.format import from_blocked_grouped, grouped_blocked_size, to_blocked_grouped

    blocked = torch.zeros(grouped_blocked_size(4, 2, 1, "m"), dtype=torch.uint8)
    blocked[0], blocked[16], blocked[512] = 7, 8, 9
    got = from_blocked_grouped(blocked, torch.tensor([2, 1], dtype=torch.int32), 4, 1)
    assert got.flatten().tolist() == [7, 8, 9, 0]
    gen = torch.Generator().manual_seed(3)
    for sizes, cols in (([0, 130, 5], 7), ([300], 9), ([5, 0, 129, 0, 1], 4), ([0, 0], 3)):
        m = sum(sizes)
        scale = torch.randint(0, 256, (m, cols), generator=gen, dtype=torch.int32).to(torch.uint8)
        gs = torch.tensor(sizes, dtype=torch.int32)
        b = to_blocked_grouped(scale, gs, "m")
        rows = m + 50  # a buffer with room past the groups, as the expanded buffers have
        padded = torch.zeros(grouped_blocked_size(rows, len(sizes), cols, "m"), dtype=torch.uint8)
        padded[: b.numel()] = b
        out = from_blocked_grouped(padded, gs, rows, cols)
        assert torch.equal(out[:m], scale) and not out[m:].any()
