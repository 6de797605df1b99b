"""CPU emulation of kernels/grouped_gemm_wg2.cu (implementation ``wgmma2``; no GPU needed).

Models what this kernel does differently from the wgmma one (tests/test_gemm_emulation_wgmma.py): the permuted
k order (logical k = 16 s + 8 h + 2 c + e is physical column 16 c + 4 s + 2 h + e of a 64-wide step), A fed to
wgmma from per-thread register fragments, B stored as 4-byte words into a 256-row 128B-swizzled stage ring, the
256-wide column tiles (two 128-row blocked scale tiles of B), the double-buffered A fragments and the
shared-memory epilogue. The B operand is read back through the same descriptor model as the wgmma test (PTX ISA,
K-major SWIZZLE_128B). Results are compared with the float64 reference by ``check_emulated_2d3d``.
"""

# ruff: noqa: B023  (the emulated kernel's closures run inside the iteration that defines them)
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from moe_ep import mxfp8
from moe_ep.experts import gemm as gemm_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_emu import (  # noqa: E402
    _check_loads,
    bf16_to_f,
    byte,
    check_emulated_2d3d,
    cvt_words_1s,
    f_to_bf16,
    scan_groups,
    words,
    zero_rows_range,
)
from test_gemm_emulation import ADDRESS_CASES  # noqa: E402
from test_gemm_emulation_wgmma import _bf16_array, gmma_operand, wg_desc  # noqa: E402

W2_BN, W2_TILE, W2_STAGES, W2_SMEM, EPI_LD = 256, 32768, 3, 99328, 528
GM_RASTER = 8  # kernels/grouped_gemm_wg2.cu's default band of row tiles


def raster(t: int, m_tiles: int, n_tiles: int, band: int = GM_RASTER) -> tuple[int, int]:
    """gm_raster: linear tile t -> (row tile, column tile), row tiles in bands of ``band``, fastest inside a band
    (wgmma2-4: GM_RASTER; wgmma5 keeps band 1).

    Example: raster(7, 5, 3, 2) == (3, 0) (band 1 holds row tiles 2, 3: t = 6, 7, 8 -> (2, 0), (3, 0), (2, 1)).
    """
    if band <= 1:
        return t // n_tiles, t % n_tiles
    b = t // (band * n_tiles)
    rows = min(band, m_tiles - b * band)
    r = t - b * band * n_tiles
    return b * band + r % rows, r // rows


TID = np.arange(256, dtype=np.int64)[None, :]


def cta_w2(gi, n_t, n, k):
    """The prologue of w2_2d3d for a CTA with a group tile, vectorized over column tiles n_t and threads."""
    n_t = np.asarray(n_t, dtype=np.int64).reshape(-1, 1)
    shape = (n_t.shape[0], 256)
    mrows = min(128, gi["rows"] - gi["tile"] * 128)
    arow0 = gi["row0"] + gi["tile"] * 128
    tpr = ((k >> 5) + 3) >> 2
    lane, wg, q, c, rb = TID & 31, TID >> 7, (TID >> 5) & 3, TID & 3, TID >> 2
    n0 = n_t * W2_BN
    ar0 = wg * 64 + q * 16 + (lane >> 2)
    ok_a0, ok_a1 = ar0 < mrows, ar0 + 8 < mrows
    out = {
        "mrows": mrows,
        "arow0": arow0,
        "n0": n0,
        "c16": c * 16,
        "ar0": ar0,
        "ok_a0": ok_a0,
        "ok_a1": ok_a1,
        "ap0": (arow0 + np.where(ok_a0, ar0, 0)) * k,
        "ap1": (arow0 + np.where(ok_a1, ar0 + 8, 0)) * k,
        "as0": (gi["toff"] + gi["tile"]) * tpr * 512 + (ar0 & 31) * 16 + (ar0 >> 5) * 4,
        "bs": gi["g"] * ((n + 127) >> 7) * tpr * 512,
        "bp": (gi["g"] * n + n0 + rb) * k,
        "b64": 64 * k,
    }
    for i in range(4):
        nn = n0 + rb + 64 * i
        out[f"ok_b{i}"] = nn < n
        out[f"bso{i}"] = (nn >> 7) * tpr * 512 + (nn & 31) * 16 + ((nn >> 5) & 3) * 4
    return {key: np.broadcast_to(v, shape) if isinstance(v, np.ndarray) else v for key, v in out.items()}


