"""Train a small MoE transformer with FSDP2 + expert parallelism on bytes of the Python standard library.

    torchrun --nproc-per-node=N launch/train.py [--ep N] [--steps S] [--preset tiny|small|medium]
             [--backend auto|reference|cuda] [--transport nvshmem|nccl] [--capacity-factor C] [--no-quantize]
             [--baseline torchtitan] [--log-json PATH] ...

With GPUs: nccl, one GPU per rank, bf16 parameters (fp32 gradient reduction), preset "small". Without: the
same command runs over gloo on CPU in fp32 with preset "tiny". The text is the running interpreter's own
standard-library ``*.py`` files (present offline on every machine), tokenized bytewise (vocab 256).

Variants (the log's ``variant``; the default log name carries it):
  mxfp8       moe_ep.MoE on the cuda backend (MXFP8 dispatch and grouped GEMMs). ``--backend auto`` (default)
              resolves to it on GPUs when CuPy + nvshmem4py import (``moe_ep[gpu]``); ``--backend cuda`` insists.
  bf16        the same with ``--no-quantize``: bf16 payloads on the same transport, ``torch._grouped_mm`` experts.
  torchtitan  ``--baseline torchtitan``: every MoE replaced by benchmarks/torchtitan_moe.py's torchtitan-style bf16
              layer (host-synced split sizes, NCCL all_to_all, ``torch._grouped_mm``), same router and expert weights
              at init, same aux loss (dropless).
  reference   moe_ep's pure-PyTorch reference backend (CPU, or ``--backend reference``); ``reference_bf16`` with
              ``--no-quantize``.
Same ``--seed``: same initial weights and the same data order for every variant.
``--model hf:<family>`` (qwen3_moe, deepseek_v3, mixtral) trains a Hugging Face model of that family with the preset's
sizes instead (HF's init; its MoE blocks swapped by ``moe_ep.integrations.hf``; the variant gets ``_<family>``).

Data: every step draws one global batch of ``batch_size * world_size`` random windows of the corpus from a
generator seeded by (seed, step); rank r takes windows [r*B, (r+1)*B). So a run is reproducible, every rank
reads a different slice, and a run on 1 process with batch 2B sees exactly the data of 2 processes with B.

Rank 0 prints loss and tokens/sec/GPU (tokens processed per rank per second; "per rank" on CPU) with a progress
bar (``--no-progress``: one log line per logging window) and writes a
JSON log (default ``runs/<preset>_<variant>_<YYYYmmdd-HHMMSS>.json``): config, variant, per-step ``loss`` /
``aux_loss`` / ``grad_norm``, per logging window the time, tokens/s/GPU, learning rate, dropped slots (summed over
ranks, MoE layers and the window's steps) and peak memory, then ``summary`` (``tokens_per_sec_per_gpu`` without the
first window, peak memory as the max over ranks), device, world size, commit (``$MOE_EP_COMMIT`` or git HEAD).
``launch/plot_train.py`` draws PNGs from one or more logs. Bad arguments fail in argument parsing, before any
collective.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
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

if str(Path(__file__).resolve().parent) not in sys.path:  # this folder's helpers (when imported by path)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_args import PRESETS, build_parser, parse_args  # noqa: E402, F401  (PRESETS, build_parser: re-exported)
from train_checks import Heartbeat, agree_log_path  # noqa: E402

from launch.model import ModelConfig, MoETransformer  # noqa: E402
from moe_ep import MoE, init_ep, update_expert_bias  # noqa: E402
from moe_ep.parallel import apply_fsdp, broadcast_params, clip_grad_norm_, finish  # noqa: E402

_HF_MOE_FIELDS = ("max_tokens_per_rank", "capacity_factor", "quantize", "backend", "transport")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


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


EVAL_FRACTION = 0.05  # the corpus's last 5% is held out: training windows never read it
EVAL_SEED = 1_234_567  # the held-out batches are the same for every run, seed and variant


def split_corpus(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out tail) of the corpus bytes."""
    n_train = int(corpus.numel() * (1 - EVAL_FRACTION))
    return corpus[:n_train], corpus[n_train:]


