"""Per-CTA timelines of row_blocked (mx_quant) against probe_tile, from builds with -DMX_STAMPS (kernels/stamps.cuh).

    python benchmarks/prof_quant_stamps.py [--shapes 16384x2048,32768x7168] [--runs 5] [--json PATH]
    python benchmarks/prof_quant_stamps.py --carveout [--shapes ...] [--reps 20] [--json PATH]

For each shape: row_blocked as the library launches it (auto: pipe 4, one tile per CTA on the cp.async path, since
NOTES pass 10; pass 8 measured pipe 3, persistent), row_blocked with MOE_EP_QUANT_PIPE=0 (one tile per CTA, register
loads, like the probe) and probe_tile (kernels/bench_probe.cu, the same traffic with no arithmetic),
each checked against the reference first, warmed up (3 timelines, dropped), then launched ``--runs`` times after
bench_quant's L2 flush.
Thread 0 of every CTA stamps %globaltimer (ns) at entry and when its first tile's row output has been issued,
the CTA's last warp at exit. Reported per kernel (medians over the runs; the event times of every run are kept):
the CUDA-event time; the span from the first CTA's entry to the last warp's exit; when the last CTA entered
(launch ramp); first output after entry (min / median / max over CTAs: the first load latency plus the first
tile's work); when the median and the last CTA exited. A profiling aid, not a
benchmark; the stamped builds are slower than the library's by the stamps' few instructions.

--carveout: no stamps; bench_quant's timer (CPU ahead, L2 flushed) on row_blocked, fused, grouped_dual and
probe_tile, each with and without ``probe_smem_touch`` (an empty kernel with 68 KB of dynamic shared memory on 3
CTAs per SM) launched between the flush and the start event: whether the timed kernels pay for switching the SMs'
L1 / shared-memory split away from the flush kernel's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# the stamped builds: set before anything compiles (the option is part of every module's cache key); the parser
# below takes no abbreviations, so this test of argv sees what argparse will
if "--carveout" not in sys.argv:
    os.environ["MOE_EP_NVRTC_OPTIONS"] = (os.environ.get("MOE_EP_NVRTC_OPTIONS", "") + " -DMX_STAMPS").strip()

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gemm import env_restored, round_order  # noqa: E402
from bench_quant import Timer, check, kernel_fn, probe_tile_fn, probe_tiles, write_results  # noqa: E402

from moe_ep import _cuda, quant_plan  # noqa: E402

STAMP_CTAS = 16384  # kernels/stamps.cuh MX_STAMP_CTAS


def stamps_view(module):
    """The module's mx_stamps [STAMP_CTAS, 4] uint64 as a CuPy array (device memory, shared with the kernels)."""
    cp = _cuda.cupy()
    return cp.ndarray((STAMP_CTAS, 4), dtype=cp.uint64, memptr=module.get_global("mx_stamps"))


def timeline(fn, stamps, flush: torch.Tensor) -> dict:
    """One launch of fn after an L2 flush: CUDA-event time and the per-CTA stamps relative to the first entry."""
    with _cuda.torch_stream():  # ordered with the launches on torch's stream
        stamps.fill(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000)  # the CPU gets ahead (as in bench_quant.Timer): no host time between the events
    flush.max()  # reads 256 MiB: a clean L2, as bench_quant.Timer leaves it
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    s = torch.as_tensor(stamps.get().astype("int64"))
    s = s[(s[:, :3] > 0).all(1)]  # CTAs with a tile (a persistent grid's others stamp only their entry)
    t0 = int(s[:, 0].min())
    entry, first, done = (s[:, 0] - t0).double(), (s[:, 1] - s[:, 0]).double(), (s[:, 2] - t0).double()
    return {
        "event_us": 1e3 * start.elapsed_time(end),
        "ctas": len(s),
        "span_us": float(done.max()) / 1e3,
        "last_entry_us": float(entry.max()) / 1e3,
        "first_out_min_us": float(first.min()) / 1e3,
        "first_out_median_us": float(first.median()) / 1e3,
        "first_out_max_us": float(first.max()) / 1e3,
        "exit_median_us": float(done.median()) / 1e3,
        "exit_max_us": float(done.max()) / 1e3,
        # the clock's resolution as seen here: the smallest nonzero gap between distinct entry stamps
        "resolution_ns": float(torch.diff(torch.unique(s[:, 0])).min()) if len(torch.unique(s[:, 0])) > 1 else 0.0,
    }


# probe_smem_touch's dynamic shared memory: 3 CTAs per SM, as mx_quant's pipe 3 (69 KB; row_blocked's auto pipe
# until NOTES pass 10)
TOUCH_SMEM = 68 * 1024


