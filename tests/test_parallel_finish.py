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
        time.sleep(0.5)  # a late rank: the others must wait in the rendezvous, not tear down first
    finish(mesh)
    assert not dist.is_initialized()
    finish(mesh)  # a second call is a no-op


@pytest.mark.parametrize("world_size", [2, 4])
def test_finish_tears_down_every_rank(world_size):
    run_distributed(_finish_rank, world_size)
