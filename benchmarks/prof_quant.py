"""Driver for profiling the quantization kernels under Nsight Compute (not a benchmark: no timing here).

    ncu --clock-control none -k regex:'mx_quant|probe_' --section ... python benchmarks/prof_quant.py \
        --variants row_blocked,col_blocked --shapes 16384x2048,32768x7168

Launches every (variant, shape) twice (the first call compiles and warms up), and with --probe the tile-order
same-traffic probe (probe_tile) twice as well, so a profiler filtering on kernel names sees steady-state launches.
Correctness is bench_quant.py's job.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_quant import kernel_fn, probe_tile_fn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="row_blocked,col_blocked,fused")
    ap.add_argument("--shapes", default="16384x2048,32768x7168")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--probe", action="store_true", help="also launch the tile-order same-traffic probe")
    args = ap.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for v in args.variants.split(","):
            fn, _ = kernel_fn(v, x, args.groups)
            fn()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
            print(f"{v} {m}x{k} launched", flush=True)
        if args.probe:
            probe = probe_tile_fn(x, torch.empty(m, k, dtype=torch.uint8, device="cuda"))
            for _ in range(2):
                probe()
                torch.cuda.synchronize()


if __name__ == "__main__":
    main()
