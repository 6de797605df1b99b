"""Diagnostics of the grouped GEMMs: wgmma3's phase profile and timing experiments (wgmma3, wgmma5).

wgmma3 (kernels/grouped_gemm_wg3.cu, the default ``--kernel wgmma3``):

* ``-DW3_PROF`` build: threads 0 and 128 (one per warpgroup) add up the clock64 cycles of each phase of every
  k-step; printed as cycles per k-step, averaged over CTAs (the stamps perturb the schedule a little).
* ``-DW3_NO_CVT`` build: the same loads, MMAs and synchronization without the e4m3 -> bf16 conversion (wrong
  results, timing only): how fast the skeleton is.
Each build is timed with bench_gemm's CUDA-event timer (median of 20) next to the normal kernel on the same operands.

wgmma5 (kernels/grouped_gemm_wg5.cu, ``--kernel wgmma5``): the kernel and timing-only builds with wrong results:
``-DW3_NO_CVT`` (no A conversion), ``-DW5_HALF_B`` (B loaded on every other k-step: half the B bytes from L2),
``-DW5_NO_EPI`` (no output stores); what each removes from the time says what bounds the kernel. Layout
variants that must give the same bytes: ``-DW5_REG_EPI`` (register epilogue only), ``-DW5_STAGES=5 -DW5_REG_EPI``
(the long-reduction build; 5 stages do not fit next to the TMA epilogue's tile).

builds (``--kernel builds --builds "s4=wgmma5@4:;s5=wgmma5@5:"``): the same interleaved
A/B for any builds (``parse_builds``) on the shapes of ``--shape`` (names or MxKxNxG specs, comma-separated;
default all of bench_gemm's), ``--rounds`` rounds, or with ``--pairs N`` N iterations of single launches in
rotating order (``alternating_ms``: the ratio per iteration cancels the clock drift between 20-launch blocks).
A dgrad is the fprop of the spec with K and N swapped (the same kernel on W^T; torch's column is then its NT GEMM;
the group sizes are seeded by the spec string, so they are not bench_gemm's for the named shape).

raster (``--kernel raster``): wgmma4 fprop built with -DGM_RASTER = 1/4/8/16 (row tiles
per band of the tile order, kernels/grouped_gemm_wg2.cu gm_raster), every shape of bench_gemm unless --shape is
given, ROUNDS rounds interleaved in rotating order with the median per build, bytes checked equal to the first build.
(The pinned A fields were measured the same way with -DW3_NO_PIN builds, a switch removed once the results were in:
results/prof_gemm_pin_h200_rerun.json, code in a1e56ee; wgmma5's band with ``--kernel builds`` and -DW5_RASTER=b.)

ncu (``--kernel ncu``): for profiling under Nsight Compute with ``--profile-from-start off``: per shape, wgmma4 and
wgmma5 fprop and torch bf16 ``_grouped_mm`` warmed up, then launched once each between cudaProfilerStart/Stop.

wgrad (kernels/grouped_gemm_wgrad.cu, ``--kernel wgrad``): the operand preparation, the GEMM alone, the GEMM
without output stores (``-DWR_NO_EPI``), the whole call and torch bf16.

    python benchmarks/prof_gemm.py [--kernel wgmma3|wgmma5|wgrad|raster|ncu] [--shape dsv3_up] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemm import SHAPES, env_restored, interleaved_ms, paired_ratio, round_order, time_ms, uneven_sizes  # noqa: E402

from moe_ep import _cuda, gemm_cuda, mxfp8  # noqa: E402

PHASES = ["issue", "wait_mma", "wait_tma", "convert_b", "convert_a", "fence", "barrier"]


def launcher(opts, xq, xs, wq, ws, sz, out):
    m, k = xq.data.shape
    g, n, _ = wq.data.shape
    fn = _cuda.get_function(gemm_cuda._WGMMA3_FILE, "mx_gmm_wg3_2d3d_bf16", extra_options=opts)
    grid = (-(-m // 128) + g) * (-(-n // 256))
    args = gemm_cuda._kernel_args(xq.data, xs, wq.data, ws, sz, out, g, m, n, k, True) + (
        gemm_cuda._tma_map_2d(xq.data, m, k, 128, 64),
        gemm_cuda._tma_map_2d(wq.data, g * n, k, 256, 64),
    )

    def run():
        _cuda.launch(fn, grid, 256, args, shared_mem=gemm_cuda._WGMMA3_SMEM_BYTES)

    return run, fn


def launcher_w5(opts, xq, xs, wprep, sz, out):
    m, k = xq.data.shape
    g, n, kp = wprep.shape
    fn = _cuda.get_function(gemm_cuda._WGMMA5_FILE, "mx_gmm_wg5_2d3d_bf16", extra_options=opts)
    grid = min((-(-m // 128) + g) * (-(-n // 256)), _cuda.num_sms())
    args = gemm_cuda._kernel_args(xq.data, xs, xq.data, xs, sz, out, g, m, n, k, True) + (
        gemm_cuda._tma_map_2d(xq.data, m, k, 128, 64),
        gemm_cuda._tma_map_2d(wprep, g * n, kp, 256, 64, elem_bytes=2, swizzle128=True),
        gemm_cuda._tma_map_2d(out, m, n, 64, 64, elem_bytes=2, swizzle128=True),
    )

    def run():
        # the most a CTA may have: the experiment builds lay shared memory out differently
        _cuda.launch(fn, grid, gemm_cuda._WGMMA5_THREADS, args, shared_mem=232448)

    return run


def shape_dims(shape: str) -> tuple[int, int, int, int]:
    """(M, K, N, G) of a bench_gemm shape name or of a spec "MxKxNxG" (e.g. 32768x2048x4096x32)."""
    if shape in SHAPES:
        return SHAPES[shape]
    m, k, n, g = (int(v) for v in shape.split("x"))
    return m, k, n, g


def fprop_operands(shape: str):
    """The benchmark shape's fprop operands (bench_gemm's uneven group sizes): (M, K, N, G, sizes, sz, x, w, xq,
    wq, xs, ws, out) with x/w bf16, xq/wq their MXFP8 quantization, xs/ws the blocked scales, out bf16 [M, N]."""
    m, k, n, g = shape_dims(shape)
    sizes = uneven_sizes(m, g, seed=sum(map(ord, shape)))
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
    xq, wq = mxfp8.quantize_torch(x, -1), mxfp8.quantize_torch(w, -1)
    xs, ws = mxfp8.to_blocked_grouped(xq.scale, sz, "m"), mxfp8.to_blocked(wq.scale)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    return m, k, n, g, sizes, sz, x, w, xq, wq, xs, ws, out


def experiments_w5(args) -> dict:
    m, k, n, g, sizes, sz, x, w, xq, wq, xs, ws, out = fprop_operands(args.shape)
    wprep = gemm_cuda.prepare_weight_bf16(wq.data, ws)
    flops = 2.0 * sum(sizes) * n * k
    res = {"kernel": "wgmma5", "shape": args.shape, "M": m, "K": k, "N": n, "G": g, "tflops": {}}
    builds = {
        "normal": (),
        "reg_epi": ("-DW5_REG_EPI",),
        "reg_epi_5stages": gemm_cuda._WGMMA5_DEEP_OPTIONS,  # the library's deep build, as it ships
        "no_cvt": ("-DW3_NO_CVT",),
        "half_b": ("-DW5_HALF_B",),
        "no_epi": ("-DW5_NO_EPI",),
        "half_b_no_cvt": ("-DW5_HALF_B", "-DW3_NO_CVT"),
    }
    exact = ("normal", "reg_epi", "reg_epi_5stages")  # builds that must give correct bytes
    normal_out = None
    for name, opts in builds.items():
        run = launcher_w5(opts, xq, xs, wprep, sz, out)
        ms = time_ms(run, 3, 20)
        res["tflops"][name] = flops / ms / 1e9
        if name in exact:
            torch.cuda.synchronize()
            if name == "normal":
                normal_out = out.clone()
                ref = gemm_cuda.grouped_mm_fprop(xq.data, xs, wq.data, ws, sz)
                res["normal_matches_default_impl"] = bool(torch.equal(out, ref))
            else:
                res[f"{name}_matches_normal"] = bool(torch.equal(out, normal_out))
            out.fill_(float("nan"))
    torch.cuda.synchronize()
    bf = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.cumsum(sz, 0, dtype=torch.int32))  # noqa: E731
    res["tflops"]["torch_bf16"] = flops / time_ms(bf, 3, 20) / 1e9
    return res


def experiments_wgrad(args) -> dict:
    """The wgmma wgrad kernel: the operand preparation alone, the GEMM alone (prepared operands given), and the
    GEMM without its output stores (-DWR_NO_EPI), next to torch bf16 wgrad on the same shape."""
    m, k, n, g = shape_dims(args.shape)
    sizes = uneven_sizes(m, g, seed=sum(map(ord, args.shape)))
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    dyc, dycs = gemm_cuda.colwise_operand_ref(dy, sizes)
    xc, xcs = gemm_cuda.colwise_operand_ref(x, sizes)
    out = torch.empty(g, n, k, dtype=torch.float32, device="cuda")
    flops = 2.0 * m * n * k
    ap = gemm_cuda.prepare_colwise_bf16(dyc, dycs, sz)
    bp = gemm_cuda.prepare_colwise_bf16(xc, xcs, sz)
    res = {"kernel": "wgrad", "shape": args.shape, "M": m, "K": k, "N": n, "G": g, "ms": {}, "tflops": {}}
    res["ms"]["prepare_dy"] = time_ms(lambda: gemm_cuda.prepare_colwise_bf16(dyc, dycs, sz, out=ap), 3, 20)
    res["ms"]["prepare_x"] = time_ms(lambda: gemm_cuda.prepare_colwise_bf16(xc, xcs, sz, out=bp), 3, 20)
    # The library's own launch on the prepared operands (the stage count follows MOE_EP_WGRAD_STAGES as in
    # full_call); the no-epilogue timing build through the NVRTC options, which get_function keys its cache on.
    res["ms"]["gemm_only"] = time_ms(lambda: gemm_cuda._launch_wgrad_prepared(ap, bp, sz, out, m), 3, 20)
    with env_restored("MOE_EP_NVRTC_OPTIONS"):
        os.environ["MOE_EP_NVRTC_OPTIONS"] = (os.environ.get("MOE_EP_NVRTC_OPTIONS", "") + " -DWR_NO_EPI").strip()
        res["ms"]["gemm_no_epi"] = time_ms(lambda: gemm_cuda._launch_wgrad_prepared(ap, bp, sz, out, m), 3, 20)
    res["ms"]["full_call"] = time_ms(lambda: gemm_cuda.grouped_mm_wgrad(dyc, dycs, xc, xcs, sz, out=out), 3, 20)
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    dyt = dy.t().contiguous()
    res["ms"]["torch_bf16"] = time_ms(lambda: torch._grouped_mm(dyt, x, offs=offs), 3, 20)
    res["tflops"] = {kk: flops / v / 1e9 for kk, v in res["ms"].items() if not kk.startswith("prepare")}
    return res


def _builds_shape(shape: str, builds: dict[str, tuple[str, str, str]], rounds: int, pairs: int = 0) -> dict:
    """Fprop of ``shape`` for every build name -> BUILD_ENV values (:func:`parse_builds`) and torch bf16, ``rounds``
    interleaved rounds in rotating order (or, with ``pairs``, that many iterations of :func:`alternating_ms`), bytes
    compared with the first build's output (all must be equal)."""
    m, k, n, g, sizes, sz, x, w, xq, wq, xs, ws, out = fprop_operands(shape)
    wprep = gemm_cuda.prepare_weight_bf16(wq.data, ws)
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    flops = 2.0 * sum(sizes) * n * k
    row: dict = {"M": m, "K": k, "N": n, "G": g, "builds": builds}
    first = next(iter(builds))

    def ours():
        gemm_cuda.grouped_mm_fprop(xq.data, xs, wq.data, ws, sz, out=out, w_prepared=wprep)

    def bf16():
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def build(name: str):
        env = dict(zip(BUILD_ENV, builds[name], strict=True))

        def run():
            if any(os.environ.get(k) != v for k, v in env.items()):  # set when it differs (every launch with --pairs)
                os.environ.update(env)
            ours()

        return run

    fns = {name: build(name) for name in builds} | {"torch_bf16": bf16}
    # A first pass whose times are dropped (it compiles every build and checks the bytes); then `rounds` rounds (or
    # `pairs` iterations) in bench_gemm's round_order, so that a position effect (e.g. the first kernel after
    # torch's) cannot pass for a build's own.
    for name, fn in fns.items():
        fn()
        if name == first:
            torch.cuda.synchronize()
            ref = out.clone()
        elif name != "torch_bf16":
            torch.cuda.synchronize()
            row[f"{name}_bytes_equal_{first}"] = bool(torch.equal(out, ref))
        out.fill_(float("nan"))
    if pairs:
        times = alternating_ms(fns, pairs)
        row["iterations"] = pairs  # launches per build
        row["ms_launches"] = times  # per build, in iteration order (the pairs behind the ratios below)
        row[f"ratio_vs_{first}"] = {kk: paired_ratio(times[first], v) for kk, v in times.items()}
        # time ratios (> 1: slower than the first build), 10 % and 90 % quantiles over iterations
        row[f"time_ratio_to_{first}_p10_p90"] = {
            kk: [float(q) for q in np.quantile(np.array(v) / np.array(times[first]), [0.1, 0.9])]
            for kk, v in times.items()
        }
    else:
        errors: dict[str, str] = {}
        times = interleaved_ms(fns, rounds, 3, 20, errors)
        if errors:
            raise RuntimeError(f"{shape}: {errors}")
        row["ms_rounds"] = times  # per build, in round order (the pairs behind the median ratios below)
    row["tflops"] = {kk: flops / statistics.median(v) / 1e9 for kk, v in times.items()}
    # speed ratios (> 1: faster than torch), median over rounds / iterations
    row["ratio_vs_torch_bf16"] = {kk: paired_ratio(times["torch_bf16"], v) for kk, v in times.items()}
    return row


