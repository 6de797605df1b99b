"""The one-pass weight preparation: ``prepare_weight_operands`` (kernels/experts/sm90/weight_prep.cu
``mx_prepare_weight_operands_*``) against the two-step path it replaced and the torch references.

* CPU: the reference ``prepare_weight_operands_torch`` is the MXFP8 definition (fake quantization along K for
  fprop, along N for dgrad, k permuted, zero padded); argument checks; the launch plan; and the kernel source itself
  compiled as C++ and run on the CPU (one fiber per CUDA thread, the shim of tests/quant_emu.py) against the
  reference on awkward inputs. The emulator uses the real kernel text; only gemm_common.cuh's two PTX helpers
  (``e4m3x2_bits``, ``hmul2_bf16``) are replaced by bit models (those of tests/gemm_emu.py).
* GPU (marker ``gpu``): the kernel's bytes equal ``prepare_weight_bf16(*quantize_weights_fused(w)[:2])`` /
  ``[2:]`` exactly (NaN payloads included) and the references up to NaN payloads, on NaN/Inf blocks, zeros, tiny
  and huge values, N / K multiples of 32 but not of 64 or 128, one and several experts, bf16 / fp32; into a
  given ``out`` with nothing written past it and no host sync; ``weight_operands`` on CUDA holds None in the e4m3
  fields, and fprop / dgrad on its operands equal those on the two-step operands bit for bit.

Run the GPU part: ``python3 -m pytest -q tests/test_weight_prep_cuda.py -m gpu``.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.sm90 import gemm as gemm_cuda
from moe_ep.experts.sm90 import operands
from tests import quant_emu
from tests.test_gemm_emulation_kernels import assert_same_bf16

DTYPES = (torch.bfloat16, torch.float32)
# (G, N, K): N and K multiples of 32; 96 / 160 / 288 / 416 are not multiples of 64 (the zero padding of the
# prepared operands), and tiles of 128 end in partial ones of 32 or 96 rows / columns
SHAPES = [(1, 32, 32), (1, 96, 160), (3, 160, 96), (2, 288, 416), (2, 416, 288), (2, 256, 384)]


def awkward_weight(g: int, n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random weight with per-row and per-column magnitudes over 1e-3 .. 1e3 (CPU), plus: a NaN (row block and
    column block), +Inf and -Inf, a zero 32 x 32 block, a block of bf16/fp32 subnormals, a block mixing 1.0 with
    values that underflow in e4m3, values near the bf16 maximum (the e4m3 rounding then overflows to Inf in bf16),
    and negative zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, n, k, generator=gen)
    w *= 10.0 ** (torch.rand(g, n, 1, generator=gen) * 6 - 3) * 10.0 ** (torch.rand(g, 1, k, generator=gen) * 6 - 3)
    w[-1, n - 1, k - 1] = float("inf")
    w[0, (40 % n), (33 % k)] = float("-inf")
    if n >= 64 and k >= 64:
        w[0, 32:64, 32:64] = 0.0
        w[-1, 32:64, :32] = torch.randn(32, 32, generator=gen) * 2.0**-130  # subnormal in bf16 and fp32
        w[-1, 32:64, 32] = -0.0
    w[-1, :32, :32] = torch.randn(32, 32, generator=gen) * 1e-30
    w[-1, :32, 0] = 1.0  # one large value per row block: the rest underflows in e4m3
    w[0, n - 1, :32] = torch.linspace(-1.0, 1.0, 32) * 3.38e38  # near bf16 max
    w[-1, n - 32 :, k - 1] = -0.0
    # last: with one expert (w[0] is w[-1]) an earlier write would overwrite it (row 0's first block is NaN)
    w[0, 0, min(5, k - 1)] = float("nan")
    return w.to(dtype)


def _two_step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The path prepare_weight_operands replaced: both MXFP8 copies (mx_quant_batch), then mx_prepare_weight_bf16
    of each."""
    from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415

    wd, ws, wtd, wts = mxfp8_cuda.quantize_weights_fused(w)
    return operands.prepare_weight_bf16(wd, ws), operands.prepare_weight_bf16(wtd, wts)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())