def load_w2(c, s, k):
    """W2Load::load(s): {register: (valid, buffer, byte offset, bytes)} with [CTAs, 256] arrays."""
    kk = s * 64 + c["c16"]
    kv = kk < k
    blk = kk >> 5
    coff = (blk >> 2) * 512 + (blk & 3)
    ld = {
        "ra0": (c["ok_a0"] & kv, "a", c["ap0"] + kk, 16),
        "ra1": (c["ok_a1"] & kv, "a", c["ap1"] + kk, 16),
        "sa0": (c["ok_a0"] & kv, "a_sc", c["as0"] + coff, 1),
        "sa1": (c["ok_a1"] & kv, "a_sc", c["as0"] + coff + 128, 1),
    }
    for i in range(4):
        ok = c[f"ok_b{i}"] & kv
        ld[f"rb{i}"] = (ok, "b", c["bp"] + i * c["b64"] + kk, 16)
        ld[f"sb{i}"] = (ok, "b_sc", c["bs"] + c[f"bso{i}"] + coff, 1)
    return ld


def a_fragments(ra0, sa0, ra1, sa1):
    """w2_cvt_a: f[4 s + j] of one thread from its two 16-byte rows (cvt16 words o[2 s + h])."""
    o0, o1 = cvt_words_1s(ra0, sa0), cvt_words_1s(ra1, sa1)
    f = []
    for s in range(4):
        f += [o0[2 * s], o1[2 * s], o0[2 * s + 1], o1[2 * s + 1]]
    return f


def b_word_offsets(tid: int) -> list[int]:
    """w2_store_b: byte offset (in a stage) of word j of B row i of thread tid, index 8 i + j."""
    rb, c = tid >> 2, tid & 3
    return [(rb + 64 * i) * 128 + ((j ^ (rb & 7)) << 4) + 4 * c for i in range(4) for j in range(8)]


def fragment_matrix(frags, wg: int, kk: int) -> np.ndarray:
    """The 64 x 16 A operand (bf16 bits) that warpgroup wg's register fragments f[4 kk .. 4 kk + 3] hold."""
    a = np.zeros((64, 16), dtype=np.uint16)
    for t in range(128 * wg, 128 * wg + 128):
        q, lane = (t >> 5) & 3, t & 31
        r, cc = q * 16 + lane // 4, 2 * (lane % 4)
        for j, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            w = frags[t][4 * kk + j]
            a[r + dr, cc + dk] = w & 0xFFFF
            a[r + dr, cc + dk + 1] = w >> 16
    return a


