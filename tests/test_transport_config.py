"""CPU tests of the NVSHMEM transport's schedule (moe_ep/comm/schedule.py): defaults, environment, validation,
and the cross-rank agreement (gloo processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from moe_ep.transport.schedule import CTA_WARPS, MAX_PIECES, TransportSchedule, agree
from tests._dist import run_distributed

_ENV = [f"MOE_EP_{f.name.upper()}" for f in dataclasses.fields(TransportSchedule)]


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_and_env(clean_env):
    assert TransportSchedule.from_env() == TransportSchedule()
    clean_env.setenv("MOE_EP_DISPATCH_SEND_WARPS", "1")
    clean_env.setenv("MOE_EP_COMBINE_SEND_WARPS", "16")
    clean_env.setenv("MOE_EP_DISPATCH_PIECES", "3")
    clean_env.setenv("MOE_EP_COMBINE_PIECES", "0")  # 0: from hidden, as the default
    assert TransportSchedule.from_env() == TransportSchedule(1, 16, 3, 0)


@pytest.mark.parametrize(
    ("hidden", "want"), [(32, 1), (2048, 1), (3584, 1), (3616, 1), (4096, 1), (7168, 2), (14336, 4), (32768, 4)]
)
@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_pieces_from_hidden(kind, hidden, want):
    # one piece per 7 steps of 512 elements (steps = ceil(hidden / 512)), at least 1, at most 4
    assert TransportSchedule().pieces(kind, hidden) == want
    # an explicit value wins
    assert TransportSchedule(**{f"{kind}_pieces": 3}).pieces(kind, hidden) == 3


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("MOE_EP_DISPATCH_SEND_WARPS", "0"),  # no sender warp: nobody takes the send tickets (ep_sync.cuh)
        ("MOE_EP_DISPATCH_SEND_WARPS", "17"),  # more than the CTA's 16 warps
        ("MOE_EP_COMBINE_SEND_WARPS", "four"),
        ("MOE_EP_DISPATCH_PIECES", "5"),  # more than the row flags the symmetric region has per row
        ("MOE_EP_COMBINE_PIECES", "-1"),
        ("MOE_EP_COMBINE_PIECES", "2.5"),
    ],
)
def test_env_rejects_bad_values(clean_env, name, raw):
    clean_env.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        TransportSchedule.from_env()


def test_constructor_rejects_bad_values():
    with pytest.raises(ValueError, match="combine_send_warps"):
        TransportSchedule(combine_send_warps=CTA_WARPS + 1)
    with pytest.raises(ValueError, match="dispatch_pieces"):
        TransportSchedule(dispatch_pieces=MAX_PIECES + 1)


def _agree_ranks(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    same = TransportSchedule(dispatch_send_warps=5, combine_pieces=2)
    assert agree(same, group) == same
    # rank 1 differs: every rank raises, naming each rank's values
    mine = dataclasses.replace(same, dispatch_pieces=3 if rank == 1 else 1)
    with pytest.raises(ValueError, match="differs between EP ranks") as e:
        agree(mine, group)
    assert "rank 1: {" in str(e.value) and "'dispatch_pieces': 3" in str(e.value)


def test_agree_across_ranks():
    run_distributed(_agree_ranks, 3)
