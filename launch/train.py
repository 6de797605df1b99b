"""Train a small MoE transformer with FSDP2 + expert parallelism on bytes of the Python standard library.

    torchrun --nproc-per-node=N launch/train.py [--ep N] [--steps S] [--preset tiny|small]
             [--backend auto|reference] [--no-quantize] [--log-json PATH] ...

With GPUs: nccl, one GPU per rank, bf16 parameters (fp32 gradient reduction), preset "small". Without: the
same command runs over gloo on CPU in fp32 with preset "tiny". The text is the running interpreter's own
standard-library ``*.py`` files (present offline on every machine), tokenized bytewise (vocab 256).

Data: every step draws one global batch of ``batch_size * world_size`` random windows of the corpus from a
generator seeded by (seed, step); rank r takes windows [r*B, (r+1)*B). So a run is reproducible, every rank
reads a different slice, and a run on 1 process with batch 2B sees exactly the data of 2 processes with B.

Rank 0 prints loss and tokens/sec/GPU (tokens processed per rank per second) with a progress bar and writes
a JSON log (config, per-step loss, throughput per logging window, device, world size, git commit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from moe_ep import init_ep  # noqa: E402
from moe_ep.model import ModelConfig, MoETransformer  # noqa: E402
from moe_ep.parallel import apply_fsdp, broadcast_params, clip_grad_norm_, finish  # noqa: E402

# Model and optimizer presets. "tiny" runs in seconds on 2 CPU cores; "small" is a GPU-sized model
# (~8k tokens per rank per step). Any field can be overridden on the command line.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        seq_len=64,
        ffn_hidden=64,
        num_experts=4,
        top_k=2,
        batch_size=8,
        lr=3e-3,
        warmup=5,
        steps=30,
        log_every=5,
    ),
    "small": dict(
        dim=768,
        n_layers=8,
        n_heads=12,
        seq_len=1024,
        ffn_hidden=768,
        num_experts=16,
        top_k=4,
        batch_size=8,
        lr=1e-3,
        warmup=20,
        steps=200,
        log_every=10,
    ),
}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model/optimizer preset (default: small with CUDA, tiny on CPU)",
    )
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: world size)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--backend", choices=["auto", "reference"], default="auto", help="MoE backend (the CUDA layer is not built yet)"
    )
    p.add_argument("--no-quantize", action="store_true", help="bf16/fp32 dispatch and GEMMs (no MXFP8)")
    p.add_argument("--log-json", type=str, default=None, help="write the JSON log here (rank 0)")
    p.add_argument("--log-every", type=int, default=None, help="steps between host syncs / log lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--n-heads", type=int, default=None)
    p.add_argument("--ffn-hidden", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--aux-loss-coef", type=float, default=1e-2)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, fraction of --lr")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="parameter/compute dtype (default: bf16 on GPU, fp32 on CPU)",
    )
    p.add_argument("--data-bytes", type=int, default=None, help="read at most this many corpus bytes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    args = p.parse_args(argv)
    args.preset = args.preset or ("small" if torch.cuda.is_available() else "tiny")
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


# --------------------------------------------------------------------------------------------- data


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The interpreter's standard-library ``*.py`` files, sorted by relative path (installed packages and
    caches excluded, so the corpus is the same on every machine with the same Python)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]  # prune: site-packages can be huge
        rel = Path(d).relative_to(root)
        found.extend((rel / f).as_posix() for f in files if f.endswith(".py"))
    return [root / f for f in sorted(found)]


def load_corpus(max_bytes: int | None = None) -> torch.Tensor:
    """All stdlib source bytes concatenated in sorted file order (newline-separated): uint8 [N] on CPU."""
    parts, n = [], 0
    for f in stdlib_files():
        b = f.read_bytes()
        parts.append(b + b"\n")
        n += len(b) + 1
        if max_bytes is not None and n >= max_bytes:
            break
    data = b"".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(
    corpus: torch.Tensor, step: int, seed: int, batch: int, seq_len: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: (inputs, targets), both int64 [batch, seq_len], CPU."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch * world,), generator=g)
    starts = starts[rank * batch : (rank + 1) * batch]
    windows = corpus[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------- logging


def git_commit() -> str:
    """$MOE_EP_COMMIT or HEAD of the checkout this script lives in (see moe_ep.provenance)."""
    from moe_ep.provenance import code_version  # noqa: PLC0415

    return code_version(REPO)


class Progress:
    """tqdm bar when tqdm is importable, else a plain text bar printed at logging points (rank 0 only)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.bar = total, enabled, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                pass

    def update(self, step: int, msg: str) -> None:
        """Advance to ``step`` (1-based, completed) and show ``msg``."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(msg)
        else:
            width = 30
            done = width * step // self.total
            print(f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {msg}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------- main


def lr_lambda(args: argparse.Namespace):
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""

    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return f


def _single_process_env() -> None:
    """Let ``python launch/train.py`` (no torchrun) run as a world of one: fill in the env:// variables."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    _single_process_env()
    use_cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world_size
    mesh = init_ep(ep)  # also initializes torch.distributed (nccl with GPUs, gloo without)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if use_cuda else "fp32")]
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokens_per_rank = args.batch_size * args.seq_len
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
        ffn_hidden=args.ffn_hidden,
        num_experts=args.num_experts,
        top_k=args.top_k,
        max_tokens_per_rank=tokens_per_rank,
        aux_loss_coef=args.aux_loss_coef,
        quantize=not args.no_quantize,
        backend=args.backend,
    )
    # Same seed everywhere: non-expert weights come out identical on all ranks (broadcast_params below is
    # only the safety net); experts are then re-drawn per global expert index, independent of the EP size.
    torch.manual_seed(args.seed)
    model = MoETransformer(cfg, mesh)
    model.init_expert_weights(args.seed)
    model.to(device)
    # Parameter counts of the global model (this rank holds E/ep experts per layer; top_k are active).
    n_local = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_params = n_local - n_expert + n_expert * ep
    n_active = n_local - n_expert + n_expert * ep * cfg.top_k // cfg.num_experts
    broadcast_params(model, mesh)
    apply_fsdp(model, mesh, param_dtype=dtype if dtype != torch.float32 else None, reduce_dtype=torch.float32)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    corpus = load_corpus(args.data_bytes)
    if corpus.numel() < args.seq_len + 2:
        raise RuntimeError(f"corpus too small ({corpus.numel()} bytes) for seq_len {args.seq_len}")

    device_name = torch.cuda.get_device_name(device) if use_cuda else (platform.processor() or "cpu")
    log: dict = {
        "config": {"args": vars(args), "model": asdict(cfg)},
        "world_size": world,
        "ep": ep,
        "dp": world // ep,
        "device": device_name,
        "device_type": device.type,
        "dist_backend": dist.get_backend(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "corpus_bytes": corpus.numel(),
        "params": n_params,
        "params_active": n_active,
        "loss": [],
        "aux_loss": [],
        "grad_norm": [],
        "windows": [],
    }
    if rank == 0:
        print(
            f"moe_ep train: world={world} ep={ep} dp={world // ep} device={device_name} dtype={log['dtype']} "
            f"preset={args.preset} quantize={cfg.quantize} backend={cfg.backend} "
            f"params={n_params / 1e6:.2f}M (active {n_active / 1e6:.2f}M) corpus={corpus.numel() / 1e6:.1f} MB "
            f"tokens/rank/step={tokens_per_rank}",
            flush=True,
        )

    def write_log() -> None:
        if rank == 0 and args.log_json:
            Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.log_json).write_text(json.dumps(log, indent=1))

    progress = Progress(args.steps, enabled=rank == 0 and not args.no_progress)
    pending: list[torch.Tensor] = []  # per step [loss, aux, grad norm], on device until the next log point
    t_last, step_last = time.perf_counter(), 0
    model.train()
    for step in range(args.steps):
        x, y = get_batch(corpus, step, args.seed, args.batch_size, args.seq_len, rank, world)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss, aux = model(x, y)
        (loss + aux).backward()
        # Global norm over both meshes (logged; also the clipping input). --clip 0 only disables clipping.
        gnorm = clip_grad_norm_(model, args.clip if args.clip > 0 else math.inf)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        pending.append(torch.stack([loss.detach().float(), aux.detach().float(), gnorm.float()]))

        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            vals = torch.stack(pending)  # [steps in window, 3]: loss, aux, grad norm
            dist.all_reduce(vals)  # sum over ranks (gloo has no AVG); divided below
            vals = (vals / world).tolist()  # NOTE: host sync (the only one per logging window)
            if use_cuda:
                torch.cuda.synchronize()  # NOTE: host sync (so the window's time covers all its kernels)
            now = time.perf_counter()
            n_steps = step + 1 - step_last
            tps = n_steps * tokens_per_rank / (now - t_last)
            log["loss"] += [v[0] for v in vals]
            log["aux_loss"] += [v[1] for v in vals]
            log["grad_norm"] += [v[2] for v in vals]
            log["windows"].append(
                {
                    "step": step + 1,
                    "steps": n_steps,
                    "seconds": now - t_last,
                    "tokens_per_sec_per_gpu": tps,
                    "lr": sched.get_last_lr()[0],
                }
            )
            pending.clear()
            t_last, step_last = now, step + 1
            msg = f"loss {vals[-1][0]:.4f} aux {vals[-1][1]:.4f} tok/s/gpu {tps:,.0f}"
            progress.update(step + 1, msg)
            if rank == 0 and not math.isfinite(vals[-1][0]):
                print(f"non-finite loss at step {step + 1}", flush=True)
            write_log()
    progress.close()

    # Throughput summary skips the first window (one-time setup: allocator, kernel compilation, caches).
    steady = log["windows"][1:] or log["windows"]
    tps = sum(w["steps"] for w in steady) * tokens_per_rank / sum(w["seconds"] for w in steady)
    log["summary"] = {
        "final_loss": log["loss"][-1],
        "first_loss": log["loss"][0],
        "tokens_per_sec_per_gpu": tps,
        "tokens_per_sec_total": tps * world,
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if use_cuda else None,
    }
    write_log()
    if rank == 0:
        s = log["summary"]
        print(
            f"done: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, "
            f"{s['tokens_per_sec_per_gpu']:,.0f} tokens/sec/GPU ({world} ranks)",
            flush=True,
        )
    finish(mesh)  # barriers on every group, then a store rendezvous, then destroy (see moe_ep.parallel.finish)
    return log


if __name__ == "__main__":
    main()
