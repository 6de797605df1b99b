"""Which ATen ops of an MoE layer's training step are nondeterministic: record every op of one forward + backward,
replay each one on copies of its recorded inputs, and compare the replays' outputs bitwise.

    python3 launch/nondeterminism.py [--layer torchtitan|cuda] [--recipe bf16] [--tokens 4096 --hidden 1024
                                     --ffn-hidden 512 --num-experts 16 --top-k 4] [--replays 4] [--deterministic]
                                     [--out PATH.json]
    (one GPU, no torchrun needed: EP = 1; --deterministic runs it under torch.use_deterministic_algorithms)

Answers "why do two runs of one seed differ" for the layers of ``launch/train.py``: the torchtitan-style baseline
(``benchmarks/torchtitan_moe.py``) or ours (``moe_ep.MoE``; its own kernels are CuPy launches, not ATen ops, so only
the torch ops around them are replayed; their determinism is tested in tests/test_expert_mlp_cuda.py and the
multi-GPU tier). Ops that create uninitialized memory (``empty*``) and collectives are not replayed. Output: one line
per op whose replays differ (count, the op, the shapes of its inputs) and a JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a check of the tool itself


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (NaN payloads and signed zeros compared too)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.numel() else t


def _same(a, b) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) and not torch.equal(_bits(x), _bits(y)):
            return False
    return True


class Recorder(TorchDispatchMode):
    """Keeps (op, cloned args, cloned kwargs) of every replayable ATen op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        replayable = name.startswith("aten.") and "empty" not in name and "_local_scalar" not in name
        if replayable and any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            self.ops.append((func, tree_map(_clone, args), tree_map(_clone, kwargs)))
        return func(*args, **kwargs)


def find(step, replays: int) -> tuple[Counter, int]:
    """step(): one forward + backward. -> (Counter of 'op[input shapes]' whose replays are not all bitwise equal,
    the number of ops replayed)."""
    rec = Recorder()
    with rec:
        step()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    bad: Counter = Counter()
    for func, args, kwargs in rec.ops:
        outs = []
        for _ in range(replays):
            a, k = tree_map(_clone, args), tree_map(_clone, kwargs)
            outs.append(func(*a, **k))
        if not all(_same(outs[0], o) for o in outs[1:]):
            shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            bad[f"{func}{shapes}"] += 1
    return bad, len(rec.ops)


def _layer(args):
    from moe_ep import MoE, MoEConfig, init_ep  # noqa: PLC0415

    mesh = init_ep(ep_size=1)
    cfg = MoEConfig(hidden=args.hidden, ffn_hidden=args.ffn_hidden, num_experts=args.num_experts, top_k=args.top_k,
                    max_tokens_per_rank=args.tokens, capacity_factor=None, recipe=args.recipe,
                    backend="cuda" if DEV.type == "cuda" else "reference")  # fmt: skip
    if args.layer == "torchtitan":
        from torchtitan_moe import TorchtitanMoELayer  # noqa: PLC0415

        layer = TorchtitanMoELayer(cfg, mesh).to(DEV)
        with torch.no_grad():
            for prm in layer.parameters():  # (its parameters are made uninitialized: the model initializes them)
                prm.normal_(0, 0.02, generator=torch.Generator(device=DEV).manual_seed(1))
        return layer.to(torch.bfloat16)
    return MoE(cfg, mesh, device=DEV, dtype=torch.bfloat16, seed=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", choices=["torchtitan", "cuda"], default="torchtitan")
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--replays", type=int, default=4)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if DEV.type == "cuda":
        torch.cuda.set_device(0)
    layer = _layer(args)
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=DEV, generator=gen).bfloat16().requires_grad_(True)
    g = torch.randn(args.tokens, args.hidden, device=DEV, generator=gen)

    def step():
        out = layer(x)
        y, aux = out if isinstance(out, tuple) else (out, torch.zeros((), device=DEV))
        ((y.float() * g).sum() + aux).backward()

    step()  # warm-up outside the recorder (compilation, buffers)
    bad, n = find(step, args.replays)
    res = {"layer": args.layer, "recipe": args.recipe, "deterministic": args.deterministic, "ops_replayed": n,
           "nondeterministic": dict(bad), "device": _device_name(), "torch": torch.__version__,
           "commit": os.environ.get("MOE_EP_COMMIT", "unknown"), "args": vars(args)}  # fmt: skip
    print(f"{args.layer} (deterministic={args.deterministic}): {n} ops replayed x{args.replays}; not bitwise equal:")
    for k, v in bad.items():
        print(f"  {v} x {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