# ---------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_mxfp8_definition(dtype):
    """prepare_weight_operands_torch: w_prepared un-permuted = fake_quantize(W, along K) in bf16, zero padded to a
    multiple of 64; wt_prepared un-permuted = fake_quantize(W, along N) transposed, zero padded. NaN where a block
    has NaN/Inf. On a CPU tensor prepare_weight_operands is the reference, and weight_operands' prepared fields."""
    g, n, k = 2, 96, 160
    w = awkward_weight(g, n, k, dtype, seed=1)
    wp, wtp = operands.prepare_weight_operands_torch(w)
    assert wp.shape == (g, n, 192) and wtp.shape == (g, k, 128) and wp.dtype == wtp.dtype == torch.bfloat16
    inv = torch.argsort(operands.k_permutation())

    def unpermute(t):
        return t.view(*t.shape[:2], -1, 64)[..., inv].reshape(t.shape)

    def fake_quantize_bf16(axis):  # the exact dequantization (fp32), rounded once to bf16
        return mxfp8.dequantize_torch(mxfp8.quantize_torch(w, axis), torch.bfloat16)

    for got, ref, width in (
        (unpermute(wp), fake_quantize_bf16(-1), k),
        (unpermute(wtp), fake_quantize_bf16(-2).transpose(1, 2), n),
    ):
        assert_same_bf16(got[..., :width].contiguous(), ref.contiguous())
        assert (got[..., width:] == 0).all() and not torch.signbit(got[..., width:]).any()
    assert torch.isnan(wp).any() and (wp == 0).any()
    assert torch.isinf(wp).any()  # near-max values round to Inf in bf16
    got = operands.prepare_weight_operands(w)
    assert _same_bytes(got[0], wp) and _same_bytes(got[1], wtp)
    out = (torch.empty_like(wp), torch.empty_like(wtp))
    assert operands.prepare_weight_operands(w, out=out)[0] is out[0] and _same_bytes(out[1], wtp)
    ops = operands.weight_operands(w)
    assert _same_bytes(ops.w_prepared, wp) and _same_bytes(ops.wt_prepared, wtp)
    assert ops.w is not None and ops.wt_scale is not None  # the reference path keeps the MXFP8 copies


