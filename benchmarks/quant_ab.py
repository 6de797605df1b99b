"""In-process A/B helpers of the prof_quant_* scripts (profiling aids; bench_quant.py is the benchmark): one parser,
one timer with the copy bandwidth, the inputs, and per (shape, variant) a row of configurations checked against the
reference and against each other before they are timed in alternating rounds."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import round_order  # noqa: E402
from bench_quant import Timer, check, copy_bandwidth, kernel_fn, run_filled, same_bytes, write_results  # noqa: E402

SHAPES = "16384x2048,16384x7168,32768x2048,32768x7168,131072x2048,131072x7168"


def ab_parser(doc: str, variants: str, rounds: int, shapes: str = SHAPES) -> argparse.ArgumentParser:
    """The options every prof_quant_* A/B script takes (--shapes, --variants, --groups, --rounds, --reps, --json),
    with the script's defaults; the script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--variants", default=variants)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def ab_start(reps: int) -> tuple[Timer, float]:
    """The prof_quant_* A/B scripts' timer (bench_quant's flushed-L2 timer, median of ``reps``) and the copy
    bandwidth (bytes/s) measured with it, printed."""
    timer = Timer(reps, warmup=3)
    bw = copy_bandwidth(timer)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    return timer, bw


def ab_inputs(shapes: str):
    """x [M, K] bf16 on the GPU, N(0, 16), per entry "MxK" of ``shapes`` ("16384x2048,...")."""
    for shape in shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        yield torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4


def ab_rounds(timer: Timer, fns: dict, apply, rounds: int, nbytes: int, bw: float) -> dict[str, dict]:
    """In-process A/B of the prof_quant_* scripts: every configuration's launcher ``fns[c]`` timed in ``rounds``
    rounds in bench_gemm.round_order, ``apply(c)`` setting c's environment before each timing. Per
    configuration: the median over rounds in us and in % of the copy bandwidth ``bw`` (``nbytes`` moved), and the
    rounds' times in ms."""
    names = list(fns)
    times: dict[str, list[float]] = {c: [] for c in names}
    for r in range(rounds):
        for c in round_order(names, r):
            apply(c)
            times[c].append(timer(fns[c]))
    out = {}
    for c in names:
        t = statistics.median(times[c])
        out[c] = {"us": 1e3 * t, "pct_copy": 100 * nbytes / (t * 1e-3) / bw, "rounds_ms": times[c]}
    return out


def ab_row(timer: Timer, bw: float, x: torch.Tensor, variant: str, groups: int, apply, names, rounds: int) -> dict:
    """One row of the prof_quant_* A/B scripts: every configuration in ``names`` (``apply(c)`` sets its
    environment) checked against the reference (``check``, 512 rows) and, whole output into 0xAB-filled buffers,
    byte for byte against the first configuration's; then timed by :func:`ab_rounds`. Raises SystemExit on a
    mismatch."""
    m, k = x.shape
    fns, nbytes, first = {}, 0, None
    for c in names:
        apply(c)
        if not check(variant, x, groups):
            raise SystemExit(f"{variant} {m}x{k} {c}: bytes differ from the reference")
        fns[c], nbytes = kernel_fn(variant, x, groups)
        got = run_filled(fns[c])
        if first is None:
            first = got
        elif not same_bytes(first, got):
            raise SystemExit(f"{variant} {m}x{k} {c}: the whole output differs from {names[0]}'s")
    return {"variant": variant, "M": m, "K": k, "bytes": nbytes, **ab_rounds(timer, fns, apply, rounds, nbytes, bw)}


def ab_line(row: dict, names) -> str:
    """One printed line of an A/B row: variant, M, K, then each configuration's us and % of copy."""
    return f"{row['variant']:<18} {row['M']:>7} {row['K']:>5}  " + "  ".join(
        f"{c} {row[c]['us']:7.1f} us {row[c]['pct_copy']:5.1f}%" for c in names
    )


def ab_run(args: argparse.Namespace, apply, names) -> None:
    """The A/B of a prof_quant_* script: :func:`ab_row` for every shape and variant of ``args`` (from
    :func:`ab_parser`) over the configurations ``names`` (``apply(c)`` sets c's environment), each printed, then all
    written to ``args.json``."""
    timer, bw = ab_start(args.reps)
    rows = []
    for x in ab_inputs(args.shapes):
        for v in args.variants.split(","):
            rows.append(ab_row(timer, bw, x, v, args.groups, apply, names, args.rounds))
            print(ab_line(rows[-1], names), flush=True)
    write_results(args.json, rows, bw, **{**vars(args), "json": str(args.json)})