def alternating_ms(fns: dict, iters: int, warmup: int = 3) -> dict[str, list[float]]:
    """One launch of every fn per iteration, in bench_gemm.round_order (rotated every second iteration, reversed on
    odd ones, so that no fn always follows the same one), each timed by its own pair of CUDA events; one
    synchronization at the end. The ratio of two builds within an iteration is taken a few ms apart, so clock and
    power drift (which moved whole 20-launch blocks by 5-10 % on this session's H200) cancels in it."""
    if iters < 1:
        raise ValueError(f"--pairs must be >= 1, got {iters}")
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()

    def pair():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    ev = {n: [pair() for _ in range(iters)] for n in names}
    for i in range(iters):
        for name in round_order(names, i):
            a, b = ev[name][i]
            a.record()
            fns[name]()
            b.record()
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) for a, b in ev[n]] for n in names}


ROUNDS = 6
RASTER_BUILDS = {f"wgmma4_r{r}": ("wgmma4", f"-DGM_RASTER={r}", "auto") for r in (1, 4, 8, 16)}


BUILD_ENV = ("MOE_EP_GEMM_IMPL", "MOE_EP_NVRTC_OPTIONS", "MOE_EP_GEMM_STAGES")  # what a build sets


def parse_builds(spec: str) -> dict[str, tuple[str, str, str]]:
    """``name=impl[@stages]:options;...`` -> {name: (MOE_EP_GEMM_IMPL, MOE_EP_NVRTC_OPTIONS, MOE_EP_GEMM_STAGES)}.

    Example: ``auto=wgmma5:;s4=wgmma5@4:;band16=wgmma5@4:-DW5_RASTER=16`` -> {"auto": ("wgmma5", "", "auto"), "s4":
    ("wgmma5", "", "4"), "band16": ("wgmma5", "-DW5_RASTER=16", "4")}: stages (``gemm_cuda.w5_stages``) default to
    auto, which picks the 5-stage build for K >= 3072 (pin them when the options touch W5_STAGES or W5_REG_EPI). An
    item without a name or an implementation from gemm_cuda.IMPLS, stages other than auto/4/5, or a repeated name,
    raises ValueError (an empty implementation would silently time the default kernel)."""
    out = {}
    for item in spec.split(";"):
        name, eq, rest = item.partition("=")
        impl, _, opts = rest.partition(":")
        impl, _, stages = impl.partition("@")
        name, impl, stages = name.strip(), impl.strip(), stages.strip() or "auto"
        if not eq or not name or impl not in gemm_cuda.IMPLS or stages not in ("auto", "4", "5") or name in out:
            raise ValueError(
                f"--builds item {item!r}: want name=impl[@stages]:options, impl in {gemm_cuda.IMPLS}, stages auto/4/5, "
                "names unique"
            )
        out[name] = (impl, opts.strip(), stages)
    return out


