"""launch/train.py's command line: the presets and the argument parser (every argument error is raised here, once,
by rank 0, before torch.distributed starts). Kept apart from the training loop; train.py re-exports both."""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from train_checks import RankZeroParser, cpu_preset_note, launch_rank

# Model and optimizer presets. "tiny" runs in seconds on 2 CPU cores; "small" is a GPU-sized model
# (~8k tokens per rank per step); "medium" is MoE-dominated, the layer of bench_layer's "small" shape (hidden 2048,
# 128 experts, top-8, expert FFN 768) in 8 blocks, 16384 tokens per rank per step. Any field can be overridden on
# the command line.
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
    "medium": dict(
        dim=2048,
        n_layers=8,
        n_heads=16,
        seq_len=4096,
        ffn_hidden=768,
        num_experts=128,
        top_k=8,
        batch_size=4,  # 4 x 4096 = 16384 tokens per rank per step (max_tokens_per_rank follows)
        lr=1e-3,
        warmup=30,
        steps=300,
        log_every=10,
    ),
}
# the MoEConfig fields of a preset run that an HF model (--model hf:<family>) takes over from the command line


def _int_at_least(lo: int):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return conv


def _float(lo: float, strict: bool, hi: float | None = None):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (strict and v == lo) or (hi is not None and v > hi):
            rng = f"{'>' if strict else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {rng}, got {text}")
        return v

    return conv


