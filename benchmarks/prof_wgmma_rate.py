"""Tensor-core rate probe for DESIGN 5.3's fp8 question (kernels/bench_wgmma_rate.cu; not a GEMM, no data).

One CTA per SM, 2 warpgroups, operands resident in shared memory, ITERS k32 steps of m64n128 per warpgroup:
bf16 wgmma (what our kernels run), fp8 wgmma with exact per-32 MXFP8 promotion (a fresh partial per k32, then
acc += partial * 2^(row exp + col exp) per element), fp8 without promotion (upper bound) and the hybrid (one
warpgroup fp8-promoted, the other bf16). Reports TFLOP/s (2 * 128 * 128 * 32 * ITERS per CTA over the kernel time,
CUDA events, median of 10) and clocks per k32 step per CTA (clock64 inside the kernel).

Second probe (rate2_*, see the kernel file): promotion serial inside a warpgroup (no C7514 serialization),
2 or 3 warpgroups, all fp8, all bf16 or a mix (the last warpgroup bf16) with their own step counts. Reported per
run: TFLOP/s over all warpgroups' m64n128k32 steps, the ratio to rate2_bf16_2wg of the same process, and each
warpgroup's clocks per step.

Third probe (rate3_*): the m64n256k16 bf16 MMA of the 128 x 256 kernels, A from shared memory (SS) or from
registers (RS, as fprop/dgrad issue it), 2 warpgroups, per 128 x 256 x 64 CTA step; reported as TFLOP/s, ratio to
rate2_bf16_2wg and clocks per step (1024 = the bf16 tensor rate).

    python benchmarks/prof_wgmma_rate.py [--iters 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import time_ms  # noqa: E402

from moe_ep import _cuda  # noqa: E402

KERNELS = ("rate_bf16", "rate_fp8_promoted", "rate_fp8_plain", "rate_hybrid")


def launch_ms(fn, grid: int, block: int, kargs: tuple, smem: int) -> float:
    """Median kernel time (bench_gemm's CUDA-event timer) of 10 launches after 2 warm-up launches."""
    return time_ms(lambda: _cuda.launch(fn, grid, block, kargs, shared_mem=smem), 2, 10)


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
        ms = launch_ms(fn, sms, 256, kargs, 33280)
        res["kernels"][name] = {
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "clk_per_k32_step": float(cycles.double().mean().item()) / args.iters,
            "finite": bool(torch.isfinite(out).all().item()),
        }
        print(name, res["kernels"][name])
    # second probe: (kernel, warpgroups, fp8 steps, bf16 steps) per fp8 / bf16 warpgroup
    n = args.iters
    runs = [("rate2_bf16_2wg", 2, 0, n), ("rate2_fp8_2wg", 2, n, 0), ("rate2_fp8_3wg", 3, n, 0)]
    runs += [("rate2_mix_2wg", 2, f, n) for f in (n // 4, n // 2, n)]
    runs += [("rate2_mix_3wg", 3, f, n) for f in (n // 4, n // 2, n)]
    cyc2 = torch.zeros(sms * 4, dtype=torch.int64, device="cuda")
    res["rate2"] = []
    base = None
    for name, nwg, it8, it16 in runs:
        fn = _cuda.get_function("bench_wgmma_rate.cu", name)
        cyc2.zero_()
        out2 = torch.empty(sms * 128 * nwg * 64, dtype=torch.float32, device="cuda")
        kargs = (_cuda.ptr(out2), _cuda.ptr(cyc2), np.int32(it8), np.int32(it16))
        ms = launch_ms(fn, sms, 128 * nwg, kargs, 8192 * nwg + 16384 + 512)
        steps = [
            it8 if (name.startswith("rate2_fp8") or (name.startswith("rate2_mix") and w < nwg - 1)) else it16
            for w in range(nwg)
        ]
        tflops = 2.0 * 64 * 128 * 32 * sum(steps) * sms / ms / 1e9
        per_wg = cyc2.view(sms, 4)[:, :nwg].double().mean(0).tolist()
        row = {
            "kernel": name,
            "warpgroups": nwg,
            "fp8_steps": it8,
            "bf16_steps": it16,
            "ms": ms,
            "tflops": tflops,
            "clk_per_step_per_wg": [c / max(st, 1) for c, st in zip(per_wg, steps, strict=True)],
            "finite": bool(torch.isfinite(out2).all().item()),
        }
        base = base or tflops
        row["ratio_vs_bf16_2wg"] = tflops / base
        res["rate2"].append(row)
        print(row)
    res["rate3"] = []
    cyc3 = torch.zeros(sms * 4, dtype=torch.int64, device="cuda")
    out3 = torch.empty(sms * 256 * 128, dtype=torch.float32, device="cuda")
    for name in ("rate3_ss_n256", "rate3_rs_n256"):
        fn = _cuda.get_function("bench_wgmma_rate.cu", name)
        steps = n // 2  # k64 steps: the same flops per CTA as n k32 steps of 128 x 128
        kargs = (_cuda.ptr(out3), _cuda.ptr(cyc3), np.int32(steps))
        ms = launch_ms(fn, sms, 256, kargs, 49152)
        tflops = 2.0 * 128 * 256 * 64 * steps * sms / ms / 1e9
        row = {
            "kernel": name,
            "steps": steps,
            "ms": ms,
            "tflops": tflops,
            "ratio_vs_bf16_2wg": tflops / base,
            "clk_per_step": cyc3.view(sms, 4)[:, :2].double().mean().item() / steps,
            "finite": bool(torch.isfinite(out3).all().item()),
        }
        res["rate3"].append(row)
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
