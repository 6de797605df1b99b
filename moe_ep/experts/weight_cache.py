"""Quantized copies of expert weights, recomputed only when a weight changes.

Weights change once per optimizer step but are read by every micro-batch's forward and backward (fprop needs
``W`` quantized along its input axis, dgrad along its output axis). Re-quantizing them each time costs a full
read of the weights per GEMM; this cache keeps the last result per (weight, kind) and recomputes it when

* the weight's version counter moved: every in-place update (``optimizer.step``'s ``add_``/``copy_``)
  increments ``Tensor._version``, or
* the weight now lives elsewhere or has another shape/dtype (a new tensor, a re-allocated storage).

Not seen: FSDP2 writes the all-gathered weights under ``torch.autograd._unsafe_preserve_version_counter``, so the
unsharded parameter keeps its version (and often its address) across optimizer steps. The MoE layer therefore uses
no cache on an FSDP2 unit (``moe_ep.layer.routed_experts``).

Reading ``_version`` and ``data_ptr()`` is host-side metadata: no device synchronization.
Entries hold a weak reference to the weight, so a cache never keeps a dead weight alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Entry:
    ref: weakref.ref
    key: tuple
    value: Any


class WeightQuantCache:
    """``get(w, kind, fn)`` returns ``fn(w)``, computed again only when ``w`` changed (see the module docstring).

    Example:
        cache = WeightQuantCache()
        ops = cache.get(w13, "gemm_operands", prepare_weight_operands)  # prepares
        ops = cache.get(w13, "gemm_operands", prepare_weight_operands)  # cached
        with torch.no_grad():
            w13.add_(1.0)                                                # optimizer step: version moves
        ops = cache.get(w13, "gemm_operands", prepare_weight_operands)  # prepares again
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], _Entry] = {}
        self.misses = 0

    @staticmethod
    def _key(w: torch.Tensor) -> tuple:
        return (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)

    def get(self, w: torch.Tensor, kind: str, fn: Callable[[torch.Tensor], Any]) -> Any:
        slot = (id(w), kind)
        key = self._key(w)
        e = self._entries.get(slot)
        if e is not None and e.ref() is w and e.key == key:
            return e.value
        # the stale value goes before the new one is computed: holding both was a transient of twice the operands
        # (4 + 4 bytes per weight element on Hopper) at every weight change
        self._entries.pop(slot, None)
        del e
        with torch.no_grad():
            value = fn(w.detach())
        self._entries[slot] = _Entry(weakref.ref(w), key, value)
        self.misses += 1
        self._prune()
        return value

    def _prune(self) -> None:
        dead = [k for k, e in self._entries.items() if e.ref() is None]
        for k in dead:
            del self._entries[k]

    def clear(self) -> None:
        self._entries.clear()
