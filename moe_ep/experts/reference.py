"""Expert MLP on expert-sorted rows: grouped GEMMs, SwiGLU, and the MXFP8 recipe (reference backend).

Per local expert e with rows X_e [n_e, H] (expert-sorted, groups contiguous, sizes may be 0):
  forward   A = X_e @ W13_e^T                 [n_e, 2F], kept in the input dtype (the GEMM's output dtype)
            h = silu(A[:, :F]) * A[:, F:]      fp32
            O = h @ W2_e^T                     [n_e, H]
  backward  dh = dO @ W2_e                     [n_e, F], kept in the input dtype like A (the GEMM's output dtype)
            dW2_e = dO^T @ h,  dA = swiglu_bwd(A, dh),  dX = dA @ W13_e,  dW13_e = dA^T @ X_e

With ``quantize=True`` every GEMM operand is MXFP8 along its reduction axis, as the Hopper/Blackwell kernels
will consume it (the recipe: E4M3 everywhere, RCEIL scales):
  fprop  X row-wise over H (the dispatch payload, so requantizing is the identity), W13 over H; h row-wise
         over F, W2 over F.
  dgrad  dO row-wise over H with W2 over H; dA row-wise over 2F with W13 over 2F.
  wgrad  dO, h, dA, X column-wise over the rows of each expert's group: 32x1 blocks start at the group's
         first row; a group's last block may be short (it is padded with zeros, which never change amax).
Products are fp32 sums of exactly dequantized operands; the kernels must match within summation order.
"""

from __future__ import annotations

import torch

from .. import mxfp8
from .fsdp_mxfp8 import MXFP8ExpertWeight
from .sm90.operands import _cdiv, _host_sizes, colwise_operand_ref, prepare_colwise_bf16_torch


def _fq(t: torch.Tensor, axis: int, on: bool) -> torch.Tensor:
    if on and isinstance(t, MXFP8ExpertWeight):  # gathered in MXFP8 (experts.fsdp_mxfp8): its stored quantizations
        return t.fake_quantize(axis)
    return mxfp8.fake_quantize(t, axis) if on else t


def fake_quantize_grouped_cols(t: torch.Tensor, group_sizes: list[int], on: bool = True) -> torch.Tensor:
    """Column-wise (32x1) MXFP8 round trip within each row group; blocks never straddle two groups.

    t: [M, N] float, group_sizes: host ints summing to M -> [M, N] t.dtype.

    Example: sizes [40, 8]: rows 0-31 and 32-39 (+24 zero rows) form group 0's blocks, rows 40-47 group 1's.
    """
    if not on:
        return t
    out = torch.empty_like(t)
    start = 0
    for n in group_sizes:
        if n:
            pad = (-n) % mxfp8.BLOCK
            seg = torch.cat([t[start : start + n], t.new_zeros(pad, t.shape[1])]) if pad else t[start : start + n]
            out[start : start + n] = mxfp8.fake_quantize(seg, axis=0)[:n]
        start += n
    return out


def grouped_mm_torch(a: torch.Tensor, b: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """Reference grouped GEMM (2-D x 3-D): rows of group g times ``b[g]^T``, fp32 accumulation.

    a: [M, K] float, b: [G, N, K] float, group_sizes: G host ints summing to M -> [M, N] fp32.
    """
    out = a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)
    start = 0
    for g, n in enumerate(group_sizes):
        out[start : start + n] = a[start : start + n].to(torch.float32) @ b[g].to(torch.float32).t()
        start += n
    return out


