"""The dispatch layout and the handle that combine consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class EPHandle:
    """Everything combine and the backward passes need from a dispatch; nothing lives on the module.

    Source side (this rank's tokens), S = rows sent = number of (token, destination rank) pairs:
      send_token:  [S] int64, source token of each sent row; rows sorted by (destination rank, token).
      send_row_of: [T, ep_size] int64, the sent row of (token, rank), -1 where the token does not go there.
      topk_rank:   [T, top_k] int64, destination rank of each top-k slot.
      send_splits: rows sent to each rank (host ints; the reference transport needs them).
      send_local:  [S, top_k] int64, local expert of each slot at the row's destination, -1 elsewhere.
    Receiver side, R = rows received, N = expanded (row, slot) pairs routed to this rank's experts:
      recv_splits: rows received from each rank (host ints).
      recv_local:  [R, top_k] int64, received send_local rows.
      expand_row:  [N] int64, received row of each expanded row; expanded rows are expert-sorted and,
                   within an expert, in (source rank, source token) order.
      expand_slot: [N] int64, top-k slot of each expanded row.
      group_sizes: [num_local_experts] int32, expanded rows per local expert (device).
      group_sizes_host: the same as host ints (reference backend only).
      num_dropped: slots routed to this rank's experts past its capacity (not expanded; 0 when dropless).
    """

    num_tokens: int
    top_k: int
    ep_size: int
    num_local_experts: int
    send_token: torch.Tensor
    send_row_of: torch.Tensor
    topk_rank: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    send_local: torch.Tensor
    recv_local: torch.Tensor
    expand_row: torch.Tensor
    expand_slot: torch.Tensor
    group_sizes: torch.Tensor
    group_sizes_host: list[int]
    group: dist.ProcessGroup | None = None
    num_dropped: int = 0

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    @property
    def num_expanded(self) -> int:
        return int(self.expand_row.numel())
