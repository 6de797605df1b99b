"""torchrun script: the NVSHMEM transport against the reference transport (run over nccl in the same process).

    torchrun --standalone --nproc-per-node=N tests/multigpu/ep_nvshmem.py      (N = 1, 2 or 4; needs nvshmem4py
                                                                                for N > 1)

The cases live beside it: ep_nvshmem_cases.py (every pass and payload: raw rows, MXFP8 1x32, blockwise 1x128;
autograd; CUDA graphs), ep_nvshmem_faults.py (errors, overflow, repeats, timeout, schedules), ep_common.py (the
shared state and checks). This file is the case list.

Every rank runs every case; ranks agree on each verdict through an all-reduce, and rank 0 prints
``PASS/FAIL name`` and ``N passed, N failed``; exit code 1 when any case failed on any rank. Failing checks print
per-rank diagnostics (first mismatching index, values, counts).

Bounds. Received bytes (e4m3 data, scales, local expert ids, weights), the expanded order and the fused dispatch's
scales (MXFP8 blocked, blockwise row-major) must be identical. Combine and dispatch-backward sum in the reference's
order (top-k slot order in fp32 on the expert side with separate multiply and add, rank order in fp32 on the
source), so they are expected to be bitwise equal; the hard check is |mine - ref| <= 2^-7 |ref| + 1e-6 (one bf16
rounding of the result, which is where a different fp32 summation order of <= top_k + ep_size terms would show).
``dw`` of combine-backward is a dot product over H in a different order than torch's sum: |mine - ref| <= 1e-5 *
sum_h |v_h y_h| + 1e-6.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("MOE_EP_FORCE_REFERENCE", "1")  # the reference quantizer is pure torch: the specification
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_ep import finish  # noqa: E402
from moe_ep.recipe import BLOCKWISE  # noqa: E402
from moe_ep.transport.nvshmem import buffer as ct  # noqa: E402
from moe_ep.transport.nvshmem import runtime as nvs  # noqa: E402
from moe_ep.transport.nvshmem.schedule import TransportSchedule  # noqa: E402
from tests.multigpu import ep_common as C  # noqa: E402
from tests.multigpu._cases import run_cases  # noqa: E402
from tests.multigpu.ep_common import checked  # noqa: E402
from tests.multigpu.ep_nvshmem_cases import case_autograd, case_graph, case_transport  # noqa: E402
from tests.multigpu.ep_nvshmem_faults import (  # noqa: E402
    case_invalid_index,
    case_overflow,
    case_repeat,
    case_schedule_mismatch,
    case_timeout,
    with_schedule,
)

MULTI_RANK = ("schedules that differ between ranks raise", "timeout raises instead of hanging")


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    C.setup(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local), dist.group.WORLD)
    ct.init_runtime(
        C.GROUP, C.TMAX, C.HMAX, C.KMAX, C.EMAX, wire_bytes=4, schedule=TransportSchedule(), timeout_s=C.TIMEOUT_S
    )
    bf, f32 = torch.bfloat16, torch.float32
    cases = [
        ("random bf16 H=256 top2", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 256, bf, specials=True)),
        (
            "random fp32 H=160 top2 (C%4!=0)",
            lambda: case_transport("random", [9, 16, 3, 5], 8, 2, 160, f32, specials=True),
        ),
        ("one expert top1", lambda: case_transport("one_expert", [5, 9, 1, 3], 8, 1, 64, bf)),
        ("top8 of 8, a rank with 0 tokens", lambda: case_transport("random", [6, 11, 4, 0], 8, 8, 96, bf)),
        ("sparse: zero-token experts/ranks", lambda: case_transport("sparse", [10, 0, 17, 2], 8, 2, 128, bf)),
        ("large: 64 experts top8 H=1024", lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 1024, bf)),
        ("all ranks empty", lambda: case_transport("random", [0, 0, 0, 0], 8, 2, 64, bf)),
        # blockwise (1x128) payloads at hidden sizes that are multiples of 128 but not of 512 (the last 512-element
        # step of a row is partial: whole 8-lane blocks inactive), with NaN / Inf / subnormal rows (every case
        # above with H % 128 == 0 runs the blockwise payload too, and those with H % 128 != 0 check its refusal)
        (
            "blockwise: H=384 bf16 top2, specials",
            lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 384, bf, specials=True),
        ),
        (
            "blockwise: H=640 fp32 top8 of 8, specials",
            lambda: case_transport("random", [9, 16, 3, 5], 8, 8, 640, f32, specials=True),
        ),
        (
            "blockwise: all tokens on one expert, H=640",
            lambda: case_transport("one_expert", [37, 9, 1, 3], 8, 1, 640, bf),
        ),
        (
            "blockwise: zero-token experts / ranks, H=384",
            lambda: case_transport("sparse", [10, 0, 17, 2], 8, 2, 384, bf, capacity=0.75),
        ),
        # the fused kernels' schedules: 1 or 16 sender warps per CTA; dispatch rows sent as 3 column pieces of
        # which the first is empty (H=1024: 2 steps of 512 -> 0 + 1 + 1; piece 0 still carries the metadata) or as
        # 2 pieces, the second a partial step (H=992); combine rows as 3 pieces of 256-element steps (4 -> 1+1+2)
        # or 4 (H=992: 4 steps, the last partial)
        (
            "schedule: 1 sender warp, 3 pieces, H=1024",
            with_schedule(
                lambda: case_transport("random", [300, 41, 0, 257], 32, 8, 1024, bf, specials=True),
                TransportSchedule(dispatch_send_warps=1, combine_send_warps=1, dispatch_pieces=3, combine_pieces=3),
                via_init=True,
            ),
        ),
        (
            "schedule: 16 sender warps, 2 / 4 pieces, H=992",
            with_schedule(
                lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 992, bf),
                TransportSchedule(dispatch_send_warps=16, combine_send_warps=16, dispatch_pieces=2, combine_pieces=4),
            ),
        ),
        ("schedules that differ between ranks raise", case_schedule_mismatch),
        ("autograd bf16 under sync_debug_mode error", lambda: case_autograd("random", [40, 17, 0, 33], 16, 4, 128, bf)),
        ("autograd fp32 top8", lambda: case_autograd("random", [20, 9, 31, 3], 16, 8, 64, f32)),
        ("CUDA graph of forward + backward: replays = eager", case_graph),
        (
            "blockwise: autograd bf16 H=384 under sync_debug_mode error",
            lambda: case_autograd("random", [40, 17, 0, 33], 16, 4, 384, bf, recipe=BLOCKWISE),
        ),
        ("blockwise: CUDA graph of forward + backward", lambda: case_graph(h=640, recipe=BLOCKWISE)),
        # drop mode (capacity=) vs the reference with the same capacity; a float is the layer's capacity factor c:
        # ceil(c * own tokens * top_k) per rank, so ranks with unequal token counts get unequal capacities, and a
        # rank with 0 tokens gets capacity 0 while it still receives rows
        (
            "capacity: one expert top1, capacities differ per rank",
            lambda: case_transport("one_expert", [5, 9, 1, 3], 8, 1, 64, bf, capacity=0.5),
        ),
        ("capacity: 1 row per rank, top2", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 128, bf, capacity=1)),
        ("capacity: 0 rows (all dropped)", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 64, bf, capacity=0)),
        (
            "capacity: top8 of 8, a rank with 0 tokens (capacity 0)",
            lambda: case_transport("random", [6, 11, 4, 0], 8, 8, 96, bf, capacity=0.6),
        ),
        (
            "capacity: bf16 H=256 top2, specials, unequal capacities",
            lambda: case_transport("random", [40, 3, 17, 0], 8, 2, 256, bf, specials=True, capacity=0.5),
        ),
        (
            "capacity: fp32 H=160 top2 (C%4!=0)",
            lambda: case_transport("random", [9, 16, 3, 5], 8, 2, 160, f32, specials=True, capacity=0.75),
        ),
        (
            "capacity: 64 experts top8 H=1024, multi-tile groups",
            lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 1024, bf, capacity=0.3),
        ),
        (
            "capacity above the load: nothing dropped",  # every rank has tokens, so no capacity is 0
            lambda: case_transport("sparse", [10, 5, 17, 2], 8, 2, 128, bf, capacity=4.0),
        ),
        (
            "capacity: autograd bf16 under sync_debug_mode error",
            lambda: case_autograd("random", [40, 17, 0, 33], 16, 4, 128, bf, capacity=0.4),
        ),
        ("capacity: autograd fp32 top8", lambda: case_autograd("random", [20, 9, 31, 3], 16, 8, 64, f32, capacity=0.3)),
        ("capacity: CUDA graph of forward + backward", lambda: case_graph(capacity=0.5)),
        ("invalid expert index raises", case_invalid_index),
        ("overflow raises, group sizes clamped to the capacity", case_overflow),
        ("1000 dispatch/combine iterations", case_repeat),
        ("timeout raises instead of hanging", case_timeout),
    ]
    if C.WORLD == 1:  # these check what ranks do to each other; one rank has no peer to disagree with or wait for
        for name in MULTI_RANK:
            if C.RANK == 0:
                print(f"SKIP {name} (needs more than one rank)", flush=True)
        cases = [(name, fn) for name, fn in cases if name not in MULTI_RANK]
    _, failed = run_cases([(name, lambda fn=fn: checked(fn)) for name, fn in cases], C.DEV)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
