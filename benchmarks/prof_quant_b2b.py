"""One launch against back-to-back launches of the quantizer (a profiling aid; bench_quant.py is the benchmark).

    python benchmarks/prof_quant_b2b.py [--configs JSON] [--timing-only NAMES] [--shapes 16384x2048,32768x2048]
                                        [--variants row_blocked] [--launches 8] [--rounds 5] [--reps 20] [--json PATH]

bench_quant times one launch between two CUDA events after an L2 flush ("one" here). At the small shapes two
effects of that method are a sizeable part of the time, in opposite directions:
- the events themselves: an empty launch timed the same way is reported (``empty_us``, ~4 us on an H200);
- the output lines still dirty in the L2 when the kernel ends are written back after the end event, outside the
  timed region (ncu at 16384x2048, NOTES pass 8: about half of the output).
"b2b" launches the kernel ``--launches`` times on as many distinct inputs (together larger than the L2) between two
events and divides by that count: each launch pays the write-back its predecessor left, and the events' overhead is
shared. That is the cost per launch in a stream of work, as in a training step.

Timed the same two ways, next to every configuration: probe_tile (kernels/bench_probe.cu, the same traffic with no
arithmetic; row-wise variants of bf16 inputs) and a device copy of the same bytes (``copy_same``). Configurations are
sets of environment variables as in prof_quant_pipes.py (the first is the baseline). Each is checked against the
reference and its whole output against the first configuration's, except those named in ``--timing-only``: builds
that write wrong bytes on purpose, e.g. with the arithmetic compiled out by a -D switch added for the experiment.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import round_order  # noqa: E402
from bench_quant import (  # noqa: E402
    Timer,
    check,
    check_low_bytes,
    kernel_fn,
    probe_tile_fn,
    run_filled,
    same_bytes,
    write_results,
)
from prof_quant_pipes import use  # noqa: E402
from quant_ab import ab_parser, ab_start  # noqa: E402

# GPU spin before each b2b measurement, per launch (torch.cuda._sleep cycles, ~0.25 ms): covers the launches' Python
B2B_SLEEP_PER_LAUNCH = 500_000


def b2b_row(timers, bw, xs, variant, groups, configs, timing_only, rounds) -> dict:
    """Per configuration (and probe_tile, copy_same): the median over ``rounds`` of one launch on xs[0] ("one") and
    of len(xs) launches on xs divided by len(xs) ("b2b"), in us and % of the copy bandwidth ``bw``."""
    one_t, b2b_t = timers
    m, k = xs[0].shape
    fns, nbytes, first = {}, {}, None
    for c in configs:
        use(configs, c)
        exact = c not in timing_only
        if exact and not check(variant, xs[0], groups):
            raise SystemExit(f"{variant} {m}x{k} {c}: bytes differ from the reference")
        launches = [kernel_fn(variant, x, groups) for x in xs]
        fns[c], nbytes[c] = [f for f, _ in launches], launches[0][1]
        if exact:
            got = run_filled(fns[c][0])
            if first is None:
                first = got
            elif not same_bytes(first, got):
                raise SystemExit(f"{variant} {m}x{k} {c}: the whole output differs from the first configuration's")
    use(configs, None)
    if variant.startswith("row_") and m % 128 == 0 and k % 128 == 0:  # xs: bf16 (main)
        outs = [torch.empty(m, k, dtype=torch.uint8, device=x.device) for x in xs]
        fns["probe_tile"] = [probe_tile_fn(x, o) for x, o in zip(xs, outs, strict=True)]
        for x, o, f in zip(xs, outs, fns["probe_tile"], strict=True):
            check_low_bytes(f, x, o, "probe_tile")
        nbytes["probe_tile"] = 3 * m * k
    half = nbytes[next(iter(configs))] // 2
    bufs = [tuple(torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(2)) for _ in xs]
    fns["copy_same"], nbytes["copy_same"] = [lambda a=a, b=b: b.copy_(a) for a, b in bufs], 2 * half
    names = list(fns)
    one = {c: [] for c in names}
    b2b = {c: [] for c in names}
    for r in range(rounds):
        for c in round_order(names, r):
            use(configs, c if c in configs else None)
            one[c].append(one_t(fns[c][0]))
            b2b[c].append(b2b_t(lambda c=c: [f() for f in fns[c]]) / len(xs))
    use(configs, None)
    row = {"variant": variant, "M": m, "K": k, "launches": len(xs)}
    for c in names:
        t1, tb = statistics.median(one[c]), statistics.median(b2b[c])
        row[c] = {
            "bytes": nbytes[c],
            "one_us": 1e3 * t1,
            "b2b_us": 1e3 * tb,
            "one_pct_copy": 100 * nbytes[c] / (t1 * 1e-3) / bw,
            "b2b_pct_copy": 100 * nbytes[c] / (tb * 1e-3) / bw,
            "one_rounds_ms": one[c],
            "b2b_rounds_ms": b2b[c],
        }
    return row


def main() -> None:
    ap = ab_parser(__doc__, "row_blocked", rounds=5, shapes="16384x2048,32768x2048")
    ap.add_argument("--configs", default='{"auto": {}}', help="JSON object: name -> environment")
    ap.add_argument("--timing-only", default="", help="comma-separated configurations whose bytes are not checked")
    ap.add_argument("--launches", type=int, default=8)
    args = ap.parse_args()
    configs: dict[str, dict[str, str]] = json.loads(args.configs)
    timing_only = set(filter(None, args.timing_only.split(",")))
    if next(iter(configs)) in timing_only:
        raise SystemExit("the first configuration is the reference of the others: it cannot be --timing-only")
    if not torch.cuda.is_available():
        raise SystemExit("prof_quant_b2b.py needs a CUDA GPU")
    one_t, bw = ab_start(args.reps)
    b2b_t = Timer(max(3, args.reps // 2), warmup=2, sleep_cycles=B2B_SLEEP_PER_LAUNCH * args.launches)
    empty = torch.zeros(1, device="cuda")
    empty_us = 1e3 * one_t(lambda: empty.add_(1))
    print(f"empty launch, timed as one: {empty_us:.2f} us", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(args.launches)]
        for v in args.variants.split(","):
            row = b2b_row((one_t, b2b_t), bw, xs, v, args.groups, configs, timing_only, args.rounds)
            rows.append(row)
            print(f"{v} {m}x{k}", flush=True)
            for c in row:
                if isinstance(row[c], dict):
                    r = row[c]
                    print(
                        f"  {c:<12} one {r['one_us']:7.2f} us {r['one_pct_copy']:5.1f}%"
                        f"   b2b {r['b2b_us']:7.2f} us {r['b2b_pct_copy']:5.1f}%",
                        flush=True,
                    )
        del xs
        torch.cuda.empty_cache()
    write_results(args.json, rows, bw, empty_launch_us=empty_us, **{**vars(args), "json": str(args.json)})


if __name__ == "__main__":
    main()
