"""CPU emulation of kernels/grouped_gemm_wgmma.cu (no GPU needed), on the helpers of gemm_emu.py.

The wgmma kernel shares the mma kernel's loader and conversion (modelled in gemm_emu.py); this file
models what differs: the 128B-swizzled bf16 stage ring, the shared-memory matrix descriptors, the m64nNk16
accumulator fragment, the epilogue and the stage-reuse discipline.
"""

# ruff: noqa: B023  (the emulated kernels' load/store closures run inside the iteration that defines them)
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from moe_ep.experts import gemm as gemm_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_emu import (  # noqa: E402
    bf16_to_f,
    byte,
    check_emulated_2d3d,
    cta_2d3d,
    cvt_words_1s,
    f_to_bf16,
    load_2d3d,
    scan_groups,
    words,
    zero_rows_range,
)

# ------------------------------------------------------------------------------ wgmma kernel (grouped_gemm_wgmma.cu)
# Model of mx_gmm_wg_2d3d_*: the same loader (cta_2d3d / load_2d3d) and conversion, bf16 stores into the 128-byte
# swizzled stage ring, wgmma operands read back through the shared-memory matrix descriptors as the PTX ISA
# describes them (K-major, 128B swizzle: element (row i, k) of a descriptor with start S and stride byte offset SBO
# sits at L = S + (i // 8) * SBO + (i % 8) * 128 + 2 k, XOR-swizzled as L ^ (((L >> 7) & 7) << 4)), the
# m64nNk16 accumulator fragment, the epilogue, and the stage-reuse discipline of the 3-stage pipeline.
WG_TILE, WG_STAGE, WG_STAGES, WG_SMEM = 16384, 32768, 3, 99328


