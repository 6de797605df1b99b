"""What launch/train.py tells the user before and while it trains: argument errors once under torchrun, the CPU
preset choice and its cost, an unwritable ``--log-json`` before any step, progress lines on slow CPU runs.

Kept out of train.py (the training loop); train.py imports it from this folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# A measured CPU run calibrates the estimates below: ``--preset small`` on 2 ranks of a 2-core machine (fp32, gloo)
# ran 29 tokens/s per rank with 10.7 GiB peak RSS per rank; its model costs ~528 MFLOP per token (forward +
# backward, the formula of :func:`cpu_cost`), so a rank computes ~15 GFLOP/s there.
CPU_FLOPS_PER_RANK = 15e9
_BASE_RSS_GIB = 1.0  # python + torch + the corpus, before the model


def launch_rank() -> int:
    """This process's rank under torchrun ($RANK), 0 without it."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankZeroParser(argparse.ArgumentParser):
    """argparse whose errors are one short line from rank 0 only, exit code 2 on every rank.

    Under torchrun every rank parses the same command line; the other ranks wait a moment before exiting so that
    rank 0's exit is the failure torchrun reports (and its message is printed before torchrun stops the rest)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if launch_rank() == 0:
            sys.stderr.write(f"{self.prog}: error: {message} ({self.prog} --help lists the arguments)\n")
            sys.stderr.flush()
        else:
            time.sleep(3.0)
        raise SystemExit(2)


def cpu_cost(args: argparse.Namespace, world: int) -> tuple[float, float]:
    """Rough (peak GiB per rank, seconds per step) of the parsed configuration on CPU in fp32.

    Memory: fp32 parameters, gradients and two AdamW moments (16 bytes per parameter) sharded over the world, plus
    the activations kept for the backward, ~4 bytes x (12 dim + 3 top_k ffn + n_heads seq_len) per token and block,
    plus ~1 GiB of process. Time: 6 x active parameters + 12 x n_layers x dim x seq_len FLOP per token at
    :data:`CPU_FLOPS_PER_RANK`. Both reproduce the measured ``small`` run (10.7 GiB, 29 tokens/s)."""
    d, f, layers, e, k = args.dim, args.ffn_hidden, args.n_layers, args.num_experts, args.top_k
    attn, expert = 4 * d * d, 3 * d * f
    params = layers * (attn + e * expert + e * d) + 2 * 256 * d
    active = layers * (attn + k * expert)
    tokens = args.batch_size * args.seq_len
    act_bytes = 4 * (12 * d + 3 * k * f + args.n_heads * args.seq_len) * tokens * layers
    gib = (16 * params / world + act_bytes) / 2**30 + _BASE_RSS_GIB
    flop_per_token = 6 * active + 12 * layers * d * args.seq_len
    return gib, tokens * flop_per_token / CPU_FLOPS_PER_RANK


def cpu_preset_note(args: argparse.Namespace, world: int, explicit_preset: bool) -> str | None:
    """What a CPU run (no CUDA) should say about its preset: the default choice, or the cost of a big one."""
    if not explicit_preset:
        return "no GPU: running preset 'tiny', the CPU default (--preset small|medium are GPU sizes)"
    if args.preset == "tiny":
        return None
    gib, sec = cpu_cost(args, world)
    total = sec * args.steps
    when = f"{total / 3600:.1f} h" if total >= 3600 else f"{total / 60:.0f} min"
    return (
        f"WARNING: --preset {args.preset} on CPU (no GPU visible): expect ~{gib:.0f} GiB of memory per rank and "
        f"~{sec:,.0f} s per step ({args.steps} steps: ~{when}); progress lines come as steps finish. A CPU trial "
        f"runs in seconds with --preset tiny (or no --preset)"
    )


def log_path_error(path: str) -> str | None:
    """None when ``path`` can be written (its folders are created), else why not. Leaves no file behind."""
    p = Path(path)
    if p.is_dir():
        return f"argument --log-json: {path} is a directory"
    for folder in p.parents:  # the nearest existing one must be a folder
        if folder.exists():
            if not folder.is_dir():
                return f"argument --log-json: cannot write {path} ({folder} is a file, not a folder)"
            break
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
        if not existed:
            p.unlink()
    except OSError as e:
        return f"argument --log-json: cannot write {path} ({e.strerror or e})"
    return None


def agree_log_path(path: str | None, rank: int, device) -> str | None:
    """Collective: rank 0 checks its log path, every rank learns the verdict. Returns the error text (rank 0) or
    "rank 0 cannot write its log" (the others), None when it is writable."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    err = log_path_error(path) if rank == 0 and path else None
    flag = torch.tensor([0.0 if err is None else 1.0], device=device)
    dist.all_reduce(flag)
    if flag.item() == 0:
        return None
    return err or "rank 0 cannot write its log"


class Heartbeat:
    """On CPU runs (no host-sync cost), a line after a step when ``every_s`` seconds passed since the last output, so
    a slow configuration shows it is alive: step, seconds per step, time left. Rank 0 only."""

    def __init__(self, total: int, enabled: bool, every_s: float = 30.0) -> None:
        self.total, self.enabled, self.every_s = total, enabled, every_s
        self.t0 = self.t_out = time.perf_counter()

    def printed(self) -> None:
        """Another line was just printed (a log line): restart the quiet interval."""
        self.t_out = time.perf_counter()

    def step_done(self, step: int) -> None:
        """``step`` (1-based) finished."""
        now = time.perf_counter()
        if not self.enabled or now - self.t_out < self.every_s or step >= self.total:
            return
        per = (now - self.t0) / step
        left_min = per * (self.total - step) / 60
        print(f"step {step}/{self.total}: {per:,.1f} s/step, ~{left_min:,.1f} min left", flush=True)
        self.t_out = now
