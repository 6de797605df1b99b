"""The bf16 baseline expert MLP (recipe "bf16"): ``torch._grouped_mm`` with autograd, on any architecture torch
supports."""

from __future__ import annotations

import torch


def expert_mlp_bf16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The bf16 baseline experts: ``torch._grouped_mm`` SwiGLU with autograd (the strongest straightforward bf16
    implementation; torchtitan's).

    x: [M, H] bf16 expert-sorted rows, w13: [E, 2F, H], w2: [E, H, F] (cast to bf16 if needed, differentiably),
    group_sizes: int32 [E] (device) -> [M, H] bf16. Rows past sum(group_sizes) are unspecified (no group reads or
    writes them; the transport never reads them back).
    """
    if x.shape[0] == 0:
        return x.new_zeros(0, w2.shape[1])
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    w13b, w2b = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    a = torch._grouped_mm(x, w13b.transpose(-2, -1), offs=offs)
    gate, up = a.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    return torch._grouped_mm(h, w2b.transpose(-2, -1), offs=offs)
