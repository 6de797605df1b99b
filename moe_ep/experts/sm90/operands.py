"""Operand formats of the MXFP8 grouped GEMMs (``moe_ep.experts.sm90.gemm``): preparation of the bf16 weight operands
the fprop / dgrad kernel reads (once per weight version: :func:`prepare_weight_operands` straight from the weight,
:func:`prepare_weight_bf16` from an MXFP8 weight), the weight-operand bundle with its cache, and the pure-PyTorch
converters from plain tensors to the kernels' formats (references, tests, benchmarks). The wgrad's prepared
activation operands come from the quantizer (``moe_ep.mxfp8.cuda.quantize_grouped_dual``);
:func:`prepare_colwise_bf16_torch` (tests/refs.py) is their reference.

The formats themselves are documented in :mod:`.gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import mxfp8
from ..._cuda import kernel_constant

_PREP_FILE = "experts/sm90/weight_prep.cu"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_dtype(name: str, t, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")


def _check_memory(name: str, t: torch.Tensor, device: torch.device | None) -> torch.device:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x})")
    return t.device


def colwise_scale_rows(m: int, num_groups: int) -> int:
    """Rows of a grouped column-wise scale buffer (static bound ``ceil(M/32) + G``, no host sync)."""
    return _cdiv(m, 32) + num_groups


def k_permutation(device=None) -> torch.Tensor:
    """int64 [64]: for the fprop / dgrad kernel's logical k position l = 16 s + 8 h + 2 c + e of a 64-wide k block,
    the physical column 16 c + 4 s + 2 h + e it holds (s: k16 slice, h: fragment half, c: lane % 4, e: pair element;
    ``kernels/experts/sm90/grouped_gemm.cu``).

    Example: k_permutation()[:4] = [0, 1, 16, 17] (lane c = 1 holds physical columns 16, 17 at logical 2, 3).
    """
    lg = torch.arange(64, device=device)  # built on the device: no host-to-device copy (sync-free)
    s, h, c, e = lg // 16, (lg // 8) % 2, (lg // 2) % 4, lg % 2
    return 16 * c + 4 * s + 2 * h + e


def _check_weight_prep(w: torch.Tensor, w_scale: torch.Tensor) -> None:
    _check_dtype("w", w, (torch.float8_e4m3fn,))
    _check_dtype("w_scale", w_scale, (torch.uint8,))
    if w.dim() != 3 or w.shape[2] % 32:
        raise ValueError(f"w must be [G, N, K] with K % 32 == 0, got {tuple(w.shape)}")
    g, n, k = w.shape
    bsz = mxfp8.blocked_size(n, k // 32)
    if w_scale.numel() != g * bsz:
        raise ValueError(
            f"w_scale must hold [G, blocked_size(N, K/32)] = [{g}, {bsz}] bytes, got {tuple(w_scale.shape)}"
        )


def prepare_weight_bf16_torch(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`prepare_weight_bf16` (same signature and bytes): pure torch on w's device."""
    _check_weight_prep(w, w_scale)
    g, n, k = w.shape
    deq = mxfp8.dequantize_torch(mxfp8.MXFP8Tensor(w, mxfp8.from_blocked(w_scale.reshape(g, -1), n, k // 32), 2))
    kp = _cdiv(k, 64) * 64
    padded = torch.zeros(g, n, kp, dtype=torch.bfloat16, device=w.device)
    padded[..., :k] = deq
    return padded.view(g, n, kp // 64, 64)[..., k_permutation(w.device)].reshape(g, n, kp).contiguous()


def prepare_weight_bf16(w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight operand of the fprop / dgrad kernel: the exact bf16 dequantization of an MXFP8 weight,
    each 64-wide k block in the kernels' permuted order (:func:`k_permutation`), K padded with zeros to a multiple
    of 64.

    w: e4m3 [G, N, K] (K % 32 == 0); w_scale: u8 [G, blocked_size(N, K/32)] (``mxfp8.to_blocked``)
    -> bf16 [G, N, ceil(K/64) * 64] (into ``out`` when given). CUDA tensors: one memory-bound kernel
    (``kernels/experts/sm90/weight_prep.cu``), no host sync; others: :func:`prepare_weight_bf16_torch` (the same
    bytes). Meant to run once per weight version and be cached with the quantized weight (e4m3 * 2^(s-127) is exact in
    bf16 down to 2^-133, like the kernel's in-register conversion of the activations, so the GEMM products are exact).
    """
    if w.device.type != "cuda":
        ref = prepare_weight_bf16_torch(w, w_scale)
        return ref if out is None else out.copy_(ref)
    _check_weight_prep(w, w_scale)
    g, n, k = w.shape
    kp = _cdiv(k, 64) * 64
    if out is None:
        out = torch.empty(g, n, kp, dtype=torch.bfloat16, device=w.device)
    _check_dtype("out", out, (torch.bfloat16,))
    if tuple(out.shape) != (g, n, kp):
        raise ValueError(f"out must be [{g}, {n}, {kp}] bf16, got {tuple(out.shape)}")
    for name, t in (("w", w), ("w_scale", w_scale), ("out", out)):
        _check_memory(name, t, w.device)
    chunks = g * n * (kp // 64) * 4
    if chunks == 0:
        return out
    from ... import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    fn = _cuda.get_function(_PREP_FILE, "mx_prepare_weight_bf16", device=w.device.index)
    grid = min(_cdiv(chunks, 256), _cuda.num_sms(w.device) * 8)
    args = (_cuda.ptr(w), _cuda.ptr(w_scale), _cuda.ptr(out), _cuda.i32(g), _cuda.i32(n), _cuda.i32(k))
    args += (_cuda.i64(mxfp8.blocked_size(n, k // 32)),)
    _cuda.launch(fn, grid, 256, args, device=w.device)
    return out


_WP_FILE = "experts/sm90/weight_prep.cu"
_OPERANDS_KERNELS = {  # by the weight's dtype (the master weights of a bf16 model: fp32 or bf16)
    torch.float32: "mx_prepare_weight_operands_f32",
    torch.bfloat16: "mx_prepare_weight_operands_bf16",
}
_OPERANDS_TILE = kernel_constant(_WP_FILE, "WP_TILE")  # a CTA's tile of one expert's W (rows of N x columns of K)
_OPERANDS_THREADS = kernel_constant(_WP_FILE, "WP_THREADS")


def _check_weight(w: torch.Tensor) -> None:
    _check_dtype("w", w, tuple(_OPERANDS_KERNELS))
    if w.dim() != 3 or w.shape[1] % 32 or w.shape[2] % 32:
        raise ValueError(f"w must be [G, N, K] with N and K multiples of 32, got {tuple(w.shape)}")


def _operands_plan(dtype: torch.dtype, g: int, n: int, k: int) -> tuple[str, tuple[int, int], int, int] | None:
    """(kernel, grid (x, y), dynamic shared memory, k tiles) of the ``mx_prepare_weight_operands_*`` launch for a
    weight [g, n, k] of ``dtype``; None when there is nothing to write (an empty dimension).

    One CTA per 128 x 128 tile of one expert (grid.x = ceil(N/128) * ceil(K/128), grid.y = expert); shared memory:
    the tile (128 x 128 elements) + the 32 KiB bf16 staging tile of W^T (kernels/experts/sm90/weight_prep.cu WP_SMEM).

    Example: bf16 [64, 4096, 7168] -> grid (32 * 56 = 1792, 64), 32768 + 32768 = 65536 bytes, 56 k tiles.
    """
    ktiles = _cdiv(k, _OPERANDS_TILE)
    tiles = _cdiv(n, _OPERANDS_TILE) * ktiles
    if g == 0 or tiles == 0:
        return None
    if g > 65535:
        raise ValueError(f"prepare_weight_operands: {g} experts, more than one launch's grid.y (65535)")
    es = torch.empty(0, dtype=dtype).element_size()
    smem = _OPERANDS_TILE * _OPERANDS_TILE * es + kernel_constant(_WP_FILE, "WP_STAGE_BYTES")
    return _OPERANDS_KERNELS[dtype], (tiles, g), smem, ktiles


def prepare_weight_operands_torch(
    w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`prepare_weight_operands` (same signature and bytes up to NaN payloads, see there): pure
    torch on w's device, the two-step definition itself: quantize W both ways (:func:`weight_operand_ref`,
    :func:`weight_t_operand_ref`), then :func:`prepare_weight_bf16_torch` of each."""
    _check_weight(w)
    wp = prepare_weight_bf16_torch(*weight_operand_ref(w))
    wtp = prepare_weight_bf16_torch(*weight_t_operand_ref(w))
    if out is None:
        return wp, wtp
    out[0].copy_(wp)
    out[1].copy_(wtp)
    return out[0], out[1]


def prepare_weight_operands(
    w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both bf16 weight operands of the fprop / dgrad kernel straight from the weight, in one pass.

    w: bf16/fp16/fp32 [G, N, K] (N, K multiples of 32) -> (w_prepared bf16 [G, N, ceil(K/64) * 64],
    wt_prepared bf16 [G, K, ceil(N/64) * 64]) (into ``out`` = that pair when given):
      w_prepared  = prepare_weight_bf16 of W quantized to MXFP8 along K (1x32 blocks), the fprop operand;
      wt_prepared = prepare_weight_bf16 of W^T quantized along N (W in 32x1 blocks, transposed), the dgrad operand.
    The bytes are those of ``prepare_weight_bf16(*mxfp8_cuda.quantize_weights_fused(w)[:2])`` and
    ``prepare_weight_bf16(*mxfp8_cuda.quantize_weights_fused(w)[2:])``, NaN/Inf blocks included (bf16 NaN in the
    whole 32-block, the hardware's canonical payload), and of :func:`prepare_weight_operands_torch` up to NaN
    payloads.

    CUDA tensors (w contiguous, 16-byte aligned): one memory-bound launch (``kernels/experts/sm90/weight_prep.cu``
    ``mx_prepare_weight_operands_*``) that reads W once and writes both operands: 2 + 2 + 2 bytes per element for a
    bf16 W, against about 10 for the e4m3 copies plus two preparation passes. No host sync. Other devices:
    :func:`prepare_weight_operands_torch`.
    """
    _check_weight(w)
    if w.device.type != "cuda":
        return prepare_weight_operands_torch(w, out)
    g, n, k = w.shape
    kp, np_ = _cdiv(k, 64) * 64, _cdiv(n, 64) * 64
    if out is None:
        out = (
            torch.empty(g, n, kp, dtype=torch.bfloat16, device=w.device),
            torch.empty(g, k, np_, dtype=torch.bfloat16, device=w.device),
        )
    wp, wtp = out
    for name, t, shape in (("out[0]", wp, (g, n, kp)), ("out[1]", wtp, (g, k, np_))):
        _check_dtype(name, t, (torch.bfloat16,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} bf16, got {tuple(t.shape)}")
    for name, t in (("w", w), ("out[0]", wp), ("out[1]", wtp)):
        _check_memory(name, t, w.device)
    plan = _operands_plan(w.dtype, g, n, k)
    if plan is None:
        return wp, wtp
    from ... import _cuda  # noqa: PLC0415  (CuPy is imported lazily)

    kernel, grid, smem, ktiles = plan
    fn = _cuda.get_function(_PREP_FILE, kernel, device=w.device.index)
    args = (_cuda.ptr(w), _cuda.ptr(wp), _cuda.ptr(wtp), _cuda.i32(n), _cuda.i32(k), _cuda.i32(ktiles))
    _cuda.launch(fn, grid, _OPERANDS_THREADS, args, shared_mem=smem, device=w.device)
    return wp, wtp


@dataclass(frozen=True)
class WeightOperands:
    """The fprop and dgrad operands of one expert weight ``W [G, N, K]`` (see the module docstring's formats).

    w: e4m3 [G, N, K] quantized along K; w_scale: u8 [G, blocked_size(N, K/32)]; w_prepared: bf16 [G, N, Kp];
    wt: e4m3 [G, K, N] = W^T quantized along N; wt_scale: u8 [G, blocked_size(K, N/32)]; wt_prepared: bf16 [G, K, Np].

    The fprop / dgrad kernel reads only ``w_prepared`` / ``wt_prepared`` (through its TMA map), never the e4m3 copies
    or their scales. So on the CUDA path (:func:`weight_operands` on a CUDA weight) ``w``, ``w_scale``, ``wt`` and
    ``wt_scale`` are None: :func:`prepare_weight_operands` writes the prepared operands straight from W, and the
    GEMM launchers take ``b=None, b_scale=None`` with ``b_prepared``. The reference path (other devices, or
    MOE_EP_FORCE_REFERENCE=1) fills all six. A direction's three fields are None where the caller asked for the other
    direction only (``moe_ep.experts.sm90.mlp`` without a cache: the unread operand is not held).
    """

    w: torch.Tensor | None
    w_scale: torch.Tensor | None
    w_prepared: torch.Tensor | None
    wt: torch.Tensor | None
    wt_scale: torch.Tensor | None
    wt_prepared: torch.Tensor | None


def quantize_weight_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert weight quantized both ways, the bytes the GEMMs' operands are prepared from.

    w: bf16/fp16/fp32 [G, N, K] (N, K multiples of 32) -> (w e4m3 [G, N, K] along K, w_scale u8 [G, blocked_size(N,
    K/32)], wt e4m3 [G, K, N] = W^T along N, wt_scale u8 [G, blocked_size(K, N/32)]): :func:`weight_operand_ref`
    and :func:`weight_t_operand_ref`. CUDA: one launch (``mxfp8.cuda.quantize_weights_fused``, the same bytes);
    other devices and MOE_EP_FORCE_REFERENCE=1: the references.
    """
    _check_weight(w)
    if mxfp8.use_reference(w):
        return (*weight_operand_ref(w), *weight_t_operand_ref(w))
    from ...mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415

    return mxfp8_cuda.quantize_weights_fused(w.contiguous())


def _weight_operands(w: torch.Tensor) -> WeightOperands:
    if mxfp8.use_reference(w):
        wd, ws, wtd, wts = quantize_weight_mxfp8(w)
        return WeightOperands(wd, ws, prepare_weight_bf16(wd, ws), wtd, wts, prepare_weight_bf16(wtd, wts))
    # One launch over all experts reads W once and writes both prepared bf16 operands (6 bytes per bf16 element).
    # It replaced quantize_weights_fused (mx_quant_batch: both e4m3 copies with blocked scales) followed by two
    # mx_prepare_weight_bf16 passes (about 10 bytes per element), whose bytes it reproduces; the e4m3 copies were
    # never read by the GEMMs (docs/performance.md, "Expert MLP").
    w = w.contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    wp, wtp = prepare_weight_operands(w)
    return WeightOperands(None, None, wp, None, None, wtp)


def weight_operands(w: torch.Tensor, cache=None) -> WeightOperands:
    """Both bf16 operands of the fprop / dgrad kernel of an expert weight (MXFP8 along K for fprop, along N for dgrad).

    w: bf16/fp16/fp32 [G, N, K] (N, K multiples of 32), any device. CUDA: one :func:`prepare_weight_operands`
    launch, no host sync; the e4m3 fields of the result are None (see :class:`WeightOperands`). Other devices (and
    MOE_EP_FORCE_REFERENCE=1): the references, all six fields. With ``cache`` (a
    ``moe_ep.experts.weight_cache.WeightQuantCache``) the result is computed once per weight version (an in-place
    optimizer step recomputes it; FSDP2's all-gather preserves the version: clear the cache there) and shared by
    every micro-batch. During CUDA-graph capture the cache is bypassed (the preparation is captured and runs in every
    replay, so replays see weight updates).
    Memory on the CUDA path: 2 + 2 bytes (the prepared operands) per weight element.
    """
    if w.dim() != 3 or w.shape[1] % 32 or w.shape[2] % 32:
        raise ValueError(f"w must be [G, N, K] with N and K multiples of 32, got {tuple(w.shape)}")
    # While a CUDA graph is captured the preparation itself must be captured: a cache hit would freeze the current
    # operands into the graph, and replays after an optimizer step would multiply by the old weights.
    if cache is None or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        with torch.no_grad():
            return _weight_operands(w.detach())
    return cache.get(w, "gemm_operands", _weight_operands)


# ----------------------------------------------------------------------------------------------------------
# reference-side converters (pure PyTorch, any device; read group sizes on the host)
# ----------------------------------------------------------------------------------------------------------


def _host_sizes(group_sizes) -> list[int]:
    if isinstance(group_sizes, torch.Tensor):
        return [int(v) for v in group_sizes.cpu().tolist()]
    return [int(v) for v in group_sizes]


def weight_operand_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [G, N, K] -> (e4m3 [G, N, K] quantized along K, u8 [G, blocked_size(N, K/32)]) for fprop."""
    q = mxfp8.quantize_torch(w, -1)
    return q.data, mxfp8.to_blocked(q.scale)


def weight_t_operand_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [G, N, K] -> (W^T e4m3 [G, K, N] quantized along N, u8 [G, blocked_size(K, N/32)]) for dgrad.

    Dequantized, it equals ``mxfp8.fake_quantize(w, axis=-2).transpose(1, 2)`` (the reference's dgrad operand).
    """
    q = mxfp8.quantize_torch(w.transpose(1, 2).contiguous(), -1)
    return q.data, mxfp8.to_blocked(q.scale)
