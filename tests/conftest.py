"""Test tiers (cheapest first): CPU unit tests -> CPU multi-process (gloo, tests/_dist.py) -> single-GPU kernels
against the reference (marker ``gpu``) -> multi-GPU scripts under torchrun (tests/multigpu/, not collected here).

Tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU with CuPy is present. After collection the
launch/train.py runs of the selected tests/test_train.py tests start in the background (tests/_train_runs.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible)"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'moe_ep[gpu]')"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread in the test process, as in every rank it starts (tests/_dist.py) and every train.py run
    # (OMP_NUM_THREADS=1): on 2 cores the processes run side by side, and idle OpenMP threads spin.
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy (skipped, with the reason, without them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    from tests._train_runs import prefetch_for  # noqa: PLC0415

    prefetch_for(session.items)
