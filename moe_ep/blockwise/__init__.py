"""The blockwise FP8 recipe (1x128 activations, 128x128 weights, 128x1 wgrad operands): its byte layouts
(:mod:`.reference`, the specification) and their CUDA quantizers. Recipe row: :data:`moe_ep.recipe.BLOCKWISE`."""

from .reference import (
    B,
    colwise_cols,
    dequantize_colwise_grouped_torch,
    dequantize_rowwise_torch,
    dequantize_weight_torch,
    padded_group_offsets,
    quantize_colwise_grouped_torch,
    quantize_rowwise_torch,
    quantize_weight_torch,
)

__all__ = [
    "B",
    "colwise_cols",
    "dequantize_colwise_grouped_torch",
    "dequantize_rowwise_torch",
    "dequantize_weight_torch",
    "padded_group_offsets",
    "quantize_colwise_grouped_torch",
    "quantize_rowwise_torch",
    "quantize_weight_torch",
]