def emu_w2_2d3d(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32, zero_rest=False):
    bufs = {"a": a, "a_sc": a_sc, "b": b, "b_sc": b_sc}
    n_tiles = (n + W2_BN - 1) // W2_BN
    m_tiles = (m_total + 127) // 128 + g_count
    grid = m_tiles * n_tiles
    boff = [b_word_offsets(t) for t in range(256)]
    for bid in range(grid):
        m_t, n_t = raster(bid, m_tiles, n_tiles)
        gi = scan_groups(sizes, g_count, m_total, 1, m_t)
        if gi["g"] < 0:
            if zero_rest:
                r0 = gi["total_rows"] + (m_t - gi["total_tiles"]) * 128
                for n0 in (n_t * W2_BN, n_t * W2_BN + 128):
                    for off, cnt in zero_rows_range(r0, m_total, n, n0):
                        out[off : off + cnt] = 0.0
            continue
        c = cta_w2(gi, [n_t], n, k)
        if c["mrows"] <= 0:
            continue
        h = np.zeros((W2_SMEM - 1024) // 2, dtype=np.uint16)
        wep = np.full(h.size, -1, dtype=np.int64)
        busy = [-1] * W2_STAGES
        inflight = []  # A fragment buffers of issued wgmma groups not yet retired by a wait_group
        epoch = 0
        acc = np.zeros((2, 64, 256))
        regs, frags = {}, [None, None]
        ksteps = (k + 63) // 64

        def load(s):
            for name, (ok, buf, off, nb) in load_w2(c, s, k).items():
                if nb == 16:
                    regs[name] = [words(bufs[buf], int(off[0, t]), 16) if ok[0, t] else [0] * 4 for t in range(256)]
                else:
                    regs[name] = [byte(bufs[buf], int(off[0, t])) if ok[0, t] else 127 for t in range(256)]

        def convert(buf, stage):
            assert buf not in inflight, f"A buffer {buf} overwritten while a wgmma may read it"
            assert busy[stage] < epoch, f"stage {stage} overwritten while a wgmma may read it"
            frags[buf] = [
                a_fragments(regs["ra0"][t], regs["sa0"][t], regs["ra1"][t], regs["sa1"][t]) for t in range(256)
            ]
            base = stage * W2_TILE
            for t in range(256):
                for i in range(4):
                    ws = cvt_words_1s(regs[f"rb{i}"][t], regs[f"sb{i}"][t])
                    for j in range(8):
                        addr = base + boff[t][8 * i + j]
                        h[addr // 2 : addr // 2 + 2] = np.array([ws[j]], dtype=np.uint32).view(np.uint16)
                        wep[addr // 2 : addr // 2 + 2] = epoch

        def wgmma_step(buf, stage):
            soff = stage * (W2_TILE >> 4)
            for wg in range(2):
                for kk in range(4):
                    db = wg_desc(0) + soff + 2 * kk
                    bb = gmma_operand(h, db, 256)
                    st = ((db & 0x3FFF) << 4) - 32 * kk
                    w_ = wep[st // 2 : st // 2 + 256 * 64]
                    assert (w_ >= 0).all() and (w_ < epoch).all(), "wgmma reads unwritten / unfenced smem"
                    acc[wg] += _bf16_array(fragment_matrix(frags[buf], wg, kk)) @ _bf16_array(bb).T
            # wgmma(s) is retired by the wait_group(1) of step s + 1, which frees its A buffer; its B stage is
            # free after the barrier ending step s + 1 (the other warpgroup's wait)
            busy[stage] = epoch + 1
            inflight.append(buf)

        load(0)
        convert(0, 0)
        if ksteps > 1:
            load(1)
        epoch += 1
        stage = 0
        for s in range(ksteps):
            wgmma_step(s % 2, stage)
            del inflight[:-1]  # wait_group(1): all but the newest group retired
            nstage = 0 if stage == W2_STAGES - 1 else stage + 1
            if s + 1 < ksteps:
                convert((s + 1) % 2, nstage)
            if s + 2 < ksteps:
                load(s + 2)
            epoch += 1
            stage = nstage
        # epilogue: accumulator register 4 j + 2 h + e = tile row ar0 + 8 h, column 8 j + 2 c + e
        arow0, mrows, n0 = c["arow0"], c["mrows"], n_t * W2_BN
        ncols = n - n0
        tile = np.zeros((128, EPI_LD // 2), dtype=np.uint16)
        for t in range(256):
            wg, q, lane, cc = t >> 7, (t >> 5) & 3, t & 31, t & 3
            ar0 = wg * 64 + q * 16 + lane // 4
            for hh in range(2):
                r = ar0 + 8 * hh
                for j in range(32):
                    col = 8 * j + 2 * cc
                    vals = [acc[wg][r - 64 * wg, col + e] for e in range(2)]
                    if out_f32:
                        if r < mrows and col < ncols:
                            for e in range(2):
                                idx = (arow0 + r) * n + n0 + col + e
                                if idx < 0 or idx >= out.size:
                                    raise IndexError(f"store {idx} outside out ({out.size})")
                                out[idx] = np.float32(vals[e])
                    else:  # sts32 at sbase + r * 528 + 4 c + 16 j
                        off = r * EPI_LD + 4 * cc + 16 * j
                        tile.reshape(-1)[off // 2 : off // 2 + 2] = [f_to_bf16(v) for v in vals]
        if not out_f32:
            for t in range(256):
                for it in range(16):
                    idx = t + 256 * it
                    r, ch = idx >> 5, idx & 31
                    if r >= mrows or ch * 8 >= ncols:
                        continue
                    base = (arow0 + r) * n + n0 + ch * 8
                    if base < 0 or base + 8 > out.size:
                        raise IndexError(f"store {base} outside out ({out.size})")
                    out[base : base + 8] = [bf16_to_f(int(v)) for v in tile[r, ch * 8 : ch * 8 + 8]]


def test_permutation_is_a_bijection_and_a_matches_b():
    """Logical k of A fragment register (slice s, half h, lane c, element e) and of B word 8 s + 4 h + c hold the
    same physical column 16 c + 4 s + 2 h + e; every physical column of the step appears exactly once."""
    phys_a, phys_b = {}, {}
    for c in range(4):
        for s in range(4):
            for hh in range(2):
                for e in range(2):
                    phys = 16 * c + 4 * s + 2 * hh + e  # cvt16 word 2 s + h, element e of the thread's chunk c
                    phys_a[16 * s + 8 * hh + 2 * c + e] = phys  # A fragment register 4 s + 2 h, lane % 4 == c
                    word = 8 * s + 4 * hh + c  # B: the logical word (bf16 pair) it is stored to
                    phys_b[2 * word + e] = phys
    assert phys_a == phys_b and sorted(phys_a.values()) == list(range(64))
    # B stores of one warp for one word j: 32 distinct banks
    offs = np.array([b_word_offsets(t) for t in range(32)])
    for j in range(32):
        assert len({(int(o) // 4) % 32 for o in offs[:, j]}) == 32
    # all 256 rows x 32 words of a stage written exactly once
    allw = np.sort(np.array([b_word_offsets(t) for t in range(256)]).reshape(-1))
    assert (allw == np.arange(0, W2_TILE, 4)).all()


W2_CASES = [  # (sizes, extra rows, K, N, out_f32, zero_rest)
    ([0, 130, 0, 5], 3, 96, 136, False, True),  # K % 64 == 32, N < 256, partial tiles, empty groups
    ([200], 0, 320, 264, True, False),  # 5 k-steps (ring and both A buffers reused), 2 column tiles
    ([3, 40], 131, 64, 384, False, True),  # 131 trailing rows zero-filled over two 128-column halves
]


@pytest.mark.parametrize("sizes,extra,k,n,out_f32,zero_rest", W2_CASES)
def test_emulated_w2_2d3d_matches_reference(sizes, extra, k, n, out_f32, zero_rest):
    check_emulated_2d3d(emu_w2_2d3d, sizes, extra, k, n, out_f32, zero_rest, seed=sum(sizes) + k + n + 11)


@pytest.mark.parametrize("name", list(ADDRESS_CASES))
def test_w2_addresses_in_bounds_and_rows_covered_once(name):
    """Every CTA of the wgmma2 grid at benchmark shapes: loads of the first and last k-step inside the buffers
    the launcher checks, every group row covered by exactly one row tile."""
    sizes, m, k, n = ADDRESS_CASES[name]
    s_rows = min(sum(max(v, 0) for v in sizes), m)
    for kk, nn in ((k, n), (n, k)):
        if kk % 32:
            continue
        g_count = len(sizes)
        sizes_of = {
            "a": m * kk,
            "a_sc": mxfp8.grouped_blocked_size(m, g_count, kk // 32, "m"),
            "b": g_count * nn * kk,
            "b_sc": g_count * mxfp8.blocked_size(nn, kk // 32),
        }
        n_tiles = (nn + W2_BN - 1) // W2_BN
        ksteps = (kk + 63) // 64
        cover = np.zeros(m + 1, dtype=np.int64)
        for m_t in range((m + 127) // 128 + g_count):
            gi = scan_groups(sizes, g_count, m, 1, m_t)
            if gi["g"] < 0:
                continue
            c = cta_w2(gi, np.arange(n_tiles), nn, kk)
            if c["mrows"] <= 0:
                continue
            for st in {0, ksteps - 1}:
                _check_loads(load_w2(c, st, kk), sizes_of)
            cover[c["arow0"]] += 1
            cover[c["arow0"] + c["mrows"]] -= 1
        assert (np.cumsum(cover)[:s_rows] == 1).all()


def test_w2_address_check_catches_a_wrong_scale_tile():
    """Sanity check: B rows 128 .. 255 of a column tile read the second 128-row scale tile; dropping the
    (n >> 7) term of bso reads wrong scales, which the emulation turns into a reference mismatch."""
    orig = cta_w2

    def bad(gi, n_t, n, k):
        c = dict(orig(gi, n_t, n, k))
        tpr = ((k >> 5) + 3) >> 2
        for i in (2, 3):
            c[f"bso{i}"] = c[f"bso{i}"] - tpr * 512
        return c

    globals()["cta_w2"] = bad
    try:
        with pytest.raises(AssertionError):
            check_emulated_2d3d(emu_w2_2d3d, [70], 0, 64, 256, True, False, seed=5)
    finally:
        globals()["cta_w2"] = orig


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


def test_w2_constants_match_the_source():
    from moe_ep import _cuda

    src = _cuda.read_source("grouped_gemm_wg2.cu")
    assert "#define W2_STAGES 3" in src and "#define W2_TILE_BYTES 32768" in src and "#define W2_BN 256" in src
    assert f"#define W2_EPI_LD {EPI_LD}" in src
    assert f"#define GM_RASTER {GM_RASTER}" in src
    assert "#define W5_RASTER 8" in _cuda.read_source("grouped_gemm_wg5.cu")
    assert W2_STAGES * W2_TILE + 1024 == W2_SMEM == gemm_cuda._WGMMA2_SMEM_BYTES
    assert gemm_cuda._WGMMA2_BN == W2_BN
    for suffix in gemm_cuda._OUT_SUFFIX.values():
        assert f"mx_gmm_wg2_2d3d_{suffix}(GM_ARGS)" in src


def test_k_permutation_matches_the_fragment_model():
    """gemm_cuda.k_permutation (the host side of wgmma4's prepared weights) is the kernels' logical -> physical map
    (the same one a_fragments and b_word_offsets realise above)."""
    perm = gemm_cuda.k_permutation().tolist()
    for c in range(4):
        for s in range(4):
            for hh in range(2):
                for e in range(2):
                    assert perm[16 * s + 8 * hh + 2 * c + e] == 16 * c + 4 * s + 2 * hh + e
    assert sorted(perm) == list(range(64))


@pytest.mark.parametrize("k", [32, 96, 128])
def test_prepare_weight_bf16_is_the_permuted_exact_dequantization(k):
    """prepare_weight_bf16 == dequantize (exact in bf16) with each 64-block of k permuted, zero past K; the blocked
    scales are read back through the same offsets as to_blocked (N = 136: two 128-row scale tiles)."""
    import torch

    torch.manual_seed(k)
    w = torch.randn(3, 136, k) * torch.logspace(-4, 4, k)[torch.randperm(k)]
    wq = mxfp8.quantize_torch(w, -1)
    prep = gemm_cuda.prepare_weight_bf16(wq.data, mxfp8.to_blocked(wq.scale))
    kp = -(-k // 64) * 64
    assert prep.dtype == torch.bfloat16 and prep.shape == (3, 136, kp)
    deq = mxfp8.dequantize_torch(wq, torch.float32)
    assert torch.equal(deq.bfloat16().float(), deq)  # exact in bf16 (no value below 2^-133 here)
    full = torch.zeros(3, 136, kp)
    full[..., :k] = deq
    perm = gemm_cuda.k_permutation()
    for j in range(kp // 64):
        for lg in range(64):
            assert torch.equal(prep[..., 64 * j + lg].float(), full[..., 64 * j + int(perm[lg])])