def test_prepare_weight_operands_rejects_bad_inputs():
    with pytest.raises(TypeError, match="w must be"):
        operands.prepare_weight_operands(torch.zeros(1, 32, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiples of 32"):
        operands.prepare_weight_operands(torch.zeros(1, 48, 32))
    with pytest.raises(ValueError, match="multiples of 32"):
        operands.prepare_weight_operands_torch(torch.zeros(1, 32, 40))
    with pytest.raises(ValueError, match="multiples of 32"):
        operands.prepare_weight_operands(torch.zeros(32, 32))


def test_operands_plan():
    """One CTA per 128 x 128 tile of each expert (grid.y = expert); shared memory = the tile + 32 KiB staging."""
    assert operands._operands_plan(torch.bfloat16, 64, 4096, 7168) == (
        "mx_prepare_weight_operands_bf16",
        (32 * 56, 64),
        65536,
        56,
    )
    assert operands._operands_plan(torch.float32, 3, 160, 96) == ("mx_prepare_weight_operands_f32", (2, 3), 98304, 1)
    assert operands._operands_plan(torch.bfloat16, 2, 32, 416)[1:] == ((4, 2), 65536, 4)
    with pytest.raises(TypeError, match="float16"):  # fp16 master weights are not prepared (no kernel for them)
        operands._check_weight(torch.zeros(1, 32, 32, dtype=torch.float16))
    assert operands._operands_plan(torch.bfloat16, 0, 32, 32) is None
    assert operands._operands_plan(torch.bfloat16, 2, 0, 32) is None
    with pytest.raises(ValueError, match="65535"):
        operands._operands_plan(torch.bfloat16, 65536, 32, 32)


# ---------------------------------------------------------------------------------------------- CPU emulator
def _replace_function(text: str, signature: str, body: str) -> str:
    """``text`` with the function whose definition starts with ``signature`` replaced by ``body`` (brace matched)."""
    start = text.index(signature)
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[:start] + body + text[j + 1 :]
    raise ValueError(f"unbalanced braces after {signature!r}")


# bit models of gemm_common.cuh's PTX helpers (prmt with sign-replicated bytes; mul.rn.bf16x2 with subnormals)
_HOST_E4M3X2 = r"""static inline unsigned e4m3x2_bits(unsigned w, unsigned sel) {
    unsigned d = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned nib = (sel >> (4 * i)) & 0xFu;
        const unsigned b = (nib & 7u) < 4u ? (w >> (8 * (nib & 3u))) & 0xFFu : 0u;  // bytes 4-7: the zero operand
        d |= ((nib & 8u) ? ((b & 0x80u) ? 0xFFu : 0u) : b) << (8 * i);
    }
    return (d << 4) & 0x87F087F0u;
}"""
_HOST_HMUL2 = r"""static inline unsigned emu_bf16_rne(float f) {
    const unsigned x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
    return ((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16) & 0xFFFFu;
}
static inline unsigned hmul2_bf16(unsigned a, unsigned b) {
    const float lo = (float)((double)__uint_as_float(a << 16) * (double)__uint_as_float(b << 16));
    const float hi = (float)((double)__uint_as_float(a & 0xFFFF0000u) * (double)__uint_as_float(b & 0xFFFF0000u));
    return emu_bf16_rne(lo) | (emu_bf16_rne(hi) << 16);
}"""

_WP_ENTRY = r"""
typedef void (*WpFn)(const unsigned char*, unsigned short*, unsigned short*, int, int, int);
extern "C" int emu_wp(int in, int gx, int gy, long long smem, const unsigned char* w, unsigned short* wp,
                      unsigned short* wtp, int N, int K, int ktiles) {
    WpFn fn = in == 0 ? &mx_prepare_weight_operands_f32 : &mx_prepare_weight_operands_bf16;
    if (smem > (long long)sizeof(g_smem)) return 3;
    memset(g_smem, 0xA5, sizeof(g_smem));
    run_grid(gx, [&] { fn(w, wp, wtp, N, K, ktiles); }, gy, 256);
    for (size_t i = (size_t)smem; i < sizeof(g_smem); ++i)
        if (g_smem[i] != 0xA5) return 2;
    return g_deadlock ? 6 : 0;
}
"""

_EXTRA_SHIM = r"""
template <class T> static T __shfl_sync(unsigned, T v, int src) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t u = 0; memcpy(&u, &v, sizeof(T));
    g_shfl[warp][lane] = u;
    g_warp[warp]->arrive_and_wait();
    T r = v;
    memcpy(&r, &g_shfl[warp][src & 31], sizeof(T));
    g_warp[warp]->arrive_and_wait();
    return r;
}
static inline void __syncwarp() { g_warp[threadIdx.x >> 5]->arrive_and_wait(); }
static inline unsigned long long __cvta_generic_to_shared(const void* p) { return (unsigned long long)(uintptr_t)p; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline void __trap() { abort(); }
"""


def build_weight_prep_emulator(workdir):
    """kernels/experts/sm90/weight_prep.cu compiled for the CPU with quant_emu's shim; a ctypes.CDLL (None without a
    compiler)."""
    import ctypes  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    if quant_emu.CXX is None:
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    common = (quant_emu.KERNELS / "experts/sm90/gemm_common.cuh").read_text()
    common = _replace_function(common, "__device__ __forceinline__ unsigned e4m3x2_bits(", _HOST_E4M3X2)
    common = _replace_function(common, "__device__ __forceinline__ unsigned hmul2_bf16(", _HOST_HMUL2)
    # the copied kernel includes this model first (its own directory), common.cuh / quant_elem.cuh from kernels/
    (workdir / "gemm_common.cuh").write_text(common)
    (workdir / "weight_prep.cu").write_text((quant_emu.KERNELS / "experts/sm90/weight_prep.cu").read_text())
    shim = quant_emu.EMU_SHIM.split('#include "mxfp8/quantize.cu"')[0]
    assert "run_grid" not in shim
    run_grid = re.search(r"template <class F> static void run_grid.*?\n}\n", quant_emu.EMU_SHIM, re.S).group(0)
    src = workdir / "emu_wp.cpp"
    src.write_text("#include <cstdlib>\n" + shim + _EXTRA_SHIM + '#include "weight_prep.cu"\n' + run_grid + _WP_ENTRY)
    lib = workdir / "libwpemu.so"
    cmd = [quant_emu.CXX, "-O1", "-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing"]
    cmd += ["-Wno-unknown-pragmas", *quant_emu.INCLUDES, str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(str(lib))
    i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    so.emu_wp.argtypes = [i, i, i, ll, p, p, p, i, i, i]
    return so


@pytest.fixture(scope="module")
def wp_emulator(tmp_path_factory):
    so = build_weight_prep_emulator(tmp_path_factory.mktemp("wpemu"))
    if so is None:
        pytest.skip("no C++ compiler")
    return so


def emulate_prepare_weight_operands(so, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch prepare_weight_operands makes (its plan, poisoned outputs), run by the emulator on the CPU."""
    g, n, k = w.shape
    kp, np_ = -(-k // 64) * 64, -(-n // 64) * 64
    wp = torch.full((g, n, kp), 0x5A5A, dtype=torch.int16)  # poison: every element must be written
    wtp = torch.full((g, k, np_), 0x5A5A, dtype=torch.int16)
    kernel, (gx, gy), smem, ktiles = operands._operands_plan(w.dtype, g, n, k)
    code = {"f32": 0, "bf16": 1}[kernel.rsplit("_", 1)[1]]
    rc = so.emu_wp(code, gx, gy, smem, w.data_ptr(), wp.data_ptr(), wtp.data_ptr(), n, k, ktiles)
    assert rc != 2, f"{kernel} wrote shared memory past the {smem} bytes the launcher allocates"
    assert rc == 0, f"emulator rc {rc}"
    return wp.view(torch.bfloat16), wtp.view(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32, 32), (3, 160, 96), (2, 288, 416), (1, 256, 128)])
def test_emulated_kernel_matches_reference(wp_emulator, shape, dtype):
    """The kernel source, run on the CPU: every element of both outputs written, equal to the reference (NaN
    payloads aside), the shared memory within the plan's size."""
    w = awkward_weight(*shape, dtype, seed=sum(shape))
    got = emulate_prepare_weight_operands(wp_emulator, w)
    ref = operands.prepare_weight_operands_torch(w)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        assert_same_bf16(a, b)


# ---------------------------------------------------------------------------------------------------- GPU
def _skip_without_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_two_step_path_and_reference(shape, dtype):
    """prepare_weight_operands == prepare_weight_bf16 of quantize_weights_fused's two copies, byte for byte (NaN
    payloads included), and == prepare_weight_operands_torch up to NaN payloads; into a given ``out`` too, nothing
    written past it, no host sync."""
    _skip_without_gpu()
    g, n, k = shape
    w = awkward_weight(g, n, k, dtype, seed=n + k).cuda()
    ref = operands.prepare_weight_operands_torch(w)
    old = _two_step(w)
    kp, np_ = -(-k // 64) * 64, -(-n // 64) * 64
    sizes = (g * n * kp, g * k * np_)
    bufs = [torch.full((s + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda") for s in sizes]
    out = (bufs[0][: g * n * kp].view(g, n, kp), bufs[1][: g * k * np_].view(g, k, np_))
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = operands.prepare_weight_operands(w)
        got_out = operands.prepare_weight_operands(w, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert got_out[0] is out[0] and got_out[1] is out[1]
    for name, a, o, b, r in zip(("w_prepared", "wt_prepared"), got, out, old, ref, strict=True):
        assert _same_bytes(a, b), f"{name}: differs from the two-step path"
        assert _same_bytes(o, b), f"{name} (out=): differs from the two-step path"
        assert_same_bf16(a.cpu(), r.cpu())
    for buf, used in zip(bufs, sizes, strict=True):
        assert torch.isnan(buf[used:]).all(), "written past the end of out"
    assert torch.isinf(got[0]).any() and torch.isnan(got[0]).any() and torch.isnan(got[1]).any()


@pytest.mark.gpu
def test_kernel_many_experts_and_tiles():
    """A larger weight (20 experts, 16 x 9 tiles each, N % 128 == 96, K % 128 == 32) against the two-step path."""
    _skip_without_gpu()
    w = awkward_weight(20, 2016, 1056, torch.bfloat16, seed=7).cuda()
    got, old = operands.prepare_weight_operands(w), _two_step(w)
    assert _same_bytes(got[0], old[0]) and _same_bytes(got[1], old[1])


@pytest.mark.gpu
def test_prepare_weight_operands_gpu_errors():
    _skip_without_gpu()
    w = torch.zeros(2, 64, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        operands.prepare_weight_operands(w.transpose(1, 2).contiguous().transpose(1, 2))
    wp = torch.empty(2, 64, 128, dtype=torch.bfloat16, device="cuda")
    wtp = torch.empty(2, 96, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"out\[1\] must be"):
        operands.prepare_weight_operands(w, out=(wp, wtp[:, :64]))
    with pytest.raises(TypeError, match=r"out\[0\] must be"):
        operands.prepare_weight_operands(w, out=(wp.float(), wtp))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_operands_on_gpu(dtype):
    """weight_operands on CUDA: the prepared operands of prepare_weight_operands (== the CPU reference path's), None
    in the e4m3 fields; cached per weight version."""
    _skip_without_gpu()
    from moe_ep.experts.weight_cache import WeightQuantCache  # noqa: PLC0415
    from tests.test_gemm_cuda import _varied  # noqa: PLC0415

    w = _varied(3 * 160, 96, torch.Generator(device="cuda").manual_seed(5)).reshape(3, 160, 96).to(dtype)
    cache = WeightQuantCache()
    ops = operands.weight_operands(w, cache)
    assert ops.w is None and ops.w_scale is None and ops.wt is None and ops.wt_scale is None
    cpu = operands.weight_operands(w.cpu())
    assert _same_bytes(ops.w_prepared, cpu.w_prepared) and _same_bytes(ops.wt_prepared, cpu.wt_prepared)
    assert operands.weight_operands(w, cache) is ops and cache.misses == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(160, 288), (96, 3104)])  # both fprop builds; N, K not multiples of 64
def test_gemms_on_new_operands_equal_two_step(n, k):
    """grouped_mm_fprop / grouped_mm_dgrad with weight_operands' new operands (w, w_scale None) == with the two-step
    operands (e4m3 copies + prepare_weight_bf16, given or prepared per call), bit for bit."""
    _skip_without_gpu()
    from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415
    from tests.test_gemm_cuda import _sizes_t, _varied  # noqa: PLC0415

    sizes = [0, 70, 200, 1, 129]
    g, s = len(sizes), sum(sizes)
    m = s + 40  # trailing rows past the groups: zero-filled
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(g, n, k, generator=gen, device="cuda") * 0.05).bfloat16()
    x, dy = _varied(m, k, gen).bfloat16(), _varied(m, n, gen).bfloat16()
    sz = _sizes_t(sizes)
    xd, xs = mxfp8_cuda.quantize_grouped_dual(x, sz)[:2]
    dyd, dys = mxfp8_cuda.quantize_grouped_dual(dy, sz)[:2]
    ops = operands.weight_operands(w)
    wd, ws, wtd, wts = mxfp8_cuda.quantize_weights_fused(w)
    new_f = gemm_cuda.grouped_mm_fprop(xd, xs, ops.w, ops.w_scale, sz, w_prepared=ops.w_prepared)
    old_f = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz, w_prepared=operands.prepare_weight_bf16(wd, ws))
    per_call_f = gemm_cuda.grouped_mm_fprop(xd, xs, wd, ws, sz)
    new_d = gemm_cuda.grouped_mm_dgrad(dyd, dys, None, None, sz, wt_prepared=ops.wt_prepared)
    old_d = gemm_cuda.grouped_mm_dgrad(dyd, dys, wtd, wts, sz, wt_prepared=operands.prepare_weight_bf16(wtd, wts))
    per_call_d = gemm_cuda.grouped_mm_dgrad(dyd, dys, wtd, wts, sz)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm_cuda.grouped_mm_2d3d_out(xd, xs, None, None, sz, out, zero_rest=True, b_prepared=ops.w_prepared)
    torch.cuda.synchronize()
    assert new_f.shape == (m, n) and new_d.shape == (m, k)
    assert _same_bytes(new_f, old_f) and _same_bytes(new_f, per_call_f) and _same_bytes(out, old_f)
    assert _same_bytes(new_d, old_d) and _same_bytes(new_d, per_call_d)
    assert (new_f[s:] == 0).all() and (new_d[s:] == 0).all() and torch.isfinite(new_f).all()


@pytest.mark.gpu
def test_gemm_launcher_none_weight_errors():
    """b / b_scale None needs b_prepared (of width ceil(K/64) * 64); one of them None alone is refused."""
    _skip_without_gpu()
    d = "cuda"
    sz = torch.tensor([4], dtype=torch.int32, device=d)
    xs = torch.zeros(mxfp8.grouped_blocked_size(4, 1, 3), dtype=torch.uint8, device=d)
    x = torch.zeros(4, 96, dtype=torch.float8_e4m3fn, device=d)
    wd = torch.zeros(1, 16, 96, dtype=torch.float8_e4m3fn, device=d)
    ws = torch.zeros(1, mxfp8.blocked_size(16, 3), dtype=torch.uint8, device=d)
    wp = torch.zeros(1, 16, 128, dtype=torch.bfloat16, device=d)
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=d)
    with pytest.raises(ValueError, match="only when b_prepared"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, None, None, sz, out)
    with pytest.raises(ValueError, match="w_prepared"):
        gemm_cuda.grouped_mm_fprop(x, xs, None, None, sz)
    with pytest.raises(ValueError, match="together"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, wd, None, sz, out, b_prepared=wp)
    with pytest.raises(ValueError, match="b_prepared must be"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, None, None, sz, out, b_prepared=wp[..., :64].contiguous())
    with pytest.raises(TypeError, match="b_prepared must be"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, None, None, sz, out, b_prepared=wp.float())
    with pytest.raises(ValueError, match="group_sizes"):
        gemm_cuda.grouped_mm_2d3d_out(x, xs, None, None, sz, out, b_prepared=torch.cat([wp, wp]))
    gemm_cuda.grouped_mm_2d3d_out(x, xs, wd, ws, sz, out, b_prepared=wp)  # both given: still accepted
