"""Tensor-core rate probe for DESIGN 5.3's fp8 question (kernels/bench_wgmma_rate.cu; not a GEMM, no data).

One CTA per SM, 2 warpgroups, operands resident in shared memory, ITERS k32 steps of m64n128 per warpgroup:
bf16 wgmma (what our kernels run), fp8 wgmma with exact per-32 MXFP8 promotion (a fresh partial per k32, then
acc += partial * 2^(row exp + col exp) per element), fp8 without promotion (upper bound) and the hybrid (one
warpgroup fp8-promoted, the other bf16). Reports TFLOP/s (2 * 128 * 128 * 32 * ITERS per CTA over the kernel time,
CUDA events, median of 10) and clocks per k32 step per CTA (clock64 inside the kernel).

    python benchmarks/prof_wgmma_rate.py [--iters 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_ep import _cuda  # noqa: E402

KERNELS = ("rate_bf16", "rate_fp8_promoted", "rate_fp8_plain", "rate_hybrid")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sms = _cuda.num_sms()
    out = torch.empty(sms * 256 * 64, dtype=torch.float32, device="cuda")
    cycles = torch.zeros(sms, dtype=torch.int64, device="cuda")
    flops = 2.0 * 128 * 128 * 32 * args.iters * sms
    res = {"device": torch.cuda.get_device_name(), "sms": sms, "iters": args.iters, "kernels": {}}
    for name in KERNELS:
        fn = _cuda.get_function("bench_wgmma_rate.cu", name)
        kargs = (_cuda.ptr(out), _cuda.ptr(cycles), np.int32(args.iters))
        times = []
        for rep in range(12):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            _cuda.launch(fn, sms, 256, kargs, shared_mem=33280)
            e.record()
            torch.cuda.synchronize()
            if rep >= 2:
                times.append(s.elapsed_time(e))
        ms = statistics.median(times)
        res["kernels"][name] = {
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "clk_per_k32_step": float(cycles.double().mean().item()) / args.iters,
            "finite": bool(torch.isfinite(out).all().item()),
        }
        print(name, res["kernels"][name])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