def carveout(args) -> None:
    """Event times with and without probe_smem_touch before the start event (see the module docstring)."""
    touch_fn = _cuda.get_function("bench_probe.cu", "probe_smem_touch")
    grid = 3 * quant_plan.sm_count(torch.device("cuda"))
    touch = lambda: _cuda.launch(touch_fn, grid, 32, (), shared_mem=TOUCH_SMEM)
    plain, touched = Timer(args.reps, warmup=3), Timer(args.reps, warmup=3, before=touch)
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4
        fns = {"probe_tile": probe_tile_fn(x, torch.empty(m, k, dtype=torch.uint8, device="cuda"))}
        for v in ("row_blocked", "fused", "grouped_dual"):
            if not check(v, x):
                raise SystemExit(f"{v} {shape}: bytes differ from the reference")
            fns[v] = kernel_fn(v, x, 32)[0]
        for name, fn in fns.items():
            t = {"plain": [], "touch": []}
            for r in range(args.runs):  # alternating, so that drift does not favour one
                for mode in round_order(["plain", "touch"], r):
                    t[mode].append(1e3 * (plain if mode == "plain" else touched)(fn))
            row = {"kernel": name, "M": m, "K": k, **{f"{mode}_us": statistics.median(v) for mode, v in t.items()}}
            rows.append(row)
            print(
                f"{name:<14} {m:>6}x{k:<5} plain {row['plain_us']:7.2f} us  after probe_smem_touch "
                f"{row['touch_us']:7.2f} us  ({row['plain_us'] - row['touch_us']:+.2f})",
                flush=True,
            )
    write_results(args.json, rows, None, **{**vars(args), "json": str(args.json)})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--shapes", default="16384x2048,32768x7168")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="--carveout: launches per timing")
    ap.add_argument("--carveout", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.carveout:
        carveout(args)
        return
    flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    quant_stamps = lambda: stamps_view(_cuda.get_module("quantize.cu", quant_plan.NAMES, quant_plan.options()))
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4
        ctiles, rtiles = probe_tiles(x, "probe_tile")
        if rtiles * ctiles > STAMP_CTAS:  # the one-tile-per-CTA grids would be stamped only in part
            raise SystemExit(f"{shape}: {rtiles * ctiles} tiles, more CTAs than the {STAMP_CTAS} stamped")
        probe = probe_tile_fn(x, torch.empty(m, k, dtype=torch.uint8, device="cuda"))
        kernels = {}
        for name, pipe in (("row_blocked", "auto"), ("row_blocked_pipe0", "0")):
            with env_restored("MOE_EP_QUANT_PIPE"):
                os.environ["MOE_EP_QUANT_PIPE"] = pipe
                if not check("row_blocked", x):
                    raise SystemExit(f"{name} {shape}: bytes differ from the reference")
                fn, _ = kernel_fn("row_blocked", x, 32)
                fn()  # compiles this build, so that its module (and mx_stamps) exists
                kernels[name] = (fn, quant_stamps(), pipe)
        kernels["probe_tile"] = (probe, stamps_view(_cuda.get_module("bench_probe.cu")), None)
        for name, (fn, stamps, pipe) in kernels.items():
            with env_restored("MOE_EP_QUANT_PIPE"):
                if pipe is not None:
                    os.environ["MOE_EP_QUANT_PIPE"] = pipe
                # warm-up timelines, dropped: the first ones of a process ran 38-194 us (its Python outran the
                # GPU spin, so the GPU waited inside the timed region); outliers the median must not depend on
                for _ in range(3):
                    timeline(fn, stamps, flush)
                runs = [timeline(fn, stamps, flush) for _ in range(args.runs)]
            row = {"kernel": name, "M": m, "K": k, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
            row["event_us_runs"] = [r["event_us"] for r in runs]
            rows.append(row)
            print(
                f"{name:<18} {m:>6}x{k:<5} event {row['event_us']:6.1f} us  span {row['span_us']:6.1f}  "
                f"last entry {row['last_entry_us']:5.1f}  first out {row['first_out_min_us']:4.1f} / "
                f"{row['first_out_median_us']:4.1f} / {row['first_out_max_us']:4.1f}  exit median "
                f"{row['exit_median_us']:6.1f} max {row['exit_max_us']:6.1f}  ({row['ctas']:.0f} CTAs, clock "
                f"{row['resolution_ns']:.0f} ns)",
                flush=True,
            )
    write_results(args.json, rows, None, **{**vars(args), "json": str(args.json)})


if __name__ == "__main__":
    main()