def grouped_wgrad_torch(a: torch.Tensor, b: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """Reference grouped GEMM (2-D x 2-D, groups along the reduction): ``a_g^T @ b_g`` per group.

    a: [M, N] float, b: [M, K] float, group_sizes: G host ints summing to M -> [G, N, K] fp32 (zeros for empty
    groups).
    """
    out = a.new_zeros(len(group_sizes), a.shape[1], b.shape[1], dtype=torch.float32)
    start = 0
    for g, n in enumerate(group_sizes):
        if n:
            out[g] = a[start : start + n].to(torch.float32).t() @ b[start : start + n].to(torch.float32)
        start += n
    return out


def swiglu(a: torch.Tensor) -> torch.Tensor:
    """a: [M, 2F] (gate | up) -> [M, F] fp32 ``silu(gate) * up``."""
    f = a.shape[-1] // 2
    g, u = a[..., :f].to(torch.float32), a[..., f:].to(torch.float32)
    return torch.nn.functional.silu(g) * u


def swiglu_bwd(a: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """a: [M, 2F], dh: [M, F] -> dA [M, 2F] fp32."""
    f = a.shape[-1] // 2
    g, u = a[..., :f].to(torch.float32), a[..., f:].to(torch.float32)
    sig = torch.sigmoid(g)
    silu = g * sig
    dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))
    return torch.cat([dg, dh * silu], dim=-1)


def quantize_grouped_dual_torch(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
    colwise: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`moe_ep.mxfp8.cuda.quantize_grouped_dual` (same signature, same bytes).

    x: [M, K] bf16 (or a: [M, 2K] bf16 with apply_swiglu, quantizing ``swiglu(a)`` [M, K] fp32; or a: [M, 2F]
    bf16 with swiglu_dh [M, F] bf16, quantizing ``swiglu_bwd(a, dh)`` [M, 2F] fp32); group_sizes: [G] int32 (read
    on the host: this is the specification, not the fast path), summing to M; colwise: "bf16" (the only layout).
    Returns (data [M, K] e4m3 row-wise, scale u8 ``to_blocked_grouped`` along M, the prepared wgrad operand bf16
    [64 (ceil(M/64) + G), K], None): the column operand is the values quantized in per-group 32-row column blocks
    (``colwise_operand_ref``), exactly dequantized into the prepared layout (``prepare_colwise_bf16_torch``; group
    g at row 64 * sum_{h<g} ceil(n_h/64); rows past the last group's 64-row block are zero here, the kernel leaves
    them unwritten).

    Example: sizes [40, 8] (M = 48): group 0's column blocks cover rows 0-31 and 32-39 (padded with 24 zero rows
    for its scale); its prepared rows are 0-39, group 1's are 64-71.
    """
    if colwise != "bf16":
        raise ValueError(f"colwise must be 'bf16' (the prepared wgrad operand), got {colwise!r}")

    h = swiglu_bwd(x, swiglu_dh) if swiglu_dh is not None else swiglu(x) if apply_swiglu else x
    sizes = group_sizes.to(device="cpu", dtype=torch.int32)
    if int(sizes.sum()) != h.shape[0]:
        raise ValueError(f"group sizes sum to {int(sizes.sum())}, expected M = {h.shape[0]}")
    q = mxfp8.quantize_torch(h, -1)
    scale = mxfp8.to_blocked_grouped(q.scale, sizes, "m")
    data_c, scale_c = colwise_operand_ref(h, [int(v) for v in sizes])
    return q.data, scale, prepare_colwise_bf16_torch(data_c, scale_c, [int(v) for v in sizes]), None


def expert_mlp_fwd(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: list[int], quantize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, H], w13: [E, 2F, H], w2: [E, H, F] -> (out [M, H] x.dtype, A [M, 2F] x.dtype saved for bwd)."""
    a = grouped_mm_torch(_fq(x, -1, quantize), _fq(w13, -1, quantize), group_sizes).to(x.dtype)
    h = _fq(swiglu(a), -1, quantize)
    out = grouped_mm_torch(h, _fq(w2, -1, quantize), group_sizes).to(x.dtype)
    return out, a


