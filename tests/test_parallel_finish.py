"""moe_ep.finish: the end-of-run teardown (barriers on the mesh groups, store rendezvous, destroy)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from moe_ep import finish, init_ep
from tests._dist import run_distributed


def test_finish_without_process_group_is_a_noop():
    assert not dist.is_initialized()
    finish()  # nothing to tear down
    assert not dist.is_initialized()


def _finish_rank(rank: int, world_size: int) -> None:
    mesh = init_ep(ep_size=2)  # ("dp", "ep") = (world / 2, 2) on gloo
    assert dist.is_initialized()
    if rank == world_size - 1:
        # A late rank: teardown must still complete on every rank. (This does not force the exit race that finish()
        # guards against, which no test can trigger deterministically; the barriers alone absorb this delay.)
        time.sleep(0.5)
    finish(mesh)
    assert not dist.is_initialized()
    finish(mesh)  # a second call is a no-op


@pytest.mark.parametrize("world_size", [2, 4])
def test_finish_tears_down_every_rank(world_size):
    run_distributed(_finish_rank, world_size)
