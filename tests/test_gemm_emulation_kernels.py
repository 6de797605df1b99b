"""CPU models of the index logic of ``kernels/experts/sm90/grouped_gemm.cu``,
``kernels/experts/sm90/grouped_gemm_wgrad.cu``, ``kernels/experts/sm90/gemm_wgmma.cuh`` (the epilogues) and
``kernels/experts/sm90/weight_prep.cu``.

* ``quad_transpose4`` (kernels/experts/sm90/gemm_common.cuh): the two xor-shuffle rounds, lane by lane.
* ``epilogue_bf16`` / ``epilogue_bf16_tma``: which (row, column) pair every store of a warp carries.
* ``mx_prepare_weight_bf16``: the whole kernel (thread -> chunk mapping, blocked scale offset, the exact conversion
  of ``gemm_emu.cvt_words_1s``, the quad transpose, the store offsets) against ``prepare_weight_bf16_torch``,
  byte for byte, on awkward weights (K % 64 == 32, N not a multiple of 128, scales 0 / 254 / 0xFF, e4m3
  subnormals).
* the launchers' shared-memory sizes and the choice of the fprop / dgrad build (``ring_stages``).
The GPU tests (tests/test_gemm_cuda.py, tests/test_gemm_prep_cuda.py) run the real kernels against the same
references.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.sm90 import gemm as gemm_cuda
from moe_ep.experts.sm90 import operands  # noqa: E402
from tests import refs  # noqa: E402
from tests.gemm_emu import cvt_words_1s


def shfl_xor(vals: list, mask: int) -> list:
    """__shfl_xor_sync over one quad: lane c receives lane c ^ mask's value."""
    return [vals[c ^ mask] for c in range(4)]


def quad_transpose4(w: list[list]) -> list[list]:
    """Model of quad_transpose4: w[c] = the 4 words of lane c (any values); returns the lanes' words after it."""
    w = [list(x) for x in w]
    odd = [bool(c & 1) for c in range(4)]
    hi = [bool(c & 2) for c in range(4)]
    s0 = [w[c][0] if odd[c] else w[c][1] for c in range(4)]
    s1 = [w[c][2] if odd[c] else w[c][3] for c in range(4)]
    r0, r1 = shfl_xor(s0, 1), shfl_xor(s1, 1)
    for c in range(4):
        if odd[c]:
            w[c][0], w[c][2] = r0[c], r1[c]
        else:
            w[c][1], w[c][3] = r0[c], r1[c]
    s0 = [w[c][0] if hi[c] else w[c][2] for c in range(4)]
    s1 = [w[c][1] if hi[c] else w[c][3] for c in range(4)]
    r0, r1 = shfl_xor(s0, 2), shfl_xor(s1, 2)
    for c in range(4):
        if hi[c]:
            w[c][0], w[c][1] = r0[c], r1[c]
        else:
            w[c][2], w[c][3] = r0[c], r1[c]
    return w


def test_quad_transpose4_transposes():
    m = [[(c, i) for i in range(4)] for c in range(4)]
    t = quad_transpose4(m)
    for c in range(4):
        for i in range(4):
            assert t[c][i] == (i, c), (c, i, t[c][i])


def test_epilogue_bf16_stores_cover_each_tile_element_once():
    """Accumulator 4 j + 2 h + e of lane (q, l) is tile row 16 q + l / 4 + 8 h, column 8 j + 2 (l % 4) + e (the
    wgmma m64n256 layout); after the epilogue's per-(h, m) quad transpose, lane c's 16-byte store at column
    32 m + 8 c holds columns 32 m + 8 c .. + 7 of its row in order."""
    seen = np.zeros((64, 256), dtype=np.int64)
    for q in range(4):
        for quad in range(8):
            for h in range(2):
                for m in range(8):
                    # word i of lane c: the bf16 pair of accumulators 4 (4 m + i) + 2 h, + 1
                    lanes = []
                    for c in range(4):
                        row = 16 * q + quad + 8 * h
                        lanes.append([(row, 8 * (4 * m + i) + 2 * c) for i in range(4)])
                    out = quad_transpose4(lanes)
                    for c in range(4):
                        row, col = 16 * q + quad + 8 * h, 32 * m + 8 * c
                        for i, (r, cc) in enumerate(out[c]):
                            assert (r, cc) == (row, col + 2 * i)
                            seen[r, cc : cc + 2] += 1
    assert (seen == 1).all()


