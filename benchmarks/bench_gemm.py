"""Benchmark the MXFP8 grouped GEMMs (moe_ep.experts.sm90.gemm) against torch's grouped GEMMs on the same shapes.

For every shape (random uneven group sizes, fixed seed) and variant (fprop, dgrad, wgrad) it first checks the
kernel against the dequantize + fp32 matmul reference on a subsample, then times (CUDA events, median of --reps;
--rounds interleaved rounds, TFLOP/s from the median round, ratio = median over rounds of the same round's torch
bf16 time over ours) and reports TFLOP/s (2*M*N*K / time) for:
  mxfp8         our fprop / dgrad kernels (moe_ep.experts.sm90.gemm) with the bf16 weight prepared once, outside the
                timing (see "prepare_weight" for that pass)
  mxfp8_prepared  our wgrad (bf16 output) on the operands as the quantizer writes them, already prepared
                (quantize_grouped_dual); the quantizer's time for dY and X is in "colwise_producer_ms"
                Our kernels are checked first; if the check fails (or raises) the script stops (--keep-going: the
                failure is reported and they are not timed).
  bf16          torch._grouped_mm on bf16 operands (offs = cumsum int32) -- the reference point for ratios
  deq+bf16      dequantize the MXFP8 operands to bf16, then torch._grouped_mm
  fp8_rowwise   torch._scaled_grouped_mm with fp8 e4m3 operands and per-row fp32 scales (errors recorded)

Weight preparation (``--weight-prep``, per weight version; W13 [E, 2F, H] and W2 [E, H, F] bf16 of WEIGHT_SHAPES):
  fused         prepare_weight_operands: both prepared bf16 operands from one read of W (6 B per element)
  two_step      the path it replaced: quantize_weights_fused (both e4m3 copies + scales), then prepare_weight_bf16 of
                each (about 10 B per element)
  copy          the ceiling: one torch copy moving the same bytes, W read once and written twice (an expanded copy
                into [E, N, 2, K]); copy_flat: a plain copy of the same byte count, for reference
Checked first (fused == two_step byte for byte); times are the median over --rounds interleaved rounds of the median
of --reps; reported as ms, GB/s (each path's own bytes) and % of the copy's GB/s.

Usage: python benchmarks/bench_gemm.py [--quick] [--json PATH] [--shapes dsv3_up,small] [--no-check]
       python benchmarks/bench_gemm.py --shapes "" --weight-prep dsv3,small --json PATH   (weight preparation only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_ep import mxfp8  # noqa: E402
from moe_ep.experts.sm90 import gemm as gemm_cuda  # noqa: E402
from moe_ep.experts.sm90 import operands  # noqa: E402
from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: E402
from tests import refs  # noqa: E402

SHAPES = {  # name: (M, K, N, G) -- fprop [M, K] x [G, N, K] -> [M, N]
    "dsv3_up": (32768, 7168, 4096, 32),
    "dsv3_down": (32768, 2048, 7168, 32),
    "small": (32768, 2048, 1536, 16),
    "llama4": (16384, 5120, 8192, 4),
}


IMPL = "mxfp8"  # the name of our kernels in the results (variants, check_rel_err, check_ok, impls)

WEIGHT_SHAPES = {  # name: (E local experts, H, F): W13 [E, 2F, H], W2 [E, H, F]
    "dsv3": (64, 7168, 2048),
    "small": (32, 2048, 768),
}


def uneven_sizes(m: int, g: int, seed: int, align: int = 16) -> list[int]:
    """Random group sizes summing to m (TMA-adaptive FP8 grouped GEMM paper, appendix C.1), multiples of ``align``.

    The alignment is for the baselines only: torch._grouped_mm / _scaled_grouped_mm assert (device-side, which
    kills the process) that group offsets along the reduction axis of wgrad are 16-byte aligned. Our kernels take
    any sizes (tests/test_gemm_cuda.py covers unaligned ones).
    """
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2 * (m // g) + 1, (g,), generator=gen).double()
    v = (v * (m / max(v.sum().item(), 1.0)) / align).floor().long() * align
    v[-1] += m - int(v.sum())
    return [int(x) for x in v]


def time_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    evs = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        evs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in evs)


def relaunch_under_torchrun(script: str, nproc: int, extra_env: dict) -> int:
    """Run ``script`` with this process's arguments under torchrun on ``nproc`` local processes (the multi-GPU
    benchmarks started as plain ``python``); returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.call([*cmd, os.path.abspath(script), *sys.argv[1:]], env={**os.environ, **extra_env})


