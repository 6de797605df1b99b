"""Does the quantizer pay for starting cold? (a profiling aid; bench_quant.py is the benchmark)

    python benchmarks/prof_quant_cold.py [--shapes 16384x2048,...] [--variants row_blocked,row_plain,fused]
                                         [--groups 32] [--rounds 6] [--reps 20] [--touch-mb 0.5,2,8]
                                         [--json PATH]

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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quant import (  # noqa: E402
    Timer,
    check,
    check_low_bytes,
    kernel_fn,
    probe_tile_fn,
    probe_tiles,
    recorded_launches,
    write_results,
)
from quant_ab import ab_inputs, ab_parser, ab_rounds, ab_start  # noqa: E402

from moe_ep import _cuda, quant_plan  # noqa: E402

WARM_ROWS = 2048
# probe_touch's access kinds (kernels/bench_probe.cu): the mode codes
TOUCH_KINDS = {"cp_async": 0, "ld_cg": 1, "ld_nc": 2, "st": 3}


def launcher(name: str, grid: int, args: tuple, shared_mem: int = 0, block: int = 256):
    fn = _cuda.get_function("bench_probe.cu", name)
    return lambda: _cuda.launch(fn, grid, block, args, shared_mem=shared_mem)


def probe(name: str, x: torch.Tensor, out: torch.Tensor, out2: torch.Tensor):
    """probe_tile / probe_dual (order 6: both row-major outputs) over x [M, K] bf16, M and K multiples of 128."""
    if name == "probe_tile":
        return probe_tile_fn(x, out)
    ctiles, rtiles = probe_tiles(x, name)
    p = _cuda.ptr
    args = (p(x), p(out), p(out2), _cuda.i64(x.shape[0]), _cuda.i32(x.shape[1]), _cuda.i32(ctiles), _cuda.i32(6))
    return launcher(name, rtiles * ctiles, args)


def timed(timer: Timer, bw: float, configs: dict, fn, rounds: int, nbytes: int) -> dict[str, float]:
    """``{c}_us`` / ``{c}_pct_copy`` of fn with each configuration's before-hook (None: plain) on ``timer``
    (quant_ab.ab_rounds: the median over alternating rounds)."""
    res = ab_rounds(timer, {c: fn for c in configs}, lambda c: setattr(timer, "before", configs[c]), rounds, nbytes, bw)
    timer.before = None
    return {f"{c}_{k}": r[k] for c, r in res.items() for k in ("us", "pct_copy")}


def main() -> None:
    ap = ab_parser(__doc__, "row_blocked,row_plain,fused", rounds=6, shapes="16384x2048,32768x2048")
    ap.add_argument(
        "--touch-mb",
        type=lambda v: [float(t) for t in v.split(",")],
        default=[0.5, 2.0, 8.0],
        help="probe_touch volumes (MB, each over 256 CTAs; cp_async holds a CTA's share in shared memory)",
    )
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
            if not check(variant, x, args.groups):
                raise SystemExit(f"{variant} {m}x{k}: bytes differ from the reference")
            fn, nbytes = kernel_fn(variant, x, args.groups)
            smem = recorded_launches(fn)[-1][2]  # the timed kernel's dynamic shared memory
            configs = {
                "plain": None,
                "same": kernel_fn(variant, xs, args.groups)[0],
                "other": kernel_fn("row_blocked" if variant == "row_plain" else "row_plain", xs, args.groups)[0],
                "one_cta": kernel_fn(variant, x[:128, :128].contiguous(), args.groups)[0],
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
            rows.append({"variant": variant, "M": m, "K": k, "bytes": nbytes})
            rows[-1].update(timed(timer, bw, configs, fn, args.rounds, nbytes))
            print(_line(rows[-1], configs), flush=True)
        for name, nbytes in (("probe_tile", 3 * m * k), ("probe_dual", 4 * m * k)):
            configs = {"plain": None, "same": probe(name, xs, out, out2)}
            for o in (out, out2) if name == "probe_dual" else (out,):  # order 6: both outputs are x's low bytes
                check_low_bytes(probe(name, x, out, out2), x, o, name)
            rows.append({"variant": name, "M": m, "K": k, "bytes": nbytes})
            rows[-1].update(timed(timer, bw, configs, probe(name, x, out, out2), args.rounds, nbytes))
            print(_line(rows[-1], configs), flush=True)
    write_results(args.json, rows, bw, **{**vars(args), "json": str(args.json)})


def _line(row: dict, configs) -> str:
    return f"{row['variant']:<12} {row['M']:>6}x{row['K']:<5} " + "  ".join(
        f"{c} {row[c + '_us']:6.2f}" for c in configs
    )


if __name__ == "__main__":
    main()