def expert_mlp_bwd(
    dout: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_sizes: list[int],
    quantize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [M, H] -> (dx [M, H] x.dtype, dw13 [E, 2F, H] w13.dtype, dw2 [E, H, F] w2.dtype)."""
    q = quantize
    h = swiglu(a)
    # dgrad reduces over the weights' output axis: quantize W along it (axis -2), dO along H
    # dh is rounded to x.dtype like A in the forward: a bf16 model's dgrad GEMM writes bf16 (torch autograd does
    # too), and the fast path's fused SwiGLU backward then reads 2 bytes per element instead of 4. The rounding
    # (2**-8 relative) is far below the e4m3 rounding of dA that follows (2**-4).
    dh = grouped_mm_torch(_fq(dout, -1, q), _fq(w2, -2, q).transpose(1, 2), group_sizes).to(x.dtype)
    dw2 = grouped_wgrad_torch(
        fake_quantize_grouped_cols(dout, group_sizes, q), fake_quantize_grouped_cols(h, group_sizes, q), group_sizes
    )
    da = swiglu_bwd(a, dh)
    dx = grouped_mm_torch(_fq(da, -1, q), _fq(w13, -2, q).transpose(1, 2), group_sizes).to(x.dtype)
    dw13 = grouped_wgrad_torch(
        fake_quantize_grouped_cols(da, group_sizes, q), fake_quantize_grouped_cols(x, group_sizes, q), group_sizes
    )
    return dx, dw13.to(w13.dtype), dw2.to(w2.dtype)


class _ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, group_sizes, quantize):
        out, a = expert_mlp_fwd(x, w13, w2, group_sizes, quantize)
        ctx.save_for_backward(x, a, w13, w2)
        ctx.group_sizes, ctx.quantize = group_sizes, quantize
        return out

    @staticmethod
    def backward(ctx, dout):
        x, a, w13, w2 = ctx.saved_tensors
        dx, dw13, dw2 = expert_mlp_bwd(dout.contiguous(), x, a, w13, w2, ctx.group_sizes, ctx.quantize)
        return dx, dw13, dw2, None, None


def expert_mlp(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: list[int], quantize: bool = True
) -> torch.Tensor:
    """SwiGLU expert MLP over expert-sorted rows.

    x: [M, H] bf16/fp32 (groups contiguous), w13: [E, 2F, H] (gate rows then up rows), w2: [E, H, F],
    group_sizes: E host ints summing to M -> [M, H] x.dtype. Differentiable in x, w13, w2.
    """
    e, f2, hdim = w13.shape
    if x.dim() != 2 or x.shape[1] != hdim or w2.shape != (e, hdim, f2 // 2) or len(group_sizes) != e:
        raise ValueError(
            f"expert_mlp shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
            f"{len(group_sizes)} groups"
        )
    if sum(group_sizes) != x.shape[0]:
        raise ValueError(f"group sizes sum to {sum(group_sizes)}, x has {x.shape[0]} rows")
    return _ExpertMLP.apply(x, w13, w2, list(group_sizes), quantize)


def grouped_wgrad_prepared_torch(a_prep, b_prep, group_sizes, num_rows: int, out_dtype=torch.float32):
    """Reference of :func:`moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out` (host group sizes; its arguments but
    ``out``).

    a_prep: bf16 [64 (ceil(M/64) + G), N], b_prep: bf16 [same rows, K] -> [G, N, K] out_dtype: group g is rows
    64 poff_g .. + n_g of both (poff_g = sum_{h<g} ceil(n_h/64)), reduced in fp32 (fp64 operands: in fp64);
    sizes sum to at most num_rows (M), as the kernel's contract.

    Example: sizes [40, 0, 8] -> out[0] from rows 0-39, out[1] = 0, out[2] from rows 64-71.
    """
    sizes = _host_sizes(group_sizes)
    if sum(sizes) > num_rows:
        raise ValueError(f"group sizes sum to {sum(sizes)}, more than M = {num_rows}")
    acc = torch.promote_types(a_prep.dtype, torch.float32)  # fp64 operands (tests' exact reference) stay fp64
    out = torch.zeros(len(sizes), a_prep.shape[1], b_prep.shape[1], dtype=acc, device=a_prep.device)
    poff = 0
    for gi, rows in enumerate(sizes):
        if rows:
            out[gi] = a_prep[poff : poff + rows].to(acc).t() @ b_prep[poff : poff + rows].to(acc)
        poff += 64 * _cdiv(rows, 64)
    return out.to(out_dtype)
