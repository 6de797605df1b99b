"""CPU emulation of kernels/grouped_gemm.cu (no GPU needed): a line-by-line numpy model of the kernels.

It mirrors the CUDA code's index arithmetic on flat byte arrays (group scan with shfl_up semantics, the
prologue's per-thread pointers and predicates, the loader's column / scale addressing, e4m3 -> bf16 bit trick +
bf16 multiplies, shared-memory byte offsets, ldmatrix (.trans) lane semantics, mma.m16n8k16 fragment layouts
from the PTX ISA, epilogue stores, the zero fill of rows past the groups) and checks the result against the
reference (dequantize + float64 matmul per group), including that nothing outside the groups' rows is written.
Out-of-range flat indices raise, so addressing bugs cannot pass silently. Shared memory tracks, per 16-bit word,
the barrier interval of its last write and read: reading a word that is unwritten or written in the same
interval (missing __syncthreads), or writing a word read in the same interval (stage reused too early), raises.

The per-thread address formulas (``cta_2d3d`` / ``load_2d3d``, ``cta_wgrad`` / ``load_wgrad``) are numpy
vectorized over the 256 threads (and over column tiles), exactly as in the kernel; the numerical emulation uses
them, and the address-only tests run them on benchmark-sized shapes (M = 32768, K = 7168, G = 32 ...), where
every load of the first and last k-step (addresses are increasing in the k-step) must lie inside its buffer and
every output row must be written by exactly one CTA.
"""

# ruff: noqa: B023  (the emulated kernels' load/store closures run inside the iteration that defines them)
from __future__ import annotations

import numpy as np
import torch

from moe_ep import mxfp8
from moe_ep.experts import gemm as gemm_cuda

KM_LD, MN_LD, OPER, STAGE, SMEM = 72, 136, 18432, 36864, 73728
TID = np.arange(256, dtype=np.int64)[None, :]  # threadIdx.x (one row per CTA of a vectorized call)


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


E4M3X2_LO, E4M3X2_HI = 0x9180, 0xB3A2  # kernels/grouped_gemm.cu: bytes 0, 1 / 2, 3, sign-extended


def e4m3x2_bits(w: int, sel: int) -> int:
    """kernels/grouped_gemm.cu's e4m3x2_bits: prmt with sign-replicated bytes, shift by 4, one mask."""
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


def pair_mults8(sv):
    fast = ((sv[0] | sv[1]) & 0x80808080) == 0
    m = []
    for w in sv:
        lo, hi = byte_perm(w, 0, 0x4140), byte_perm(w, 0, 0x4342)
        if fast:
            m += [((lo + 0x00780078) << 7) & 0xFFFFFFFF, ((hi + 0x00780078) << 7) & 0xFFFFFFFF]
        else:
            m += [
                mult_slow1(lo & 0xFF) | (mult_slow1(lo >> 16) << 16),
                mult_slow1(hi & 0xFF) | (mult_slow1(hi >> 16) << 16),
            ]
    return m, fast


def cvt_words_ps(words, m, fast):
    o = []
    for w in words:
        o += [e4m3x2_bits(w, E4M3X2_LO), e4m3x2_bits(w, E4M3X2_HI)]
    if fast:
        return [hmul2(x, mm) for x, mm in zip(o, m, strict=True)]
    return [hmul2(hmul2(x, 0x7B807B80), mm) for x, mm in zip(o, m, strict=True)]


def words(mem: np.ndarray, off: int, nbytes: int) -> list[int]:
    if off < 0 or off + nbytes > mem.size:
        raise IndexError(f"load [{off}, {off + nbytes}) outside a buffer of {mem.size} bytes")
    if off % nbytes:
        raise ValueError(f"misaligned {nbytes}-byte load at {off}")
    return [int(v) for v in mem[off : off + nbytes].view(np.uint32)]


def byte(mem: np.ndarray, off: int) -> int:
    if off < 0 or off >= mem.size:
        raise IndexError(f"scale byte {off} outside a buffer of {mem.size} bytes")
    return int(mem[off])