_POS, _NONNEG = _int_at_least(1), _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = RankZeroParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model/optimizer preset (default: small with CUDA, tiny on CPU)",
    )
    p.add_argument("--ep", type=_POS, default=None, help="expert-parallel size, divides the world size (default: all)")
    p.add_argument("--steps", type=_POS, default=None)
    p.add_argument(
        "--backend",
        choices=["auto", "reference", "cuda"],
        default="auto",
        help="moe_ep.MoE backend: auto = cuda on GPUs when CuPy + nvshmem4py import, else reference",
    )
    p.add_argument(
        "--transport",
        choices=["nvshmem", "nccl"],
        default=None,
        help="the cuda backend's all-to-all (default nvshmem)",
    )
    p.add_argument(
        "--capacity-factor",
        type=_float(0.0, strict=True),
        default=None,
        help="drop slots past ceil(C * tokens * top_k) expanded rows per rank (default: dropless)",
    )
    p.add_argument(
        "--no-quantize", action="store_true", help="our bf16 path: bf16 dispatch and GEMMs (= --recipe bf16)"
    )
    p.add_argument(
        "--recipe",
        choices=("mxfp8", "blockwise", "bf16"),
        default=None,
        help="the MoE layers' quantization recipe (MoEConfig.recipe; default mxfp8, bf16 with --no-quantize)",
    )
    p.add_argument(
        "--eval-every", type=_NONNEG, default=0, help="steps between held-out losses (0: only after the last step)"
    )
    p.add_argument("--eval-batches", type=_POS, default=8, help="fixed held-out batches per rank of each evaluation")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms: bitwise reproducible runs of a seed (the torchtitan-style layer's "
        "row gather otherwise sums its backward with atomics); slower, for loss-parity runs",
    )
    p.add_argument(
        "--baseline",
        choices=["torchtitan"],
        default=None,
        help="replace every MoE by the torchtitan-style bf16 layer of benchmarks/torchtitan_moe.py",
    )
    p.add_argument(
        "--model",
        default="moe_ep",
        help="moe_ep (our transformer) or hf:<family> (qwen3_moe, deepseek_v3, mixtral): a Hugging Face model of "
        "that family built from its config with the preset's sizes, its MoE blocks swapped for moe_ep's layer",
    )
    p.add_argument(
        "--log-json",
        type=str,
        default=None,
        help="write the JSON log here (rank 0; default runs/<preset>_<variant>_<YYYYmmdd-HHMMSS>.json)",
    )
    p.add_argument("--log-every", type=_POS, default=None, help="steps between host syncs / log lines")
    p.add_argument("--seed", type=_NONNEG, default=0)
    p.add_argument("--batch-size", type=_POS, default=None, help="sequences per rank per step")
    p.add_argument("--seq-len", type=_POS, default=None)
    p.add_argument("--dim", type=_POS, default=None)
    p.add_argument("--n-layers", type=_POS, default=None)
    p.add_argument("--n-heads", type=_POS, default=None)
    p.add_argument("--ffn-hidden", type=_POS, default=None)
    p.add_argument("--num-experts", type=_POS, default=None)
    p.add_argument("--top-k", type=_POS, default=None)
    p.add_argument("--aux-loss-coef", type=_float(0.0, strict=False), default=1e-2)
    p.add_argument("--lr", type=_float(0.0, strict=True), default=None)
    p.add_argument(
        "--min-lr-ratio", type=_float(0.0, strict=False, hi=1.0), default=0.1, help="cosine decay floor, of --lr"
    )
    p.add_argument("--warmup", type=_NONNEG, default=None, help="linear warmup steps")
    p.add_argument("--weight-decay", type=_float(0.0, strict=False), default=0.1)
    p.add_argument("--clip", type=_float(0.0, strict=False), default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="parameter/compute dtype (default: bf16 on GPU, fp32 on CPU)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP2 keeps the gathered block and expert parameters from forward to backward (no second all-gather)",
    )
    p.add_argument(
        "--expert-gather",
        choices=["fp8", "mxfp8", "plain"],
        default=None,
        help="FSDP2's all-gather of the expert weights: fp8 (in the layer's FP8 recipe, quantized from the master "
        "weights once per step; the default of the FP8 variants), mxfp8 (the same, requiring the MXFP8 recipe) or "
        "plain (the param dtype, the default otherwise)",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="record step N with torch.profiler: the log's 'profile' holds its top device kernels (pick N in the "
        "first logging window, which the summary leaves out)",
    )
    p.add_argument(
        "--ac",
        action="store_true",
        help="recompute each block's attention half in the backward (the MoE keeps its MXFP8 rows instead)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the attention and the norms of every block (the MoE layers stay eager: its kernels and "
        "collectives are opaque to the compiler)",
    )
    p.add_argument("--data-bytes", type=_POS, default=None, help="read at most this many corpus bytes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar: one log line per --log-every steps")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line (argparse errors, exit code 2, before any collective: the world size
    comes from torchrun's $WORLD_SIZE)."""
    p = build_parser()
    args = p.parse_args(argv)
    explicit_preset, explicit_transport = args.preset is not None, args.transport is not None
    args.preset = args.preset or ("small" if torch.cuda.is_available() else "tiny")
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world
    if world % ep:
        p.error(f"argument --ep: {ep} does not divide the world size {world} (torchrun --nproc-per-node x nodes)")
    if args.num_experts % ep:
        p.error(f"argument --num-experts: {args.num_experts} experts do not split over --ep {ep}")
    if args.top_k > args.num_experts:
        p.error(f"argument --top-k: {args.top_k} exceeds --num-experts {args.num_experts}")
    if args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
        p.error(f"argument --n-heads: --dim {args.dim} does not split into {args.n_heads} heads of even size")
    if args.model != "moe_ep":
        family = args.model.removeprefix("hf:")
        if not args.model.startswith("hf:") or family not in ("qwen3_moe", "deepseek_v3", "mixtral"):
            p.error(f"argument --model: moe_ep or hf:qwen3_moe / hf:deepseek_v3 / hf:mixtral, got {args.model!r}")
        if args.baseline or args.compile:
            p.error("argument --model: an HF model runs without --baseline / --compile")
    if args.baseline == "torchtitan":
        if args.capacity_factor is not None:
            p.error("argument --capacity-factor: the torchtitan baseline is dropless")
        if args.backend != "auto" or args.transport is not None:
            p.error("argument --baseline: torchtitan replaces moe_ep's layer; --backend / --transport do not apply")
    elif not args.no_quantize and (args.dim % 32 or args.ffn_hidden % 32):
        p.error(f"MXFP8 needs --dim ({args.dim}) and --ffn-hidden ({args.ffn_hidden}) to be multiples of 32")
    if args.profile_step is not None and not 0 <= args.profile_step < args.steps:
        p.error(f"argument --profile-step: {args.profile_step} is not a step of --steps {args.steps}")
    if args.recipe is None:
        args.recipe = "bf16" if args.no_quantize else "mxfp8"
    elif args.no_quantize and args.recipe != "bf16":
        p.error(f"argument --recipe: --no-quantize is recipe bf16, not {args.recipe}")
    args.no_quantize = args.recipe == "bf16"
    if args.recipe == "blockwise" and args.baseline is None and (args.dim % 128 or args.ffn_hidden % 128):
        p.error(
            f"argument --recipe: blockwise needs --dim and --ffn-hidden multiples of 128, got {args.dim} and "
            f"{args.ffn_hidden}"
        )
    quantized = not args.no_quantize and args.baseline is None
    if args.expert_gather == "mxfp8" and (not quantized or args.recipe != "mxfp8"):
        p.error("argument --expert-gather: mxfp8 gathers the weights of moe_ep's MXFP8 layer (not with --no-quantize "
                "or --baseline)")  # fmt: skip
    if args.expert_gather == "fp8" and not quantized:
        p.error("argument --expert-gather: fp8 gathers the weights of moe_ep's FP8 layer (not with --no-quantize "
                "or --baseline)")  # fmt: skip
    if args.expert_gather is None:
        args.expert_gather = "fp8" if quantized else "plain"
    if args.backend == "cuda":
        from moe_ep.layer_cuda import missing_gpu_packages  # noqa: PLC0415

        if not torch.cuda.is_available():
            p.error("argument --backend: cuda needs a CUDA GPU (none visible); use --backend auto or reference")
        missing = missing_gpu_packages(args.transport or "nvshmem")
        if missing:
            p.error(f"argument --backend: cuda needs {', '.join(missing)} (pip install 'moe_ep[gpu]')")
    if args.data_bytes is not None and args.data_bytes < args.seq_len + 2:
        p.error(f"argument --data-bytes: {args.data_bytes} bytes cannot hold a window of --seq-len {args.seq_len}")
    args.transport = args.transport or "nvshmem"
    if launch_rank() == 0 and not torch.cuda.is_available():  # after every error: notes only for a run that starts
        note = cpu_preset_note(args, world, explicit_preset)
        if note:
            print(note, flush=True)
        if explicit_transport:
            print(
                f"WARNING: --transport {args.transport} is the cuda backend's all-to-all and there is no GPU here: "
                "this run uses the reference backend's all_to_all over gloo",
                file=sys.stderr,
                flush=True,
            )
    return args


# --------------------------------------------------------------------------------------------- data
