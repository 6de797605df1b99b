"""The verdict loop of the torchrun test scripts (tests/multigpu/*.py): one helper, every rank the same status.

Every rank runs every case. A case passes on a rank when it returns; the ranks agree on each verdict through an
all-reduce (MIN), so a case that fails on one rank fails everywhere and every rank keeps issuing the same
collectives. Rank 0 prints ``PASS/FAIL name (world=W)`` and the closing ``N passed, N failed`` line; a failing
rank prints its traceback. The CPU test tests/test_multigpu_cases.py runs this loop over gloo.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def run_cases(cases: Sequence[tuple[str, Callable[[], None]]], device: torch.device | str) -> tuple[int, int]:
    """Run ``cases`` ([(name, fn)]) on this rank; returns (passed, failed), the same on every rank.

    device: where the verdict flag lives (a CUDA device under nccl, "cpu" under gloo).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    passed = failed = 0
    for name, fn in cases:
        try:
            fn()
            ok = 1
        except Exception:  # noqa: BLE001  (a failing case is reported, the next one still runs)
            ok = 0
            print(f"[rank {rank}] FAILED {name}\n{traceback.format_exc()}", flush=True)
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            passed += 1
        else:
            failed += 1
        if rank == 0:
            print(f"{'PASS' if flag.item() else 'FAIL'} {name} (world={world})", flush=True)
    if rank == 0:
        print(f"{passed} passed, {failed} failed", flush=True)
    return passed, failed
