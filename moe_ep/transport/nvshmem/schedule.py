"""Work split of the NVSHMEM transport's fused kernels (kernels/transport/nvshmem/dispatch.cu ``ep_dispatch_mx``,
combine.cu ``ep_combine``), held by the runtime and identical on every EP rank (docs/design-transport.md).

Two knobs per kernel:
  send_warps  warps of every 16-warp CTA that start on the sending side (1..16); the others start receiving at
              once, so that received rows are expanded / summed while the send is still running.
  pieces      column pieces per row (1..4), each a separate send ticket with its own row flag, so that the last
              wave of sends (what the receivers finish after the send) is smaller; 0 = from the hidden size.

The schedule is configuration: ``init_runtime(..., schedule=TransportSchedule(...))`` when the runtime is created,
:meth:`EPRuntime.set_schedule` later. The pieces value decides which row flag a sender sets and which ones a
receiver waits for: ranks that disagree would read rows before they arrive. So the schedule is agreed on when it
is set (:func:`agree`, a collective with a host sync), never per call.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch.distributed as dist

CTA_WARPS = 16  # 512-thread CTAs of the fused kernels
MAX_PIECES = 4  # row flags per row in the symmetric region (disp_flag / comb_flag are [cap][MAX_PIECES])


# valid range of every field (pieces 0: from hidden)
_RANGE = {
    "dispatch_send_warps": (1, CTA_WARPS),
    "combine_send_warps": (1, CTA_WARPS),
    "dispatch_pieces": (0, MAX_PIECES),
    "combine_pieces": (0, MAX_PIECES),
}


def _check(field: str, value) -> None:
    lo, hi = _RANGE[field]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"expected an integer in {lo}..{hi}" + (" (0: from hidden)" if lo == 0 else ""))


@dataclass(frozen=True)
class TransportSchedule:
    """The fused kernels' work split; every field is checked on construction (ValueError naming the field).

    Defaults: the measured best (docs/performance.md): dispatch 6 sender warps, combine 12, pieces from hidden.
    Example: ``TransportSchedule(dispatch_send_warps=8, combine_pieces=4)``.
    """

    dispatch_send_warps: int = 6
    combine_send_warps: int = 12
    dispatch_pieces: int = 0  # 0: one piece per 7 x 512 elements of hidden (2 at 7168, 1 at 2048), at most 4
    combine_pieces: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            try:
                _check(f.name, v)
            except ValueError as e:
                raise ValueError(f"{f.name}={v!r}: {e}") from None

    def pieces(self, kind: str, hidden: int) -> int:
        """Pieces of the ``kind`` ("dispatch" / "combine") kernel for rows of ``hidden`` elements.

        Example: ``TransportSchedule().pieces("dispatch", 7168) == 2`` (14 steps of 512 -> 2 pieces of 7).
        """
        p = getattr(self, f"{kind}_pieces")
        return p if p else max(1, min(MAX_PIECES, (hidden + 511) // 512 // 7))


def agree(schedule: TransportSchedule, group) -> TransportSchedule:
    """Check that every rank of ``group`` holds the same schedule (collective; host sync); returns it.

    Raises ValueError on every rank, listing each rank's values, when they differ; TypeError (before any
    collective) when ``schedule`` is not a :class:`TransportSchedule`.
    """
    if not isinstance(schedule, TransportSchedule):
        raise TypeError(f"expected a TransportSchedule, got {type(schedule).__name__}: {schedule!r}")
    if group is None or dist.get_world_size(group) == 1:
        return schedule
    mine = astuple(schedule)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)  # NOTE: host sync (runtime creation / schedule change)
    if any(tuple(v) != mine for v in everyone):
        names = [f.name for f in fields(TransportSchedule)]
        rows = "; ".join(f"rank {r}: {dict(zip(names, v, strict=True))}" for r, v in enumerate(everyone))
        raise ValueError(f"the transport schedule differs between EP ranks (pass the same TransportSchedule): {rows}")
    return schedule
