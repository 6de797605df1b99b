"""The blockwise FP8 recipe (1x128 activations, 128x128 weights, 128x1 wgrad operands): its byte layouts
(:mod:`.reference`, the specification: the 128x1 blocks as e4m3 bytes + scales, transposed and group padded, and
the prepared bf16 form the wgrad reads) and the CUDA quantizers the recipe runs (:mod:`.cuda`, imported lazily: the
names in ``_CUDA_NAMES`` resolve on first use, so ``import moe_ep.blockwise`` needs no CuPy). The CUDA side writes
the 128x1 blocks only in the prepared bf16 form (``quantize_colwise_prepared``, ``swiglu_colwise_prepared``,
``swiglu_bwd_quantize_prepared``): the bf16 wgrad kernel's operand. Recipe row: :data:`moe_ep.recipe.BLOCKWISE`."""

from .reference import (
    B,
    colwise_cols,
    dequantize_colwise_grouped_torch,
    dequantize_rowwise_torch,
    dequantize_weight_torch,
    padded_group_offsets,
    quantize_colwise_grouped_torch,
    quantize_colwise_prepared_torch,
    quantize_rowwise_torch,
    quantize_weight_torch,
)

# the CUDA launchers (moe_ep.blockwise.cuda), resolved on first attribute access
_CUDA_NAMES = (
    "quantize_rowwise",
    "quantize_rowwise_into",
    "quantize_colwise_prepared",
    "quantize_colwise_prepared_into",
    "quantize_weight",
    "quantize_weight_into",
    "transpose_weight",
    "transpose_weight_into",
    "swiglu_quantize",
    "swiglu_quantize_into",
    "swiglu_colwise_prepared",
    "swiglu_colwise_prepared_into",
    "swiglu_bwd_quantize_prepared",
    "swiglu_bwd_quantize_prepared_into",
)


def __getattr__(name: str):
    if name in _CUDA_NAMES:
        from . import cuda  # noqa: PLC0415

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_CUDA_NAMES,
    "B",
    "colwise_cols",
    "dequantize_colwise_grouped_torch",
    "dequantize_rowwise_torch",
    "dequantize_weight_torch",
    "padded_group_offsets",
    "quantize_colwise_grouped_torch",
    "quantize_colwise_prepared_torch",
    "quantize_rowwise_torch",
    "quantize_weight_torch",
]
