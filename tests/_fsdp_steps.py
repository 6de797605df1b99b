"""Pieces shared by the FSDP2 FP8-gather tests (tests/test_fsdp_mxfp8.py, tests/test_fsdp_blockwise.py), run inside
the gloo ranks of tests/_dist.py."""

from __future__ import annotations

import math

import torch


def train_steps(model, rank: int, world: int, steps: int = 3) -> tuple[list[tuple[float, float]], list]:
    """``steps`` AdamW steps of ``model`` (an FSDP2-sharded launch.model.MoETransformer) on this rank's 2 sequences
    of 16 tokens (the same batches on every call) -> ([(loss, grad norm)] per step, the experts' local shards)."""
    from moe_ep.parallel import clip_grad_norm_  # noqa: PLC0415

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        tok = torch.randint(0, 256, (2 * world, 17), generator=torch.Generator().manual_seed(step))
        tok = tok[2 * rank : 2 * rank + 2]
        loss, aux = model(tok[:, :-1], tok[:, 1:])
        (loss + aux).backward()
        out.append((loss.item(), float(clip_grad_norm_(model, math.inf))))
        opt.step()
        opt.zero_grad(set_to_none=True)
    shards = [p._local_tensor for n, p in model.named_parameters() if ".experts." in f".{n}"]
    return out, shards


def cuda_stand_in(weight_type: type, seen: list):
    """A CPU stand-in for ``moe_ep.layer_cuda.routed_experts_cuda``: appends to ``seen`` whether it received FSDP2's
    gathered weights of ``weight_type`` (and no operand cache), then computes the reference layer in the config's
    recipe on them (their stored quantizations)."""
    from moe_ep.experts.reference import expert_mlp  # noqa: PLC0415
    from moe_ep.transport import combine, dispatch  # noqa: PLC0415

    def routed_experts_cuda(x, topk_idx, topk_w, w13, w2, cache, cfg, group):
        seen.append(type(w13) is weight_type and type(w2) is weight_type and cache is None)
        r = cfg.recipe_row
        rows, w, handle = dispatch(x, topk_idx, topk_w, cfg.num_experts, group, r)
        out = expert_mlp(rows, w13, w2, handle.group_sizes_host, r)
        return combine(out, w, handle, r), handle.num_dropped

    return routed_experts_cuda
