"""Tile order of the transposed column outputs (fused and col_blocked): banded order against mx_quant's
column-tile-fastest order, as a no-arithmetic probe.

The transposed output xt [K, M] gets one 128-byte segment per xt row and tile. In mx_quant's order (column tile
fastest) the CTAs running together cover ~CTAs / ctiles row tiles, so each xt row gets only a few adjacent segments
at a time, while x and the row output get long runs. A band of B row tiles taken row tile fastest gives xt rows
B x 128-byte segments written together, and x / the row output runs of (CTAs / B) x 256 / 128 bytes. Question: is
the 84-88 % ceiling of the fused traffic (NOTES pass 6) a property of the order?

``probe_fused_band`` (kernels/bench_probe.cu) runs over bands, for the fused traffic and the xt stores alone.
The same bands in the kernel itself (fused and col_blocked; a compile-time MX_BAND in kernels/quantize.cu,
every build's bytes equal to band 1 on the whole input) were measured at commit 73f2181 with this script's
``--kbands`` part; that switch was removed when it gained nothing (benchmarks/NOTES.md, "Pass 7"), and so was the
part: ``results/prof_quant_band_h200.json`` holds both.

Usage: python benchmarks/prof_quant_band.py [--bands 1,4,8,16,32,0] [--rounds 3] [--json P]
(band 0 = all row tiles in one band: column-major order)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_quant import Timer, copy_bandwidth, probe_tiles, write_results  # noqa: E402

from moe_ep import _cuda  # noqa: E402

SHAPES = [(16384, 2048), (16384, 7168), (32768, 2048), (32768, 7168), (131072, 2048), (131072, 7168)]


def probe(timer: Timer, x: torch.Tensor, band: int, xt_only: bool) -> float:
    """Bytes/s of probe_fused_band; checks the row bytes (fused traffic)."""
    m, k = x.shape
    ctiles, rtiles = probe_tiles(x, "probe_fused_band")
    out = torch.zeros(m, k, dtype=torch.uint8, device=x.device)
    outt = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    b = rtiles if band <= 0 else band
    fn_k = _cuda.get_function("bench_probe.cu", "probe_fused_band")
    args = (
        _cuda.ptr(x),
        _cuda.ptr(out),
        _cuda.ptr(outt),
        _cuda.i64(m),
        _cuda.i32(k),
        _cuda.i32(ctiles),
        _cuda.i32(b),
        _cuda.i32(int(xt_only)),
    )
    fn = lambda: _cuda.launch(fn_k, rtiles * ctiles, 256, args)
    fn()
    torch.cuda.synchronize()
    if not xt_only and not torch.equal(out, x.view(torch.uint8).view(m, k, 2)[..., 0]):
        raise AssertionError(f"probe_fused_band band {band} wrote wrong row bytes")
    return (3 if xt_only else 4) * m * k / (timer(fn) * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bands", default="1,4,8,16,32,0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bands = [int(b) for b in args.bands.split(",") if b]
    timer = Timer(args.reps, warmup=3)
    copy_bw = copy_bandwidth(timer)
    print(f"device {torch.cuda.get_device_name()}  copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.float32).mul_(4.0).to(torch.bfloat16)
        pr = {}
        for xt_only in (False, True):
            for b in bands:
                pr[(xt_only, b)] = []
        for _ in range(args.rounds):
            for key in pr:
                pr[key].append(probe(timer, x, key[1], key[0]))
        for (xt_only, b), v in pr.items():
            bw = statistics.median(v)
            rows.append(
                {
                    "traffic": "xt_only" if xt_only else "fused",
                    "band": b,
                    "M": m,
                    "K": k,
                    "GBps": bw / 1e9,
                    "pct_copy": 100 * bw / copy_bw,
                }
            )
        print(
            f"{m}x{k} probe fused  "
            + "  ".join(f"b{b}:{100 * statistics.median(pr[(False, b)]) / copy_bw:.1f}" for b in bands),
            flush=True,
        )
        print(
            f"{m}x{k} probe xtonly "
            + "  ".join(f"b{b}:{100 * statistics.median(pr[(True, b)]) / copy_bw:.1f}" for b in bands),
            flush=True,
        )
        del x
        torch.cuda.empty_cache()
    write_results(args.json, rows, copy_bw, bands=bands, rounds=args.rounds, reps=args.reps)


if __name__ == "__main__":
    main()