@torch.no_grad()
def evaluate(model, held_out: torch.Tensor, args, rank: int, world: int, device: torch.device) -> float:
    """Mean next-byte loss over ``args.eval_batches`` fixed held-out batches per rank (the same batches at every
    evaluation and in every run), averaged over ranks. NOTE: host sync (one read per evaluation, not per step)."""
    model.eval()
    total = torch.zeros(1, device=device)
    for b in range(args.eval_batches):
        x, y = get_batch(held_out, b, EVAL_SEED, args.batch_size, args.seq_len, rank, world)
        loss, _ = model(x.to(device), y.to(device))
        total += loss.float()
    dist.all_reduce(total)
    model.train()
    return total.item() / (args.eval_batches * world)


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
    """$MOE_EP_COMMIT or HEAD of the checkout this script lives in (see launch.provenance)."""
    from launch.provenance import code_version  # noqa: PLC0415

    return code_version(REPO)


class Progress:
    """tqdm bar when tqdm is importable, else a plain text bar printed at logging points; ``bar=False``
    (--no-progress): a plain ``step i/N ...`` log line at each logging point (rank 0 only)."""

    def __init__(self, total: int, enabled: bool, bar: bool = True) -> None:
        self.total, self.enabled, self.bar, self.plain_lines = total, enabled, None, not bar
        if enabled and bar:
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
        elif self.plain_lines:  # --no-progress: log lines only
            print(f"step {step}/{self.total} {msg}", flush=True)
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


def torchtitan_factory():
    """``MoETransformer``'s ``moe_factory`` for ``--baseline torchtitan`` (benchmarks/ is a script folder, not part of
    the package: imported through sys.path, as bench_layer.py does)."""
    bench = str(REPO / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from torchtitan_moe import TorchtitanMoELayer  # noqa: PLC0415

    return TorchtitanMoELayer


def shard_factory_experts(model: MoETransformer, mesh, param_dtype, reduce_dtype, reshard_after_forward: bool) -> None:
    """FSDP2 for the ``experts`` of every non-``MoE`` layer (the baseline), exactly as
    :func:`moe_ep.parallel.apply_fsdp` treats ``MoE.experts``: a unit on "dp", gradients divided by the world size.
    Call before ``apply_fsdp`` (which then leaves these parameters to their own unit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    from moe_ep.parallel import _needs_sum_only  # noqa: PLC0415

    dp = mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for blk in model.blocks:
        if hasattr(blk, "moe") and not isinstance(blk.moe, MoE):
            fully_shard(blk.moe.experts, mesh=dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
            blk.moe.experts.set_gradient_divide_factor(float(dist.get_world_size()))
            blk.moe.experts.set_force_sum_reduction_for_comms(_needs_sum_only(dp.size()))


def step_profiler(use_cuda: bool):
    """A started torch.profiler recording CPU ops and, with CUDA, device kernels."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if use_cuda else [])
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def finish_profile(prof, use_cuda: bool, top: int = 40) -> dict:
    """Stop ``prof`` -> {"device_ms": the step's summed self device time (kernels of all streams, so overlapped
    communication counts in full), "top": the ``top`` kernels by self device time [{name, ms, count}]} (CPU runs:
    self CPU time of the ops)."""
    if use_cuda:
        torch.cuda.synchronize()  # NOTE: host sync (the profiled step only)
    prof.__exit__(None, None, None)
    if use_cuda:  # device activity only (kernels, copies); CUPTI's "Command Buffer Full" marks are launch stalls
        events = [
            e
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.key != "Command Buffer Full"
        ]
        rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in events if e.self_device_time_total > 0]
    else:
        rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return {
        "device_ms": round(sum(r[1] for r in rows), 3),
        "top": [{"name": k[:120], "ms": round(ms, 3), "count": c} for k, ms, c in rows[:top] if ms > 0],
    }


def resolve_variant(args: argparse.Namespace, cfg: ModelConfig, device: torch.device) -> tuple[str, str | None]:
    """(variant name, the MoE backend it runs: "cuda" / "reference", None for the baseline). After init_ep: "auto"
    resolves to cuda only with torch.distributed initialized (moe_ep.layer_cuda.resolve_backend, on a probe tensor
    of the training device)."""
    if args.baseline == "torchtitan":
        return "torchtitan", None
    from moe_ep.layer_cuda import resolve_backend  # noqa: PLC0415

    backend = resolve_backend(cfg.moe_config(), torch.empty(0, device=device))
    if backend == "cuda":
        return cfg.recipe, backend
    return ("reference" if cfg.recipe == "mxfp8" else f"reference_{cfg.recipe}"), backend


