"""Does mx_quant_dual's thread mapping cost memory bandwidth? No-arithmetic probes of the grouped-dual traffic
(read bf16, write two row-major byte outputs) under the kernel's mapping and probe_tile's, next to the kernel.

mx_quant_dual (kernels/quant_dual.cuh) gives each thread 8 rows of one 16-byte chunk: one warp store writes 4 rows x
64 bytes (half lines, the other halves come from warp w ^ 4), one warp cp.async reads 4 rows x 128 bytes. The probe
that reaches 88-95 % of copy on this traffic (probe_fused order 3) writes 2 full lines and reads 2 rows x 256 bytes
per warp instruction. ``probe_dual`` (kernels/bench_probe.cu) separates the two sides (mode 0: both as the kernel,
1: the kernel's loads with full-line stores, 2: full-line loads with the kernel's stores, 6: both full-line, at
probe_dual's own occupancy (probe_fused order 3 runs 2 CTAs per SM, probe_dual 4); 3-5: the loads through
shared memory as 16-byte cp.async in either mapping or one cp.async.bulk per tile row). row_blocked (mx_quant,
cp.async; pipe 3 when this was written, pipe 4 since NOTES pass 10) is timed alongside for reference; both kernels
through bench_quant.kernel_fn, after bench_quant.check.

Usage: python benchmarks/prof_quant_dual_map.py [--rounds 3] [--shapes 16384x2048,...] [--json PATH] [--ncu]
(--ncu: 32768x7168, each kernel twice after the byte-check launches of the probes and the two kernels, for a
profiler run with -k regex:'probe_|mx_quant')
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

from bench_quant import Timer, check, copy_bandwidth, kernel_fn, probe_tiles, write_results  # noqa: E402

from moe_ep import _cuda  # noqa: E402

SHAPES = [(16384, 2048), (16384, 7168), (32768, 2048), (32768, 7168), (131072, 2048), (131072, 7168)]
GROUPS = 32


def closures(x: torch.Tensor) -> dict:
    """{name: (closure, bytes)}: the probe_dual modes and probe_fused order 3 (``tile_tile``), each checked to write
    x's low bytes where it stores them, and the kernels grouped_dual and row_blocked as bench_quant times them
    (bench_quant's group sizes), checked against the reference first."""
    m, k = x.shape
    ctiles, rtiles = probe_tiles(x, "probe_dual / probe_fused")
    out = torch.zeros(m, k, dtype=torch.uint8, device=x.device)
    out2 = torch.zeros(m, k, dtype=torch.uint8, device=x.device)
    common = (_cuda.ptr(x), _cuda.ptr(out), _cuda.ptr(out2), _cuda.i64(m), _cuda.i32(k), _cuda.i32(ctiles))
    dual = _cuda.get_function("bench_probe.cu", "probe_dual")
    fused = _cuda.get_function("bench_probe.cu", "probe_fused")
    res = {}
    modes = (
        (0, "dual_dual"),
        (1, "dual_load_tile_store"),
        (2, "tile_load_dual_store"),
        (3, "cpasync16_dual"),
        (4, "bulk_rows_dual"),
        (5, "cpasync16_tile"),
        (6, "tile_tile_same_kernel"),
    )
    for mode, name in modes:
        res[name] = (
            lambda mode=mode: _cuda.launch(dual, rtiles * ctiles, 256, (*common, _cuda.i32(mode))),
            4 * m * k,
        )
    res["tile_tile"] = (lambda: _cuda.launch(fused, rtiles * ctiles, 256, (*common, _cuda.i32(3))), 4 * m * k)
    want = x.view(torch.uint8).view(m, k, 2)[..., 0]
    exact = ("dual_dual", "tile_tile", "cpasync16_dual", "bulk_rows_dual", "cpasync16_tile", "tile_tile_same_kernel")
    for name in exact:  # the modes whose bytes are x's low bytes
        out.zero_()
        out2.zero_()
        res[name][0]()
        torch.cuda.synchronize()
        if not (torch.equal(out, want) and torch.equal(out2, want)):
            raise AssertionError(f"probe {name} wrote wrong bytes")
    for v in ("grouped_dual", "row_blocked"):  # the kernels as bench_quant times them, checked first
        if not check(v, x, GROUPS):
            raise AssertionError(f"{v} wrote wrong bytes")
        res[f"kernel_{v}"] = kernel_fn(v, x, GROUPS)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES), help="MxK,MxK,...")
    args = ap.parse_args()
    if args.ncu:
        x = torch.randn(32768, 7168, device="cuda").mul_(4.0).to(torch.bfloat16)
        for name, (fn, _) in closures(x).items():
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            print(f"ncu: {name} launched", flush=True)
        return
    timer = Timer(args.reps, warmup=3)
    copy_bw = copy_bandwidth(timer)
    print(f"device {torch.cuda.get_device_name()}  copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for m, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.float32).mul_(4.0).to(torch.bfloat16)
        cl = closures(x)
        ts = {n: [] for n in cl}
        for _ in range(args.rounds):
            for n, (fn, _) in cl.items():
                ts[n].append(timer(fn))
        line = []
        for n, (_, nbytes) in cl.items():
            t = statistics.median(ts[n])
            pct = 100 * nbytes / (t * 1e-3) / copy_bw
            rows.append({"name": n, "M": m, "K": k, "ms": t, "ms_rounds": ts[n], "bytes": nbytes, "pct_copy": pct})
            line.append(f"{n}:{pct:.1f}")
        print(f"{m}x{k} " + "  ".join(line), flush=True)
        del x, cl
        torch.cuda.empty_cache()
    write_results(args.json, rows, copy_bw, rounds=args.rounds, reps=args.reps, shapes=args.shapes)


if __name__ == "__main__":
    main()
