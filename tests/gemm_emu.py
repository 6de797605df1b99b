"""CPU models of the arithmetic the grouped GEMM kernels share (kernels/experts/sm90/gemm_common.cuh), no GPU needed.

Bit-level models of the exact e4m3 -> bf16 conversion with the block scale (``e4m3x2_bits``, ``cvt_words_1s`` for
one scale byte per 16 bytes), of bf16 rounding and multiplication, and of the group scan (``scan_groups``:
gm_scan_groups with shfl_up semantics) and the tile order (``raster``: gm_raster), plus float64 references of the
grouped products (``mm64``, ``wgrad64``).
"""

from __future__ import annotations

import numpy as np
import torch


# ---------------------------------------------------------------------------------------------- bit helpers
def byte_perm(x: int, y: int, s: int) -> int:
    """prmt.b32 (default mode): selector nibble i picks byte (nibble & 7) of {y, x}; with bit 3 set, the byte's sign
    bit replicated over 8 bits instead."""
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (s >> (4 * i)) & 0xF
        v = b[nib & 7]
        out |= ((0xFF if v & 0x80 else 0) if nib & 8 else v) << (8 * i)
    return out


def bf16_to_f(h: int) -> float:
    return float(np.array([h << 16], dtype=np.uint32).view(np.float32)[0])


def f_to_bf16(v: float) -> int:
    """fp64 -> fp32 -> bf16 bits, round to nearest even (subnormals kept), like cvt.rn / mul.rn."""
    with np.errstate(over="ignore"):
        u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def hmul2(a: int, b: int) -> int:  # mul.rn.bf16x2 (subnormals kept, RNE)
    lo = f_to_bf16(bf16_to_f(a & 0xFFFF) * bf16_to_f(b & 0xFFFF))
    hi = f_to_bf16(bf16_to_f(a >> 16) * bf16_to_f(b >> 16))
    return lo | (hi << 16)


E4M3X2_LO, E4M3X2_HI = 0x9180, 0xB3A2  # kernels/experts/sm90/gemm_common.cuh: bytes 0, 1 / 2, 3, sign-extended


def e4m3x2_bits(w: int, sel: int) -> int:
    """kernels/experts/sm90/gemm_common.cuh's e4m3x2_bits: prmt with sign-replicated bytes, shift by 4, one mask."""
    return ((byte_perm(w, 0, sel) << 4) & 0xFFFFFFFF) & 0x87F087F0


def e4m3x2_bits_placed(w: int, sel: int) -> int:
    """The direct statement of the bit placement (the kernels' form before, selectors 0x1404 / 0x3424): byte b to
    bits 8..15 of its half, sign kept at bit 15, bits (b & 0x7F) << 4."""
    d = byte_perm(w, 0, sel)
    return (d & 0x80008000) | ((d >> 4) & 0x07F007F0)


def mult_slow1(s: int) -> int:
    return 0x7FC0 if s == 0xFF else (0x0040 if s == 0 else (s << 7))


def cvt_words_1s(words, s):
    o = []
    for w in words:
        o += [e4m3x2_bits(w, E4M3X2_LO), e4m3x2_bits(w, E4M3X2_HI)]
    if s < 128:
        m = ((s + 120) << 7) * 0x00010001
        return [hmul2(x, m) for x in o]
    m = mult_slow1(s) * 0x00010001
    return [hmul2(hmul2(x, 0x7B807B80), m) for x in o]


# ---------------------------------------------------------------------------------------------- group scan
def scan_groups(sizes, g_count, m_total, by_tile, target):
    """gm_scan_groups (one warp): 32 groups per iteration, inclusive shfl_up scans, totals from lane 31.
    by_tile: 0 group index, 1 128-row tile."""
    gi = {"g": -1}
    crow = ctile = cblk = cpad = 0
    for base in range(0, g_count, 32):
        n = [max(sizes[base + ln], 0) if base + ln < g_count else 0 for ln in range(32)]
        nt = [(v + 127) >> 7 for v in n]  # the kernel rounds in unsigned: no int overflow near INT_MAX
        nb = [(v + 31) >> 5 for v in n]
        npc = [(v + 63) >> 6 for v in n]
        r, t, b, pc = list(n), list(nt), list(nb), list(npc)
        o = 1
        while o < 32:  # __shfl_up_sync: lanes < o keep their own value (and do not add)
            r2, t2, b2, p2 = list(r), list(t), list(b), list(pc)
            for ln in range(o, 32):
                r[ln] += r2[ln - o]
                t[ln] += t2[ln - o]
                b[ln] += b2[ln - o]
                pc[ln] += p2[ln - o]
            o <<= 1
        for ln in range(32):
            h = base + ln
            r_ex, t_ex, b_ex = crow + r[ln] - n[ln], ctile + t[ln] - nt[ln], cblk + b[ln] - nb[ln]
            p_ex = cpad + pc[ln] - npc[ln]
            if by_tile == 1:
                hit = h < g_count and n[ln] > 0 and t_ex <= target < t_ex + nt[ln]
            else:
                hit = h < g_count and h == target
            if hit:
                assert gi["g"] == -1, "two lanes claim the same tile"
                avail = min(max(m_total - r_ex, 0), n[ln])
                gi = {
                    "row0": r_ex,
                    "rows": avail,
                    "g": h,
                    "tile": target - t_ex if by_tile == 1 else 0,
                    "toff": t_ex,
                    "boff": b_ex,
                    "poff": p_ex,
                }
        crow, ctile, cblk, cpad = crow + r[31], ctile + t[31], cblk + b[31], cpad + pc[31]
    assert ctile < 2**31 and cblk < 2**31, "int overflow of the tile / block counters"
    gi["total_rows"], gi["total_tiles"] = crow, ctile
    return gi


# ---------------------------------------------------------------------------------------------- tile order
GM_RASTER = 8  # the fprop / dgrad kernel's band of row tiles (kernels/experts/sm90/grouped_gemm.cu GG_RASTER)


def raster(t: int, m_tiles: int, n_tiles: int, band: int = GM_RASTER) -> tuple[int, int]:
    """gm_raster: linear tile t -> (row tile, column tile), row tiles in bands of ``band``, fastest inside a band.

    Example: raster(7, 5, 3, 2) == (3, 0) (band 1 holds row tiles 2, 3: t = 6, 7, 8 -> (2, 0), (3, 0), (2, 1)).
    """
    if band <= 1:
        return t // n_tiles, t % n_tiles
    b = t // (band * n_tiles)
    rows = min(band, m_tiles - b * band)
    r = t - b * band * n_tiles
    return b * band + r % rows, r // rows


# ---------------------------------------------------------------------------------------------- reference helpers
def mm64(a, b, sizes):
    """grouped_mm_torch in float64 on a's device (the reference accumulates in fp32, which cancellation makes
    inexact): a [M, K], b [G, N, K], sizes G host ints -> [M, N] float64."""
    out, start = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = a[start : start + n].double() @ b[g].double().t()
        start += n
    return out


def wgrad64(a, b, sizes):
    """grouped_wgrad_torch in float64 on a's device: a [M, N], b [M, K], sizes G host ints -> [G, N, K] float64."""
    out, start = torch.zeros(len(sizes), a.shape[1], b.shape[1], dtype=torch.float64, device=a.device), 0
    for g, n in enumerate(sizes):
        out[g] = a[start : start + n].double().t() @ b[start : start + n].double()
        start += n
    return out