class Smem:
    """Dynamic shared memory (uint16 words) with a barrier-interval race / uninitialized-read detector."""

    def __init__(self):
        self.h = np.zeros(SMEM // 2, dtype=np.uint16)
        self.wep = np.full(SMEM // 2, -1, dtype=np.int64)  # barrier interval of the last write (-1: never)
        self.rep = np.full(SMEM // 2, -1, dtype=np.int64)  # barrier interval of the last read
        self.epoch = 0

    def syncthreads(self):
        self.epoch += 1

    def sts(self, addr: int, ws):
        assert addr % 16 == 0 and 0 <= addr and addr + 4 * len(ws) <= SMEM, addr
        sl = slice(addr // 2, addr // 2 + 2 * len(ws))
        if (self.rep[sl] == self.epoch).any():
            raise AssertionError(f"smem race: {addr} written in the barrier interval in which it is read")
        self.h[sl] = np.array(ws, dtype=np.uint32).view(np.uint16)
        self.wep[sl] = self.epoch

    def row(self, addr: int) -> np.ndarray:
        """The 8 bf16 words of one ldmatrix row address (16 bytes)."""
        assert addr % 16 == 0 and 0 <= addr and addr + 16 <= SMEM, addr
        sl = slice(addr // 2, addr // 2 + 8)
        if (self.wep[sl] < 0).any():
            raise AssertionError(f"smem read of never-written words at {addr}")
        if (self.wep[sl] >= self.epoch).any():
            raise AssertionError(f"smem race: {addr} read in the barrier interval in which it is written")
        self.rep[sl] = self.epoch
        return self.h[sl]


# ---------------------------------------------------------------------------------------------- group scan
def scan_groups(sizes, g_count, m_total, by_tile, target):
    """gm_scan_groups (one warp): 32 groups per iteration, inclusive shfl_up scans, totals from lane 31.
    by_tile: 0 group index, 1 128-row tile, 2 padded 32-row block (GM_BY_PAD32: 2 ceil(n / 64) blocks per group)."""
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
            elif by_tile == 2:
                hit = h < g_count and n[ln] > 0 and 2 * p_ex <= target < 2 * (p_ex + npc[ln])
            else:
                hit = h < g_count and h == target
            if hit:
                assert gi["g"] == -1, "two lanes claim the same tile"
                avail = min(max(m_total - r_ex, 0), n[ln])
                gi = {
                    "row0": r_ex,
                    "rows": avail,
                    "g": h,
                    "tile": target - t_ex if by_tile == 1 else (target - 2 * p_ex if by_tile == 2 else 0),
                    "toff": t_ex,
                    "boff": b_ex,
                    "poff": p_ex,
                }
        crow, ctile, cblk, cpad = crow + r[31], ctile + t[31], cblk + b[31], cpad + pc[31]
    assert ctile < 2**31 and cblk < 2**31, "int overflow of the tile / block counters"
    gi["total_rows"], gi["total_tiles"] = crow, ctile
    return gi


# ---------------------------------------------------------------------------------------------- warp math
def ldsm(sm: Smem, addrs, trans):
    """ldmatrix .x4: addrs[32] byte addresses (lanes 8i..8i+7 = rows of matrix i) -> regs[4][32]."""
    rows = [sm.row(a) for a in addrs]
    regs = [[0] * 32 for _ in range(4)]
    for i in range(4):
        for ln in range(32):
            if trans:  # thread gets (row 2*(l%4) + j, col l/4) of the stored matrix
                e = [int(rows[8 * i + 2 * (ln % 4) + j][ln // 4]) for j in range(2)]
            else:  # thread gets (row l/4, cols 2*(l%4) + j)
                e = [int(rows[8 * i + ln // 4][2 * (ln % 4) + j]) for j in range(2)]
            regs[i][ln] = e[0] | (e[1] << 16)
    return regs


def bf_pair(w):
    return bf16_to_f(w & 0xFFFF), bf16_to_f(w >> 16)


def mma(acc, af, b0, b1):
    """acc[4][32] += A(16x16) @ B(16x8) with the PTX m16n8k16 bf16 fragment layouts."""
    a = np.zeros((16, 16))
    bm = np.zeros((16, 8))
    c = np.zeros((16, 8))
    for ln in range(32):
        gid, tig = ln >> 2, ln & 3
        for reg, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            a[gid + dr, tig * 2 + dk], a[gid + dr, tig * 2 + dk + 1] = bf_pair(af[reg][ln])
        bm[tig * 2, gid], bm[tig * 2 + 1, gid] = bf_pair(b0[ln])
        bm[tig * 2 + 8, gid], bm[tig * 2 + 9, gid] = bf_pair(b1[ln])
        for j in range(4):
            c[gid + 8 * (j >> 1), tig * 2 + (j & 1)] = acc[j][ln]
    d = c + a @ bm
    for ln in range(32):
        gid, tig = ln >> 2, ln & 3
        for j in range(4):
            acc[j][ln] = d[gid + 8 * (j >> 1), tig * 2 + (j & 1)]


def compute_stage(sm: Smem, sa, sb, acc, mn):
    for w in range(8):
        wm, wn = w >> 2, w & 3
        for kk in range(4):
            af, bfr = [], [[None, None] for _ in range(4)]
            for mi in range(4):
                addrs = []
                for ln in range(32):
                    i8, r8 = ln >> 3, ln & 7
                    if mn:
                        k, m = kk * 16 + r8 + (i8 >> 1) * 8, wm * 64 + mi * 16 + (i8 & 1) * 8
                        addrs.append(sa + (k * MN_LD + m) * 2)
                    else:
                        m, k = wm * 64 + mi * 16 + (ln & 15), kk * 16 + (ln >> 4) * 8
                        addrs.append(sa + (m * KM_LD + k) * 2)
                af.append(ldsm(sm, addrs, mn))
            for np_ in range(2):
                addrs = []
                for ln in range(32):
                    i8, r8 = ln >> 3, ln & 7
                    if mn:
                        k, n = kk * 16 + r8 + (i8 & 1) * 8, wn * 32 + np_ * 16 + (i8 >> 1) * 8
                        addrs.append(sb + (k * MN_LD + n) * 2)
                    else:
                        n, k = wn * 32 + np_ * 16 + r8 + (i8 >> 1) * 8, kk * 16 + (i8 & 1) * 8
                        addrs.append(sb + (n * KM_LD + k) * 2)
                r = ldsm(sm, addrs, mn)
                bfr[2 * np_], bfr[2 * np_ + 1] = [r[0], r[1]], [r[2], r[3]]
            for mi in range(4):
                for ni in range(4):
                    mma(acc[w][mi][ni], [[af[mi][j][ln] for ln in range(32)] for j in range(4)], bfr[ni][0], bfr[ni][1])


def mainloop(sm: Smem, load, store, ksteps: int, acc, mn: bool) -> None:
    """The kernels' two-stage k loop: load k-step s+1 into registers while stage s is computed, then convert and
    store it into the other stage; one barrier per step (both kernels share this schedule)."""
    if ksteps > 0:
        load(0)
        store(0)
    sm.syncthreads()
    for s in range(ksteps):
        if s + 1 < ksteps:
            load(s + 1)
        compute_stage(sm, (s & 1) * STAGE, (s & 1) * STAGE + OPER, acc, mn)
        if s + 1 < ksteps:
            store((s + 1) & 1)
        sm.syncthreads()


def store_tile(out, obase, ld, nrows, ncols, acc, out_f32):
    for w in range(8):
        wm, wn = w >> 2, w & 3
        for ln in range(32):
            gid, tig = ln >> 2, ln & 3
            for mi in range(4):
                for h in range(2):
                    r = wm * 64 + mi * 16 + gid + 8 * h
                    if r >= nrows:
                        continue
                    for ni in range(4):
                        c = wn * 32 + ni * 8 + tig * 2
                        if c >= ncols:
                            continue
                        for j in range(2):
                            v = np.float32(acc[w][mi][ni][2 * h + j][ln])
                            idx = obase + r * ld + c + j
                            if idx < 0 or idx >= out.size:
                                raise IndexError(f"store {idx} outside out ({out.size})")
                            out[idx] = v if out_f32 else bf16_to_f(f_to_bf16(float(v)))


def zero_rows_range(r0, m_total, n, n0):
    """zero_rows: the (element offset, count) of each 8-element store, [] when r0 >= M."""
    if r0 >= m_total:
        return []
    nrows, ncols = min(m_total - r0, 128), min(128, n - n0)
    st = []
    for i in range(128 * 16):  # i = threadIdx.x + 256 j
        r, c = i >> 4, (i & 15) * 8
        if r < nrows and c < ncols:
            st.append(((r0 + r) * n + n0 + c, 8))
    return st


def new_acc():
    return [[[[[0.0] * 32 for _ in range(4)] for _ in range(4)] for _ in range(4)] for _ in range(8)]


# ---------------------------------------------------------------------------------------------- 2d3d kernel
def cta_2d3d(gi, n_t, n, k):
    """gm_2d3d_tile (the prologue of both 2d3d kernels) for a CTA with a group tile, vectorized over n_t and threads.

    Returns the per-thread constants as int64 / bool arrays [len(n_t), 256] (offsets in bytes / elements)."""
    n_t = np.asarray(n_t, dtype=np.int64).reshape(-1, 1)
    shape = (n_t.shape[0], 256)
    g = gi["g"]
    mrows = min(128, gi["rows"] - gi["tile"] * 128)
    arow0 = gi["row0"] + gi["tile"] * 128
    tpr = ((k >> 5) + 3) >> 2
    a_sc = (gi["toff"] + gi["tile"]) * tpr * 512
    bstride = ((n + 127) >> 7) * tpr * 512
    b_sc = g * bstride + n_t * tpr * 512
    n0 = n_t * 128
    crow, ck = TID >> 2, (TID & 3) * 16
    aok0, aok1 = crow < mrows, crow + 64 < mrows
    bok0, bok1 = n0 + crow < n, n0 + crow + 64 < n
    c = {
        "mrows": mrows,
        "arow0": arow0,
        "n0": n0,
        "ck": ck,
        "aok0": aok0,
        "aok1": aok1,
        "bok0": bok0,
        "bok1": bok1,
        "ap": (arow0 + np.where(aok0, crow, 0)) * k,  # ap - A (column 0 of the thread's first row)
        "bp": (g * n + np.where(bok0, n0 + crow, 0)) * k,
        "step64": 64 * k,
        "a_so": a_sc + (crow & 31) * 16 + (crow >> 5) * 4,
        "b_so": b_sc + (crow & 31) * 16 + (crow >> 5) * 4,
        "st0": (crow * KM_LD + ck) * 2,
    }
    c["st1"] = c["st0"] + 64 * KM_LD * 2
    return {key: np.broadcast_to(v, shape) if isinstance(v, np.ndarray) else v for key, v in c.items()}


def load_2d3d(c, s, k):
    """Gm2d3dLoad::load(s): {register: (valid, buffer, byte offset, bytes)} with [CTAs, 256] arrays."""
    kk = s * 64 + c["ck"]
    kv = kk < k
    cc = kk >> 5
    coff = (cc >> 2) * 512 + (cc & 3)
    return {
        "ra0": (c["aok0"] & kv, "a", c["ap"] + kk, 16),
        "ra1": (c["aok1"] & kv, "a", c["ap"] + c["step64"] + kk, 16),
        "rb0": (c["bok0"] & kv, "b", c["bp"] + kk, 16),
        "rb1": (c["bok1"] & kv, "b", c["bp"] + c["step64"] + kk, 16),
        "sa0": (c["aok0"] & kv, "a_sc", c["a_so"] + coff, 1),
        "sa1": (c["aok1"] & kv, "a_sc", c["a_so"] + coff + 8, 1),
        "sb0": (c["bok0"] & kv, "b_sc", c["b_so"] + coff, 1),
        "sb1": (c["bok1"] & kv, "b_sc", c["b_so"] + coff + 8, 1),
    }


def emu_2d3d(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32, zero_rest=False):
    bufs = {"a": a, "a_sc": a_sc, "b": b, "b_sc": b_sc}
    n_tiles = (n + 127) // 128
    grid = ((m_total + 127) // 128 + g_count) * n_tiles
    for bid in range(grid):
        m_t, n_t = bid // n_tiles, bid % n_tiles
        gi = scan_groups(sizes, g_count, m_total, 1, m_t)
        if gi["g"] < 0:
            assert m_t >= gi["total_tiles"]
            if zero_rest:
                r0 = gi["total_rows"] + (m_t - gi["total_tiles"]) * 128
                for off, cnt in zero_rows_range(r0, m_total, n, n_t * 128):
                    assert off % 8 == 0 and 0 <= off and off + cnt <= out.size, off  # 16-byte aligned stores
                    out[off : off + cnt] = 0.0
            continue
        c = cta_2d3d(gi, [n_t], n, k)
        if c["mrows"] <= 0:
            continue
        sm = Smem()
        acc = new_acc()
        ksteps = (k + 63) // 64
        regs = {}

        def load(s):
            for name, (ok, buf, off, nb) in load_2d3d(c, s, k).items():
                if nb == 16:
                    regs[name] = [words(bufs[buf], int(off[0, t]), 16) if ok[0, t] else [0] * 4 for t in range(256)]
                else:
                    regs[name] = [byte(bufs[buf], int(off[0, t])) if ok[0, t] else 127 for t in range(256)]

        def store(stage):
            base = stage * STAGE
            for t in range(256):
                for ra, sa, oper, st in (
                    ("ra0", "sa0", 0, "st0"),
                    ("ra1", "sa1", 0, "st1"),
                    ("rb0", "sb0", OPER, "st0"),
                    ("rb1", "sb1", OPER, "st1"),
                ):
                    ws = cvt_words_1s(regs[ra][t], regs[sa][t])
                    addr = base + oper + int(c[st][0, t])
                    sm.sts(addr, ws[:4])
                    sm.sts(addr + 16, ws[4:])

        mainloop(sm, load, store, ksteps, acc, False)
        n0 = int(c["n0"][0, 0])
        store_tile(out, c["arow0"] * n + n0, n, c["mrows"], n - n0, acc, out_f32)


# ---------------------------------------------------------------------------------------------- wgrad kernel
def cta_wgrad(g, rem, gi, n, k):
    """The prologue of gmm_wgrad for CTAs (g, rem[]) vectorized over rem (1-D) and threads."""
    kt = (k + 127) // 128
    rem = np.asarray(rem, dtype=np.int64).reshape(-1, 1)
    shape = (rem.shape[0], 256)
    i0, j0 = (rem // kt) * 128, (rem % kt) * 128
    q, c8 = TID >> 4, (TID & 15) * 8
    aok, bok = i0 + c8 < n, j0 + c8 < k
    c = {
        "g": g,
        "i0": i0,
        "j0": j0,
        "row0": gi["row0"],
        "rows": gi["rows"],
        "boff": gi["boff"],
        "q": q,
        "aok": aok,
        "bok": bok,
        "ca": i0 + np.where(aok, c8, 0),
        "cb": j0 + np.where(bok, c8, 0),
        "st0": ((4 * q) * MN_LD + c8) * 2,
    }
    return {key: np.broadcast_to(v, shape) if isinstance(v, np.ndarray) else v for key, v in c.items()}


def load_wgrad(c, s, n, k):
    """load(s) of gmm_wgrad: {register: (valid, buffer, byte offset, bytes)} with [CTAs, 256] arrays."""
    lr = s * 64 + 4 * c["q"]
    ld = {}
    for i in range(4):
        rv = lr + i < c["rows"]
        r = c["row0"] + lr + i
        ld[f"ra{i}"] = (c["aok"] & rv, "a", r * n + c["ca"], 8)
        ld[f"rb{i}"] = (c["bok"] & rv, "b", r * k + c["cb"], 8)
    rv = lr < c["rows"]
    sr = c["boff"] + (lr >> 5)
    ld["sva"] = (c["aok"] & rv, "a_sc", sr * n + c["ca"], 8)
    ld["svb"] = (c["bok"] & rv, "b_sc", sr * k + c["cb"], 8)
    return ld


def emu_wgrad(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32):
    bufs = {"a": a, "a_sc": a_sc, "b": b, "b_sc": b_sc}
    nt, kt = (n + 127) // 128, (k + 127) // 128
    for bid in range(g_count * nt * kt):
        g, rem = bid // (nt * kt), bid % (nt * kt)
        gi = scan_groups(sizes, g_count, m_total, 0, g)
        c = cta_wgrad(g, [rem], gi, n, k)
        sm = Smem()
        acc = new_acc()
        ksteps = (c["rows"] + 63) // 64
        regs = {}

        def load(s):
            for name, (ok, buf, off, nb) in load_wgrad(c, s, n, k).items():
                dflt = [0x7F7F7F7F] * 2 if name.startswith("sv") else [0, 0]  # scale 127 / zero data
                regs[name] = [words(bufs[buf], int(off[0, t]), nb) if ok[0, t] else dflt for t in range(256)]

        def store(stage):
            base = stage * STAGE
            for t in range(256):
                ma, fa = pair_mults8(regs["sva"][t])
                mb, fb = pair_mults8(regs["svb"][t])
                st0 = int(c["st0"][0, t])
                for i in range(4):
                    sm.sts(base + st0 + i * MN_LD * 2, cvt_words_ps(regs[f"ra{i}"][t], ma, fa))
                    sm.sts(base + OPER + st0 + i * MN_LD * 2, cvt_words_ps(regs[f"rb{i}"][t], mb, fb))

        mainloop(sm, load, store, ksteps, acc, True)
        i0, j0 = int(c["i0"][0, 0]), int(c["j0"][0, 0])
        store_tile(out, (g * n + i0) * k + j0, k, n - i0, k - j0, acc, out_f32)


# ---------------------------------------------------------------------------------------------- address-only runs
def _check_loads(ld, sizes_of):
    for name, (ok, buf, off, nb) in ld.items():
        o = off[ok]
        if o.size == 0:
            continue
        lo, hi = int(o.min()), int(o.max())
        if lo < 0 or hi + nb > sizes_of[buf]:
            raise IndexError(f"{name}: load [{lo}, {hi + nb}) outside {buf} ({sizes_of[buf]} bytes)")
        if nb > 1 and (o % nb).any():
            raise ValueError(f"{name}: misaligned {nb}-byte load")


def addresses_2d3d(sizes, m_total, n, k, zero_rest=True):
    """Every CTA of the 2d3d grid, addresses only: loads of the first and last k-step are inside the operand
    buffers (as sized by the launcher's checks), and each output row is written by exactly one CTA per column
    tile (rows past the groups: once with zero_rest, else never). Returns the per-row write counts."""
    g_count = len(sizes)
    sizes_of = {
        "a": m_total * k,
        "a_sc": mxfp8.grouped_blocked_size(m_total, g_count, k // 32, "m"),
        "b": g_count * n * k,
        "b_sc": g_count * mxfp8.blocked_size(n, k // 32),
    }
    n_tiles = (n + 127) // 128
    ksteps = (k + 63) // 64
    cover = np.zeros((m_total + 1, n_tiles), dtype=np.int64)  # +1: difference array
    for m_t in range((m_total + 127) // 128 + g_count):
        gi = scan_groups(sizes, g_count, m_total, 1, m_t)
        if gi["g"] < 0:
            assert m_t >= gi["total_tiles"]
            r0 = gi["total_rows"] + (m_t - gi["total_tiles"]) * 128
            if zero_rest and r0 < m_total:
                for n_t in (0, n_tiles - 1):  # the zero stores of the extreme column tiles stay inside out
                    st = zero_rows_range(r0, m_total, n, n_t * 128)
                    assert max(o + cnt for o, cnt in st) <= m_total * n and min(o for o, _ in st) >= 0
                cover[r0] += 1
                cover[min(r0 + 128, m_total)] -= 1
            continue
        c = cta_2d3d(gi, np.arange(n_tiles), n, k)
        if c["mrows"] <= 0:
            continue
        for s in {0, ksteps - 1}:
            _check_loads(load_2d3d(c, s, k), sizes_of)
        r0 = c["arow0"]
        assert gi["row0"] <= r0 and r0 + c["mrows"] <= gi["row0"] + gi["rows"] <= m_total
        cover[r0] += 1
        cover[r0 + c["mrows"]] -= 1
    return np.cumsum(cover, axis=0)[:m_total]


def addresses_wgrad(sizes, m_total, n, k):
    """Every CTA of the wgrad grid, addresses only (loads of the first and last k-step inside the buffers)."""
    g_count = len(sizes)
    rows_sc = gemm_cuda.colwise_scale_rows(m_total, g_count)
    sizes_of = {"a": m_total * n, "b": m_total * k, "a_sc": rows_sc * n, "b_sc": rows_sc * k}
    nt, kt = (n + 127) // 128, (k + 127) // 128
    for g in range(g_count):
        gi = scan_groups(sizes, g_count, m_total, 0, g)
        assert gi["g"] == g and 0 <= gi["rows"] and gi["row0"] + gi["rows"] <= max(m_total, gi["row0"])
        c = cta_wgrad(g, np.arange(nt * kt), gi, n, k)
        ksteps = (gi["rows"] + 63) // 64
        for s in {0, ksteps - 1} if ksteps else ():
            _check_loads(load_wgrad(c, s, n, k), sizes_of)
        # store_tile: rows i0 .. i0 + min(128, N - i0) - 1, columns j0 .. j0 + min(128, K - j0) - 1 of out[g]
        i0, j0 = c["i0"][:, 0], c["j0"][:, 0]
        last = (g * n + i0 + np.minimum(128, n - i0) - 1) * k + j0 + np.minimum(128, k - j0) - 1
        assert (last < g_count * n * k).all() and ((g * n + i0) * k + j0 >= 0).all()


# ---------------------------------------------------------------------------------------------- reference helpers
def mm64(a, b, sizes):
    """grouped_mm_torch in float64 (the reference accumulates in fp32, which cancellation makes inexact)."""
    out, start = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = a[start : start + n].double() @ b[g].double().t()
        start += n
    return out


def wgrad64(a, b, sizes):
    out, start = torch.zeros(len(sizes), a.shape[1], b.shape[1], dtype=torch.float64), 0
    for g, n in enumerate(sizes):
        out[g] = a[start : start + n].double().t() @ b[start : start + n].double()
        start += n
    return out


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def check_emulated_2d3d(emu, sizes, extra, k, n, out_f32, zero_rest, seed):
    """Run an emulated 2d3d kernel (emu_2d3d, or emu_wg_2d3d of the wgmma file) against the float64 reference."""
    torch.manual_seed(seed)
    g, s = len(sizes), sum(sizes)
    m = s + extra  # trailing rows outside every group: untouched, or zero with zero_rest
    x = torch.randn(m, k) * torch.logspace(-3, 3, k).reshape(1, k)[:, torch.randperm(k)]
    w = torch.randn(g, n, k) * 0.5
    xd, xs = gemm_cuda.rowwise_operand_ref(x[:s], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[s:], -1).data])
    xs = torch.cat([xs, torch.zeros(mxfp8.grouped_blocked_size(m, g, k // 32) - xs.numel(), dtype=torch.uint8)])
    wd, ws = gemm_cuda.weight_operand_ref(w)
    out = np.full(m * n, np.nan)
    emu(_u8(xd), _u8(xs), _u8(wd), _u8(ws), sizes, out, g, m, n, k, out_f32, zero_rest)
    out = torch.from_numpy(out).reshape(m, n)
    ref = mm64(mxfp8.fake_quantize(x[:s], -1), mxfp8.fake_quantize(w, -1), sizes)
    if zero_rest:
        assert (out[s:] == 0).all()
    else:
        assert torch.isnan(out[s:]).all()
    # emulated sums are float64: only the final rounding remains, <= 2^-24 (fp32) or 2^-9 (bf16) relative; the
    # bounds are twice that
    tol = 2.0**-23 if out_f32 else 2.0**-8
    torch.testing.assert_close(out[:s], ref, rtol=tol, atol=1e-30)
