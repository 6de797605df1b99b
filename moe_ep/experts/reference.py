"""Expert MLP on expert-sorted rows: grouped GEMMs, SwiGLU, and the MXFP8 recipe (reference backend).

Per local expert e with rows X_e [n_e, H] (expert-sorted, groups contiguous, sizes may be 0):
  forward   A = X_e @ W13_e^T                 [n_e, 2F], kept in the input dtype (the GEMM's output dtype)
            h = silu(A[:, :F]) * A[:, F:]      fp32
            O = h @ W2_e^T                     [n_e, H]
  backward  dh = dO @ W2_e                     [n_e, F], kept in the input dtype like A (the GEMM's output dtype)
            dW2_e = dO^T @ h,  dA = swiglu_bwd(A, dh),  dX = dA @ W13_e,  dW13_e = dA^T @ X_e

With a recipe (a row of :data:`moe_ep.recipe.RECIPES`; ``quantize=True`` is MXFP8) every GEMM operand is fake-quantized
as the table says (:func:`quantize_operand`: element E4M3, E8M0 scales, the operand's block in its [outer, reduction]
view, grouped blocks restarting at each expert's first row), which is what the kernels consume:
  MXFP8      everything in 1x32 blocks along its reduction axis (the weights twice: along H for fprop, along 2F /
             F for dgrad); wgrad operands in 32x1 blocks down each expert's rows.
  blockwise  activations 1x128 along K, weights 128x128 (one quantization for both directions), wgrad operands
             128x1 down each expert's rows.
Products are fp32 sums of exactly dequantized operands; the kernels must match within summation order.
"""

from __future__ import annotations

import torch

from .. import mxfp8
from ..mxfp8.reference import fake_quantize_blocks_torch
from ..recipe import MXFP8, Operand, Recipe
from .fsdp_blockwise import BlockwiseExpertWeight
from .fsdp_mxfp8 import MXFP8ExpertWeight


def as_recipe(quantize: bool | Recipe | None) -> Recipe | None:
    """The recipe a ``quantize`` argument names: True -> MXFP8, False / None -> no quantization."""
    if isinstance(quantize, Recipe) or quantize is None:
        return quantize
    return MXFP8 if quantize else None


def quantize_operand(t: torch.Tensor, op: Operand | None, group_sizes: list[int], transposed: bool = False):
    """Fake-quantize one GEMM operand as the recipe table says (the specification of every kernel's operand).

    t: the layer tensor (expert-sorted rows [M, C] for activations and wgrad operands; [E, N, K] for weights);
    op: its :class:`moe_ep.recipe.Operand` (None: no quantization); transposed: the GEMM reads a weight's transpose
    (dgrad), so blocks are taken in the [E, K, N] view -> t's shape and dtype (t itself when op is None).

    Example: MXFP8's dgrad of w2 [E, H, F] takes (1, 32) blocks of w2^T [E, F, H], i.e. 32 consecutive rows of w2;
    blockwise's grouped (1, 128) blocks of h [M, F] run down each expert's rows, restarting at its first row.
    """
    if op is None:
        return t
    if isinstance(t, MXFP8ExpertWeight):  # gathered in MXFP8 (experts.fsdp_mxfp8): its stored quantizations
        if op.block != (1, 32):
            raise TypeError(
                "an MXFP8-gathered weight holds MXFP8 quantizations only; gather plain weights for this recipe"
            )
        return t.fake_quantize(-2 if transposed else -1)
    if isinstance(t, BlockwiseExpertWeight):  # gathered in blockwise FP8 (experts.fsdp_blockwise): its stored bytes
        if op.block != (128, 128):
            raise TypeError(
                "a blockwise-gathered weight holds 128x128 quantizations only; gather plain weights for this recipe"
            )
        return t.fake_quantize()  # a 128x128 block is also a block of the transpose: the same values
    if op.grouped:  # the reduction runs down the rows of each group: blocks of the group's transpose
        return fake_quantize_grouped_cols(t, group_sizes, True, op.block[1])
    # back to t's dtype, as mxfp8.fake_quantize: the value a bf16 tensor core is fed (exact down to 2**-133)
    if transposed:
        return fake_quantize_blocks_torch(t.transpose(-2, -1), op.block).transpose(-2, -1).to(t.dtype).contiguous()
    return fake_quantize_blocks_torch(t, op.block).to(t.dtype)