def peak_memory(device: torch.device) -> dict:
    """This process's peaks so far: GPU allocator (None on CPU) and host RSS, GiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss: KiB on Linux
    if device.type != "cuda":
        return {"max_memory_gib": None, "max_reserved_gib": None, "max_rss_gib": rss}
    return {
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "max_rss_gib": rss,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)  # every argument error is raised here, before torch.distributed starts
    _single_process_env()
    use_cuda = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world_size
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if use_cuda else "fp32")]
    tokens_per_rank = args.batch_size * args.seq_len
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        seq_len=args.seq_len,
        ffn_hidden=args.ffn_hidden,
        num_experts=args.num_experts,
        top_k=args.top_k,
        max_tokens_per_rank=tokens_per_rank,  # the receive buffers cover every token this rank passes per step
        capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef,
        quantize=not args.no_quantize and args.baseline is None,
        recipe=args.recipe if args.baseline is None else "bf16",
        backend=args.backend,
        transport=args.transport,
        activation_checkpoint=args.ac,
    )
    corpus = load_corpus(args.data_bytes)
    corpus, held_out = split_corpus(corpus)
    if held_out.numel() < args.seq_len + 2:
        raise ValueError(f"--seq-len {args.seq_len}: the held-out part of the corpus has only {held_out.numel()} bytes")
    if args.deterministic:  # before any CUDA work: cuBLAS reads its workspace setting when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    moe_factory = torchtitan_factory() if args.baseline == "torchtitan" else None

    mesh = init_ep(ep)  # also initializes torch.distributed (nccl with GPUs, gloo without)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    variant, backend = resolve_variant(args, cfg, device)
    if args.model != "moe_ep":
        variant = f"{variant}_{args.model[3:]}"  # e.g. reference_deepseek_v3: the log name and plot label
    if rank == 0 and args.log_json is None:
        args.log_json = f"runs/{args.preset}_{variant}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    log_error = agree_log_path(args.log_json, rank, device)  # before any step: every rank learns it
    if log_error is not None:
        if rank == 0:
            print(f"{Path(sys.argv[0]).name}: error: {log_error}", file=sys.stderr, flush=True)
        finish(mesh)
        raise SystemExit(2)
    if rank == 0 and use_cuda and args.backend == "auto" and backend == "reference":
        from moe_ep.layer_cuda import missing_gpu_packages  # noqa: PLC0415

        missing = ", ".join(missing_gpu_packages(cfg.transport))
        print(
            f"WARNING: --backend auto runs the reference backend on GPUs: {missing} do not import "
            f"(pip install 'moe_ep[gpu]'); the variant is named {variant!r}",
            flush=True,
        )

    # Same seed everywhere: non-expert weights come out identical on all ranks (broadcast_params below is
    # only the safety net); experts are then re-drawn per global expert index, independent of the EP size
    # and of the MoE implementation (the baseline starts from the same weights).
    torch.manual_seed(args.seed)
    if args.model.startswith("hf:"):  # a tiny HF model of the family with our layer (moe_ep.integrations.hf)
        from moe_ep.integrations.hf import build_causal_lm  # noqa: PLC0415

        sizes = dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, ffn_hidden=cfg.ffn_hidden,
                     num_experts=cfg.num_experts, top_k=cfg.top_k, vocab_size=256, seq_len=cfg.seq_len)  # fmt: skip
        mc = cfg.moe_config()
        model = build_causal_lm(args.model[3:], mesh, sizes, **{k: getattr(mc, k) for k in _HF_MOE_FIELDS})
    else:
        model = MoETransformer(cfg, mesh, moe_factory=moe_factory, seed=args.seed)
    model.to(device)
    # Parameter counts of the global model (this rank holds E/ep experts per layer; top_k are active).
    n_local = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_params = n_local - n_expert + n_expert * ep
    n_active = n_local - n_expert + n_expert * ep * cfg.top_k // cfg.num_experts
    broadcast_params(model, mesh)
    param_dtype = dtype if dtype != torch.float32 else None
    reshard = not args.no_reshard_after_forward
    shard_factory_experts(model, mesh, param_dtype, torch.float32, reshard)
    if args.compile:  # before FSDP wraps the blocks, as torchtitan does; the MoE layers are left eager
        for blk in model.blocks:
            for m in (blk.attn_norm, blk.attn, blk.moe_norm):
                m.compile()
        model.norm.compile()
    apply_fsdp(
        model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, reshard_after_forward=reshard,
        fp8_expert_gather=args.expert_gather == "fp8", mxfp8_expert_gather=args.expert_gather == "mxfp8",
    )  # fmt: skip

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    # fused AdamW on GPUs (one kernel for every parameter instead of the multi-tensor loops: the unfused step took
    # ~55 ms of a ~400 ms medium step), for every variant alike
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=use_cuda,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))

    device_name = torch.cuda.get_device_name(device) if use_cuda else (platform.processor() or "cpu")
    # expanded slots per step summed over ranks and layers (the denominator of the dropped fraction)
    slots_per_step = tokens_per_rank * cfg.top_k * cfg.n_layers * world
    log: dict = {
        "config": {"args": vars(args), "model": asdict(cfg)},
        "variant": variant,
        "preset": args.preset,
        "model": args.model,
        "backend": backend,
        "transport": cfg.transport if backend == "cuda" else None,
        "quantize": cfg.quantize,
        "capacity_factor": cfg.capacity_factor,
        "world_size": world,
        "ep": ep,
        "dp": world // ep,
        "tokens_per_rank_per_step": tokens_per_rank,
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
        "recipe": cfg.recipe if args.baseline is None else None,
        "deterministic": args.deterministic,
        "eval": [],
        "loss": [],
        "aux_loss": [],
        "grad_norm": [],
        "windows": [],
    }
    if rank == 0:
        print(
            f"moe_ep train: variant={variant} world={world} ep={ep} dp={world // ep} device={device_name} "
            f"dtype={log['dtype']} preset={args.preset} backend={backend} transport={log['transport']} "
            f"capacity_factor={cfg.capacity_factor} expert_gather={args.expert_gather} "
            f"params={n_params / 1e6:.2f}M (active {n_active / 1e6:.2f}M) "
            f"corpus={corpus.numel() / 1e6:.1f} MB tokens/rank/step={tokens_per_rank} log={args.log_json}",
            flush=True,
        )

    def write_log() -> None:
        if rank == 0 and args.log_json:
            Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.log_json).write_text(json.dumps(log, indent=1))

    progress = Progress(args.steps, enabled=rank == 0, bar=not args.no_progress)
    heartbeat = Heartbeat(args.steps, enabled=rank == 0 and not use_cuda)  # CPU: a line at least every 30 s
    per = "gpu" if use_cuda else "rank"  # what a rank is in the printed throughput
    pending: list[torch.Tensor] = []  # per step [loss, aux, grad norm], on device until the next log point
    dropped_dev: list[torch.Tensor] = []  # per step, summed over layers: device counts (cuda backend, nvshmem)
    dropped_host = 0  # the same, host ints (reference backend, nccl transport: already host-synced there)
    t_last, step_last = time.perf_counter(), 0
    model.train()
    for step in range(args.steps):
        prof = step_profiler(use_cuda) if step == args.profile_step else None
        x, y = get_batch(corpus, step, args.seed, args.batch_size, args.seq_len, rank, world)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss, aux = model(x, y)
        d = model.dropped_slots()  # no host sync: a device tensor or a host int
        if isinstance(d, torch.Tensor):
            dropped_dev.append(d)
        else:
            dropped_host += d
        (loss + aux).backward()
        # Global norm over both meshes (logged; also the clipping input). --clip 0 only disables clipping.
        gnorm = clip_grad_norm_(model, args.clip if args.clip > 0 else math.inf)
        opt.step()
        update_expert_bias(model)  # the layers with cfg.expert_bias (DeepSeek-V3): device-side, no host sync
        sched.step()
        opt.zero_grad(set_to_none=True)
        pending.append(torch.stack([loss.detach().float(), aux.detach().float(), gnorm.float()]))
        if prof is not None:
            log["profile"] = finish_profile(prof, use_cuda)
        heartbeat.step_done(step + 1)

        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            vals = torch.stack(pending)  # [steps in window, 3]: loss, aux, grad norm
            dropped = torch.tensor([float(dropped_host)], device=device)  # (a tiny host-to-device copy)
            if dropped_dev:
                dropped = dropped + torch.stack(dropped_dev).sum().float()
            packed = torch.cat([vals.reshape(-1), dropped])
            dist.all_reduce(packed)  # sum over ranks (gloo has no AVG); loss etc. divided below
            packed = packed.tolist()  # NOTE: host sync (the only one per logging window; also reads the drop counts)
            vals = [[v / world for v in packed[i : i + 3]] for i in range(0, len(packed) - 1, 3)]
            n_dropped = int(round(packed[-1]))
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
                    "dropped_slots": n_dropped,  # summed over ranks, MoE layers and the window's steps
                    "dropped_fraction": n_dropped / (n_steps * slots_per_step),
                    **peak_memory(device),  # rank 0's peaks so far (summary: max over ranks)
                }
            )
            pending.clear()
            dropped_dev.clear()
            dropped_host = 0
            t_last, step_last = now, step + 1
            msg = f"loss {vals[-1][0]:.4f} aux {vals[-1][1]:.4f} tok/s/{per} {tps:,.0f}"
            if cfg.capacity_factor is not None:
                msg += f" dropped {n_dropped}"
            progress.update(step + 1, msg)
            heartbeat.printed()
            if rank == 0 and not math.isfinite(vals[-1][0]):
                print(f"non-finite loss at step {step + 1}", flush=True)
            write_log()
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 != args.steps:
            log["eval"].append({"step": step + 1, "loss": evaluate(model, held_out, args, rank, world, device)})
    log["eval"].append({"step": args.steps, "loss": evaluate(model, held_out, args, rank, world, device)})
    if rank == 0:
        print(f"held-out loss after {args.steps} steps: {log['eval'][-1]['loss']:.4f}", flush=True)
    progress.close()

    # Peak memory: the max over ranks (one collective after the last step).
    mem = peak_memory(device)
    keys = [k for k, v in mem.items() if v is not None]
    peaks = torch.tensor([mem[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    mem.update(zip(keys, peaks.tolist(), strict=True))
    # Throughput summary skips the first window (one-time setup: allocator, kernel compilation, caches).
    # ... and the window of a profiled step (the profiler slows it)
    prof_step = args.profile_step
    steady = [
        w for w in log["windows"][1:] if prof_step is None or not (w["step"] - w["steps"] <= prof_step < w["step"])
    ]
    steady = steady or log["windows"][1:] or log["windows"]
    tps = sum(w["steps"] for w in steady) * tokens_per_rank / sum(w["seconds"] for w in steady)
    total_dropped = sum(w["dropped_slots"] for w in log["windows"])
    log["summary"] = {
        "final_loss": log["loss"][-1],
        "first_loss": log["loss"][0],
        "mean_loss_last_50": sum(log["loss"][-50:]) / len(log["loss"][-50:]),
        "eval_loss": log["eval"][-1]["loss"],
        "finite": all(math.isfinite(v) for v in log["loss"] + log["aux_loss"] + log["grad_norm"])
        and all(math.isfinite(e["loss"]) for e in log["eval"]),
        "tokens_per_sec_per_gpu": tps,
        "tokens_per_sec_total": tps * world,
        "steady_steps": sum(w["steps"] for w in steady),
        "dropped_slots": total_dropped,
        "dropped_fraction": total_dropped / (args.steps * slots_per_step),
        **mem,
    }
    write_log()
    if rank == 0:
        s = log["summary"]
        mem_txt = f", peak {s['max_memory_gib']:.1f} GiB" if s["max_memory_gib"] is not None else ""
        print(
            f"done ({variant}): loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, "
            f"{s['tokens_per_sec_per_gpu']:,.0f} tokens/sec/{per.upper() if use_cuda else per} "
            f"({world} rank{'s' if world != 1 else ''}){mem_txt}; log {args.log_json}",
            flush=True,
        )
    finish(mesh)  # barriers on every group, then a store rendezvous, then destroy (see moe_ep.parallel.finish)
    return log


if __name__ == "__main__":
    main()