def round_order(names: list[str], rnd: int) -> list[str]:
    """Order of round ``rnd`` of an interleaved timing: rotated by one every second round, and reversed on odd
    rounds, so that no implementation always runs first or right after the same one (a plain rotation keeps every
    predecessor fixed, and a position effect such as "the first kernel after torch's" would then pass for the
    implementation's own).

    Example: names [a, b]: rounds 0-3 are [a, b], [b, a], [b, a], [a, b]. names [a, b, c]: rounds 0-5 are
    [a, b, c], [c, b, a], [b, c, a], [a, c, b], [c, a, b], [b, a, c] (all six orders).
    """
    k = (rnd // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if rnd % 2 else order


def interleaved_ms(fns: dict, rounds: int, warmup: int, reps: int, errors: dict | None = None) -> dict[str, list]:
    """Times of every ``fns`` entry (name -> closure, or None: not timed) over ``rounds`` rounds in
    :func:`round_order`; a closure that raises is recorded in ``errors[name]`` and not timed again."""
    errors = {} if errors is None else errors
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(rounds):
        for name in round_order(list(fns), rnd):
            fn = fns[name]
            if fn is None or name in errors:
                continue
            try:
                times[name].append(time_ms(fn, warmup, reps))
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return times


def paired_ratio(ref: list[float], times: list[float]) -> float:
    """Median over rounds of the same round's ref / time (ratio > 1: faster than ref)."""
    return statistics.median(b / o for b, o in zip(ref, times, strict=True))


def dequant(t: mxfp8.MXFP8Tensor) -> torch.Tensor:
    try:
        return mxfp8.dequantize(t, torch.bfloat16)
    except ImportError:  # CUDA quantization kernels not available: torch ops
        return mxfp8.dequantize_torch(t, torch.bfloat16)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 e4m3 quantization for the fp8 rowwise baseline: (data, fp32 scales [rows])."""
    amax = t.float().abs().amax(dim=-1).clamp_min(1e-12)
    s = amax / 448.0
    return (t.float() / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn), s.float()


def rowwise_fp8_grouped_cols(t: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 scales within each column group (the wgrad 2d x 2d form of the fp8 rowwise baseline).

    t: [R, M] with groups cutting M -> (e4m3 [R, M], fp32 scales [G * R]): torch's 2d x 2d scaled grouped GEMM
    takes one scale per row of each group's slice.
    """
    data = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=t.device)
    scales, start = [], 0
    for n in sizes:
        seg = t[:, start : start + n].float()
        sc = seg.abs().amax(dim=1).clamp_min(1e-12) / 448.0 if n else torch.ones(t.shape[0], device=t.device)
        if n:
            data[:, start : start + n] = (seg / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales.append(sc)
        start += n
    return data, torch.cat(scales).float()


def run_shape(name, m, k, n, g, args, out_rows):
    dev = "cuda"
    sizes = uneven_sizes(m, g, seed=sum(map(ord, name)))
    sz = torch.tensor(sizes, dtype=torch.int32, device=dev)
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    w = (torch.randn(g, n, k, generator=gen, device=dev) * 0.02).bfloat16()

    # MXFP8 operands (reference converters; they also give the plain MXFP8 tensors for the baselines)
    xq, dyq, wq = mxfp8.quantize_torch(x, -1), mxfp8.quantize_torch(dy, -1), mxfp8.quantize_torch(w, -1)
    wtq = mxfp8.quantize_torch(w.transpose(1, 2).contiguous(), -1)
    xs = mxfp8.to_blocked_grouped(xq.scale, sz, "m")
    dys = mxfp8.to_blocked_grouped(dyq.scale, sz, "m")
    ws, wts = mxfp8.to_blocked(wq.scale), mxfp8.to_blocked(wtq.scale)
    dyc, dycs = refs.colwise_operand_ref(dy, sizes)
    xc, xcs = refs.colwise_operand_ref(x, sizes)
    flops = 2.0 * m * n * k
    res = {"M": m, "K": k, "N": n, "G": g, "group_sizes": sizes, "variants": {}}

    ours = {"fprop": {}, "dgrad": {}, "wgrad": {}}
    # the fprop / dgrad kernel takes the weight as exact bf16 prepared once per weight version (prepare_weight_bf16):
    # timed here as the kernel alone; the preparation (kernels/experts/sm90/weight_prep.cu) is reported separately, per
    # weight version, with its bandwidth (e4m3 + scale bytes read, bf16 written) and the torch reference's time
    wprep = operands.prepare_weight_bf16(wq.data, ws)
    wtprep = operands.prepare_weight_bf16(wtq.data, wts)
    prep = {"matches_torch_reference": True}
    for key, (wd_, ws_, pp) in {"fprop_w": (wq.data, ws, wprep), "dgrad_wt": (wtq.data, wts, wtprep)}.items():
        prep["matches_torch_reference"] &= bool(torch.equal(pp, operands.prepare_weight_bf16_torch(wd_, ws_)))
        ms = time_ms(lambda wd_=wd_, ws_=ws_, pp=pp: operands.prepare_weight_bf16(wd_, ws_, out=pp), 3, 10)
        nbytes = wd_.numel() + ws_.numel() + 2 * pp.numel()
        prep[key] = {
            "ms": ms,
            "gb_s": nbytes / ms / 1e6,
            "torch_ref_ms": time_ms(lambda wd_=wd_, ws_=ws_: operands.prepare_weight_bf16_torch(wd_, ws_), 1, 3),
        }
    res["prepare_weight"] = prep
    print(f"[{name}] prepare_weight: {prep}")
    ours["fprop"][IMPL] = lambda: gemm_cuda.grouped_mm_fprop(xq.data, xs, wq.data, ws, sz, w_prepared=wprep)
    ours["dgrad"][IMPL] = lambda: gemm_cuda.grouped_mm_dgrad(dyq.data, dys, wtq.data, wts, sz, wt_prepared=wtprep)
    # wgrad: the operands as the quantizer writes them (already in the GEMM's prepared layout), bf16 output like the
    # torch baselines: the GEMM alone. The quantizer's time is reported below ("colwise_producer_ms").
    dyp = mxfp8_cuda.quantize_grouped_dual(dy, sz)[2]
    xp = mxfp8_cuda.quantize_grouped_dual(x, sz)[2]
    used = refs.colwise_prep_rows_used(sizes)
    res["prepared_operands_match_reference"] = bool(
        torch.equal(dyp[:used], refs.prepare_colwise_bf16_torch(dyc, dycs, sizes)[:used])
        and torch.equal(xp[:used], refs.prepare_colwise_bf16_torch(xc, xcs, sizes)[:used])
    )
    ours["wgrad"]["mxfp8_prepared"] = lambda: gemm_cuda.grouped_wgrad_prepared_out(
        dyp, xp, sz, torch.empty(g, n, k, dtype=torch.bfloat16, device=dev), m
    )
    res["colwise_producer_ms"] = {  # quantize_grouped_dual of dY and of X (both operands, prepared column output)
        f"{who}_bf16": time_ms(lambda t=t: mxfp8_cuda.quantize_grouped_dual(t, sz), 3, 10)
        for who, t in (("dy", dy), ("x", x))
    }
    print(
        f"[{name}] prepared operands match the reference: {res['prepared_operands_match_reference']}; "
        f"producer ms {res['colwise_producer_ms']}"
    )

    # ---- correctness on a subsample before timing (our kernels are not timed if it fails)
    if not args.no_check:
        starts = [0] + torch.cumsum(torch.tensor(sizes), 0).tolist()[:-1]
        nonempty = [i for i in range(g) if sizes[i]]
        pick = sorted({nonempty[0], nonempty[-1], max(nonempty, key=lambda i: sizes[i])})
        xf, dyf = mxfp8.dequantize_torch(xq, torch.float32), mxfp8.dequantize_torch(dyq, torch.float32)
        wf = mxfp8.dequantize_torch(wq, torch.float32)
        wtf = mxfp8.dequantize_torch(wtq, torch.float32)
        # bf16 outputs: one bf16 rounding (rel. 2**-9 per element). wgrad fp32: the tensor cores truncate at each
        # 16-term step (tests/test_gemm_cuda.py); over ~2048-row groups of random data the biased error is about
        # 2/3 * steps * 2**-24 ~ 5e-6 of the norm, so 3e-5 (indexing / scale bugs give O(1)).
        limit = {"fprop": 5e-3, "dgrad": 5e-3, "wgrad": 3e-5, "finite": 0.0}
        res["check_rel_err"], res["check_ok"] = {}, {}
        errs = {}
        try:
            o_f, o_d = ours["fprop"][IMPL](), ours["dgrad"][IMPL]()
            for gi in pick:  # the first and the last (partial) 128-row tile of each picked group
                n_chk = min(sizes[gi], 64)
                for part, r0 in (("head", starts[gi]), ("tail", starts[gi] + sizes[gi] - n_chk)):
                    r = slice(r0, r0 + n_chk)
                    errs[f"fprop_g{gi}{part}"] = rel_err(o_f[r], xf[r] @ wf[gi].t())
                    errs[f"dgrad_g{gi}{part}"] = rel_err(o_d[r], dyf[r] @ wtf[gi].t())
            fin = bool(torch.isfinite(o_f).all() and torch.isfinite(o_d).all())
            errs["finite"] = 0.0 if fin else float("inf")
            del o_f, o_d
            # wgrad on the prepared operands (fp32 output)
            dcf = refs.colwise_dequantize_ref(dyc, dycs, sizes)
            xcf = refs.colwise_dequantize_ref(xc, xcs, sizes)
            o_w = gemm_cuda.grouped_wgrad_prepared_out(dyp, xp, sz, torch.empty(g, n, k, device=dev), m)
            for gi in pick[:2]:
                r = slice(starts[gi], starts[gi] + sizes[gi])
                errs[f"wgrad_g{gi}"] = rel_err(o_w[gi], dcf[r].t() @ xcf[r])
            del o_w, dcf, xcf
            bad = {kk: v for kk, v in errs.items() if not v <= limit[kk.split("_")[0]]}
        except Exception as e:  # noqa: BLE001  (reported like a failed check)
            bad = {"exception": f"{type(e).__name__}: {str(e)[:300]}"}
            errs["exception"] = bad["exception"]
        res["check_rel_err"][IMPL], res["check_ok"][IMPL] = errs, not bad
        summary = ", ".join(f"{kk}={v:.1e}" if isinstance(v, float) else f"{kk}={v}" for kk, v in errs.items())
        print(f"[{name}] check {IMPL} {'ok' if not bad else 'FAILED'}: {summary}")
        if bad and not args.keep_going:
            raise SystemExit(f"{name}: kernel does not match the reference: {bad}")
        if bad:  # --keep-going: not timed, reported as error rows
            for var in ours:
                ours[var] = dict.fromkeys(ours[var])
        del xf, dyf, wf, wtf
        torch.cuda.empty_cache()

    # ---- baselines (each in try/except: torch's private grouped-GEMM APIs change between versions)
    xb, dyb, wb = x, dy, w
    dyt = dy.t().contiguous()
    base = {
        "fprop": {
            "bf16": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=offs),
            "deq+bf16": lambda: torch._grouped_mm(dequant(xq), dequant(wq).transpose(-2, -1), offs=offs),
        },
        "dgrad": {
            "bf16": lambda: torch._grouped_mm(dyb, wb, offs=offs),
            "deq+bf16": lambda: torch._grouped_mm(dequant(dyq), dequant(wtq).transpose(-2, -1), offs=offs),
        },
        "wgrad": {
            "bf16": lambda: torch._grouped_mm(dyt, xb, offs=offs),  # dY^T [N, M] (K-major) x X [M, K]
            "deq+bf16": lambda: torch._grouped_mm(
                refs.colwise_dequantize_ref(dyc, dycs, sizes).bfloat16().t(),
                refs.colwise_dequantize_ref(xc, xcs, sizes).bfloat16(),
                offs=offs,
            ),
        },
    }
    try:  # fp8 rowwise operands (per-row scales; K-major A, column-major B as torch requires)
        xf8, xsc = rowwise_fp8(x)
        wf8, wsc = rowwise_fp8(w)  # [G, N, K], scales [G, N]
        dyf8, dysc = rowwise_fp8(dy)
        wtf8, wtsc = rowwise_fp8(w.transpose(1, 2).contiguous())  # [G, K, N]
        dytf8, dytsc = rowwise_fp8_grouped_cols(dyt, sizes)  # [N, M], scales [G * N]
        xtf8, xtsc = rowwise_fp8_grouped_cols(x.t().contiguous(), sizes)  # [K, M], scales [G * K]

        def sgm(a, b, sa, sb):
            return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)

        base["fprop"]["fp8_rowwise"] = lambda: sgm(xf8, wf8.transpose(-2, -1), xsc, wsc)
        base["dgrad"]["fp8_rowwise"] = lambda: sgm(dyf8, wtf8.transpose(-2, -1), dysc, wtsc)
        base["wgrad"]["fp8_rowwise"] = lambda: sgm(dytf8, xtf8.t(), dytsc, xtsc)
    except Exception as e:  # noqa: BLE001
        res["fp8_rowwise_setup_error"] = f"{type(e).__name__}: {e}"

    for var in ("fprop", "dgrad", "wgrad"):
        fns = {**ours[var], **base[var]}
        # Interleaved rounds (every implementation once per round, then again): the GPU's clock and heat drift
        # between processes and within one moved torch bf16 itself by up to ~17 %, so a ratio is taken per round
        # (same minute, same clocks) and the median of those is reported.
        errors: dict[str, str] = {}
        rounds = interleaved_ms(fns, args.rounds, args.warmup, args.reps, errors)
        vres = {impl: {"error": err} for impl, err in errors.items()}
        for impl, fn in fns.items():
            if fn is None:
                vres[impl] = {"error": "check failed: not timed"}
            elif impl not in vres:
                ms = statistics.median(rounds[impl])
                vres[impl] = {"ms": ms, "tflops": flops / ms / 1e9, "ms_rounds": rounds[impl]}
        ref = rounds.get("bf16") if "tflops" in vres.get("bf16", {}) else None
        for v in vres.values():
            if ref and "tflops" in v:
                v["ratio_vs_bf16"] = paired_ratio(ref, v["ms_rounds"])
        res["variants"][var] = vres
        out_rows.append((name, var, vres))
    return res


