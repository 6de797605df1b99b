"""Does the quantizer pay for starting cold? (a profiling aid; bench_quant.py is the benchmark)

    python benchmarks/prof_quant_cold.py [--shapes 16384x2048,...] [--variants row_blocked,row_plain,fused]
                                         [--rounds 6] [--reps 20] [--touch-mb 0.5,2,8] [--json PATH]

bench_quant's timer flushes the L2 (a 256 MiB read) before every timed launch. This script times the same launch
with one more kernel run between the flush and the start event (Timer's ``before`` hook), and reports each
configuration's median over ``--rounds`` alternating rounds (bench_gemm.round_order) in us and % of copy:
  plain        nothing in between (bench_quant's measurement)
  same         the same quantizer on a copy of x's first 2048 rows (its own outputs): every SM runs its code once
  other        another mx_quant kernel (row_plain, or row_blocked for row_plain) on that copy
  one_cta      the same quantizer on one 128 x 128 tile (two CTAs on pipe 5)
  probe        probe_tile (kernels/bench_probe.cu: the same traffic, register loads, no arithmetic) on the copy
  hold_smem    probe_hold: 3 us of spinning on 5 CTAs per SM with the quantizer's dynamic shared memory (the SMs'
               shared-memory configuration, no memory traffic)
  x_<kind>_<v>MB  probe_touch on x ITSELF: its first v MB read in 256 CTAs by one access kind, i.e. that much of the
               timed kernel's input left in the L2: cp_async (16-byte cp.async.cg into shared memory), ld_cg
               (ld.global.cg), ld_nc (ld.global.nc.L1::no_allocate, probe_tile's loads)
  st_<v>MB     probe_touch's 16-byte stores of zeros to a scratch buffer (that many dirty lines in the L2)
probe_tile and probe_dual (order 6: two row-major outputs) are timed plain and after themselves on the copy.
Every quantizer output is checked against the reference first (bench_quant.check, 512 rows).
(NOTES pass 11: a first version warmed with x[:2048].contiguous(), which is a view of x, so its "warm" kernels
prefetched the timed input; the x_* rows measure that effect on purpose.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import round_order  # noqa: E402
from bench_quant import Timer, ab_inputs, ab_start, check, kernel_fn, write_results  # noqa: E402

from moe_ep import _cuda, quant_plan  # noqa: E402

WARM_ROWS = 2048
# probe_touch's access kinds (kernels/bench_probe.cu): the mode codes
TOUCH_KINDS = {"cp_async": 0, "ld_cg": 1, "ld_nc": 2, "st": 3}


def launcher(name: str, grid: int, args: tuple, shared_mem: int = 0, block: int = 256):
    fn = _cuda.get_function("bench_probe.cu", name)
    return lambda: _cuda.launch(fn, grid, block, args, shared_mem=shared_mem)


def probe(name: str, x: torch.Tensor, out: torch.Tensor, out2: torch.Tensor):
    """probe_tile / probe_dual (order 6) over x [M, K] bf16, M and K multiples of 128."""
    m, k = x.shape
    p = _cuda.ptr
    if name == "probe_tile":
        args = (p(x), p(out), _cuda.i64(m), _cuda.i32(k), _cuda.i32(k // 128))
    else:
        args = (p(x), p(out), p(out2), _cuda.i64(m), _cuda.i32(k), _cuda.i32(k // 128), _cuda.i32(6))
    return launcher(name, m // 128 * (k // 128), args)


def timed(timer: Timer, configs: dict, fn, rounds: int) -> dict[str, float]:
    """Median over rounds (us) of fn with each configuration's before-hook (None: plain) on ``timer``."""
    t: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(rounds):
        for c in round_order(list(configs), r):
            timer.before = configs[c]
            t[c].append(1e3 * timer(fn))
    timer.before = None
    return {c: statistics.median(v) for c, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16384x2048,32768x2048")
    ap.add_argument("--variants", default="row_blocked,row_plain,fused")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--touch-mb",
        type=lambda v: [float(t) for t in v.split(",")],
        default=[0.5, 2.0, 8.0],
        help="probe_touch volumes (MB, each over 256 CTAs; cp_async holds a CTA's share in shared memory)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    _, bw = ab_start(args.reps)
    sms = quant_plan.sm_count(torch.device("cuda"))
    # ~1 ms of GPU spin per launch: a before-hook that goes through mxfp8_cuda's Python launcher must not leave the
    # GPU waiting for the timed launch (with bench_quant's ~100 us, 'same' measured 66 us instead of ~27 in one run)
    timer = Timer(args.reps, warmup=3, sleep_cycles=2_000_000)
    rows = []
    for x in ab_inputs(args.shapes):
        m, k = x.shape
        xs = x[:WARM_ROWS].clone()  # other memory: a view of x would leave the timed input in the L2
        out, out2, scratch = (torch.empty(m, k, dtype=torch.uint8, device="cuda") for _ in range(3))
        for variant in args.variants.split(","):
            if not check(variant, x):
                raise SystemExit(f"{variant} {m}x{k}: bytes differ from the reference")
            fn, nbytes = kernel_fn(variant, x, 32)
            smem = quant_plan.quant_plan(x, m, k, *_modes(variant), 0, None, None)[2]
            configs = {
                "plain": None,
                "same": kernel_fn(variant, xs, 32)[0],
                "other": kernel_fn("row_blocked" if variant == "row_plain" else "row_plain", xs, 32)[0],
                "one_cta": kernel_fn(variant, x[:128, :128].contiguous(), 32)[0],
                "probe": probe("probe_tile", xs, out, out2),
                "hold_smem": launcher("probe_hold", 5 * sms, (_cuda.i64(3000),), shared_mem=smem),
            }
            for kind, mode in TOUCH_KINDS.items():
                for mb in args.touch_mb:
                    n = int(mb * 2**20) // 256 // 16 * 16  # 256 CTAs of mb / 256 MB each, whole 16-byte chunks
                    if 256 * n > min(x.nbytes, scratch.nbytes):
                        raise SystemExit(f"--touch-mb {mb:g} does not fit a {m}x{k} input")
                    targs = (_cuda.ptr(x), _cuda.ptr(scratch), _cuda.i32(n), _cuda.i32(256), _cuda.i32(mode))
                    label = f"st_{mb:g}MB" if kind == "st" else f"x_{kind}_{mb:g}MB"
                    configs[label] = launcher("probe_touch", 256, targs, n if mode == 0 else 0)
            us = timed(timer, configs, fn, args.rounds)
            row = {"variant": variant, "M": m, "K": k, "bytes": nbytes}
            row.update({f"{c}_us": v for c, v in us.items()})
            row.update({f"{c}_pct_copy": 100 * nbytes / (v * 1e-6) / bw for c, v in us.items()})
            rows.append(row)
            print(f"{variant:<12} {m:>6}x{k:<5} " + "  ".join(f"{c} {v:6.2f}" for c, v in us.items()), flush=True)
        for name in ("probe_tile", "probe_dual"):
            us = timed(
                timer, {"plain": None, "same": probe(name, xs, out, out2)}, probe(name, x, out, out2), args.rounds
            )
            rows.append({"variant": name, "M": m, "K": k, **{f"{c}_us": v for c, v in us.items()}})
            print(f"{name:<12} {m:>6}x{k:<5} " + "  ".join(f"{c} {v:6.2f}" for c, v in us.items()), flush=True)
    write_results(args.json, rows, bw, **{**vars(args), "json": str(args.json)})


def _modes(variant: str) -> tuple[int, int]:
    """(row, column) scale modes of a bench_quant variant (for its shared-memory size)."""
    return {
        "row_blocked": (quant_plan.RS["blocked"], 0),
        "row_plain": (quant_plan.RS["plain"], 0),
        "fused": (quant_plan.RS["blocked"], quant_plan.CS["blocked"]),
    }[variant]


if __name__ == "__main__":
    main()
