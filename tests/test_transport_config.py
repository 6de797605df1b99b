"""CPU tests of the NVSHMEM transport's configuration: the fused kernels' schedule (moe_ep/transport/schedule.py:
defaults, validation, cross-rank agreement over gloo processes) and the runtime's spin-wait timeout and argument
checks (moe_ep/transport/runtime.py), which run before any CUDA or collective call."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from moe_ep.transport.nvshmem import runtime
from moe_ep.transport.nvshmem.schedule import CTA_WARPS, MAX_PIECES, TransportSchedule, agree
from tests._dist import run_distributed


def test_defaults():
    s = TransportSchedule()
    assert (s.dispatch_send_warps, s.combine_send_warps, s.dispatch_pieces, s.combine_pieces) == (6, 12, 0, 0)
    assert TransportSchedule(1, 16, 3, 0) == TransportSchedule(
        dispatch_send_warps=1, combine_send_warps=16, dispatch_pieces=3, combine_pieces=0
    )


def test_schedule_is_not_read_from_the_environment(monkeypatch):
    for f in dataclasses.fields(TransportSchedule):
        monkeypatch.setenv(f"MOE_EP_{f.name.upper()}", "3")
    assert TransportSchedule() == TransportSchedule(6, 12, 0, 0)


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
    ("field", "value"),
    [
        ("dispatch_send_warps", 0),  # no sender warp: nobody takes the send tickets (ep_sync.cuh)
        ("dispatch_send_warps", CTA_WARPS + 1),  # more than the CTA's 16 warps
        ("combine_send_warps", "four"),
        ("combine_send_warps", True),
        ("dispatch_pieces", MAX_PIECES + 1),  # more than the row flags the symmetric region has per row
        ("combine_pieces", -1),
        ("combine_pieces", 2.5),
    ],
)
def test_constructor_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        TransportSchedule(**{field: value})
    with pytest.raises(ValueError, match=field):  # dataclasses.replace runs the same checks (set_schedule's input)
        dataclasses.replace(TransportSchedule(), **{field: value})


def test_agree_rejects_other_types():
    with pytest.raises(TypeError, match="TransportSchedule"):
        agree({"dispatch_send_warps": 6}, None)
    assert agree(TransportSchedule(combine_pieces=2), None) == TransportSchedule(combine_pieces=2)


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


def test_timeout_seconds(monkeypatch):
    monkeypatch.delenv("MOE_EP_COMM_TIMEOUT_S", raising=False)
    assert runtime.timeout_seconds() == 60.0
    assert runtime.timeout_seconds(2) == 2.0
    monkeypatch.setenv("MOE_EP_COMM_TIMEOUT_S", "7.5")  # the debugging override, below an explicit argument
    assert runtime.timeout_seconds() == 7.5
    assert runtime.timeout_seconds(0.25) == 0.25
    for bad in (0, -1.0, float("inf"), float("nan"), "20", True):
        with pytest.raises(ValueError, match="timeout_s"):
            runtime.timeout_seconds(bad)
    monkeypatch.setenv("MOE_EP_COMM_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MOE_EP_COMM_TIMEOUT_S"):
        runtime.timeout_seconds()


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(schedule={"dispatch_send_warps": 8}), TypeError, "TransportSchedule"),
        (dict(timeout_s=0), ValueError, "timeout_s"),
        (dict(hidden=100), ValueError, "multiple of 32"),
    ],
)
def test_init_runtime_checks_arguments_first(kw, exc, match):
    """Bad arguments raise before init_runtime touches CUDA or a process group (this machine may have neither)."""
    args = dict(group=None, max_tokens_per_rank=8, hidden=64, top_k=2, num_experts=4)
    args.update(kw)
    with pytest.raises(exc, match=match):
        runtime.init_runtime(**args)
