"""Shared experts: a dense SwiGLU every token goes through, added to the routed output (DeepSeek-V3, Qwen-MoE).

On the cuda backend it runs on a side CUDA stream, so that it overlaps the router's successors (layout, dispatch,
experts, combine) on the current stream, as DeepSeek-V3's and DeepEP's users do:

  current stream   record "x ready" ─┬─ router, layout, dispatch, experts, combine ─ wait "shared done" ─ add
  side stream                        └─ wait "x ready" ─ SwiGLU(x) ─ record "shared done" ┘

Memory safety: x (made on the current stream) is also read on the side stream, and the shared output (made on the
side stream) is read on the current one: ``record_stream`` tells the caching allocator about both uses, so neither
block is reused before the other stream's work on it is done. Autograd runs each backward op on its forward op's
stream, so the shared expert's backward runs on the side stream too, and the engine synchronizes the two gradient
contributions to x. Graph capture: only event record/wait and kernels between the fork and the join (the side stream
joins the current one before the layer returns), which CUDA graph capture supports; the side stream is created once
per device, outside any capture. Deterministic: the same kernels on the same data, one add at the join.

Shortcut: the shared SwiGLU computes in x's dtype (bf16 on the cuda backend), not in the layer's MXFP8 recipe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
OVERLAP = True  # False: the cuda backend runs the shared SwiGLU on the current stream (A/B runs of the overlap)


class SharedExperts(nn.Module):
    """The merged shared experts: w13 [2Fs, H] (gate rows, then up rows), w2 [H, Fs].

    forward(x: [T, H] bf16/fp32) -> [T, H] x.dtype = (silu(x w_gate^T) * (x w_up^T)) w2^T, in x's dtype.
    """

    def __init__(self, hidden: int, width: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * width, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(hidden, width, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13.to(x.dtype)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2.to(x.dtype))


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` (one per device, made on first use: make it before capturing a graph, e.g. in
    the warm-up run that graph capture needs anyway)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def with_shared_experts(
    shared: SharedExperts, x: torch.Tensor, routed: Callable[[], torch.Tensor], overlap: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``routed()`` (the routed part of the layer, on the current stream) and ``shared(x)``.

    x: [T, H]; routed() -> y [T, H] -> (y, shared(x) [T, H] x.dtype); the caller adds them. ``overlap`` (CUDA x
    only): the shared SwiGLU runs on the device's side stream, forked before ``routed()`` and joined after it (see
    the module docstring). Otherwise it runs on the current stream, issued before ``routed()``.
    """
    if not (overlap and OVERLAP and x.is_cuda):
        # issued before routed(), as on the side stream: the same forward order gives autograd the same order of
        # x's three gradient contributions (router, routed, shared), so both paths are bitwise equal
        ys = shared(x)
        return routed(), ys
    cur = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    side.wait_stream(cur)  # fork: x (and the weights) are ready
    with torch.cuda.stream(side):
        ys = shared(x)
    x.record_stream(side)
    y = routed()
    cur.wait_stream(side)  # join before the add
    ys.record_stream(cur)
    return y, ys
