"""The quantization recipes of the expert MLP, as one table (``RECIPES``: name -> :class:`Recipe`).

A recipe says, for each of the six GEMMs of the SwiGLU expert MLP, how each operand is quantized: element format,
scale format, the shape of one scale block, whether blocks restart at every expert group, and where in the layer
the bytes are made. The reference backend quantizes generically from this table
(:func:`moe_ep.experts.reference.quantize_operand`), so the table is the specification; the kernels of a recipe
(``kernels/<recipe>/``, ``kernels/experts/sm90/``) implement exactly its rows and are tested against it.

Every GEMM is written ``C[i, j] = sum_r A[i, r] * B[j, r]``: both operands are viewed with the reduction axis
``r`` last, and ``block = (rows, cols)`` is one scale block of that view. For the weights the view is one expert's
matrix (``w13[e]``: [2F, H]; its transpose for dgrad), for the wgrad operands the transpose of the expert-sorted
rows (``dy^T``: [H, M]), where ``grouped`` blocks start at each expert's first row and a group's last block is short
(padded with zeros, which never change a block's amax).

    GEMM     out      A (view)          B (view)
    fprop1   a        x      [M, H]     w13[e]   [2F, H]
    fprop2   o        h      [M, F]     w2[e]    [H, F]
    dgrad2   dh       dy     [M, H]     w2[e]^T  [F, H]
    dgrad1   dx       da     [M, 2F]    w13[e]^T [H, 2F]
    wgrad2   dw2[e]   dy^T   [H, M_e]   h^T      [F, M_e]
    wgrad1   dw13[e]  da^T   [2F, M_e]  x^T      [H, M_e]

``x`` is the dispatched payload (quantized on the source rank before the all-to-all) and ``dy`` the combine's
gradient, dispatched back in the forward payload's format; ``h = swiglu(a)`` and ``da = swiglu_bwd(a, dh)`` are
quantized by the fused SwiGLU kernels. An operand quantized from values that were already rounded (``x^T`` from
the dispatched ``x``, ``dy^T`` from the dispatched ``dy``) is rounded twice; the reference models that exactly,
because it quantizes the dequantized tensor it is given.

To add a recipe: one :class:`Recipe` row here, its quantizers, and its GEMM kernels behind
:func:`moe_ep.experts.base.gemms_for` (docs/design.md, "How to extend").
"""

from __future__ import annotations

from dataclasses import dataclass

