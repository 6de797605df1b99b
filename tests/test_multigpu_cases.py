"""tests/multigpu/_cases.py (the torchrun scripts' verdict loop) over gloo: every rank gets the same counts."""

from __future__ import annotations

from tests._dist import run_distributed
from tests.multigpu._cases import run_cases


def _ok() -> None:
    pass


def _ranks(rank: int, world: int) -> None:
    def fails_on_rank1() -> None:
        if rank == 1:
            raise AssertionError("only rank 1 fails")

    def fails_everywhere() -> None:
        raise RuntimeError("boom")

    got = run_cases([("ok", _ok), ("one rank", fails_on_rank1), ("all ranks", fails_everywhere), ("ok2", _ok)], "cpu")
    assert got == (2, 2), f"rank {rank}: {got}"  # the rank-1-only failure counts as a failure on rank 0 too


def test_verdicts_agree_across_ranks():
    run_distributed(_ranks, 2)