def emulate_prepare_weight(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """mx_prepare_weight_bf16, thread by thread (quads of lanes = the 4 chunks of one (row, 64-block))."""
    g_count, n, k = w.shape
    nblk, tpr = -(-k // 64), -(-(k // 32) // 4)
    bsz = mxfp8.blocked_size(n, k // 32)
    wb = w.contiguous().view(torch.uint8).reshape(-1).numpy()
    ws = w_scale.contiguous().reshape(-1).numpy()
    out = np.full(g_count * n * nblk * 64, 0xDEAD, dtype=np.uint16)  # poison: every element must be written
    total = g_count * n * nblk * 4
    assert total % 4 == 0
    for quad0 in range(0, total, 4):
        lanes = []
        for c in range(4):
            idx = quad0 + c
            rb = idx >> 2
            row, b = divmod(rb, nblk)
            k0 = b * 64 + 16 * c
            o = [0] * 8
            if k0 < k:
                g, nn = divmod(row, n)
                kb = k0 >> 5
                raw = [int(v) for v in wb[row * k + k0 : row * k + k0 + 16].view(np.uint32)]
                off = ((nn >> 7) * tpr + (kb >> 2)) * 512 + (nn & 31) * 16 + ((nn >> 5) & 3) * 4 + (kb & 3)
                s = int(ws[g * bsz + off])
                o = cvt_words_1s(raw, s)
            lanes.append(o)
        lo = quad_transpose4([x[:4] for x in lanes])
        hi = quad_transpose4([x[4:] for x in lanes])
        row, b = divmod(quad0 >> 2, nblk)
        base = row * nblk * 64 + b * 64
        for c in range(4):
            for half, words in ((0, lo[c]), (1, hi[c])):
                off = base + 8 * (4 * half + c)  # uint4 index 4 half + c = 8 bf16
                for i, wd in enumerate(words):
                    out[off + 2 * i] = wd & 0xFFFF
                    out[off + 2 * i + 1] = wd >> 16
    return torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16).reshape(g_count, n, nblk * 64)


def assert_same_bf16(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal bf16, except that NaN payloads may differ (torch's fp32 NaN product keeps its sign and payload,
    the hardware's bf16 multiply returns a canonical NaN): NaN exactly where the reference has NaN."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def _awkward_weight(g: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (g, n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[codes == 0x7F] = 0x3C  # e4m3fn NaN codes replaced (the data of a quantized weight is never NaN)
    codes[codes == 0xFF] = 0xBC
    codes[0, 0, :8] = torch.tensor([1, 2, 7, 0x81, 0x87, 0, 0x80, 8], dtype=torch.uint8)  # subnormals, +-0
    data = codes.view(torch.float8_e4m3fn)
    scale = torch.randint(100, 160, (g, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale.view(-1)[:4] = torch.tensor([0, 254, 0xFF, 127], dtype=torch.uint8)
    scale[-1, -1, -1] = 1
    return data, mxfp8.to_blocked(scale)


@pytest.mark.parametrize(("g", "n", "k"), [(2, 8, 32), (1, 136, 96), (2, 16, 160)])
def test_emulated_weight_prep_matches_reference_bytes(g, n, k):
    w, ws = _awkward_weight(g, n, k, seed=k)
    ref = operands.prepare_weight_bf16_torch(w, ws)
    emu = emulate_prepare_weight(w, ws)
    assert torch.isnan(ref).sum() == 32 and (ref == 0).any()  # the 0xFF block is there, and the padding / zeros
    assert_same_bf16(emu, ref)


def test_weight_prep_rejects_bad_inputs():
    w, ws = _awkward_weight(1, 8, 64, seed=0)
    with pytest.raises(TypeError, match="w must be"):
        operands.prepare_weight_bf16(w.view(torch.uint8), ws)
    with pytest.raises(ValueError, match="K % 32"):
        operands.prepare_weight_bf16(w[..., :48], ws)
    with pytest.raises(ValueError, match="w_scale must hold"):
        operands.prepare_weight_bf16(w, ws[..., :-1])


def test_launcher_shared_memory_sizes():
    """The launchers' dynamic shared memory per CTA: ring stages of [B bf16 256 x 128 B | A raw 128 x 64 B] (fprop /
    dgrad) or [A 2 x 64 x 128 B | B 4 x 64 x 128 B] (wgrad), the output staging, one 512-byte A scale tile per stage
    (fprop / dgrad), two 8-byte mbarriers per stage and one 48-byte GroupInfo per warp (12 warps, the 9 first used);
    all within the 232448 bytes an H100/H200 CTA may have. (The launchers read these sizes from the kernels' sources
    through _cuda.kernel_constant; this recomputes them from the layout.)"""
    stage = 256 * 128 + 128 * 64
    assert stage % 1024 == 0  # every stage 1024-aligned (the 128-byte swizzle)
    tile = 2 * 4 * 64 * 128  # bf16 output staging: 2 warpgroups x 4 boxes of 64 rows x 128 B
    assert gemm_cuda._GEMM_SMEM_BYTES == 4 * stage + tile + 512 * 4 + 16 * 4 + 9 * 48 <= 232448
    assert gemm_cuda._DEEP_SMEM_BYTES == 5 * stage + 0 + 512 * 5 + 16 * 5 + 9 * 48 <= 232448  # register epilogue
    assert gemm_cuda._DEEP_OPTIONS == ("-DGG_STAGES=5", "-DGG_REG_EPI=1")
    wstage = 2 * 64 * 128 + 4 * 64 * 128
    assert gemm_cuda._WGRAD_SMEM_BYTES == 4 * wstage + 2 * 16384 + 16 * 4 + 9 * 48 <= 232448
    assert gemm_cuda._THREADS == 384


def test_ring_stages_rule():
    """The 5-stage build (register epilogue) from K = 3072 on, the 4-stage one (TMA-store epilogue) below."""
    assert [gemm_cuda.ring_stages(k) for k in (32, 2048, 3040, 3072, 3104, 7168)] == [4, 4, 4, 5, 5, 5]


# ------------------------------------------------------------------------- wgrad: prepared operands, k-steps
def test_prepare_colwise_bf16_worked_example():
    """Docstring example of prepare_colwise_bf16_torch (the reference of the quantizer's prepared wgrad operand):
    sizes [40, 0, 8] -> group 0 at rows 0-39 (40-63 zero), group 2 at rows 64-71 (72-127 zero); each row is the
    exact dequantization of its source row."""
    sizes = [40, 0, 8]
    x = torch.randn(48, 16)
    data, scale = refs.colwise_operand_ref(x, sizes)
    out = refs.prepare_colwise_bf16_torch(data, scale, torch.tensor(sizes, dtype=torch.int32))
    deq = refs.colwise_dequantize_ref(data, scale, sizes)
    assert out.shape == (mxfp8.colwise_prep_rows(48, 3), 16) == (64 * (1 + 3), 16)
    assert torch.equal(out[:40].float(), deq[:40]) and torch.equal(out[64:72].float(), deq[40:48])
    assert (out[40:64] == 0).all() and (out[72:] == 0).all()


@pytest.mark.parametrize("rows", [0, 1, 63, 64, 65, 128, 130])
def test_wgrad_ksteps_match_the_prepared_layout(rows):
    """The wgrad kernel reduces a group over ceil(rows / 64) full k-steps of 64 prepared rows (4 k16 slices each)
    starting at row 64 poff_g; the prepared layout (prepare_colwise_bf16_torch) must put exactly those rows there:
    the group's rows, then zeros up to the next group, which starts right after the last k-step."""
    ksteps = (rows + 63) // 64
    sizes = [rows, 5]
    x = torch.randn(rows + 5, 8) + 3.0  # no zeros in the data: a zero row can only be padding
    data, scale = refs.colwise_operand_ref(x, sizes)
    prep = refs.prepare_colwise_bf16_torch(data, scale, sizes)
    deq = refs.colwise_dequantize_ref(data, scale, sizes)
    assert torch.equal(prep[:rows].float(), deq[:rows])
    assert (prep[rows : 64 * ksteps] == 0).all()  # what the last k-step reads past the group: zeros
    assert torch.equal(prep[64 * ksteps : 64 * ksteps + 5].float(), deq[rows:])  # the next group's first row


def test_tma_epilogue_stores_are_the_box_layout_and_conflict_free():
    """epilogue_bf16_tma (one round of 4 boxes): accumulator pair (h, j) of lane (q, l) goes to chunk j / 8, row r,
    16-byte unit (j % 8) ^ (r % 8), byte 4 c. Reading the region back as 4 TMA boxes of 64 rows x 128 B with the
    128-byte swizzle (unit u of row r at (u ^ (r % 8)) * 16) must give every (row, column pair) exactly once, and
    each warp store instruction (fixed h, j) must hit 32 different banks."""
    region = {}
    for q in range(4):
        for h in range(2):
            for j in range(32):
                banks = set()
                for lane in range(32):
                    c, r = lane % 4, 16 * q + lane // 4 + 8 * h
                    addr = (j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4) + 4 * c
                    assert addr not in region
                    region[addr] = (r, 8 * j + 2 * c)
                    banks.add((addr // 4) % 32)
                assert len(banks) == 32, (q, h, j)
    for addr, (r, col) in region.items():  # the TMA box view: chunk, row, swizzled unit, byte
        ch, rem = divmod(addr, 8192)
        row, byte = divmod(rem, 128)
        unit = (byte // 16) ^ (row & 7)
        assert (row, 64 * ch + 8 * unit + (byte % 16) // 2) == (r, col)
    assert len(region) == 64 * 128  # 64 rows x 128 bf16 pairs


def test_scale_offset_and_kstep_bound_match_their_definitions():
    """gg_convert_a's per-thread constants (kernels/experts/sm90/grouped_gemm.cu): T.sa = (ar0 & 31) 16 + (ar0 >> 5) 4
    + c / 2, plus 2 (s % 2), is the blocked-tile offset of row ar0's scale byte for the 32-block of k = 64 s + 16 c
    ((ar0 % 32) 16 + (ar0 / 32) 4 + (k / 32) % 4), and s < T.slim = (K - 16 c + 63) / 64 holds exactly when that k
    is inside K (the kernel reads the scale byte only then)."""
    for ar0 in range(128):
        for c in range(4):
            sa = (ar0 & 31) * 16 + (ar0 >> 5) * 4 + (c >> 1)
            for s in range(6):
                k = 64 * s + 16 * c
                assert sa + 2 * (s & 1) == (ar0 % 32) * 16 + (ar0 // 32) * 4 + (k // 32) % 4
    for kk in range(32, 64 * 9, 32):
        for c in range(4):
            slim = (kk - 16 * c + 63) // 64
            assert all((s < slim) == (64 * s + 16 * c < kk) for s in range(-(-kk // 64)))
