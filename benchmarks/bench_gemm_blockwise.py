"""Benchmark the blockwise FP8 grouped GEMMs (moe_ep.experts.sm90.blockwise_gemm) against torch on one GPU.

Shapes: benchmarks/bench_gemm.py SHAPES, (M, K, N, G) with fprop [M, K] x [G, N, K] -> [M, N], dgrad
[M, N] x W[G, N, K] -> [M, K] (the kernel reads the weight's transposed bytes data_t [G, K, N] and
scale.transpose(1, 2)), each with "uniform" (M / G rows each) and "skewed" (bench_gemm.uneven_sizes) group sizes.
The recipe's wgrad runs on the MXFP8 bf16 wgrad kernel: benchmarks/bench_wgrad_blockwise.py (the FP8 wgrad kernel
this script also timed is gone; its rows in benchmarks/results/bench_gemm_blockwise.json are from 8541feb).

Per row: tflops (2 M N K / median time), ratio_vs_bf16 (torch._grouped_mm on bf16 operands, same process, median
over interleaved rounds of the per-round ratio), ratio_vs_fp8_rowwise (torch._scaled_grouped_mm with rowwise
scales; null with the reason in meta when it does not run), quant_ms (the CUDA quantizers of the operands the GEMM
reads fresh, from moe_ep.blockwise.cuda when the tree has it; else null: meta.quant_note) and
ratio_vs_bf16_with_quant. Our kernels are checked against the reference on a slice (two groups) before timing.

--probe: the rate probe (the promotion schedule's ceiling) on a dense M = N = K = 8192 problem (one group): the
fprop kernel with its per-128 promotion vs the same mainloop without it (-DBW_NO_PROMOTE: plain FP8 wgmma
accumulation), torch bf16 matmul and torch._scaled_mm rowwise.

--smoke: small fprop / dgrad problems against the reference (exit code).

The one tuning pass (--sweep: fprop / dgrad schedules, wgrad schedules, 2-CTA multicast builds; its result is
meta.sweep of benchmarks/results/bench_gemm_blockwise.json, whose probe keys carry the _single / _cluster2 suffixes
of the two builds) lives in git history at 8541feb / f74eaac; the losing variants were deleted after it.

Usage: python benchmarks/bench_gemm_blockwise.py [--shapes dsv3_up,small] [--groups uniform,skewed]
       [--gemms fprop,dgrad] [--probe] [--smoke] [--quick] --json PATH
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import (  # noqa: E402
    SHAPES,
    interleaved_ms,
    paired_ratio,
    rowwise_fp8,
    time_ms,
    uneven_sizes,
)

from moe_ep.blockwise import reference as ref  # noqa: E402
from moe_ep.experts.sm90 import blockwise_gemm as bw  # noqa: E402


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def group_sizes(kind: str, m: int, g: int, name: str) -> list[int]:
    if kind == "uniform":
        return [m // g] * (g - 1) + [m - (m // g) * (g - 1)]
    return uneven_sizes(m, g, seed=sum(map(ord, name)))


def _quantizers():
    """(rowwise,) CUDA quantizer callables of moe_ep.blockwise.cuda, or (None, reason)."""
    try:
        from moe_ep.blockwise import cuda as bcuda  # noqa: PLC0415
    except ImportError as e:
        return None, f"moe_ep.blockwise.cuda not in this tree ({e}); quant_ms is filled in by the quantizer work"
    return (bcuda.quantize_rowwise,), None


def _setup_mm(gemm, x, dy, w, sz, offs, sizes, starts, pick, det, quant):
    """Our fprop / dgrad closure (checked on the picked groups), the torch baselines, the quantizer closure."""
    m, dev = x.shape[0], x.device
    ours, base, qfn = {}, {}, None
    src = x if gemm == "fprop" else dy
    a, a_s = ref.quantize_rowwise_torch(src)
    data, data_t, scale = ref.quantize_weight_torch(w)
    b, b_s = (data, scale) if gemm == "fprop" else (data_t, scale.transpose(1, 2))
    out = torch.empty(m, b.shape[1], dtype=torch.bfloat16, device=dev)
    ours["blockwise"] = lambda a=a, a_s=a_s, b=b, b_s=b_s, out=out: bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, out)
    # check: the picked groups' rows against the dequantized fp32 product
    ours["blockwise"]()
    errs = {}
    for gi in pick:
        r = slice(starts[gi], starts[gi + 1])
        want = (
            ref.dequantize_rowwise_torch(a[r], a_s[r])
            @ ref.dequantize_weight_torch(b[gi : gi + 1], b_s[gi : gi + 1])[0].t()
        )
        errs[f"g{gi}"] = rel_err(out[r], want)
    det["check_rel_err"] = errs
    det["check_ok"] = all(v < 5e-3 for v in errs.values())
    if gemm == "fprop":
        base["bf16"] = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    else:
        base["bf16"] = lambda: torch._grouped_mm(dy, w, offs=offs)
    try:
        if gemm == "fprop":
            af8, asc = rowwise_fp8(x)
            bf8, bsc = rowwise_fp8(w)
        else:
            af8, asc = rowwise_fp8(dy)
            bf8, bsc = rowwise_fp8(w.transpose(1, 2).contiguous())
        base["fp8_rowwise"] = lambda: torch._scaled_grouped_mm(
            af8, bf8.transpose(-2, -1), asc, bsc, offs=offs, out_dtype=torch.bfloat16
        )
    except Exception as e:  # noqa: BLE001
        det["fp8_rowwise_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if quant is not None:
        qfn = lambda src=src: quant[0](src)  # noqa: E731  (the activation: the weight is cached)
    return ours, base, qfn


def run_case(name, kind, gemms, args, rows, details, quant):
    m, k, n, g = SHAPES[name]
    dev = "cuda"
    sizes = group_sizes(kind, m, g, name)
    sz = torch.tensor(sizes, dtype=torch.int32, device=dev)
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    w = (torch.randn(g, n, k, generator=gen, device=dev) * 0.02).bfloat16()
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    nonempty = [i for i in range(g) if sizes[i]]
    pick = sorted({nonempty[0], max(nonempty, key=lambda i: sizes[i])})

    for gemm in gemms:
        key = f"{name}/{kind}/{gemm}"
        det = {"M": m, "K": k, "N": n, "G": g, "sizes": sizes}
        flops = 2.0 * m * n * k
        try:
            ours, base, qfn = _setup_mm(gemm, x, dy, w, sz, offs, sizes, starts, pick, det, quant)
        except Exception as e:  # noqa: BLE001
            det["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"[{key}] ERROR {det['error']}", flush=True)
            details[key] = det
            rows.append(_row(name, kind, gemm, None, None, None, None, None))
            continue
        print(f"[{key}] check {'ok' if det['check_ok'] else 'FAILED'} {det['check_rel_err']}", flush=True)
        if not det["check_ok"] and not args.keep_going:
            ours = {kk: None for kk in ours}
        errors: dict[str, str] = {}
        fns = {**ours, **base}
        times = interleaved_ms(fns, args.rounds, args.warmup, args.reps, errors)
        det["errors"] = errors
        med = {kk: statistics.median(v) for kk, v in times.items() if v}
        det["ms"] = med
        det["tflops_all"] = {kk: flops / v / 1e9 for kk, v in med.items()}
        quant_ms = None
        if qfn is not None:
            try:
                quant_ms = time_ms(qfn, args.warmup, args.reps)
            except Exception as e:  # noqa: BLE001
                det["quant_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "blockwise" not in med:
            rows.append(_row(name, kind, gemm, None, None, None, quant_ms, None))
        else:
            tf = flops / med["blockwise"] / 1e9
            r16 = paired_ratio(times["bf16"], times["blockwise"]) if times.get("bf16") else None
            r8 = paired_ratio(times["fp8_rowwise"], times["blockwise"]) if times.get("fp8_rowwise") else None
            rq = med["bf16"] / (med["blockwise"] + quant_ms) if quant_ms is not None and "bf16" in med else None
            rows.append(_row(name, kind, gemm, tf, r16, r8, quant_ms, rq))
        print(f"[{key}] " + ", ".join(f"{kk} {v:.0f} TFLOP/s" for kk, v in det["tflops_all"].items()), flush=True)
        details[key] = det
        del ours, base, fns
        torch.cuda.empty_cache()


def _row(shape, groups, gemm, tflops, r16, r8, quant_ms, rq):
    return {
        "shape": shape,
        "groups": groups,
        "gemm": gemm,
        "tflops": tflops,
        "ratio_vs_bf16": r16,
        "ratio_vs_fp8_rowwise": r8,
        "quant_ms": quant_ms,
        "ratio_vs_bf16_with_quant": rq,
    }


def run_probe(args) -> dict:
    """Dense 8192^3 rates: promotion vs none, torch bf16 and _scaled_mm rowwise (TFLOP/s)."""
    s = 8192
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(s, s, generator=gen, device=dev)
    w = torch.randn(1, s, s, generator=gen, device=dev) * 0.02
    a, a_s = ref.quantize_rowwise_torch(x)
    b, _, b_s = ref.quantize_weight_torch(w)
    sz = torch.tensor([s], dtype=torch.int32, device=dev)
    out = torch.empty(s, s, dtype=torch.bfloat16, device=dev)
    flops = 2.0 * s**3
    res: dict = {"shape": [s, s, s], "note": "TFLOP/s, median of CUDA-event times"}
    fns = {
        "fp8_blockwise_promote": lambda: bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, out),
        "fp8_no_promote": lambda: bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, out, _options=("-DBW_NO_PROMOTE",)),
    }
    xb, wb = x.bfloat16(), w[0].bfloat16()
    fns["torch_bf16_matmul"] = lambda: xb @ wb.t()
    try:
        xf8, xsc = rowwise_fp8(xb)
        wf8, wsc = rowwise_fp8(wb)
        fns["torch_scaled_mm_rowwise"] = lambda: torch._scaled_mm(
            xf8, wf8.t(), xsc[:, None], wsc[None, :], out_dtype=torch.bfloat16
        )
    except Exception as e:  # noqa: BLE001
        res["scaled_mm_error"] = f"{type(e).__name__}: {e}"
    errors: dict[str, str] = {}
    times = interleaved_ms(fns, args.rounds, args.warmup, args.reps, errors)
    res["tflops"] = {kk: flops / statistics.median(v) / 1e9 for kk, v in times.items() if v}
    res["errors"] = errors
    tf = res["tflops"]
    if "fp8_blockwise_promote" in tf and "fp8_no_promote" in tf:
        res["promotion_cost"] = 1.0 - tf["fp8_blockwise_promote"] / tf["fp8_no_promote"]
    print(f"[probe] {res}", flush=True)
    return res


def run_smoke() -> bool:
    """Small fprop / dgrad problems against the reference (exit code for scripts)."""
    ok = True
    sizes = [0, 130, 1, 0, 300, 0]
    m, k, n = 512, 512, 256
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, generator=gen, device="cuda")
    w = torch.randn(len(sizes), n, k, generator=gen, device="cuda") * 0.02
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    a, a_s = ref.quantize_rowwise_torch(x)
    data, data_t, scale = ref.quantize_weight_torch(w)
    dy, dy_s = ref.quantize_rowwise_torch(torch.randn(m, n, generator=gen, device="cuda"))
    for what, args in (("fprop", (a, a_s, data, scale)), ("dgrad", (dy, dy_s, data_t, scale.transpose(1, 2)))):
        want = ref.grouped_mm_torch(*args, sizes)[: sum(sizes)]
        out = torch.empty(m, args[2].shape[1], dtype=torch.bfloat16, device="cuda")
        got = bw.grouped_mm_blockwise_out(*args, sz, out)[: sum(sizes)]
        torch.cuda.synchronize()
        e = rel_err(got, want)
        ok &= e < 5e-3
        print(f"[smoke] {what}: rel err {e:.2e}", flush=True)
    return bool(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--groups", default="uniform,skewed")
    ap.add_argument("--gemms", default="fprop,dgrad")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="only the small checks against the reference (exit code)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep-going", action="store_true", help="time our kernels even if the check fails")
    args = ap.parse_args()
    args.warmup, args.reps = (2, 6) if args.quick else (5, 20)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        raise SystemExit(0 if run_smoke() else 1)
    from launch.provenance import code_version  # noqa: PLC0415

    quant, qnote = _quantizers()
    meta = {
        "device": torch.cuda.get_device_name(),
        "commit": code_version(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {"warmup": args.warmup, "reps": args.reps, "rounds": args.rounds},
        "shapes": {kk: SHAPES[kk] for kk in args.shapes.split(",") if kk},
        "shape_convention": "(M, K, N, G): fprop [M,K]x[G,N,K]->[M,N]; dgrad [M,N]xW->[M,K]",
        "quant_note": qnote or "quant_ms: moe_ep.blockwise.cuda quantizers of the GEMM's fresh activation operands",
        "details": {},
    }
    rows: list = []
    result = {"meta": meta, "results": rows, "probe": {}}

    def dump():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if args.probe:
        try:
            result["probe"] = run_probe(args)
        except Exception as e:  # noqa: BLE001
            result["probe"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        torch.cuda.empty_cache()
        dump()
    for name in [s for s in args.shapes.split(",") if s]:
        for kind in [s for s in args.groups.split(",") if s]:
            run_case(name, kind, [s for s in args.gemms.split(",") if s], args, rows, meta["details"], quant)
            torch.cuda.empty_cache()
            dump()
    print(f"\n{meta['device']}  torch {meta['torch']}")
    print(f"{'shape':<10} {'groups':<8} {'gemm':<6} {'TFLOP/s':>8} {'x bf16':>7} {'x fp8rw':>8}")
    for r in rows:
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(
            f"{r['shape']:<10} {r['groups']:<8} {r['gemm']:<6} {f(r['tflops'], '8.0f'):>8} "
            f"{f(r['ratio_vs_bf16'], '7.2f'):>7} {f(r['ratio_vs_fp8_rowwise'], '8.2f'):>8}"
        )
    dump()


if __name__ == "__main__":
    main()