def fake_quantize_grouped_cols(
    t: torch.Tensor, group_sizes: list[int], on: bool = True, block: int = mxfp8.BLOCK
) -> torch.Tensor:
    """Column-wise (``block`` x 1, MXFP8: 32) round trip within each row group; blocks never straddle two groups.

    t: [M, N] float, group_sizes: host ints summing to M -> [M, N] t.dtype.

    Example: sizes [40, 8]: rows 0-31 and 32-39 (+24 zero rows) form group 0's blocks, rows 40-47 group 1's.
    """
    if not on:
        return t
    out = torch.empty_like(t)
    start = 0
    for n in group_sizes:
        if n:
            seg = t[start : start + n]
            if block == mxfp8.BLOCK:
                pad = (-n) % block
                seg = torch.cat([seg, t.new_zeros(pad, t.shape[1])]) if pad else seg
                out[start : start + n] = mxfp8.fake_quantize(seg, axis=0)[:n]
            else:  # a short last block is zero padded by the block quantizer
                out[start : start + n] = fake_quantize_blocks_torch(seg.t(), (1, block)).t()
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


def _ops(recipe: Recipe | None, name: str) -> tuple[Operand | None, Operand | None]:
    if recipe is None:
        return None, None
    g = recipe.gemm(name)
    return g.a, g.b


def expert_mlp_fwd(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: list[int], quantize: bool | Recipe | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, H], w13: [E, 2F, H], w2: [E, H, F], quantize: the recipe (True: MXFP8) -> (out [M, H] x.dtype,
    A [M, 2F] x.dtype saved for bwd)."""
    r, s = as_recipe(quantize), group_sizes
    qa, qb = _ops(r, "fprop1")
    a = grouped_mm_torch(quantize_operand(x, qa, s), quantize_operand(w13, qb, s), s).to(x.dtype)
    qa, qb = _ops(r, "fprop2")
    out = grouped_mm_torch(quantize_operand(swiglu(a), qa, s), quantize_operand(w2, qb, s), s).to(x.dtype)
    return out, a


def expert_mlp_bwd(
    dout: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group_sizes: list[int],
    quantize: bool | Recipe | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [M, H] -> (dx [M, H] x.dtype, dw13 [E, 2F, H] w13.dtype, dw2 [E, H, F] w2.dtype)."""
    r, s = as_recipe(quantize), group_sizes
    q = quantize_operand
    h = swiglu(a)
    # dh is rounded to x.dtype like A in the forward: a bf16 model's dgrad GEMM writes bf16 (torch autograd does
    # too), and the fast path's fused SwiGLU backward then reads 2 bytes per element instead of 4. The rounding
    # (2**-8 relative) is far below the e4m3 rounding of dA that follows (2**-4).
    qa, qb = _ops(r, "dgrad2")
    dh = grouped_mm_torch(q(dout, qa, s), q(w2, qb, s, transposed=True).transpose(1, 2), s).to(x.dtype)
    qa, qb = _ops(r, "wgrad2")
    dw2 = grouped_wgrad_torch(q(dout, qa, s), q(h, qb, s), s)
    da = swiglu_bwd(a, dh)
    qa, qb = _ops(r, "dgrad1")
    dx = grouped_mm_torch(q(da, qa, s), q(w13, qb, s, transposed=True).transpose(1, 2), s).to(x.dtype)
    qa, qb = _ops(r, "wgrad1")
    dw13 = grouped_wgrad_torch(q(da, qa, s), q(x, qb, s), s)
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
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: list[int], quantize: bool | Recipe | None = True
) -> torch.Tensor:
    """SwiGLU expert MLP over expert-sorted rows.

    x: [M, H] bf16/fp32 (groups contiguous), w13: [E, 2F, H] (gate rows then up rows), w2: [E, H, F],
    group_sizes: E host ints summing to M, quantize: the recipe (a :class:`moe_ep.recipe.Recipe`; True: MXFP8; False:
    none) -> [M, H] x.dtype. Differentiable in x, w13, w2.
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