def wg_desc(addr: int) -> int:
    """wg_desc in grouped_gemm_wgmma.cu."""
    return ((addr & 0x3FFFF) >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


def sw128_offset(row: int, chunk: int) -> int:
    """Byte offset of logical 16-byte chunk ``chunk`` (bf16 8c .. 8c+7) of tile row ``row``."""
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def wg_store_offsets(tid):
    """so0 / so1 of the kernel: swizzled offsets of the thread's chunks ck/8 and ck/8 + 1 in tile row crow."""
    crow, ck = tid >> 2, (tid & 3) * 16
    c0, sw = ck >> 3, crow & 7
    return crow * 128 + ((c0 ^ sw) << 4), crow * 128 + (((c0 + 1) ^ sw) << 4)


def gmma_operand(h: np.ndarray, desc: int, rows: int) -> np.ndarray:
    """Hardware model: the rows x 16 bf16 operand a K-major, 128B-swizzled descriptor points at (bf16 bits)."""
    assert desc >> 62 == 1, "layout type must be SWIZZLE_128B"
    start, sbo = (desc & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    i = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    lin = start + (i // 8) * sbo + (i % 8) * 128 + 2 * k
    phys = lin ^ (((lin >> 7) & 7) << 4)
    assert (phys >= 0).all() and (phys + 2 <= 2 * h.size).all()
    return h[phys // 2]


def _bf16_array(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def emu_wg_2d3d(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32, zero_rest=False):
    bufs = {"a": a, "a_sc": a_sc, "b": b, "b_sc": b_sc}
    n_tiles = (n + 127) // 128
    grid = ((m_total + 127) // 128 + g_count) * n_tiles
    tids = np.arange(256)
    so0, so1 = wg_store_offsets(tids)
    for bid in range(grid):
        m_t, n_t = bid // n_tiles, bid % n_tiles
        gi = scan_groups(sizes, g_count, m_total, 1, m_t)
        if gi["g"] < 0:
            if zero_rest:
                r0 = gi["total_rows"] + (m_t - gi["total_tiles"]) * 128
                for off, cnt in zero_rows_range(r0, m_total, n, n_t * 128):
                    out[off : off + cnt] = 0.0
            continue
        c = cta_2d3d(gi, [n_t], n, k)
        if c["mrows"] <= 0:
            continue
        sbase = 0  # the kernel rounds the dynamic smem base up to 1024
        h = np.zeros((WG_SMEM - 1024) // 2, dtype=np.uint16)
        wep = np.full(h.size, -1, dtype=np.int64)  # barrier epoch of the last write of each bf16 word
        busy = [-1] * WG_STAGES  # stage -> last epoch in which an issued wgmma may still read it
        epoch = 0
        acc = np.zeros((2, 64, 128))  # per warpgroup D (64 x 128), float64 sums
        regs = {}
        ksteps = (k + 63) // 64

        def load(s):
            for name, (ok, buf, off, nb) in load_2d3d(c, s, k).items():
                if nb == 16:
                    regs[name] = [words(bufs[buf], int(off[0, t]), 16) if ok[0, t] else [0] * 4 for t in range(256)]
                else:
                    regs[name] = [byte(bufs[buf], int(off[0, t])) if ok[0, t] else 127 for t in range(256)]

        def store(stage):
            assert busy[stage] < epoch, f"stage {stage} overwritten while a wgmma may read it"
            base = sbase + stage * WG_STAGE
            for t in range(256):
                for ra, sa, off in (
                    ("ra0", "sa0", 0),
                    ("ra1", "sa1", 8192),
                    ("rb0", "sb0", WG_TILE),
                    ("rb1", "sb1", WG_TILE + 8192),
                ):
                    ws = cvt_words_1s(regs[ra][t], regs[sa][t])
                    for addr, part in ((base + off + so0[t], ws[:4]), (base + off + so1[t], ws[4:])):
                        assert addr % 16 == 0
                        sl = slice(addr // 2, addr // 2 + 8)
                        h[sl] = np.array(part, dtype=np.uint32).view(np.uint16)
                        wep[sl] = epoch

        def wgmma_stage(stage):
            for wg in range(2):
                da0 = wg_desc(sbase + wg * 8192)
                db0 = wg_desc(sbase + WG_TILE)
                soff = stage * (WG_STAGE >> 4)
                for kk in range(4):
                    da, db = da0 + soff + 2 * kk, db0 + soff + 2 * kk
                    ab, bb = gmma_operand(h, da, 64), gmma_operand(h, db, 128)
                    st_a = ((da & 0x3FFF) << 4) - 32 * kk
                    st_b = ((db & 0x3FFF) << 4) - 32 * kk
                    for st_, rows in ((st_a, 64), (st_b, 128)):  # written and fenced before the last barrier
                        w_ = wep[st_ // 2 : st_ // 2 + rows * 64]
                        assert (w_ >= 0).all() and (w_ < epoch).all(), "wgmma reads unwritten / unfenced smem"
                    acc[wg] += _bf16_array(ab) @ _bf16_array(bb).T
            busy[stage] = epoch + 1  # complete after wait_group(1) + the barrier of the next iteration

        load(0)
        store(0)
        if ksteps > 1:
            load(1)
        epoch += 1  # fence.proxy.async + __syncthreads
        stage = 0
        for s in range(ksteps):
            wgmma_stage(stage)
            nstage = 0 if stage == WG_STAGES - 1 else stage + 1
            if s + 1 < ksteps:
                store(nstage)
            if s + 2 < ksteps:
                load(s + 2)
            epoch += 1  # wait_group(1), fence.proxy.async, __syncthreads
            stage = nstage
        # accumulator fragments (PTX m64nNk16 D layout): thread t of warpgroup wg, register i
        frag = np.zeros((256, 64))
        for t in range(256):
            wg, q, lane = t >> 7, (t >> 5) & 3, t & 31
            for i in range(64):
                j, hh, e = i // 4, (i // 2) % 2, i % 2
                frag[t, i] = acc[wg][q * 16 + lane // 4 + 8 * hh, 8 * j + 2 * (lane % 4) + e]
        # epilogue of the kernel
        erow0 = gi["row0"] + gi["tile"] * 128
        en0 = n_t * 128
        erows, ncols = min(128, gi["rows"] - gi["tile"] * 128), n - en0
        for t in range(256):
            lane, q, wg = t & 31, (t >> 5) & 3, t >> 7
            for hh in range(2):
                r = wg * 64 + q * 16 + (lane >> 2) + 8 * hh
                if r >= erows:
                    continue
                for j in range(16):
                    col = j * 8 + (lane & 3) * 2
                    if col >= ncols:
                        continue
                    for e in range(2):
                        idx = (erow0 + r) * n + en0 + col + e
                        if idx < 0 or idx >= out.size:
                            raise IndexError(f"store {idx} outside out ({out.size})")
                        v = np.float32(frag[t, 4 * j + 2 * hh + e])
                        out[idx] = v if out_f32 else bf16_to_f(f_to_bf16(float(v)))


def test_wg_descriptor_and_swizzle_hand_values():
    # start 0x400 -> 0x40; LBO field 1; SBO 1024 -> 64; layout SWIZZLE_128B = 1 at bits 62-63
    assert wg_desc(0x400) == 0x40 | (1 << 16) | (64 << 32) | (1 << 62) == 0x4000004000010040
    assert wg_desc(0x8000 + 0x400) & 0x3FFF == 0x840
    assert wg_desc(0) + 2 == wg_desc(32)  # + 32 bytes (one k16 slice) = + 2 in the start field
    hand = [0, 144, 480, 896, 1072, 1152]
    assert [sw128_offset(r, c) for r, c in ((0, 0), (1, 0), (3, 5), (7, 7), (8, 3), (9, 1))] == hand
    so0, so1 = wg_store_offsets(np.arange(256))
    # thread 5: row 1, ck 16 (chunks 2, 3) -> chunks 3, 2 of row 1
    assert (int(so0[5]), int(so1[5])) == (128 + 48, 128 + 32)
    # every 16-byte chunk of the 64 rows x 128 B half tile is written by exactly one (thread, part)
    allo = np.sort(np.concatenate([so0, so1]))
    assert (allo == np.arange(0, 8192, 16)).all()
    # a quarter warp (8 threads) stores 8 distinct 16-byte bank groups: conflict-free
    for q0 in range(0, 256, 8):
        for so in (so0, so1):
            assert len({int(v) % 128 for v in so[q0 : q0 + 8]}) == 8


def test_wg_gmma_operand_model_reads_what_was_written():
    """Write a known matrix with the kernel's swizzled chunk stores, read it back with the descriptor model."""
    h = np.zeros(WG_TILE // 2, dtype=np.uint16)
    vals = np.arange(128 * 64, dtype=np.uint16).reshape(128, 64)  # element (row, k) = 64 row + k
    for r in range(128):
        for ch in range(8):
            off = sw128_offset(r, ch)
            h[off // 2 : off // 2 + 8] = vals[r, 8 * ch : 8 * ch + 8]
    for kk in range(4):
        got = gmma_operand(h, wg_desc(32 * kk), 128)
        assert (got == vals[:, 16 * kk : 16 * kk + 16]).all()
        got = gmma_operand(h, wg_desc(8192 + 32 * kk), 64)  # warpgroup 1's A rows
        assert (got == vals[64:, 16 * kk : 16 * kk + 16]).all()


WG_CASES = [  # (sizes, extra rows, K, N, out_f32, zero_rest)
    ([0, 130, 0, 5], 3, 96, 136, True, True),  # K % 64 == 32, N % 128 != 0, partial tiles, empty groups
    ([200], 0, 320, 128, False, False),  # 5 k-steps: every stage of the ring reused
]


@pytest.mark.parametrize("sizes,extra,k,n,out_f32,zero_rest", WG_CASES)
def test_emulated_wg_2d3d_matches_reference(sizes, extra, k, n, out_f32, zero_rest):
    check_emulated_2d3d(emu_wg_2d3d, sizes, extra, k, n, out_f32, zero_rest, seed=sum(sizes) + k + n + 7)


def test_wg_constants_match_the_source():
    """WG_* sizes, the descriptor bits and the launcher's shared-memory size agree with grouped_gemm_wgmma.cu."""
    from moe_ep import _cuda

    src = _cuda.read_source("grouped_gemm_wgmma.cu")
    assert "#define WG_STAGES 3" in src and "#define WG_TILE_BYTES 16384" in src
    assert WG_STAGES * WG_STAGE + 1024 == WG_SMEM == gemm_cuda._WGMMA_SMEM_BYTES
    assert "(1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)" in src and "(1ull << 62)" in src
    for suffix in gemm_cuda._OUT_SUFFIX.values():
        assert f"mx_gmm_wg_2d3d_{suffix}(GM_ARGS)" in src
