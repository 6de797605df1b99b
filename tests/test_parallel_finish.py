"""moe_ep.finish: the end-of-run teardown (barriers on the mesh groups, store rendezvous, destroy).

Covered: teardown on every rank, the no-op cases, and rank 0 waiting for the peers' last store call (the slow
poller). Not covered: the arrival rendezvous itself (its race, a peer still inside a gloo collective when another
closes its connections, cannot be forced here: removing that step passes these tests).
"""

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


class _SlowPollStore:
    """The default store, except that this rank's first poll of the finish rendezvous (``add(key, 0)``) comes
    ``delay_s`` late: the slow peer of the exit race. Attribute access goes to the real store."""

    def __init__(self, store, delay_s: float) -> None:
        self._store, self._delay_s, self._delayed = store, delay_s, False

    def add(self, key: str, value: int) -> int:
        if value == 0 and not self._delayed:
            self._delayed = True
            time.sleep(self._delay_s)
        return self._store.add(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _finish_slow_poller_rank(rank: int, world_size: int) -> None:
    # Rank 0 hosts the TCPStore (env:// rendezvous): it must not leave while a peer still has a store call to
    # make. Every rank but 0 arrives, then polls 1 s late; rank 0 sees all arrivals at once and, without the
    # "left" count, would return, exit and take the store with it before the peers' polls (they then fail).
    real = dist.distributed_c10d._get_default_store
    if rank != 0:
        store = _SlowPollStore(real(), 1.0)
        dist.distributed_c10d._get_default_store = lambda: store
    try:
        finish()
    finally:
        dist.distributed_c10d._get_default_store = real
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size", [2, 3])
def test_finish_waits_for_a_slow_poller(world_size):
    run_distributed(_finish_slow_poller_rank, world_size)
