"""A/B of the weights' fused quantization: one launch for all experts (``quantize_weights_fused``, mx_quant_batch)
against one mx_quant launch per expert (the previous launcher, rebuilt here), on the expert-MLP shapes.

Both write the same bytes (checked first). Timed in rounds in one process, in bench_gemm.round_order's rotating
order (the committed results up to d6c836d ran the same order every round): the GPU time between CUDA
events around one call (it includes the GPU idling while the host is still launching), and the host time of the
call (perf_counter, without waiting for the GPU). Also the whole ``weight_operands`` (both quantizations and both
prepared bf16 copies) as the cache miss of a training step pays it.

Usage: python benchmarks/prof_weight_prep.py [--rounds 5] [--reps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import round_order  # noqa: E402

from moe_ep import _cuda, gemm_operands, mxfp8_cuda  # noqa: E402
from moe_ep import quant_plan as qp  # noqa: E402
from moe_ep.provenance import code_version  # noqa: E402

SHAPES = {  # name: the expert MLP's weights W13 [E, 2F, H] and W2 [E, H, F]
    "dsv3": (32, 7168, 2048),
    "small": (16, 2048, 768),
    "llama4": (4, 5120, 4096),
}


def per_expert(w, data, scale, data_t, scale_t) -> None:
    """The previous launcher: mx_quant<IN,2,2> once per expert, pointers advanced by each tensor's stride(0)."""
    e, n, k = w.shape
    name, grid, smem, nrt, ctiles, _ = qp.quant_plan(w, n, k, qp.RS["blocked"], qp.CS["blocked"], 0, None, None)
    ts = (w, data, scale, data_t, scale_t)
    bases, steps = [t.data_ptr() for t in ts], [t.stride(0) * t.element_size() for t in ts]
    null = _cuda.ptr(None)
    for i in range(e):
        px, prq, prs, pcq, pcs = (np.uint64(b + i * s) for b, s in zip(bases, steps, strict=True))
        args = mxfp8_cuda._quant_args(
            px, n, k, prq, prs, pcq, pcs, null, 0, 0, nrt, ctiles, null, mxfp8_cuda._sched_ptr(name, w.device)
        )
        mxfp8_cuda._launch(name, grid, args, smem, w.device)


def batched(w, data, scale, data_t, scale_t) -> None:
    mxfp8_cuda.quantize_weights_fused_into(w, data, scale, data_t, scale_t)


def timed(fn, reps: int) -> tuple[float, float]:
    """(median GPU ms between events, median host ms of the call)."""
    gpu, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"benchmark": "prof_weight_prep", "device": torch.cuda.get_device_name(), "commit": code_version()}
    out["shapes"] = {}
    for name, (e, h, f) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        weights = {
            "w13": torch.randn(e, 2 * f, h, generator=gen, device=dev).bfloat16(),
            "w2": torch.randn(e, h, f, generator=gen, device=dev).bfloat16(),
        }
        res = {}
        for wname, w in weights.items():
            outs = {k: [torch.full_like(t, 0x5A) for t in mxfp8_cuda.quantize_weights_fused(w)] for k in "ab"}
            per_expert(w, *outs["a"])
            batched(w, *outs["b"])
            pairs = zip(outs["a"], outs["b"], strict=True)
            same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)
            if not same:
                raise SystemExit(f"{name}/{wname}: the batched launch wrote other bytes than the per-expert one")
            fns = {
                "per_expert": lambda w=w, o=outs["a"]: per_expert(w, *o),
                "batched": lambda w=w, o=outs["b"]: batched(w, *o),
                "weight_operands": lambda w=w: gemm_operands.weight_operands(w),
            }
            rounds = {k: [] for k in fns}
            for fn in fns.values():
                timed(fn, 2)  # warm-up (compiles)
            for r in range(args.rounds):
                for k in round_order(list(fns), r):
                    rounds[k].append(timed(fns[k], args.reps))
            res[wname] = {
                k: {"gpu_ms": statistics.median(g for g, _ in v), "host_ms": statistics.median(h for _, h in v)}
                for k, v in rounds.items()
            }
            pe, bt = res[wname]["per_expert"], res[wname]["batched"]
            nbytes = w.numel() * (w.element_size() + 2) + sum(t.numel() for t in outs["b"][1::2])
            res[wname]["batched"]["GBps"] = nbytes / bt["gpu_ms"] / 1e6
            print(
                f"{name:7s} {wname:4s} {tuple(w.shape)}: per expert {pe['gpu_ms']:.3f} ms GPU / {pe['host_ms']:.3f} "
                f"ms host; batched {bt['gpu_ms']:.3f} / {bt['host_ms']:.3f} ({nbytes / bt['gpu_ms'] / 1e6:.0f} GB/s); "
                f"weight_operands {res[wname]['weight_operands']['gpu_ms']:.3f} ms GPU"
            )
        out["shapes"][name] = res
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
