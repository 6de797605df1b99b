"""Whole-layer benchmark: one MoE layer's forward + backward over expert parallelism, every variant in one process.

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_layer.py [--shapes dsv3,small] [--steps 20]
        [--warmup 5] [--variants torchtitan_bf16,bf16,mxfp8,mxfp8_cached] [--out benchmarks/results/bench_layer.json]
    python3 benchmarks/bench_layer.py [...]     re-launches itself under torchrun on every visible GPU (skips, and
                                                writes {"skipped": ...}, with fewer than 2); --json is --out
    python3 benchmarks/bench_layer.py --dry-cpu self-check without a GPU: 2 gloo processes on the CPU, a tiny shape

Shapes (per rank, EP = the world size): dsv3 T=4096 H=7168 F=2048 E=256 top-8; small T=8192 H=2048 F=768 E=128
top-8. Routing: the layer's router on its random init weights and random bf16 tokens (each rank its own):
uniform in expectation; ``meta.shapes.<shape>.routing`` gives the measured imbalance of the checked batch.
Variants, all on the same router and expert weights (copied from one layer) and the same tokens and output gradient:
  torchtitan_bf16      benchmarks/torchtitan_moe.py: torchtitan's MoE with expert parallelism (host-synced split
                       sizes, NCCL all_to_all_single_autograd of bf16 rows, index permutation, torch._grouped_mm
                       SwiGLU experts, deterministic scatter_add); torchtitan_bf16_align<N>: with groups padded to N
                       rows, as torchtitan did before April 2026 (N = 8 for bf16)
  torchtitan_fp8_rowwise the same layer with torchao's FP8 rowwise grouped GEMMs for its experts, the FP8 MoE a
                       Hopper user has today (torchtitan ``--model.converters quantize.grouped_mm.float8`` with torchao
                       0.18; ``TorchtitanMoE(gemm="fp8_rowwise")``): torchao's
                       ``moe_training.utils._quantize_then_scaled_grouped_mm`` with ``Float8TrainingOpConfig()`` per
                       GEMM, quantizing activations, weights and gradients in every call (forward and backward, as in
                       training; nothing cached), groups padded to 16 rows by torchao's ``ep.permute.permute_and_pad``
                       (torchtitan's TorchAOTokenDispatcher); eager, no torch.compile. Needs torchao (and triton):
                       without it the variant is skipped (``error`` and ``skipped`` in its row; the run goes on and
                       its exit status ignores it); ``meta.torchao`` records the version and functions that ran
  bf16                 moe_ep.MoE, backend="cuda", quantize=False: our transport with bf16 payloads, torch._grouped_mm
  mxfp8                backend="cuda", quantize=True, ``layer.experts.weight_cache.clear()`` before every step: the
                       weights' MXFP8 operands re-prepared every step (every step under FSDP2, whose all-gather
                       rewrites the weights; the first micro-batch after an optimizer step)
  mxfp8_cached         the same layer without the clear: operands prepared once (later micro-batches of gradient
                       accumulation)
  blockwise            recipe="blockwise" (1x128 activations, 128x128 weights on the FP8 tensor cores), weights
                       quantized every step (cache cleared, as mxfp8)
  blockwise_cached     the same layer, weights quantized once
  reference_bf16       (not in the default list) moe_ep's reference backend, quantize=False: the oracle of --dry-cpu
The layers are dropless (capacity_factor=None); ``dropped_slots`` must be 0.

Per shape:
  1. check: one forward + backward per variant (backward of y alone, so the router gradients compare: torchtitan has
     no aux loss) against the bf16 variant (else reference_bf16): norm-relative error ||a - b|| / ||b|| and max-abs
     relative error max|a - b| / max|b| of y, dx, dw13, dw2 and the router weight's gradient, max over ranks.
     Bounds: BF16_BOUND for the bf16 variants (the same math with bf16 roundings in other places: torchtitan
     rounds the SwiGLU product and every scatter-add partial sum to bf16), MXFP8_BOUND for the FP8 ones (E4M3
     keeps 3 mantissa bits: each quantized operand is off by up to 2^-4 relative, and the expert MLP's recipe error
     against bf16 measured 6.6-6.8 % norm-relative in bench_expert_mlp, so the bound is about twice that).
     torchtitan_fp8_rowwise has the same bound (FP8_ROWWISE_BOUND = MXFP8_BOUND): the same E4M3 elements, so the
     same 2^-4 relative rounding of every element that stays normal; its power-of-2 scales (as MXFP8's E8M0) cover a
     whole row of K (or a column over an expert's rows in the weight gradient) instead of 32 elements, so an element
     falls into E4M3's subnormals only when it is below ~2^-14 of its row's largest: for these random Gaussian
     tokens, weights and dy a fraction ~1e-4 of elements, far too small to move the norm. An fp32 emulation of the
     recipe (E4M3, power-of-2 scales per row along K in the forward, along N for dx, per column over the rows for
     dw) on the small shape's expert MLP (2048 Gaussian rows) gives 6.6-6.9 % norm-relative for y, dx, dw1, dw3,
     dw2 against the unquantized MLP: MXFP8's error, so MXFP8's bound (torch._scaled_grouped_mm's
     use_fast_accum=True accumulation adds ~1e-3); a broken layer (a wrong scale, group or transpose) is off by O(1).
  2. --warmup rounds, then --steps rounds; a round times one step of every variant, in bench_gemm.round_order (the
     order rotates and reverses so that no variant always runs first or after the same one). A step: parameter
     gradients and x.grad set to None (and the weight cache cleared for mxfp8), ranks aligned (all_reduce +
     synchronize), peak memory stats reset, a ~1 ms GPU spin so the CPU enqueues ahead of the GPU, then CUDA events
     around the forward (``fwd_ms``) and forward + backward (``fwd_bwd_ms``; the backward of y and of the aux loss,
     as in training). Per rank the median over steps; reported: the max over ranks (the slowest rank is the step).
  3. memory (torch's caching allocator; the NVSHMEM symmetric heap is outside it and not counted): ``act_mem_gb`` =
     max_memory_allocated during forward + backward minus memory_allocated before the forward; ``saved_gb`` =
     memory_allocated after the forward minus before (what the backward keeps). act_mem_gb counts the parameter
     gradients and dx allocated in the backward (``grad_gb`` of them; saved_gb does not: they do not exist yet); both
     count mxfp8's re-prepared weight operands (``weight_cache_gb`` measures the cache by clearing it). Max over steps
     and ranks.
  4. one more step per variant under ``moe_ep.profiling.record_phases()`` (torchtitan: its own marks, same
     convention): ``phases`` {name: ms} as recorded, ``phase_groups`` summed into router, layout, dispatch, gemms,
     swiglu_quant, combine, weight_prep, other (bf16 and torchtitan do not separate SwiGLU from the GEMMs: their
     experts_fwd / experts_bwd count as gemms; torchtitan_fp8_rowwise's also hold all of torchao's quantization,
     activations' and weights', which runs inside torchao's GEMM function: its swiglu_quant and weight_prep are 0).
     ``router_bwd`` is what is left of the backward after the layer's last mark (the router's and aux loss's
     backward; torchtitan: also the row gather's).
Output (--out, rank 0): {"meta": {...}, "results": [{"shape", "variant", "fwd_ms", "fwd_bwd_ms", "act_mem_gb",
"phases", ...}, ...]}; benchmarks/results/README.md ("Layer") lists every field; torchtitan rows add ``gemm`` (what
their experts ran: bf16, or torchao's version and functions). A table on stdout; exit 1 when a check fails, a slot
was dropped or a variant raised (a variant skipped for a missing package does not count).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import relaunch_under_torchrun, round_order  # noqa: E402
from layer_report import BF16_BOUND, FP8_ROWWISE_BOUND, MXFP8_BOUND, TARGETS, phase_groups, print_table, ratios  # noqa: E402, F401
from layer_timing import SPIN_CYCLES, profiled_step, timed_step  # noqa: E402
from layer_variants import DRY_VARIANTS, FP8, PEER_FP8, SKIPPED, VARIANTS, Variant, build_variants, check_step  # noqa: E402, F401
from torchtitan_moe import TorchtitanMoE, torchao_fp8_rowwise_info  # noqa: E402

SHAPES = {
    "dsv3": dict(T=4096, H=7168, F=2048, E=256, K=8),
    "small": dict(T=8192, H=2048, F=768, E=128, K=8),
    "tiny": dict(T=48, H=64, F=64, E=8, K=3),  # --dry-cpu
}
DEFAULT_OUT = "benchmarks/results/bench_layer.json"
GB = 1e9
MAX = dist.ReduceOp.MAX


# ---------------------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------------------


def _errs(got: torch.Tensor | None, ref: torch.Tensor | None) -> dict:
    """Norm-relative and max-abs-relative error, in chunks (dsv3's dw13 is 1.9 G elements per rank)."""
    if got is None or ref is None or got.shape != ref.shape:
        return {"rel": math.inf, "max_rel": math.inf, "note": "missing or shape mismatch"}
    num = den = 0.0
    dmax = rmax = 0.0
    for a, b in zip(got.reshape(-1).split(1 << 24), ref.reshape(-1).split(1 << 24), strict=True):
        a, b = a.double(), b.double()
        d = a - b
        num += float(d.square().sum())
        den += float(b.square().sum())
        dmax = max(dmax, float(d.abs().max()))
        rmax = max(rmax, float(b.abs().max()))
    rel = math.sqrt(num) / max(math.sqrt(den), 1e-30)
    mrel = dmax / max(rmax, 1e-30)
    return {"rel": rel if math.isfinite(rel) else math.inf, "max_rel": mrel if math.isfinite(mrel) else math.inf}


def _reduce(vals: list[float], op, dev: torch.device) -> list[float]:
    t = torch.tensor(vals, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _agree(ok: bool, dev: torch.device) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    return bool(_reduce([float(ok)], dist.ReduceOp.MIN, dev)[0])


def routing_stats(src: torch.nn.Module, x: torch.Tensor, dims: dict, dev: torch.device) -> dict:
    """Load of the checked batch under the shared router weights: per-expert slots (max / mean over the E experts,
    summed over ranks) and the expanded rows each rank receives (max / mean over ranks)."""
    if isinstance(src, TorchtitanMoE):
        w = src.gate
    else:
        w = src.router.weight
    with torch.no_grad():
        logits = x.float() @ w.float().t()
        idx = torch.topk(logits, dims["K"], dim=-1).indices
        counts = torch.bincount(idx.reshape(-1), minlength=dims["E"]).to(torch.float64)
    dist.all_reduce(counts)
    world = dist.get_world_size()
    per_rank = counts.view(world, -1).sum(1)
    return {
        "expert_slots_max_over_mean": float(counts.max() / counts.mean()),
        "rank_rows_max_over_mean": float(per_rank.max() / per_rank.mean()),
        "rows_per_rank_mean": float(per_rank.mean()),
    }


def shape_dims(shape: str, args, ep_size: int) -> dict:
    """SHAPES[shape], with E = --local-experts x the EP size when given (the per-rank expert load of another EP
    size: dsv3's 64 local experts of EP=4 on 2 GPUs is E=128)."""
    dims = dict(SHAPES[shape])
    per = dict(kv.split("=") for kv in args.local_experts.split(",") if "=" in kv)
    n = int(per.get(shape, 0 if per else args.local_experts or 0))
    if n:
        dims["E"] = n * ep_size
    return dims


def run_shape(shape: str, names: list[str], mesh, dev: torch.device, args) -> tuple[list[dict], dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = shape_dims(shape, args, mesh["ep"].size())
    errors: dict[str, str] = {}
    t_start = time.time()
    variants = build_variants(names, dims, mesh, dev, args, errors)
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    x = torch.randn(dims["T"], dims["H"], generator=gen).to(torch.bfloat16).to(dev).requires_grad_(True)
    g = torch.randn(dims["T"], dims["H"], generator=gen).to(torch.bfloat16).to(dev)
    info: dict = {**dims, "ep_size": world, "tokens_total": dims["T"] * world}
    if variants:
        info["routing"] = routing_stats(next(iter(variants.values())).module, x, dims, dev)
    rows = {n: {"shape": shape, "variant": n, **dims} for n in names}
    for n, e in errors.items():
        rows[n]["error"] = e

    # ---- 1. correctness against the bf16 variant (else the reference, else the first that runs)
    base = ref = None
    firsts = ("bf16", "reference_bf16")
    for b in [b for b in firsts if b in variants] + [n for n in variants if n not in firsts]:
        try:
            r0, ok0 = check_step(variants[b], x, g), True
        except Exception as exc:  # noqa: BLE001
            r0, ok0 = None, False
            errors[b] = f"check: {type(exc).__name__}: {str(exc)[:400]}"
        if _agree(ok0, dev):
            base, ref = b, r0
            break
        errors.setdefault(b, "check failed on another rank")
        del r0
    for n, v in variants.items() if ref is not None else ():
        if n in errors:  # its baseline attempt failed (on every rank's record)
            continue
        try:
            got = ref if n == base else check_step(v, x, g)
            errs = {k: _errs(got[k], ref[k]) for k in ref}
            ok_local = 1
        except Exception as exc:  # noqa: BLE001
            got, errs, ok_local = None, {}, 0
            errors[n] = f"check: {type(exc).__name__}: {str(exc)[:400]}"
        keys = list(ref)
        flat = [errs.get(k, {}).get(m, math.inf) for k in keys for m in ("rel", "max_rel")]
        flat = _reduce([min(f, 1e300) for f in flat], dist.ReduceOp.MAX, dev)
        reduced = {k: {"rel": flat[2 * i], "max_rel": flat[2 * i + 1]} for i, k in enumerate(keys)}
        bound = MXFP8_BOUND if n in FP8 else FP8_ROWWISE_BOUND if n in PEER_FP8 else BF16_BOUND
        worst = max(r["rel"] for r in reduced.values())
        if not _agree(bool(ok_local), dev):
            errors.setdefault(n, "check failed on another rank")
            rows[n]["check"] = {"against": base, "ok": False, "error": errors[n]}
            del got
            continue
        ok = worst <= bound
        rows[n]["check"] = {
            "against": base,
            "errors": reduced,
            "max_rel_err": worst,
            "max_abs_rel_err": max(r["max_rel"] for r in reduced.values()),
            "bound": bound,
            "ok": ok,
        }
        del got
    del ref
    _free(dev)
    if rank == 0:
        for n in (n for n in variants if "max_rel_err" in rows[n].get("check", {})):
            c = rows[n]["check"]
            per = json.dumps({k: round(r["rel"], 6) for k, r in c["errors"].items()})
            print(
                f"[{shape}] check {n} vs {c['against']}: max rel err {c['max_rel_err']:.3e} (bound {c['bound']:g}) "
                f"{'ok' if c['ok'] else 'FAILED'}  {per}",
                flush=True,
            )

    # ---- 2 + 3. warmup, then interleaved timed rounds
    live = [n for n in names if n in variants and n not in errors]
    samples: dict[str, list[dict]] = {n: [] for n in live}
    for rnd in range(args.warmup + args.steps):
        for n in round_order(list(live), rnd):
            if n in errors:
                continue
            try:
                s = timed_step(variants[n], x, g, dev)
            except Exception as exc:  # noqa: BLE001
                errors[n] = f"step: {type(exc).__name__}: {str(exc)[:400]}"
            if not _agree(n not in errors, dev):  # a variant that raised on any rank stops on every rank
                errors.setdefault(n, "step failed on another rank")
                continue
            if rnd >= args.warmup:
                samples[n].append(s)
    for v in variants.values():  # the weight cache stays: every mxfp8 step leaves it full
        for p in v.module.parameters():
            p.grad = None

    # ---- 4. phases, one profiled step per variant
    for n in live:
        if n in errors:
            continue
        try:
            rows[n]["profile"] = profiled_step(variants[n], x, g, dev)
            rows[n]["profile_dropped"] = variants[n].dropped()
        except Exception as exc:  # noqa: BLE001
            rows[n]["profile"] = {"phases": {}, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    weight_cache_gb: dict[str, float] = {}
    for rcp in ("mxfp8", "blockwise"):  # the prepared operands the uncached step allocates inside the step
        if rcp in variants and dev.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            variants[rcp].module.experts.weight_cache.clear()
            gb = (before - torch.cuda.memory_allocated()) / GB
            weight_cache_gb[rcp] = _reduce([gb], dist.ReduceOp.MAX, dev)[0]

    # ---- reduce over ranks and assemble the rows
    for n in live:
        r = rows[n]
        ss = samples[n]
        r["steps"] = len(ss)
        bad = _reduce([float(n in errors)], dist.ReduceOp.MAX, dev)[0]
        if bad or not ss:
            r.setdefault("error", errors.get(n, "failed on another rank"))
            continue
        fwd = [s["fwd_ms"] for s in ss]
        fb = [s["fwd_bwd_ms"] for s in ss]
        med = _reduce([statistics.median(fwd), statistics.median(fb)], dist.ReduceOp.MAX, dev)
        lo = _reduce([statistics.median(fwd), statistics.median(fb)], dist.ReduceOp.MIN, dev)
        r["fwd_ms"], r["fwd_bwd_ms"] = med
        r["bwd_ms"] = med[1] - med[0]
        r["fwd_bwd_ms_fastest_rank"] = lo[1]
        r["fwd_ms_steps"] = _reduce(fwd, dist.ReduceOp.MAX, dev)
        r["fwd_bwd_ms_steps"] = _reduce(fb, dist.ReduceOp.MAX, dev)
        if dev.type == "cuda":
            act, saved = _reduce(
                [max(s["act"] for s in ss) / GB, max(s["saved"] for s in ss) / GB], dist.ReduceOp.MAX, dev
            )
            r["act_mem_gb"], r["saved_gb"] = act, saved
        else:
            r["act_mem_gb"] = r["saved_gb"] = None
        r["grad_gb"] = variants[n].grad_bytes(x) / GB
        dropped = max([s["dropped"] for s in ss] + [r.pop("profile_dropped", 0)])
        r["dropped_slots"] = int(_reduce([float(dropped)], dist.ReduceOp.SUM, dev)[0])
        prof = r.pop("profile", {"phases": {}})
        every = [None] * world
        dist.all_gather_object(every, list(prof["phases"]))  # the same names on every rank, unless one failed
        names_ph = list(dict.fromkeys(k for ks in every for k in ks))
        vals = _reduce([prof["phases"].get(k, 0.0) for k in names_ph] + [prof.get("total_ms", -1.0)], MAX, dev)
        r["phases"] = dict(zip(names_ph, vals[:-1], strict=True))  # max over ranks, per phase
        r["phase_groups"] = phase_groups(r["phases"])
        r["phases_total_ms"] = sum(vals[:-1])
        if vals[-1] >= 0:
            r["profiled_fwd_bwd_ms"] = vals[-1]
        if "error" in prof:
            r["phases_error"] = prof["error"]
        if n in FP8:
            r["weight_prep_ms"] = r["phases"].get("weight_prep", 0.0)
            r["weight_cache_gb"] = weight_cache_gb.get(n.removesuffix("_cached"))
        if n.startswith("torchtitan"):
            r["scatter_add"] = variants[n].module.scatter_mode
            r["gemm"] = variants[n].module.gemm_info
    for n in errors:
        rows[n]["error"] = errors[n]
        if errors[n].startswith(SKIPPED):
            rows[n]["skipped"] = True
    info["seconds"] = round(time.time() - t_start, 1)
    del variants, x, g
    _free(dev)
    return [rows[n] for n in names], info


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# entry
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="dsv3,small", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=20, help="timed steps (rounds) per variant; the median is reported")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds before the timed ones")
    p.add_argument("--out", "--json", dest="out", default=None, help=f"result JSON (default {DEFAULT_OUT})")
    p.add_argument("--transport", default="nvshmem", choices=("nvshmem", "nccl"), help="MoEConfig.transport")
    p.add_argument(
        "--local-experts",
        default="",
        help="experts per rank (E = this x EP size), one number or per shape (dsv3=64,small=32); default: SHAPES' E",
    )
    p.add_argument("--seed", type=int, default=0, help="weights (MoE seed) and, + 1000 + rank, the tokens")
    p.add_argument("--dry-cpu", action="store_true", help="self-check on 2 gloo CPU processes, tiny shape")
    p.add_argument("--dry-ranks", type=int, default=2, help="processes of --dry-cpu")
    p.add_argument("--no-spawn", action="store_true", help="skip instead of re-launching under torchrun")
    args = p.parse_args(argv)
    if args.dry_cpu:
        if args.shapes == "dsv3,small":
            args.shapes = "tiny"
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(DRY_VARIANTS)
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    elif args.out is None:
        args.out = DEFAULT_OUT
    for s in args.shapes.split(","):
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r} (known: {sorted(SHAPES)})")
    for v in args.variants.split(","):
        if v not in (*VARIANTS, "reference_bf16") and not re.fullmatch(r"torchtitan_bf16_align[1-9][0-9]*", v):
            raise SystemExit(
                f"--variants: unknown variant {v!r} (known: {', '.join(VARIANTS)}, reference_bf16, "
                "torchtitan_bf16_align<N>)"
            )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    under_torchrun = "LOCAL_RANK" in os.environ
    if args.dry_cpu and not under_torchrun:
        return relaunch_under_torchrun(__file__, args.dry_ranks, {"CUDA_VISIBLE_DEVICES": ""})
    if not under_torchrun:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2 or args.no_spawn:
            msg = f"bench_layer: skipped (needs torchrun with >1 GPU; {n} visible)"
            print(msg)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"skipped": msg}))
            return 0
        return relaunch_under_torchrun(__file__, n, {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (NCCL and NVSHMEM)
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import moe_ep  # noqa: PLC0415
    from launch.provenance import code_version  # noqa: PLC0415

    world = int(os.environ["WORLD_SIZE"])
    if args.dry_cpu:
        dev = torch.device("cpu")
        mesh = moe_ep.init_ep(world, backend="gloo")
    else:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        mesh = moe_ep.init_ep(world)
    rank = dist.get_rank()
    shapes = [s for s in args.shapes.split(",") if s]
    names = [v for v in args.variants.split(",") if v]
    if args.steps < 10 and rank == 0 and not args.dry_cpu:
        print(f"warning: --steps {args.steps} < 10: the issue asks for the median of at least 10", flush=True)

    preinit = None
    if dev.type == "cuda" and args.transport == "nvshmem" and world > 1 and {"bf16", *FP8} & set(names):
        # One runtime sized for every shape up front: a later, larger shape would otherwise grow the symmetric
        # buffers past the NVSHMEM heap sized at the first initialization.
        try:
            from moe_ep.transport.nvshmem import buffer as ct  # noqa: PLC0415

            dd = [shape_dims(s, args, mesh["ep"].size()) for s in shapes]
            ct.init_runtime(
                mesh["ep"].get_group(),
                max(d["T"] for d in dd),
                max(d["H"] for d in dd),
                max(d["K"] for d in dd),
                max(d["E"] for d in dd),
            )
            preinit = "ok"
        except Exception as exc:  # noqa: BLE001
            preinit = f"{type(exc).__name__}: {str(exc)[:300]}"
            if rank == 0:
                print(f"warning: NVSHMEM runtime pre-initialization failed ({preinit}); the layers initialize it")

    results: list[dict] = []
    shape_info: dict = {}
    for shape in shapes:
        rows, info = run_shape(shape, names, mesh, dev, args)
        results += rows
        shape_info[shape] = info
        if rank == 0:
            print(f"[{shape}] done in {info['seconds']} s", flush=True)

    meta = {
        "benchmark": "bench_layer",
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (--dry-cpu)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": code_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "ep_size": world,
        "dp_size": 1,
        "dtype": "bfloat16",
        "steps": args.steps,
        "warmup": args.warmup,
        "transport": args.transport,
        "nvshmem_preinit": preinit,
        "variants": names,
        "shapes": shape_info,
        "capacity_factor": None,
        "timing": (
            "per step: CUDA events around forward and forward+backward after an all_reduce+synchronize rank "
            f"alignment and a {SPIN_CYCLES}-cycle GPU spin; rounds interleave the variants (bench_gemm.round_order); "
            "per-rank median over steps, max over ranks"
        ),
        "memory": (
            "torch caching allocator only (the NVSHMEM symmetric heap is not counted); parameter .grad and x.grad set "
            "to None before every step, so act_mem_gb includes the gradients allocated in the backward (grad_gb; "
            "saved_gb, taken after the forward, does not); mxfp8 clears the weight cache before every step, so its "
            "act_mem_gb includes the re-prepared operands (weight_cache_gb), mxfp8_cached's does not"
        ),
        "backward": "timed and profiled steps: backward of y (random bf16 dy) and of the aux loss (moe_ep variants); "
        "check: of y only",
        "check_bounds": {
            "bf16": BF16_BOUND,
            "mxfp8": MXFP8_BOUND,
            "torchtitan_fp8_rowwise": FP8_ROWWISE_BOUND,
            "metric": "norm-relative, max over tensors and ranks",
        },
        "torchao": torchao_fp8_rowwise_info() if set(PEER_FP8) & set(names) else None,
        "targets": TARGETS,
        "ratios": {s: ratios(s, [r for r in results if r["shape"] == s]) for s in shapes},
        "config": vars(args),
    }
    if rank == 0:
        print_table(results, meta)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
            print(f"wrote {args.out}")
    ok = all(
        r.get("skipped") or ("error" not in r and r.get("check", {}).get("ok") and r.get("dropped_slots", 0) == 0)
        for r in results
    )
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if "moe_ep.transport.nvshmem.runtime" in sys.modules:  # symmetric memory freed on every rank before the groups go
        sys.modules["moe_ep.transport.nvshmem.runtime"].shutdown()
    moe_ep.finish(mesh)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