def run_weight_prep(name: str, e: int, h: int, f: int, args) -> dict:
    """Weight preparation of W13 [E, 2F, H] and W2 [E, H, F] (bf16): the fused kernel, the two-step path and the
    copy ceiling (see the module docstring), every output preallocated (kernel time only)."""
    dev = "cuda"
    res = {"E": e, "H": h, "F": f, "weights": {}}
    for wname, (n, k) in (("w13", (2 * f, h)), ("w2", (h, f))):
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(e, n, k, generator=gen, device=dev) * 0.02).bfloat16()
        kp, np_ = -(-k // 64) * 64, -(-n // 64) * 64
        new = (
            torch.empty(e, n, kp, dtype=torch.bfloat16, device=dev),
            torch.empty(e, k, np_, dtype=torch.bfloat16, device=dev),
        )
        old = (torch.empty_like(new[0]), torch.empty_like(new[1]))
        q = mxfp8_cuda.quantize_weights_fused(w)  # the two-step path's intermediates (e4m3 both ways + scales)

        def fused(w=w, new=new):
            operands.prepare_weight_operands(w, out=new)

        def two_step(w=w, q=q, old=old):
            mxfp8_cuda.quantize_weights_fused_into(w, *q)
            operands.prepare_weight_bf16(q[0], q[1], out=old[0])
            operands.prepare_weight_bf16(q[2], q[3], out=old[1])

        # ---- correctness first: the fused bytes are the two-step path's (NaN-free input: plain equality of bits)
        fused()
        two_step()
        ok = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(new, old, strict=True))
        print(f"[weight_prep {name}/{wname}] [{e}, {n}, {k}] fused == two_step: {ok}")
        if not ok and not args.keep_going:
            raise SystemExit(f"weight_prep {name}/{wname}: the fused kernel's bytes differ from the two-step path")

        out_bytes = 2 * (new[0].numel() + new[1].numel())
        fused_bytes = 2 * w.numel() + out_bytes  # read W, write both prepared operands
        qbytes = sum(t.numel() for t in q)  # e4m3 both ways + their scales: written once, read once
        two_bytes = 2 * w.numel() + 2 * qbytes + out_bytes
        dst = torch.empty(e, n, 2, k, dtype=torch.bfloat16, device=dev)
        flat = torch.empty(fused_bytes // 2, dtype=torch.uint8, device=dev)
        flat_dst = torch.empty_like(flat)
        fns = {
            "fused": fused,
            "two_step": two_step,
            # read W once (the second read of each row is an L2 hit) and write it twice: 6 B per element
            "copy": lambda w=w, dst=dst: dst.copy_(w.unsqueeze(2).expand(-1, -1, 2, -1)),
            "copy_flat": lambda a=flat, b=flat_dst: b.copy_(a),  # the same byte count, one contiguous copy
        }
        nbytes = {"fused": fused_bytes, "two_step": two_bytes, "copy": fused_bytes, "copy_flat": fused_bytes}
        rounds = interleaved_ms(fns, args.rounds, args.warmup, args.reps)
        out = {"shape": [e, n, k], "fused_matches_two_step": ok}
        for key, times in rounds.items():
            ms = statistics.median(times)
            out[key] = {"ms": ms, "gb_s": nbytes[key] / ms / 1e6, "bytes": nbytes[key], "ms_rounds": times}
        for key in ("fused", "two_step"):
            out[key]["pct_copy"] = 100 * out[key]["gb_s"] / out["copy"]["gb_s"]
            out[key]["pct_copy_flat"] = 100 * out[key]["gb_s"] / out["copy_flat"]["gb_s"]
        out["speedup_fused_over_two_step"] = paired_ratio(rounds["two_step"], rounds["fused"])
        res["weights"][wname] = out
        line = ", ".join(
            f"{key} {out[key]['ms']:.3f} ms {out[key]['gb_s']:.0f} GB/s"
            + (f" ({out[key]['pct_copy']:.1f}% of copy)" if "pct_copy" in out[key] else "")
            for key in fns
        )
        print(f"[weight_prep {name}/{wname}] {line}; fused {out['speedup_fused_over_two_step']:.2f}x two_step")
        del w, new, old, q, dst, flat, flat_dst, fns, fused, two_step  # the closures hold the buffers too
        torch.cuda.empty_cache()
    res["total_ms"] = {
        key: sum(v[key]["ms"] for v in res["weights"].values()) for key in ("fused", "two_step", "copy", "copy_flat")
    }
    print(f"[weight_prep {name}] W13 + W2 ms: {res['total_ms']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=str, default=None, help="write results to this JSON file")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument(
        "--shapes", type=str, default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES)
    )
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (ratio = median per round)")
    ap.add_argument("--keep-going", action="store_true", help="time even if the check fails")
    ap.add_argument(
        "--weight-prep",
        type=str,
        default="",
        help="comma-separated subset of " + ",".join(WEIGHT_SHAPES) + ": time the weight preparation (see above)",
    )
    args = ap.parse_args()
    args.warmup, args.reps = (2, 5) if args.quick else (5, 20)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    from launch.provenance import code_version  # noqa: PLC0415

    commit = code_version()
    result = {
        "benchmark": "bench_gemm",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": commit,
        "impls": [IMPL],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {"warmup": args.warmup, "reps": args.reps, "quick": args.quick, "rounds": args.rounds},
        "shapes": {},
    }
    rows: list = []
    for name in [s for s in args.shapes.split(",") if s]:
        m, k, n, g = SHAPES[name]
        result["shapes"][name] = run_shape(name, m, k, n, g, args, rows)
        torch.cuda.empty_cache()
    wp_names = [s for s in args.weight_prep.split(",") if s]
    if wp_names:
        result["weight_prep"] = {}
    for name in wp_names:
        result["weight_prep"][name] = run_weight_prep(name, *WEIGHT_SHAPES[name], args)

    cols = [IMPL, "mxfp8_prepared"]
    cols += ["bf16", "deq+bf16", "fp8_rowwise"]
    print(f"\n{result['device']}  torch {result['torch']}  (TFLOP/s, ratio vs torch bf16)")
    print(f"{'shape':<10} {'var':<6} " + " ".join(f"{c:>18}" for c in cols))
    for name, var, vres in rows:
        cells = []
        for c in cols:
            v = vres.get(c)
            if v is None:
                cells.append(f"{'-':>18}")
            elif "error" in v:
                cells.append(f"{'error':>18}")
            else:
                cells.append(f"{v['tflops']:8.1f} ({v.get('ratio_vs_bf16', float('nan')):4.2f}x)".rjust(18))
        print(f"{name:<10} {var:<6} " + " ".join(cells))
    errors = {f"{n_}/{v_}/{c}": vres[c]["error"] for n_, v_, vres in rows for c in vres if "error" in vres[c]}
    for key, msg in errors.items():
        print(f"  {key}: {msg}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
