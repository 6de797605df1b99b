"""torchrun script: the CPU layer tests (tests/test_layer.py) on GPUs over nccl, reference backend.

    torchrun --standalone --nproc-per-node=N tests/multigpu/ep_reference.py

Every rank runs every case; ranks agree on the verdict through an all-reduce, and rank 0 prints
``N passed, N failed``. Exit code 1 when any case failed on any rank. Without a GPU the same cases run over gloo on
the CPU (what tests/test_layer.py checks), saying so; outside torchrun it exits 2 naming the command.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_ep import finish  # noqa: E402
from tests.multigpu._cases import run_cases  # noqa: E402
from tests.test_layer import _layer, _pipeline  # noqa: E402


def main() -> int:
    if "LOCAL_RANK" not in os.environ:
        print(f"run it under torchrun: torchrun --standalone --nproc-per-node=N {sys.argv[0]}", file=sys.stderr)
        return 2
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = f"cuda:{local}"
    else:  # no GPU (or a CPU-only torch): the same cases over gloo on the CPU
        dist.init_process_group("gloo")
        device = "cpu"
        if dist.get_rank() == 0:
            print("no CUDA GPU here: running the cases over gloo on the CPU (nccl needs GPUs)", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [("pipeline", lambda: _pipeline(rank, world, device))]
    for ep in sorted({world, max(1, world // 2)}):
        for top_k in (1, 2, 8):
            cases.append((f"layer ep={ep} top_k={top_k}", lambda ep=ep, k=top_k: _layer(rank, world, ep, k, device)))
    _, failed = run_cases(cases, device)
    finish()  # nobody tears connections down while a peer is still in the last collective
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
