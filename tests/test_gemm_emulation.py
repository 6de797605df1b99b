"""CPU emulation of kernels/grouped_gemm.cu (no GPU needed): a line-by-line numpy model of the kernels.

It mirrors the CUDA code's index arithmetic on flat byte arrays (group scan with shfl_up semantics, loader
chunk mapping, scale addressing, e4m3 -> bf16 bit trick + bf16 multiplies, shared-memory byte offsets, ldmatrix
(.trans) lane semantics, mma.m16n8k16 fragment layouts from the PTX ISA, epilogue stores) and checks the
result against the reference (dequantize + float64 matmul per group), including that nothing outside the
groups' rows is written. Out-of-range flat indices raise, so addressing bugs cannot pass silently.
"""

# ruff: noqa: B023  (the emulated kernels' load/store closures run inside the iteration that defines them)
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ep import gemm_cuda, mxfp8
from moe_ep.gemm import fake_quantize_grouped_cols, grouped_mm_torch, grouped_wgrad_torch

KM_LD, MN_LD, OPER, STAGE, SMEM = 72, 136, 18432, 36864, 73728


# ---------------------------------------------------------------------------------------------- bit helpers
def byte_perm(x: int, y: int, s: int) -> int:
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


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


def e4m3x2_bits(w: int, sel: int) -> int:
    d = byte_perm(w, 0, sel)
    return (d & 0x80008000) | ((d >> 4) & 0x07F007F0)


def mult_slow1(s: int) -> int:
    return 0x7FC0 if s == 0xFF else (0x0040 if s == 0 else (s << 7))


def cvt_words_1s(words, s):
    o = []
    for w in words:
        o += [e4m3x2_bits(w, 0x1404), e4m3x2_bits(w, 0x3424)]
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
            m += [mult_slow1(lo & 0xFF) | (mult_slow1(lo >> 16) << 16),
                  mult_slow1(hi & 0xFF) | (mult_slow1(hi >> 16) << 16)]
    return m, fast


def cvt_words_ps(words, m, fast):
    o = []
    for w in words:
        o += [e4m3x2_bits(w, 0x1404), e4m3x2_bits(w, 0x3424)]
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