def experiments_builds(args) -> dict:
    builds = parse_builds(args.builds) if args.builds else RASTER_BUILDS
    res = {"kernel": args.kernel, "shapes": {}}
    with env_restored(*BUILD_ENV):
        for shape in args.shape.split(",") if args.shape_given else list(SHAPES):
            res["shapes"][shape] = _builds_shape(shape, builds, args.rounds, args.pairs)
            print(shape, json.dumps(res["shapes"][shape]))
    return res


def launches_for_ncu(args) -> dict:
    shapes = [args.shape] if args.shape_given else list(SHAPES)
    with env_restored("MOE_EP_GEMM_IMPL"):
        for shape in shapes:
            m, k, n, g, sizes, sz, x, w, xq, wq, xs, ws, out = fprop_operands(shape)
            wprep = gemm_cuda.prepare_weight_bf16(wq.data, ws)
            offs = torch.cumsum(sz, 0, dtype=torch.int32)

            def ours(impl, xq=xq, xs=xs, wq=wq, ws=ws, sz=sz, out=out, wprep=wprep):
                os.environ["MOE_EP_GEMM_IMPL"] = impl
                gemm_cuda.grouped_mm_fprop(xq.data, xs, wq.data, ws, sz, out=out, w_prepared=wprep)

            fns = [
                lambda: ours("wgmma4"),
                lambda: ours("wgmma5"),
                lambda x=x, w=w, offs=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            ]
            for fn in fns:
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for fn in fns:
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"{shape}: launched wgmma4, wgmma5, torch bf16 once each")
    return {"kernel": "ncu", "shapes": shapes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="wgmma3", choices=("wgmma3", "wgmma5", "wgrad", "raster", "builds", "ncu"))
    ap.add_argument(
        "--shape", default=None, help="a bench_gemm shape or MxKxNxG; raster and builds also take a comma list"
    )
    ap.add_argument("--builds", default=None, help="--kernel builds: name=impl[@stages]:options;... (parse_builds)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--pairs", type=int, default=0, help="--kernel builds: alternate single launches this many times")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.shape_given = args.shape is not None
    args.shape = args.shape or "dsv3_up"
    if args.kernel in ("wgmma5", "wgrad", "raster", "builds", "ncu"):
        exp = {
            "wgmma5": experiments_w5,
            "wgrad": experiments_wgrad,
            "raster": experiments_builds,
            "builds": experiments_builds,
            "ncu": launches_for_ncu,
        }[args.kernel]
        res = exp(args)
        from moe_ep.provenance import code_version  # noqa: PLC0415

        res["commit"] = code_version()  # MOE_EP_COMMIT on the device (its copy's git metadata may be stale)
        print(json.dumps(res, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    m, k, n, g, sizes, sz, x, w, xq, wq, xs, ws, out = fprop_operands(args.shape)
    ref = gemm_cuda.grouped_mm_fprop(xq.data, xs, wq.data, ws, sz)  # whatever MOE_EP_GEMM_IMPL selects
    flops = 2.0 * sum(sizes) * n * k
    res = {"shape": args.shape, "M": m, "K": k, "N": n, "G": g, "ksteps": -(-k // 64), "tflops": {}}
    for name, opts in (("normal", ()), ("prof", ("-DW3_PROF",)), ("no_cvt", ("-DW3_NO_CVT",))):
        run, _ = launcher(opts, xq, xs, wq, ws, sz, out)
        ms = time_ms(run, 3, 20)
        res["tflops"][name] = flops / ms / 1e9
        if name == "normal":
            torch.cuda.synchronize()
            res["normal_matches_default_impl"] = bool(torch.equal(out, ref))
    ctas = min(8192, (-(-m // 128) + g) * (-(-n // 256)))
    mod = _cuda.get_module(gemm_cuda._WGMMA3_FILE, extra_options=("-DW3_PROF",))
    cp = _cuda.cupy()
    prof = cp.ndarray((8192, 2, 8), dtype=cp.uint64, memptr=mod.get_global("w3_prof")).get().astype(np.float64)
    prof = prof[:ctas]
    live = prof[:, 0, 7] > 0
    res["ctas_profiled"] = int(live.sum())
    for wg in range(2):
        p = prof[live, wg]
        res[f"wg{wg}_cycles_per_step"] = {
            ph: round(float(p[:, i].mean() / res["ksteps"]), 1) for i, ph in enumerate(PHASES)
        }
        res[f"wg{wg}_cta_cycles"] = float(p[:, 7].mean())
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
