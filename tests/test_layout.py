"""Scale layouts: cuBLAS 128x4 blocked, per-group blocked along M and along K."""

from __future__ import annotations

import pytest
import torch

from moe_ep.mxfp8 import (
    blocked_offset,
    blocked_size,
    group_tile_offsets,
    grouped_blocked_size,
    to_blocked,
    to_blocked_grouped,
)


def _distinct(m: int, c: int, seed: int = 0) -> torch.Tensor:
    # values 1..255 so that zero padding is distinguishable from data
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (m, c), generator=g, dtype=torch.uint8)


def test_reference_doc_offsets():
    assert blocked_offset(5, 0, 2) == 80
    assert blocked_offset(5, 1, 2) == 81
    assert blocked_offset(32, 0, 2) == 4
    assert blocked_offset(0, 4, 8) == 512
    s = _distinct(40, 8)
    b = to_blocked(s)
    assert b[80] == s[5, 0] and b[81] == s[5, 1] and b[4] == s[32, 0] and b[512] == s[0, 4]


@pytest.mark.parametrize("m,c", [(1, 1), (5, 2), (128, 4), (130, 7), (300, 56), (64, 224)])
def test_to_blocked_matches_formula_and_pads_with_zeros(m, c):
    s = _distinct(m, c)
    b = to_blocked(s)
    assert b.numel() == blocked_size(m, c)
    expect = torch.zeros_like(b)
    for r in range(m):
        for k in range(c):
            expect[blocked_offset(r, k, c)] = s[r, k]
    assert torch.equal(b, expect)


def test_to_blocked_batched_weights():
    s = torch.stack([_distinct(130, 6, seed=i) for i in range(3)])
    b = to_blocked(s)
    assert b.shape == (3, blocked_size(130, 6))
    for e in range(3):
        assert torch.equal(b[e], to_blocked(s[e]))


def test_group_tile_offsets_example():
    assert group_tile_offsets(torch.tensor([0, 130, 5])).tolist() == [0, 0, 2, 3]
    assert group_tile_offsets(torch.tensor([3, 4, 5]), 4).tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("sizes", [[0, 130, 5, 0], [300], [0, 0, 0, 7], [128, 128, 1, 127], [1] * 9])
def test_grouped_along_m(sizes):
    c = 7
    m = sum(sizes)
    s = _distinct(m, c)
    out = to_blocked_grouped(s, torch.tensor(sizes, dtype=torch.int32), "m")
    assert out.numel() == grouped_blocked_size(m, len(sizes), c, "m")
    offs = group_tile_offsets(torch.tensor(sizes)).tolist()
    assert offs[-1] <= -(-m // 128) + len(sizes)  # the static bound holds
    expect = torch.zeros_like(out)
    start = 0
    for g, n in enumerate(sizes):
        for r in range(n):  # group rows start on a fresh 128-row tile; data rows are not padded
            for k in range(c):
                expect[blocked_offset(offs[g] * 128 + r, k, c)] = s[start + r, k]
        start += n
    assert torch.equal(out, expect)


@pytest.mark.parametrize("sizes", [[0, 5, 3], [8], [1, 0, 4, 9]])
def test_grouped_along_k(sizes):
    rows = 130
    ck = sum(sizes)
    s = _distinct(rows, ck)
    out = to_blocked_grouped(s, torch.tensor(sizes), "k")
    assert out.numel() == grouped_blocked_size(ck, len(sizes), rows, "k")
    offs = group_tile_offsets(torch.tensor(sizes), 4).tolist()
    row_tiles = -(-rows // 128)
    start = 0
    for g, n in enumerate(sizes):
        if n:  # each group is an independent standard blocked matrix
            base = row_tiles * offs[g] * 512
            blk = to_blocked(s[:, start : start + n])
            assert torch.equal(out[base : base + blk.numel()], blk)
        start += n
    # nothing else was written: total non-zero bytes equal the data bytes
    assert int((out != 0).sum()) == rows * ck


def test_grouped_bad_sizes():
    with pytest.raises(ValueError, match="sum to"):
        to_blocked_grouped(_distinct(10, 2), torch.tensor([3, 4]), "m")
    with pytest.raises(ValueError, match="groups_along"):
        to_blocked_grouped(_distinct(10, 2), torch.tensor([10]), "x")
    with pytest.raises(TypeError):
        to_blocked(torch.zeros(4, 4))