def sts(smem: np.ndarray, addr: int, ws):
    assert addr % 16 == 0 and 0 <= addr and addr + 4 * len(ws) <= SMEM
    smem[addr // 2 : addr // 2 + 2 * len(ws)] = np.array(ws, dtype=np.uint32).view(np.uint16)


# ---------------------------------------------------------------------------------------------- group scan
def scan_groups(sizes, g_count, m_total, by_tile, target):
    gi = {"g": -1}
    crow = ctile = cblk = 0
    for base in range(0, g_count, 32):
        n = [max(sizes[base + ln], 0) if base + ln < g_count else 0 for ln in range(32)]
        nt = [(v + 127) >> 7 for v in n]
        nb = [(v + 31) >> 5 for v in n]
        r, t, b = list(n), list(nt), list(nb)
        o = 1
        while o < 32:  # __shfl_up_sync: lanes < o keep their own value (and do not add)
            r2, t2, b2 = list(r), list(t), list(b)
            for ln in range(o, 32):
                r[ln] += r2[ln - o]
                t[ln] += t2[ln - o]
                b[ln] += b2[ln - o]
            o <<= 1
        for ln in range(32):
            h = base + ln
            r_ex, t_ex, b_ex = crow + r[ln] - n[ln], ctile + t[ln] - nt[ln], cblk + b[ln] - nb[ln]
            hit = h < g_count and ((n[ln] > 0 and t_ex <= target < t_ex + nt[ln]) if by_tile else h == target)
            if hit:
                avail = min(max(m_total - r_ex, 0), n[ln])
                gi = {"row0": r_ex, "rows": avail, "g": h, "tile": target - t_ex if by_tile else 0, "toff": t_ex,
                      "boff": b_ex}
        crow, ctile, cblk = crow + r[31], ctile + t[31], cblk + b[31]
    return gi


# ---------------------------------------------------------------------------------------------- warp math
def ldsm(smem, addrs, trans):
    """ldmatrix .x4: addrs[32] byte addresses (lanes 8i..8i+7 = rows of matrix i) -> regs[4][32]."""
    h = smem  # uint16 view
    regs = [[0] * 32 for _ in range(4)]
    for i in range(4):
        for ln in range(32):
            if trans:  # thread gets (row 2*(l%4) + j, col l/4) of the stored matrix
                e = [int(h[(addrs[8 * i + 2 * (ln % 4) + j] + (ln // 4) * 2) // 2]) for j in range(2)]
            else:  # thread gets (row l/4, cols 2*(l%4) + j)
                e = [int(h[(addrs[8 * i + ln // 4] + (2 * (ln % 4) + j) * 2) // 2]) for j in range(2)]
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


def compute_stage(smem, sa, sb, acc, mn):
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
                af.append(ldsm(smem, addrs, mn))
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
                r = ldsm(smem, addrs, mn)
                bfr[2 * np_], bfr[2 * np_ + 1] = [r[0], r[1]], [r[2], r[3]]
            for mi in range(4):
                for ni in range(4):
                    mma(acc[w][mi][ni], [[af[mi][j][ln] for ln in range(32)] for j in range(4)], bfr[ni][0], bfr[ni][1])


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


def new_acc():
    return [[[[[0.0] * 32 for _ in range(4)] for _ in range(4)] for _ in range(4)] for _ in range(8)]


# ---------------------------------------------------------------------------------------------- kernels
def emu_2d3d(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32):
    n_tiles = (n + 127) // 128
    grid = ((m_total + 127) // 128 + g_count) * n_tiles
    for bid in range(grid):
        m_t, n_t = bid // n_tiles, bid % n_tiles
        gi = scan_groups(sizes, g_count, m_total, 1, m_t)
        if gi["g"] < 0:
            continue
        g = gi["g"]
        mrows = min(128, gi["rows"] - gi["tile"] * 128)
        if mrows <= 0:
            continue
        arow0 = gi["row0"] + gi["tile"] * 128
        tpr = ((k >> 5) + 3) >> 2
        a_base = (gi["toff"] + gi["tile"]) * tpr * 512
        b_base = g * (((n + 127) >> 7) * tpr * 512) + n_t * tpr * 512
        n0 = n_t * 128
        smem = np.zeros(SMEM // 2, dtype=np.uint16)
        acc = new_acc()
        ksteps = (k + 63) // 64

        def load_store(s, stage):
            base = stage * STAGE
            for tid in range(256):
                crow, ck = tid >> 2, (tid & 3) * 16
                kk = s * 64 + ck
                kv = kk < k
                c = kk >> 5
                coff = (c >> 2) * 512 + (c & 3)
                so = (crow & 31) * 16 + (crow >> 5) * 4
                for i in range(2):
                    r = crow + 64 * i
                    aok, bok = r < mrows, n0 + r < n
                    ra = words(a, (arow0 + r) * k + kk, 16) if aok and kv else [0] * 4
                    rb = words(b, (g * n + n0 + r) * k + kk, 16) if bok and kv else [0] * 4
                    sa_ = byte(a_sc, a_base + so + coff + 8 * i) if aok and kv else 127
                    sb_ = byte(b_sc, b_base + so + coff + 8 * i) if bok and kv else 127
                    st = (crow * KM_LD + ck) * 2 + i * 64 * KM_LD * 2
                    ws = cvt_words_1s(ra, sa_)
                    sts(smem, base + st, ws[:4])
                    sts(smem, base + st + 16, ws[4:])
                    ws = cvt_words_1s(rb, sb_)
                    sts(smem, base + OPER + st, ws[:4])
                    sts(smem, base + OPER + st + 16, ws[4:])

        load_store(0, 0)
        for s in range(ksteps):
            compute_stage(smem, (s & 1) * STAGE, (s & 1) * STAGE + OPER, acc, False)
            if s + 1 < ksteps:
                load_store(s + 1, (s + 1) & 1)
        store_tile(out, arow0 * n + n0, n, mrows, n - n0, acc, out_f32)


def emu_wgrad(a, a_sc, b, b_sc, sizes, out, g_count, m_total, n, k, out_f32):
    nt, kt = (n + 127) // 128, (k + 127) // 128
    for bid in range(g_count * nt * kt):
        g, rem = bid // (nt * kt), bid % (nt * kt)
        i0, j0 = (rem // kt) * 128, (rem % kt) * 128
        gi = scan_groups(sizes, g_count, m_total, 0, g)
        row0, rows, boff = gi["row0"], gi["rows"], gi["boff"]
        smem = np.zeros(SMEM // 2, dtype=np.uint16)
        acc = new_acc()
        ksteps = (rows + 63) // 64

        def load_store(s, stage):
            base = stage * STAGE
            for tid in range(256):
                q, c8 = tid >> 4, (tid & 15) * 8
                aok, bok = i0 + c8 < n, j0 + c8 < k
                ca, cb = i0 + (c8 if aok else 0), j0 + (c8 if bok else 0)
                lr = s * 64 + 4 * q
                rv = lr < rows
                sr = boff + (lr >> 5)
                sva = words(a_sc, sr * n + ca, 8) if aok and rv else [0x7F7F7F7F] * 2
                svb = words(b_sc, sr * k + cb, 8) if bok and rv else [0x7F7F7F7F] * 2
                ma, fa = pair_mults8(sva)
                mb, fb = pair_mults8(svb)
                st0 = ((4 * q) * MN_LD + c8) * 2
                for i in range(4):
                    rvi = lr + i < rows
                    r = row0 + lr + i
                    ra = words(a, r * n + ca, 8) if aok and rvi else [0, 0]
                    rb = words(b, r * k + cb, 8) if bok and rvi else [0, 0]
                    sts(smem, base + st0 + i * MN_LD * 2, cvt_words_ps(ra, ma, fa))
                    sts(smem, base + OPER + st0 + i * MN_LD * 2, cvt_words_ps(rb, mb, fb))

        if ksteps > 0:
            load_store(0, 0)
        for s in range(ksteps):
            compute_stage(smem, (s & 1) * STAGE, (s & 1) * STAGE + OPER, acc, True)
            if s + 1 < ksteps:
                load_store(s + 1, (s + 1) & 1)
        store_tile(out, (g * n + i0) * k + j0, k, n - i0, k - j0, acc, out_f32)


# ---------------------------------------------------------------------------------------------- tests
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
        if t >= offs[-1]:
            assert gi["g"] == -1
            continue
        g = gi["g"]
        assert offs[g] <= t < offs[g + 1] and gi["toff"] == offs[g] and gi["row0"] == sum(sizes[:g])
    for g in range(len(sizes)):
        gi = scan_groups(sizes, len(sizes), m, 0, g)
        assert gi["boff"] == sum((v + 31) // 32 for v in sizes[:g]) and gi["rows"] == sizes[g]


CASES_2D3D = [([5, 0, 37, 130], 96, 136, False), ([0, 0, 0], 64, 16, True), ([200], 32, 8, True),
              ([1, 127, 0, 64], 128, 264, True), ([3, 40], 64, 24, False)]


@pytest.mark.parametrize("sizes,k,n,out_f32", CASES_2D3D)
def test_emulated_2d3d_matches_reference(sizes, k, n, out_f32):
    torch.manual_seed(sum(sizes) + k + n)
    g, m = len(sizes), sum(sizes) + 3  # 3 trailing rows outside every group: must stay untouched
    x = torch.randn(m, k) * torch.logspace(-3, 3, k).reshape(1, k)[:, torch.randperm(k)]
    w = torch.randn(g, n, k) * 0.5
    xd, xs = gemm_cuda.rowwise_operand_ref(x[: sum(sizes)], sizes)
    xd = torch.cat([xd, mxfp8.quantize_torch(x[sum(sizes) :], -1).data])
    xs = torch.cat([xs, torch.zeros(mxfp8.grouped_blocked_size(m, g, k // 32) - xs.numel(), dtype=torch.uint8)])
    wd, ws = gemm_cuda.weight_operand_ref(w)
    out = np.full(m * n, np.nan)
    emu_2d3d(_u8(xd), _u8(xs), _u8(wd), _u8(ws), sizes, out, g, m, n, k, out_f32)
    out = torch.from_numpy(out).reshape(m, n)
    xq = mxfp8.fake_quantize(x[: sum(sizes)], -1)
    ref = mm64(xq, mxfp8.fake_quantize(w, -1), sizes)
    got = out[: sum(sizes)]
    assert torch.isnan(out[sum(sizes) :]).all()
    tol = 1e-5 if out_f32 else 2.0**-8  # emulated sums are float64: only the final fp32/bf16 rounding remains
    torch.testing.assert_close(got, ref, rtol=tol, atol=1e-30)


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
    torch.testing.assert_close(ref.float(), spec, rtol=1e-4, atol=1e-4)  # the fp64 helper agrees with the spec
    torch.testing.assert_close(torch.from_numpy(out).reshape(m, k), ref, rtol=1e-5, atol=1e-30)


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
    torch.testing.assert_close(ref.float(), grouped_wgrad_torch(fake_quantize_grouped_cols(dy, sizes),
                                                                fake_quantize_grouped_cols(x, sizes), sizes),
                               rtol=1e-4, atol=1e-4)  # the fp64 helper agrees with the spec
    torch.testing.assert_close(torch.from_numpy(out).reshape(g, n, k), ref, rtol=1e-5, atol=1e-30)


def test_colwise_converter_matches_fake_quantize_grouped_cols():
    sizes = [0, 5, 33, 64, 0, 100]
    t = torch.randn(sum(sizes), 24) * 10
    d, s = gemm_cuda.colwise_operand_ref(t, sizes)
    assert s.shape == (gemm_cuda.colwise_scale_rows(sum(sizes), len(sizes)), 24)
    back = gemm_cuda.colwise_dequantize_ref(d, s, sizes)
    assert torch.equal(back, fake_quantize_grouped_cols(t, sizes))