GEMM_NAMES = ("fprop1", "fprop2", "dgrad2", "dgrad1", "wgrad2", "wgrad1")
SOURCES = ("dispatch", "swiglu", "weight", "requantize")


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized.

    tensor:  the layer tensor it is made of ("x", "w13", "h", "w2", "dy", "da").
    block:   (rows, cols) of one scale block in the operand's [outer, reduction] view (see the module docstring);
             (1, 32): 32 consecutive values along the reduction axis; (128, 128): a square tile.
    grouped: the reduction axis runs over expert-sorted rows and blocks restart at each expert's first row
             (the wgrad operands).
    source:  where the bytes are made: "dispatch" (on the source rank, fused into the dispatch), "swiglu" (fused
             into the SwiGLU forward / backward), "weight" (once per weight version), "requantize" (from the
             dequantized bytes of this tensor's other quantization: a second rounding).
    """

    tensor: str
    block: tuple[int, int]
    grouped: bool
    source: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"Operand.source must be one of {SOURCES}, got {self.source!r}")
        r, c = self.block
        if r <= 0 or c <= 0 or (self.grouped and r != 1):
            raise ValueError(f"bad block {self.block} (grouped operands have one row per block)")


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the expert MLP: ``out = A B^T`` over the reduction axis of both views."""

    name: str
    out: str
    a: Operand
    b: Operand


@dataclass(frozen=True)
class Recipe:
    """A quantization recipe: element / scale format and the six GEMMs' operands (:data:`GEMM_NAMES` order).

    element: "e4m3" (the only FP8 element format the kernels read).
    scale:   "e8m0" (a power of two 2**(s - 127) stored as one byte s; s = 255 marks a block holding NaN/Inf). The
             scale of a block is chosen by the RCEIL rule: the smallest power of two >= amax / 448.
    arch:    the architectures whose tensor cores consume this recipe natively (informational).
    """

    name: str
    gemms: tuple[Gemm, ...]
    element: str = "e4m3"
    scale: str = "e8m0"
    arch: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = tuple(g.name for g in self.gemms)
        if names != GEMM_NAMES:
            raise ValueError(f"recipe {self.name!r} must list the GEMMs {GEMM_NAMES}, got {names}")

    def gemm(self, name: str) -> Gemm:
        for g in self.gemms:
            if g.name == name:
                return g
        raise KeyError(f"no GEMM {name!r} in recipe {self.name!r} (GEMMs: {GEMM_NAMES})")

    @property
    def act_block(self) -> int:
        """Values per scale along the reduction axis of the activation operands (fprop/dgrad A)."""
        return self.gemm("fprop1").a.block[1]

    @property
    def weight_block(self) -> tuple[int, int]:
        """Scale block of the weights in their [out, in] view."""
        return self.gemm("fprop1").b.block


def _recipe(name: str, act: tuple[int, int], wf: tuple[int, int], wd: tuple[int, int], col: int, arch) -> Recipe:
    """A row of the table: activations in ``act`` blocks, weights in ``wf`` (fprop view) / ``wd`` (dgrad view),
    wgrad operands in ``col``-long grouped blocks along the tokens."""

    def op(t: str, block: tuple[int, int], src: str, grouped: bool = False) -> Operand:
        return Operand(t, block, grouped, src)

    cb = (1, col)
    return Recipe(
        name=name,
        arch=arch,
        gemms=(
            Gemm("fprop1", "a", op("x", act, "dispatch"), op("w13", wf, "weight")),
            Gemm("fprop2", "o", op("h", act, "swiglu"), op("w2", wf, "weight")),
            Gemm("dgrad2", "dh", op("dy", act, "dispatch"), op("w2", wd, "weight")),
            Gemm("dgrad1", "dx", op("da", act, "swiglu"), op("w13", wd, "weight")),
            Gemm("wgrad2", "dw2", op("dy", cb, "requantize", True), op("h", cb, "swiglu", True)),
            Gemm("wgrad1", "dw13", op("da", cb, "swiglu", True), op("x", cb, "requantize", True)),
        ),
    )


# MXFP8 (OCP MX): every operand in 1x32 blocks along its reduction axis, so the weights are quantized twice (along
# their input axis for fprop, along their output axis for dgrad). Exact on Hopper with per-32 promotion; native on
# Blackwell's block-scaled tensor cores.
MXFP8 = _recipe("mxfp8", act=(1, 32), wf=(1, 32), wd=(1, 32), col=32, arch=("sm_100",))

# Blockwise (DeepSeek-V3; the TMA-adaptive grouped GEMM paper): activations 1x128, weights 128x128 (one
# quantization serves fprop and dgrad: a square block is the same block in the transposed view), wgrad operands
# 128x1 along each expert's tokens. One fp32 promotion per 128 of K on Hopper's FP8 tensor cores.
BLOCKWISE = _recipe("blockwise", act=(1, 128), wf=(128, 128), wd=(128, 128), col=128, arch=("sm_90a",))

RECIPES: dict[str, Recipe] = {r.name: r for r in (MXFP8, BLOCKWISE)}
# The names MoEConfig.recipe accepts: an FP8 recipe of the table, or "bf16" (no quantization).
RECIPE_NAMES = ("bf16", *RECIPES)


def get_recipe(name: str | Recipe | None) -> Recipe | None:
    """The table row for ``name`` (None and "bf16" mean no quantization). Raises naming the valid names."""
    if name is None or isinstance(name, Recipe):
        return name
    if name == "bf16":
        return None
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; choose one of {RECIPE_NAMES}") from None
