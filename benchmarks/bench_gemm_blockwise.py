"""Benchmark the blockwise FP8 grouped GEMMs (moe_ep.experts.sm90.blockwise_gemm) against torch on one GPU.

Shapes: benchmarks/bench_gemm.py SHAPES, (M, K, N, G) with fprop [M, K] x [G, N, K] -> [M, N], dgrad
[M, N] x W[G, N, K] -> [M, K] (the kernel reads the weight's transposed bytes data_t [G, K, N] and
scale.transpose(1, 2)), wgrad dW[g] = dY_g^T X_g -> [G, N, K] (fp32, the contract's output; bf16-output times
in meta.details), each with "uniform" (M / G rows each) and "skewed" (bench_gemm.uneven_sizes) group sizes.

Per row: tflops (2 M N K / median time), ratio_vs_bf16 (torch._grouped_mm on bf16 operands, same process, median
over interleaved rounds of the per-round ratio), ratio_vs_fp8_rowwise (torch._scaled_grouped_mm with rowwise
scales; null with the reason in meta when it does not run), quant_ms (the CUDA quantizers of the operands the GEMM
reads fresh, from moe_ep.blockwise.cuda when the tree has it; else null: meta.quant_note) and
ratio_vs_bf16_with_quant. Our kernels are checked against the reference on a slice (two groups) before timing.

--sweep ENVFILE: the one tuning pass -- each kernel's candidate schedules (fprop / dgrad: BW_PIPE 0 / 1 / 2, single CTA
or 2-CTA multicast with the cluster grid from cuOccupancyMaxActiveClusters or forced to 60 / 64 clusters; wgrad:
WB_PIPE 1 / 2, single or multicast), each checked first, then timed on a grouped shape with short per-tile
reductions; the winners go to ENVFILE as exports (MOE_EP_BW_PIPE, ...) for the test and benchmark runs.

--probe: the rate probe (the promotion schedule's ceiling) on a dense M = N = K = 8192 problem (one group): the
fprop kernel with its per-128 promotion vs the same mainloop without it (-DBW_NO_PROMOTE: plain FP8 wgmma
accumulation), the wgrad kernel (two-sided promotion), torch bf16 matmul and torch._scaled_mm rowwise.

Usage: python benchmarks/bench_gemm_blockwise.py [--shapes dsv3_up,small] [--groups uniform,skewed]
       [--gemms fprop,dgrad,wgrad] [--probe] [--quick] --json PATH
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
    rowwise_fp8_grouped_cols,
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
    """(rowwise, colwise) CUDA quantizer callables of moe_ep.blockwise.cuda, or (None, reason)."""
    try:
        from moe_ep.blockwise import cuda as bcuda  # noqa: PLC0415
    except ImportError as e:
        return None, f"moe_ep.blockwise.cuda not in this tree ({e}); quant_ms is filled in by the quantizer work"
    row = getattr(bcuda, "quantize_rowwise", None)
    col = getattr(bcuda, "quantize_colwise_grouped", None)
    if row is None or col is None:
        return None, "moe_ep.blockwise.cuda has no quantize_rowwise / quantize_colwise_grouped"
    return (row, col), None


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
    # the other build (single CTA or 2-CTA multicast: the one bw.MULTICAST does not pick), in meta.details only
    ours["blockwise_other_build"] = lambda: bw.grouped_mm_blockwise_out(
        a, a_s, b, b_s, sz, out, _multicast=not bw.MULTICAST
    )
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


def _setup_wgrad(x, dy, sz, offs, sizes, pick, det, quant):
    """Our wgrad closures (fp32 and bf16 output; checked on the picked groups), the baselines, the quantizers."""
    g, n, k, dev = len(sizes), dy.shape[1], x.shape[1], x.device
    ours, base, qfn = {}, {}, None
    a_t, a_st = ref.quantize_colwise_grouped_torch(dy, sizes)
    b_t, b_st = ref.quantize_colwise_grouped_torch(x, sizes)
    out = torch.empty(g, n, k, dtype=torch.float32, device=dev)
    out16 = torch.empty(g, n, k, dtype=torch.bfloat16, device=dev)
    ours["blockwise"] = lambda: bw.grouped_wgrad_blockwise_out(a_t, a_st, b_t, b_st, sz, out)
    ours["blockwise_bf16out"] = lambda: bw.grouped_wgrad_blockwise_out(a_t, a_st, b_t, b_st, sz, out16)
    ours["blockwise_other_build"] = lambda: bw.grouped_wgrad_blockwise_out(
        a_t, a_st, b_t, b_st, sz, out, _multicast=not bw.WGRAD_MULTICAST
    )
    ours["blockwise"]()
    offp = ref.padded_group_offsets(sizes)
    errs = {}
    for gi in pick:
        c = slice(offp[gi], offp[gi + 1])
        da = ref.dequantize_rowwise_torch(a_t[:, c], a_st[c.start // 128 : c.stop // 128].t())
        db = ref.dequantize_rowwise_torch(b_t[:, c], b_st[c.start // 128 : c.stop // 128].t())
        errs[f"g{gi}"] = rel_err(out[gi], da @ db.t())
    det["check_rel_err"] = errs
    # fp32 output vs an fp32 matmul of the dequantized operands: the FP8 tensor cores' in-block accumulation keeps
    # ~14 bits (tests/test_blockwise_gemm.py), a ~1.2e-4 relative error on random data; index or scale bugs give O(1)
    det["check_ok"] = all(v < 1e-3 for v in errs.values())
    dyt = dy.t().contiguous()
    base["bf16"] = lambda: torch._grouped_mm(dyt, x, offs=offs)
    try:
        dytf8, dytsc = rowwise_fp8_grouped_cols(dyt, sizes)
        xtf8, xtsc = rowwise_fp8_grouped_cols(x.t().contiguous(), sizes)
        base["fp8_rowwise"] = lambda: torch._scaled_grouped_mm(
            dytf8, xtf8.t(), dytsc, xtsc, offs=offs, out_dtype=torch.bfloat16
        )
    except Exception as e:  # noqa: BLE001
        det["fp8_rowwise_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if quant is not None:
        qfn = lambda: (quant[1](dy, sz), quant[1](x, sz))  # noqa: E731
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
            if gemm in ("fprop", "dgrad"):
                ours, base, qfn = _setup_mm(gemm, x, dy, w, sz, offs, sizes, starts, pick, det, quant)
            else:
                ours, base, qfn = _setup_wgrad(x, dy, sz, offs, sizes, pick, det, quant)
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
    """Dense 8192^3 rates: promotion vs none, wgrad, torch bf16 and _scaled_mm rowwise (TFLOP/s)."""
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
    fns = {}
    for mc in (False, True):
        tag = "cluster2" if mc else "single"
        fns[f"fp8_blockwise_promote_{tag}"] = lambda mc=mc: bw.grouped_mm_blockwise_out(
            a, a_s, b, b_s, sz, out, _multicast=mc
        )
        fns[f"fp8_no_promote_{tag}"] = lambda mc=mc: bw.grouped_mm_blockwise_out(
            a, a_s, b, b_s, sz, out, _options=("-DBW_NO_PROMOTE",), _multicast=mc
        )
    cols = ref.colwise_cols(s, 1)
    a_t, a_st = ref.quantize_colwise_grouped_torch(x, [s], cols)
    b_t, b_st = ref.quantize_colwise_grouped_torch(w[0].t().contiguous(), [s], cols)
    wout = torch.empty(1, s, s, dtype=torch.float32, device=dev)
    for mc in (False, True):
        fns[f"fp8_wgrad_promote_f32out_{'cluster2' if mc else 'single'}"] = lambda mc=mc: (
            bw.grouped_wgrad_blockwise_out(a_t, a_st, b_t, b_st, sz, wout, _multicast=mc)
        )
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
    for tag in ("single", "cluster2"):
        if f"fp8_blockwise_promote_{tag}" in tf and f"fp8_no_promote_{tag}" in tf:
            res[f"promotion_cost_{tag}"] = 1.0 - tf[f"fp8_blockwise_promote_{tag}"] / tf[f"fp8_no_promote_{tag}"]
    print(f"[probe] {res}", flush=True)
    return res


SWEEP_FPROP = [  # (pipe, multicast, clusters override or None)
    (0, False, None),
    (1, False, None),
    (2, False, None),
    (0, True, None),
    (2, True, None),
    (0, True, 60),
    (0, True, 64),
]
SWEEP_WGRAD = [(1, False, None), (2, False, None), (2, True, None), (1, True, None)]


def _set_config(gemm: str, pipe: int, mc: bool, clusters) -> None:
    if gemm == "fprop":
        bw.FPROP_PIPE, bw.MULTICAST = pipe, mc
    else:
        bw.WGRAD_PIPE, bw.WGRAD_MULTICAST = pipe, mc
    bw._CLUSTERS_ENV = None if clusters is None else str(clusters)


def run_sweep(args, env_path: str) -> dict:
    """One tuning pass: every candidate schedule of each kernel, first checked (run_smoke's problems), then timed
    on a grouped shape with short per-tile reductions and on the dense 8192^3 probe; the fastest correct one on
    the grouped shape wins and is written to env_path as shell exports."""
    res: dict = {"fprop": [], "wgrad": []}
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    # fprop: dsv3_down-like (16 groups of 1024 rows, K 2048, N 7168): 16 blocks per tile
    m, k, n, g = 16384, 2048, 7168, 16
    sz = torch.tensor([m // g] * g, dtype=torch.int32, device=dev)
    a, a_s = ref.quantize_rowwise_torch(torch.randn(m, k, generator=gen, device=dev))
    b, _, b_s = ref.quantize_weight_torch(torch.randn(g, n, k, generator=gen, device=dev) * 0.02)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    s = 8192
    da, da_s = ref.quantize_rowwise_torch(torch.randn(s, s, generator=gen, device=dev))
    db, _, db_s = ref.quantize_weight_torch(torch.randn(1, s, s, generator=gen, device=dev) * 0.02)
    dsz = torch.tensor([s], dtype=torch.int32, device=dev)
    dout = torch.empty(s, s, dtype=torch.bfloat16, device=dev)
    for pipe, mc, cl in SWEEP_FPROP:
        _set_config("fprop", pipe, mc, cl)
        row = {"pipe": pipe, "multicast": mc, "clusters": cl}
        try:
            row["ok"] = run_smoke(("fprop", "dgrad"), (mc,))
            row["grouped_tflops"] = (
                2.0 * m * n * k / time_ms(lambda: bw.grouped_mm_blockwise_out(a, a_s, b, b_s, sz, out), 3, 10) / 1e9
            )
            row["dense_tflops"] = (
                2.0 * s**3 / time_ms(lambda: bw.grouped_mm_blockwise_out(da, da_s, db, db_s, dsz, dout), 3, 10) / 1e9
            )
        except Exception as e:  # noqa: BLE001
            row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
        print(f"[sweep] fprop {row}", flush=True)
        res["fprop"].append(row)
    a = b = out = da = db = dout = None  # free the fprop operands before the wgrad ones
    torch.cuda.empty_cache()
    # wgrad: dsv3_up-like (16 groups of 1024 tokens, N 4096, K 7168): 8 blocks per tile, fp32 output
    m, n, k, g = 16384, 4096, 7168, 16
    sizes = [m // g] * g
    sz = torch.tensor(sizes, dtype=torch.int32, device=dev)
    a_t, a_st = ref.quantize_colwise_grouped_torch(torch.randn(m, n, generator=gen, device=dev), sizes)
    b_t, b_st = ref.quantize_colwise_grouped_torch(torch.randn(m, k, generator=gen, device=dev), sizes)
    wout = torch.empty(g, n, k, device=dev)
    for pipe, mc, cl in SWEEP_WGRAD:
        _set_config("wgrad", pipe, mc, cl)
        row = {"pipe": pipe, "multicast": mc, "clusters": cl}
        try:
            row["ok"] = run_smoke(("wgrad",), (mc,))
            row["grouped_tflops"] = (
                2.0
                * m
                * n
                * k
                / time_ms(lambda: bw.grouped_wgrad_blockwise_out(a_t, a_st, b_t, b_st, sz, wout), 3, 10)
                / 1e9
            )
        except Exception as e:  # noqa: BLE001
            row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
        print(f"[sweep] wgrad {row}", flush=True)
        res["wgrad"].append(row)
    exports = []
    for gemm, names in (
        ("fprop", ("MOE_EP_BW_PIPE", "MOE_EP_BW_MULTICAST")),
        ("wgrad", ("MOE_EP_WB_PIPE", "MOE_EP_WB_MULTICAST")),
    ):
        good = [r for r in res[gemm] if r.get("ok") and "grouped_tflops" in r]
        best = (
            max(good, key=lambda r: r["grouped_tflops"])
            if good
            else {"pipe": 0 if gemm == "fprop" else 1, "multicast": False, "clusters": None}
        )
        res[f"{gemm}_choice"] = best
        exports += [f"export {names[0]}={best['pipe']}", f"export {names[1]}={int(best['multicast'])}"]
        if gemm == "fprop" and best.get("clusters") is not None:
            exports.append(f"export MOE_EP_BW_CLUSTERS={best['clusters']}")
    with open(env_path, "w") as f:
        f.write("\n".join(exports) + "\n")
    print(f"[sweep] chose: {exports}", flush=True)
    return res


def run_smoke(gemms=("fprop", "dgrad", "wgrad"), builds=(False, True)) -> bool:
    """Small fprop / dgrad / wgrad problems through both builds against the reference (exit code for scripts)."""
    ok = True
    sizes = [0, 130, 1, 0, 300, 0]
    m, k, n = 512, 512, 256  # even tile counts (N / 128, K / 128): the cluster builds run as such
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, generator=gen, device="cuda")
    w = torch.randn(len(sizes), n, k, generator=gen, device="cuda") * 0.02
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    a, a_s = ref.quantize_rowwise_torch(x)
    data, data_t, scale = ref.quantize_weight_torch(w)
    dy, dy_s = ref.quantize_rowwise_torch(torch.randn(m, n, generator=gen, device="cuda"))
    for mc in builds:
        for what, args in (("fprop", (a, a_s, data, scale)), ("dgrad", (dy, dy_s, data_t, scale.transpose(1, 2)))):
            if what not in gemms:
                continue
            want = ref.grouped_mm_torch(*args, sizes)[: sum(sizes)]
            out = torch.empty(m, args[2].shape[1], dtype=torch.bfloat16, device="cuda")
            got = bw.grouped_mm_blockwise_out(*args, sz, out, _multicast=mc)[: sum(sizes)]
            torch.cuda.synchronize()
            e = rel_err(got, want)
            ok &= e < 5e-3
            print(f"[smoke] {what} multicast={mc}: rel err {e:.2e}", flush=True)
        if "wgrad" not in gemms:
            continue
        a_t, a_st = ref.quantize_colwise_grouped_torch(torch.randn(m, n, generator=gen, device="cuda"), sizes)
        b_t, b_st = ref.quantize_colwise_grouped_torch(x, sizes)
        want = ref.grouped_wgrad_torch(a_t, a_st, b_t, b_st, sizes)
        got = torch.empty(len(sizes), n, k, device="cuda")
        bw.grouped_wgrad_blockwise_out(a_t, a_st, b_t, b_st, sz, got, _multicast=mc)
        torch.cuda.synchronize()
        e = rel_err(got, want)
        ok &= e < 1e-3
        print(f"[smoke] wgrad multicast={mc}: rel err {e:.2e}", flush=True)
    return bool(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--groups", default="uniform,skewed")
    ap.add_argument("--gemms", default="fprop,dgrad,wgrad")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="only the small checks of both builds (exit code)")
    ap.add_argument("--sweep", default=None, help="run the tuning sweep only; write the winners' exports here")
    ap.add_argument("--attach-sweep", default=None, help="a --sweep --json result to embed as meta.sweep")
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
    if args.sweep:
        res = run_sweep(args, args.sweep)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    from moe_ep.provenance import code_version  # noqa: PLC0415

    quant, qnote = _quantizers()
    meta = {
        "device": torch.cuda.get_device_name(),
        "commit": code_version(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {"warmup": args.warmup, "reps": args.reps, "rounds": args.rounds},
        "shapes": {kk: SHAPES[kk] for kk in args.shapes.split(",") if kk},
        "shape_convention": "(M, K, N, G): fprop [M,K]x[G,N,K]->[M,N]; dgrad [M,N]xW->[M,K]; wgrad -> [G,N,K] fp32",
        "kernel_config": {
            "fprop_dgrad_multicast": bw.MULTICAST,
            "fprop_dgrad_pipe": bw.FPROP_PIPE,
            "wgrad_multicast": bw.WGRAD_MULTICAST,
            "wgrad_pipe": bw.WGRAD_PIPE,
            "clusters_override": os.environ.get("MOE_EP_BW_CLUSTERS"),
        },
        "quant_note": qnote or "quant_ms: moe_ep.blockwise.cuda quantizers of the GEMM's fresh activation operands",
        "details": {},
    }
    if args.attach_sweep and os.path.exists(args.attach_sweep):
        with open(args.attach_sweep) as f:
            meta["sweep"] = json.load(f)
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
