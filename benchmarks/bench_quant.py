"""Benchmark of the MXFP8 quantization kernels (issue 3) against the device copy bandwidth and torch.compile.

    python benchmarks/bench_quant.py [--quick] [--json PATH] [--reps N] [--compile static|dynamic|off]

For every (variant, M, K): checks the kernel's bytes against the CPU reference on a slice of rows, then times
kernel and the ``torch.compile``-d reference in the same process with CUDA events (median of ``--reps``; the L2
is flushed before each rep and a spin kernel keeps the GPU queue ahead of the CPU, so launch overhead is not
timed). Bytes moved = input read + e4m3 data written + scale bytes written (fused: both outputs).
Copy bandwidth = a large (2 GiB) device-to-device copy, read + write bytes: the targets are judged against it.
Each shape also reports a copy of its own size (``pct_copy_same_size``), the ceiling that launch and tail leave.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gemm import env_restored  # noqa: E402

from moe_ep.experts.operands import colwise_prep_rows_used  # noqa: E402
from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: E402
from moe_ep.mxfp8 import plan as quant_plan  # noqa: E402
from moe_ep.mxfp8 import quantize_torch, to_blocked, to_blocked_grouped  # noqa: E402

TARGETS = {"row_blocked": 0.92, "col_blocked": 0.85, "fused": 0.85}  # fraction of copy bandwidth (H200)
MIN_RATIO = 1.05  # vs torch.compile


def git_commit() -> str:
    from moe_ep.provenance import code_version  # noqa: PLC0415

    return code_version(ROOT)


def write_results(path: Path | None, rows: list, copy_bw: float | None, **config) -> None:
    """Write the quantizer benchmarks' JSON (nothing when path is None): device, torch, commit, config (with the
    copy bandwidth measured in the same run, GB/s; None when the script measures none) and rows."""
    if path is None:
        return
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "config": {**config, "copy_bandwidth_GBps": None if copy_bw is None else copy_bw / 1e9},
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


class Timer:
    """Median GPU time (ms) of fn() with a flushed L2 and the CPU kept ahead of the GPU.

    The L2 is flushed by READING a 256 MiB buffer: a flush that writes (``zero_()``) leaves up to 50 MB of dirty
    lines whose write-back lands inside the next timed kernel and was measured to cost small shapes up to ~30 %.
    Kernel, torch.compile baseline and copy bandwidth are all timed the same way.
    """

    def __init__(self, reps: int, warmup: int, before=None, sleep_cycles: int = 200_000):
        self.reps, self.warmup = reps, warmup
        self.flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
        # launched after the flush, before the start event (prof_quant_stamps.py --carveout, prof_quant_cold.py)
        self.before = before
        # GPU spin per launch (torch.cuda._sleep cycles, ~100 us by default) that the CPU's launches queue behind;
        # a before-hook with Python launch overhead needs more, or the GPU waits for the timed launch inside the
        # timed region (prof_quant_cold.py)
        self.sleep_cycles = sleep_cycles

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends, strict=True):
            torch.cuda._sleep(self.sleep_cycles)  # the launches below queue up behind it
            self.flush.max()  # reads 256 MiB: evicts the L2 with clean lines
            if self.before is not None:
                self.before()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def probe_tiles(x: torch.Tensor, what: str) -> tuple[int, int]:
    """(column tiles, row tiles) of x [M, K] for the 128 x 128-tile probes of kernels/bench_probe.cu, which need M and
    K multiples of 128 (they have no edge handling): a ValueError naming ``what`` otherwise."""
    m, k = x.shape
    if m % 128 or k % 128:
        raise ValueError(f"{what} needs M and K multiples of 128, got {m} x {k}")
    return k // 128, m // 128


def copy_bandwidth(timer: Timer, nbytes: int = 2 << 30) -> float:
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = timer(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    return 2 * nbytes / (ms * 1e-3)


def probe_tile_fn(x: torch.Tensor, out: torch.Tensor):
    """Closure launching kernels/bench_probe.cu's probe_tile: x [M, K] bf16 -> out [M, K] uint8 (the low byte of
    every element), one 128 x 128 tile per CTA; M and K multiples of 128 (:func:`probe_tiles`)."""
    from moe_ep import _cuda  # noqa: PLC0415

    ctiles, rtiles = probe_tiles(x, "probe_tile")
    fn = _cuda.get_function("bench_probe.cu", "probe_tile")
    args = (_cuda.ptr(x), _cuda.ptr(out), _cuda.i64(x.shape[0]), _cuda.i32(x.shape[1]), _cuda.i32(ctiles))
    return lambda: _cuda.launch(fn, rtiles * ctiles, 256, args)


def check_low_bytes(fn, x: torch.Tensor, out: torch.Tensor, what: str) -> None:
    """One launch of the probe fn into out (zeroed first): out [M, K] uint8 must hold the low byte of every bf16
    element of x [M, K] (kernels/bench_probe.cu's row output); an AssertionError naming ``what`` otherwise."""
    m, k = x.shape
    out.zero_()
    fn()
    if not torch.equal(out, x.view(torch.uint8).view(m, k, 2)[..., 0]):
        raise AssertionError(f"{what} wrote wrong bytes")


def recorded_launches(fn) -> list[tuple]:
    """(kernel name, grid, shared memory) of every mxfp8_cuda launch one call of fn makes (fn runs)."""
    seen = []
    launch = mxfp8_cuda._launch

    def rec(name, grid, args, shared_mem, *rest):
        seen.append((name, grid, shared_mem))
        return launch(name, grid, args, shared_mem, *rest)

    mxfp8_cuda._launch = rec
    try:
        fn()
    finally:
        mxfp8_cuda._launch = launch
    return seen


def probe_bandwidths(timer: Timer, x: torch.Tensor) -> dict[str, float]:
    """Bytes/s of kernels/bench_probe.cu on x's traffic (read 2 B + write 1 B per element, no arithmetic; the
    ``fused_*`` probes write a second byte per element at the transposed output's addresses).

    ``linear``: flat grid-stride order; ``tile``: mx_quant's 128x128 tile order, one tile per CTA. They tell
    how much of the gap to the copy bandwidth belongs to the traffic mix and access order rather than to the
    quantizer's arithmetic.
    """
    from moe_ep import _cuda  # noqa: PLC0415

    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    nchunks = m * k // 8
    sms = _cuda.num_sms(x.device)
    lin = _cuda.get_function("bench_probe.cu", "probe_linear")
    ctiles, rtiles = probe_tiles(x, "probe_bandwidths")
    grid_tile = rtiles * ctiles
    grid_lin = max(1, min(-(-nchunks // (256 * 8)), 3 * sms))
    res = {}
    for name, fn in (
        ("linear", lambda: _cuda.launch(lin, grid_lin, 256, (_cuda.ptr(x), _cuda.ptr(out), _cuda.i64(nchunks)))),
        ("tile", probe_tile_fn(x, out)),
    ):
        check_low_bytes(fn, x, out, f"probe_{name}")
        res[name] = 3 * m * k / (timer(fn) * 1e-3)
    # The fused quantizer's traffic: read 2 B, write 1 B row-wise + 1 B at the transposed output's addresses.
    fus = _cuda.get_function("bench_probe.cu", "probe_fused")
    outt = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    # orders 2-5 (bench_probe.cu): evict-first xt stores; a second row-major output; the xt stores alone
    for order, name in (
        (0, "fused_tile"),
        (1, "fused_group4"),
        (2, "fused_cs"),
        (3, "fused_two_rowmajor"),
        (4, "xt_only"),
        (5, "fused_pairs"),
    ):
        args = (_cuda.ptr(x), _cuda.ptr(out), _cuda.ptr(outt), _cuda.i64(m), _cuda.i32(k), _cuda.i32(ctiles))
        grid = grid_tile // 2 if order == 5 else grid_tile  # pairs need an even number of row tiles (all shapes)
        fn = lambda args=args, order=order, grid=grid: _cuda.launch(fus, grid, 256, (*args, _cuda.i32(order)))
        out.zero_()
        fn()
        torch.cuda.synchronize()
        if order != 4 and not torch.equal(out, x.view(torch.uint8).view(m, k, 2)[..., 0]):
            raise AssertionError(f"probe_{name} wrote wrong row bytes")
        res[name] = (3 if order == 4 else 4) * m * k / (timer(fn) * 1e-3)
    return res


# ----------------------------------------------------------------------------------------------------------
# variants: (kernel closure, compiled-reference closure or None, bytes, correctness check on a slice)
# ----------------------------------------------------------------------------------------------------------


def _ref_row_blocked(x):
    q = quantize_torch(x, -1)
    return q.data, to_blocked(q.scale)


def _ref_row_plain(x):
    q = quantize_torch(x, -1)
    return q.data, q.scale


def _ref_col_blocked(x):
    q = quantize_torch(x.t(), -1)
    return q.data, to_blocked(q.scale)


def _ref_fused(x):
    q, qt = quantize_torch(x, -1), quantize_torch(x.t(), -1)
    return q.data, to_blocked(q.scale), qt.data, to_blocked(qt.scale)


REFS = {
    "row_plain": _ref_row_plain,
    "row_blocked": _ref_row_blocked,
    "col_blocked": _ref_col_blocked,
    "fused": _ref_fused,
}


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def check(variant: str, x: torch.Tensor, groups: int = 32, rows: int = 512) -> bool:
    """Kernel bytes == reference bytes on the first ``rows`` rows (all columns).

    The grouped-dual kernel is checked at the cp.async depth the timed full-size input (in ``groups`` groups) gets:
    the ``rows``-row slice alone would get 2 stages under MOE_EP_QUANT_DUAL_STAGES=auto.
    """
    if variant in ("grouped_dual", "grouped_dual_prep") and x.dtype == torch.bfloat16:
        m, k = x.shape
        tiles = (quant_plan.cdiv(m, quant_plan.TILE) + groups) * quant_plan.cdiv(k, quant_plan.TILE)
        with env_restored("MOE_EP_QUANT_DUAL_STAGES"):
            os.environ["MOE_EP_QUANT_DUAL_STAGES"] = str(quant_plan.dual_stages(tiles, x.device))
            return _check(variant, x, rows)
    return _check(variant, x, rows)


def _check(variant: str, x: torch.Tensor, rows: int) -> bool:
    xs = x[:rows].contiguous()
    xc = xs.cpu()
    if variant == "row_plain":
        return all(map(_eq, mxfp8_cuda.quantize_rowwise(xs, "plain"), _ref_row_plain(xc)))
    if variant == "row_blocked":
        return all(map(_eq, mxfp8_cuda.quantize_rowwise(xs, "blocked"), _ref_row_blocked(xc)))
    if variant in DUAL:
        from moe_ep.experts.reference import quantize_grouped_dual_torch  # noqa: PLC0415

        xs, kw, kh = _dual_args(variant, x[:rows].contiguous())
        sizes = torch.tensor([0, 100, 1, 0, rows - 101], dtype=torch.int32)
        got = mxfp8_cuda.quantize_grouped_dual(xs, sizes.to(xs.device), **kw)
        want = quantize_grouped_dual_torch(xs, sizes, **kw)  # SwiGLU on the GPU: torch's CUDA ops, as the kernel
        if kw.get("colwise") == "bf16":  # the prepared operand: its used rows (finite input: no NaN payloads)
            used = colwise_prep_rows_used(sizes)
            return all(map(_eq, got[:2], want[:2])) and _eq(got[2][:used], want[2][:used]) and got[2].shape[1] == kh
        used = sum(-(-int(n) // 32) for n in sizes)
        return all(map(_eq, got[:3], want[:3])) and _eq(got[3][:used], want[3][:used]) and got[3].shape[1] == kh
    if variant == "row_grouped":
        sizes = torch.tensor([0, 100, 1, 0, rows - 101], dtype=torch.int32)
        d, s = mxfp8_cuda.quantize_rowwise(xs, "grouped", sizes.to(xs.device))
        q = quantize_torch(xc, -1)
        return _eq(d, q.data) and _eq(s, to_blocked_grouped(q.scale, sizes, "m"))
    if variant == "col_blocked":
        return all(map(_eq, mxfp8_cuda.quantize_colwise(xs, "blocked"), _ref_col_blocked(xc)))
    if variant == "fused":
        return all(map(_eq, mxfp8_cuda.quantize_fused(xs, "blocked", "blocked"), _ref_fused(xc)))
    raise ValueError(variant)


def _random_sizes(m: int, groups: int, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randint(0, m + 1, (groups - 1,), generator=g)).values
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([m])])).to(torch.int32).to(dev)


# both grouped GEMM operands from one read; "_prep": the column operand written as the wgrad's prepared bf16
DUAL = (
    "grouped_dual",
    "swiglu_dual",
    "swiglu_bwd_dual",
    "grouped_dual_prep",
    "swiglu_dual_prep",
    "swiglu_bwd_dual_prep",
)


def _dual_args(variant: str, x: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """(input, quantize_grouped_dual keyword arguments, quantized width) of a DUAL variant on x [M, K].

    swiglu_dual: x plays a = (gate | up), h is [M, K/2]; swiglu_bwd_dual: x plays a, with a bf16 dh [M, K/2]
    (the dgrad GEMM's default output, and what expert_mlp_cuda passes), dA is [M, K].
    The SwiGLU variants take bf16 GEMM outputs.
    A "_prep" suffix adds colwise="bf16".
    """
    if variant.endswith("_prep"):
        xin, kw, kh = _dual_args(variant.removesuffix("_prep"), x)
        return xin, {**kw, "colwise": "bf16"}, kh
    if variant == "grouped_dual":
        return x, {}, x.shape[1]
    a = x.to(torch.bfloat16)
    if variant == "swiglu_dual":
        return a, {"apply_swiglu": True}, a.shape[1] // 2
    f = a.shape[1] // 2
    dh = (a[:, :f].float() * 0.5 - a[:, f:].float()).to(torch.bfloat16).contiguous()
    return a, {"swiglu_dh": dh}, a.shape[1]


def _launcher(fn, *outs: torch.Tensor):
    fn.outs = tuple(t for t in outs if t is not None)  # the preallocated outputs fn writes (check_schedules)
    return fn


def run_filled(fn) -> tuple[torch.Tensor, ...]:
    """fn's outputs (``fn.outs``, as bytes) after one launch into buffers prefilled with 0xAB, so that bytes no
    launch wrote show as junk."""
    for t in fn.outs:
        t.view(torch.uint8).fill_(0xAB)
    fn()
    return tuple(t.view(torch.uint8) for t in fn.outs)


def same_bytes(a: tuple, b: tuple) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def kernel_fn(variant: str, x: torch.Tensor, groups: int):
    """(closure launching the kernel into preallocated outputs, bytes moved); the closure's ``outs`` are those
    outputs."""
    m, k = x.shape
    dev = x.device
    read = x.numel() * x.element_size()
    if variant in DUAL:
        xin, kw, kh = _dual_args(variant, x)
        sizes = _random_sizes(m, groups, dev)
        outs = mxfp8_cuda.quantize_grouped_dual(xin, sizes, **kw)
        if kw.get("colwise") == "bf16":  # bf16 rows written: each group's rows up to its next multiple of 64
            col = 2 * kh * colwise_prep_rows_used(sizes)
        else:
            col = m * kh + -(-m // 32) * kh
        nbytes = (
            sum(t.numel() * t.element_size() for t in (xin, *kw.values()) if isinstance(t, torch.Tensor))
            + m * kh
            + outs[1].numel()
            + col
        )
        return _launcher(lambda: mxfp8_cuda.quantize_grouped_dual_into(xin, sizes, *outs, **kw), *outs), nbytes
    data = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev)
    if variant in ("row_plain", "row_blocked", "row_grouped"):
        layout = variant.removeprefix("row_")
        sizes = None
        if layout == "grouped":
            sizes = _random_sizes(m, groups, dev)
        scale = torch.empty(mxfp8_cuda.row_scale_shape(m, k, layout, groups), dtype=torch.uint8, device=dev)
        fn = _launcher(lambda: mxfp8_cuda.quantize_rowwise_into(x, data, scale, layout, sizes), data, scale)
        return fn, read + m * k + scale.numel()
    data_t = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=dev)
    scale_t = torch.empty(mxfp8_cuda.col_scale_shape(m, k, "blocked"), dtype=torch.uint8, device=dev)
    if variant == "col_blocked":
        fn = _launcher(lambda: mxfp8_cuda.quantize_colwise_into(x, data_t, scale_t, "blocked"), data_t, scale_t)
        return fn, read + m * k + scale_t.numel()
    scale = torch.empty(mxfp8_cuda.row_scale_shape(m, k, "blocked"), dtype=torch.uint8, device=dev)
    fn = lambda: mxfp8_cuda.quantize_fused_into(x, data, scale, data_t, scale_t, "blocked", "blocked")
    return _launcher(fn, data, scale, data_t, scale_t), read + 2 * m * k + scale.numel() + scale_t.numel()


def check_schedules(variant: str, x: torch.Tensor, groups: int) -> tuple[bool | None, bool]:
    """(equal, dynamic ran): the whole output of the timed shape under MOE_EP_QUANT_SCHED=dynamic == the static
    schedule's (``check`` covers 512 rows: fewer tiles than the persistent grid has CTAs, so no tickets), and
    whether the dynamic run launched mx_quant_dyn at all (the dual kernels and one-tile-per-CTA launches have only
    the static order: for them equal is None, nothing was compared). Each schedule runs three launches into
    outputs refilled with 0xAB before the last, so a tile no CTA took, or a counter left non-zero by the launch
    before, cannot pass on stale bytes.
    """
    got, dyn_names = [], []
    with env_restored("MOE_EP_QUANT_SCHED"):
        for sched in ("static", "dynamic"):
            os.environ["MOE_EP_QUANT_SCHED"] = sched
            fn, _ = kernel_fn(variant, x, groups)
            fn()
            fn()
            launched = recorded_launches(lambda fn=fn: got.append(run_filled(fn)))
            if sched == "dynamic":
                dyn_names = [name for name, _, _ in launched]
    dyn_ran = any(n.startswith("mx_quant_dyn<") for n in dyn_names)
    return (same_bytes(*got) if dyn_ran else None), dyn_ran


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="M=16384 only, fewer reps")
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument(
        "--compile",
        choices=["static", "dynamic", "off"],
        default="static",
        help="torch.compile baseline: static shapes (one compile per shape), dynamic, or none",
    )
    ap.add_argument(
        "--variants",
        default=",".join(("row_plain", "row_blocked", "row_grouped", "col_blocked", "fused", *DUAL)),
    )
    ap.add_argument("--groups", type=int, default=32, help="groups of the row_grouped variant")
    ap.add_argument("--pipes", default="", help="MOE_EP_QUANT_PIPE values to sweep, e.g. auto,0,2,3 (default: current)")
    ap.add_argument(
        "--dual-impls",
        default="",
        help="MOE_EP_QUANT_DUAL values to sweep for the grouped-dual variants, e.g. reg,smem (default: current)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    ms_list = [16384] if args.quick else [16384, 32768, 131072]
    ks = [2048, 7168]
    reps = args.reps or (20 if args.quick else 50)
    variants = args.variants.split(",")
    timer = Timer(reps, warmup=3)

    copy_bw = copy_bandwidth(timer)
    name = torch.cuda.get_device_name()
    print(
        f"device: {name}   torch {torch.__version__}   copy bandwidth (read+write): {copy_bw / 1e9:.0f} GB/s",
        flush=True,
    )
    compiled = {}
    for knob in ("cache_size_limit", "recompile_limit"):  # one static compile per shape must not hit the limit
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    if args.compile != "off":
        for v in variants:
            if v in REFS:
                compiled[v] = torch.compile(REFS[v], dynamic=args.compile == "dynamic")

    rows = []
    pipes = [-1 if p == "auto" else int(p) for p in args.pipes.split(",") if p] or [quant_plan.pipe_switch()]
    duals = [d for d in args.dual_impls.split(",") if d] or [quant_plan.dual_impl()]
    tcs: dict = {}  # torch.compile time per (variant, M, K), timed once
    hdr = (
        f"{'variant':<12} {'pipe':>4} {'M':>7} {'K':>5}  {'ok':>3} {'us':>8} {'GB/s':>7} {'%copy':>6}  "
        f"{'compile us':>10} {'x vs compile':>12}"
    )
    print(hdr)
    print("-" * len(hdr), flush=True)
    for m in ms_list:
        for k in ks:
            x = torch.randn(m, k, device="cuda", dtype=torch.float32).mul_(4.0).to(dtype)
            probes = probe_bandwidths(timer, x) if x.dtype == torch.bfloat16 else {}
            # A copy of the same size as row-wise quantization's traffic (3 bytes per element, read + write): at
            # the small shapes launch and tail cost the copy too, so this is the ceiling of each shape.
            copy_same = copy_bandwidth(timer, 3 * m * k // 2)
            print(
                f"  same-size copy: {copy_same / 1e9:.0f} GB/s ({100 * copy_same / copy_bw:.1f}% of the large copy)",
                flush=True,
            )
            if probes:
                print(
                    "  same-traffic probes (read bf16, write 1 B/element, no math): "
                    + ", ".join(f"{n} {v / 1e9:.0f} GB/s ({100 * v / copy_bw:.1f}% copy)" for n, v in probes.items()),
                    flush=True,
                )
            combos = [(v, p, d) for v in variants for p in pipes for d in (duals if v in DUAL else [""])]
            for v, pipe, dual in combos:
                os.environ["MOE_EP_QUANT_PIPE"] = "auto" if pipe < 0 else str(pipe)
                if dual:
                    os.environ["MOE_EP_QUANT_DUAL"] = dual
                ok = check(v, x, args.groups)
                sched_ok, dyn_ran = check_schedules(v, x, args.groups)
                ok = ok and sched_ok is not False
                fn, nbytes = kernel_fn(v, x, args.groups)
                t = timer(fn)
                tc = tcs.get((v, m, k))
                if v in compiled and (v, m, k) not in tcs:
                    try:
                        f = compiled[v]
                        tc = tcs[(v, m, k)] = timer(lambda f=f, x=x: f(x))
                    except Exception as e:  # noqa: BLE001
                        print(f"  torch.compile baseline failed for {v}: {type(e).__name__}: {e}", flush=True)
                bw = nbytes / (t * 1e-3)
                row = {
                    "variant": v,
                    "pipe": pipe,
                    "dual_impl": dual or None,
                    "M": m,
                    "K": k,
                    "dtype": args.dtype,
                    "correct": ok,
                    "schedules_equal": sched_ok,
                    "dynamic_schedule_checked": dyn_ran,
                    "ms": t,
                    "bytes": nbytes,
                    "GBps": bw / 1e9,
                    "pct_copy": 100 * bw / copy_bw,
                    "copy_same_size_GBps": copy_same / 1e9,
                    "pct_copy_same_size": 100 * bw / copy_same,
                    **{f"probe_{n}_GBps": v / 1e9 for n, v in probes.items()},
                    **{f"pct_probe_{n}": 100 * bw / v for n, v in probes.items()},
                    "compile_ms": tc,
                    "ratio_vs_compile": (tc / t) if tc else None,
                }
                if v in TARGETS:
                    row["target_pct_copy"] = 100 * TARGETS[v]
                    row["meets_target"] = bool(bw >= TARGETS[v] * copy_bw and (tc is None or tc / t >= MIN_RATIO))
                rows.append(row)
                ctxt = f"{tc * 1e3:10.1f} {tc / t:11.2f}x" if tc else f"{'-':>10} {'-':>12}"
                label = v + (":" + dual if dual else "")
                print(
                    f"{label:<12} {pipe:>4} {m:>7} {k:>5}  {'yes' if ok else 'NO':>3} {t * 1e3:8.1f} {bw / 1e9:7.0f} "
                    f"{100 * bw / copy_bw:5.1f}%  {ctxt}",
                    flush=True,
                )
                del fn
            del x
            torch.cuda.empty_cache()

    bad = [r for r in rows if not r["correct"]]
    print(f"\ncorrect: {len(rows) - len(bad)}/{len(rows)}")
    for pipe in pipes:
        rp = [r for r in rows if r["pipe"] == pipe]
        print(
            f"pipe {pipe}: targets met {sum(1 for r in rp if r.get('meets_target'))}/"
            f"{sum(1 for r in rp if 'meets_target' in r)}"
        )
    write_results(
        args.json,
        rows,
        copy_bw,
        quick=args.quick,
        reps=reps,
        dtype=args.dtype,
        compile=args.compile,
        variants=variants,
        groups=args.groups,
        pipes=pipes,
        dual_impls=duals,
        M=ms_list,
        K=ks,
        targets_pct_copy=TARGETS,
        min_ratio_vs_compile=MIN_RATIO,
    )
    if bad:
        raise SystemExit(f"{len(bad)} configurations produced wrong bytes")


if __name__ == "__main__":
    main()
