"""The seam between the layer and an architecture's expert kernels: :class:`ExpertGemms` and :func:`gemms_for`.

The layer hands an implementation the dispatched payload of the recipe (e4m3 rows and their scales, in the layout the
recipe's dispatch writes), the group sizes on the device and the weights; the implementation owns every other
format (weight operands, column operands, what it saves for the backward): the layer passes them back unchanged and
never looks inside. Implementations: ``moe_ep/experts/sm90/`` (Hopper). A Blackwell ``sm100/`` sibling would run
``torch._scaled_grouped_mm`` on the MXFP8 payload as it arrives (native 1x32 block scaling) and register here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..recipe import Recipe, get_recipe
from .weight_cache import WeightQuantCache


class ExpertGemms(Protocol):
    """The SwiGLU expert MLP of one (architecture, recipe) on expert-sorted rows; group sizes int32 [G] on the device,
    never read on the host."""

    recipe: Recipe

    def prepare(self, w: torch.Tensor, cache: WeightQuantCache | None, fprop: bool = True, dgrad: bool = True) -> Any:
        """w [G, N, K] master weights -> opaque operands for the directions asked for (once per weight version with a
        cache)."""
        ...

    def quantize_rows(self, x: torch.Tensor, group_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] bf16 expert-sorted rows -> the dispatch payload of the recipe (e4m3 rows, scales in its layout):
        the bytes the fused dispatch delivers, for rows that arrive unquantized (tests, the unfused paths)."""
        ...

    def mlp_fwd(
        self, xq: torch.Tensor, xs: torch.Tensor, w13o: Any, w2o: Any, group_sizes: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """xq e4m3 [M, H] + scales (the recipe's dispatch layout) -> (out [M, H] bf16, what the backward needs)."""
        ...

    def mlp_bwd(
        self,
        saved: dict[str, torch.Tensor],
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13o: Any,
        w2o: Any,
        group_sizes: torch.Tensor,
        on_dx: Callable[[torch.Tensor], Any] | None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """saved (mlp_fwd's dict plus "dout" [M, H] bf16; consumed) -> (on_dx(dx) or None, dw13, dw2)."""
        ...


# (compute capability major, recipe name) -> "module:attribute" of the implementation, imported on first use
_IMPLEMENTATIONS: dict[tuple[int, str], str] = {
    (9, "mxfp8"): "moe_ep.experts.sm90.mlp:HOPPER_MXFP8",
    (9, "blockwise"): "moe_ep.experts.sm90.blockwise:HOPPER_BLOCKWISE",
}


def register(major: int, recipe: str, target: str) -> None:
    """Add an implementation: ``target`` = "module:attribute" of an :class:`ExpertGemms` for GPUs of compute
    capability ``major`` and the recipe named ``recipe``."""
    _IMPLEMENTATIONS[(major, recipe)] = target


def gemms_for(device: torch.device | int | None, recipe: str | Recipe) -> ExpertGemms:
    """The expert-GEMM implementation for ``device``'s architecture and ``recipe``; raises naming what exists."""
    r = get_recipe(recipe)
    if r is None:
        raise ValueError("gemms_for needs an FP8 recipe (the bf16 path runs torch._grouped_mm, no implementation)")
    major, minor = torch.cuda.get_device_capability(device)
    target = _IMPLEMENTATIONS.get((major, r.name))
    if target is None:
        have = ", ".join(f"sm_{m}x/{n}" for m, n in sorted(_IMPLEMENTATIONS))
        raise NotImplementedError(
            f"no expert GEMMs for sm_{major}{minor} with recipe {r.name!r} (implemented: {have}; "
            "Blackwell (sm_100) is planned as moe_ep/experts/sm100/, see docs/design.md 'How to extend')"
        )
    import importlib  # noqa: PLC0415

    mod, attr = target.split(":")
    return getattr(importlib.import_module(mod), attr)
