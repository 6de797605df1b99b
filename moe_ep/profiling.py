"""Phase timing of the MoE layer with CUDA events (benchmarks; nothing here waits for the GPU while recording).

The layer calls :func:`mark` at the end of each phase; outside :func:`record_phases` that is a no-op (one global
read), so the training path pays nothing.

Example:
    with profiling.record_phases() as timer:
        y, aux = layer(x)
        y.backward(dy)
    torch.cuda.synchronize()
    timer.summary()  # {"router": 0.05, "layout": 0.03, ...} milliseconds, in the order first seen
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Events recorded on the current stream; phase ``name`` lasts from the previous mark to ``mark(name)``."""

    def __init__(self) -> None:
        self._marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._marks.append((name, ev))

    def summary(self) -> dict[str, float]:
        """{phase: milliseconds}, summed over repeated names. Call after the GPU finished (synchronize)."""
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:], strict=False):
            out[name] = out.get(name, 0.0) + a.elapsed_time(b)
        return out


_active: PhaseTimer | None = None


def recording() -> bool:
    """Whether a :func:`record_phases` block is active (callers skip work that only serves the marks)."""
    return _active is not None


def mark(name: str) -> None:
    """End phase ``name`` (no-op unless a :func:`record_phases` block is active)."""
    if _active is not None:
        _active.mark(name)


@contextmanager
def record_phases() -> Iterator[PhaseTimer]:
    """Record the layer's phases (forward and backward) issued inside the block; see the module docstring."""
    global _active
    prev, _active = _active, PhaseTimer()
    _active.mark("start")
    try:
        yield _active
    finally:
        _active = prev
