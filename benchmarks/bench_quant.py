"""Benchmark of the product's MXFP8 quantization paths against the device copy bandwidth and torch.compile.

    python benchmarks/bench_quant.py [--quick] [--json PATH] [--reps N] [--compile static|dynamic|off]

Variants (each the launcher the product calls, with its automatic kernel choice):
  row_plain       ``quantize(x, -1)``: row-wise, plain scales (``moe_ep.mxfp8.quantize`` on CUDA)
  col_nt          ``quantize(x, 0)``: column-wise in x's layout, plain scales
  weights_fused   ``quantize_weights_fused`` of x as 8 experts' weights: both GEMM operands of each
  grouped_dual_prep, swiglu_dual_prep, swiglu_bwd_dual_prep
                  ``quantize_grouped_dual`` in 32 groups (the expert MLP's four quantization passes: row-wise MXFP8
                  and the wgrad's prepared bf16 column operand; bf16 inputs whatever --dtype)

For every (variant, M, K): checks the kernel's bytes against the CPU reference on a slice of rows, then times
kernel and the ``torch.compile``-d reference in the same process with CUDA events (median of ``--reps``; the L2
is flushed before each rep and a spin kernel keeps the GPU queue ahead of the CPU, so launch overhead is not
timed). Bytes moved = input read + e4m3 data written + scale bytes written (both operands where there are two).
Copy bandwidth = a large (2 GiB) device-to-device copy, read + write bytes: the targets are judged against it.
Each shape also reports a copy of its own size (``pct_copy_same_size``), the ceiling that launch and tail leave.
Each row names the kernels the variant launched (``kernels``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: E402
from moe_ep.mxfp8 import quantize_torch, to_blocked  # noqa: E402
from tests import refs  # noqa: E402

TARGETS = {"row_plain": 0.92, "col_nt": 0.85, "weights_fused": 0.85}  # fraction of copy bandwidth (H200)
MIN_RATIO = 1.05  # vs torch.compile
EXPERTS = 8  # weights_fused: x [M, K] as [8, M / 8, K]


def git_commit() -> str:
    from launch.provenance import code_version  # noqa: PLC0415

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

    The L2 is flushed by READING a 256 MiB buffer: a flush that writes (``zero_()``) leaves dirty lines whose
    write-back lands inside the next timed kernel. Kernel, torch.compile baseline and copy bandwidth are all timed
    the same way.
    """

    def __init__(self, reps: int, warmup: int, sleep_cycles: int = 200_000):
        self.reps, self.warmup = reps, warmup
        self.flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
        # GPU spin per launch (torch.cuda._sleep cycles, ~100 us) that the CPU's launches queue behind
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
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def copy_bandwidth(timer: Timer, nbytes: int = 2 << 30) -> float:
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = timer(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    return 2 * nbytes / (ms * 1e-3)


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


# ----------------------------------------------------------------------------------------------------------
# variants: (kernel closure, bytes), the torch.compile baseline's reference, a correctness check on a slice
# ----------------------------------------------------------------------------------------------------------


def _ref_row_plain(x):
    q = quantize_torch(x, -1)
    return q.data, q.scale


def _ref_col_nt(x):
    q = quantize_torch(x, 0)
    return q.data, q.scale


def _ref_weights_fused(x):
    w = x.view(EXPERTS, -1, x.shape[1])
    q, qt = quantize_torch(w, -1), quantize_torch(w.transpose(1, 2), -1)
    return q.data, to_blocked(q.scale), qt.data, to_blocked(qt.scale)


REFS = {"row_plain": _ref_row_plain, "col_nt": _ref_col_nt, "weights_fused": _ref_weights_fused}

# both grouped GEMM operands from one read, the column operand written as the wgrad's prepared bf16 ("_prep")
DUAL = ("grouped_dual_prep", "swiglu_dual_prep", "swiglu_bwd_dual_prep")
VARIANTS = ("row_plain", "col_nt", "weights_fused", *DUAL)


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def check(variant: str, x: torch.Tensor, rows: int = 512) -> bool:
    """Kernel bytes == reference bytes on the first ``rows`` rows (all columns)."""
    xs = x[:rows].contiguous()
    xc = xs.cpu()
    if variant == "row_plain":
        q = mxfp8_cuda.quantize(xs, 1)
        return all(map(_eq, (q.data, q.scale), _ref_row_plain(xc)))
    if variant == "col_nt":
        q = mxfp8_cuda.quantize(xs, 0)
        return all(map(_eq, (q.data, q.scale), _ref_col_nt(xc)))
    if variant == "weights_fused":
        return all(
            map(_eq, mxfp8_cuda.quantize_weights_fused(xs.view(EXPERTS, -1, xs.shape[1])), _ref_weights_fused(xc))
        )
    if variant in DUAL:
        from tests.refs import quantize_grouped_dual_torch  # noqa: PLC0415

        xs, kw, kh = _dual_args(variant, xs)
        sizes = torch.tensor([0, 100, 1, 0, rows - 101], dtype=torch.int32)
        got = mxfp8_cuda.quantize_grouped_dual(xs, sizes.to(xs.device), **kw)
        # SwiGLU on the GPU: torch's CUDA ops, as the kernel
        want = quantize_grouped_dual_torch(xs, sizes, colwise="bf16", **kw)
        used = refs.colwise_prep_rows_used(sizes)  # the prepared operand: its used rows (finite input: no NaN payloads)
        return all(map(_eq, got[:2], want[:2])) and _eq(got[2][:used], want[2][:used]) and got[2].shape[1] == kh
    raise ValueError(variant)


def _random_sizes(m: int, groups: int, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randint(0, m + 1, (groups - 1,), generator=g)).values
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([m])])).to(torch.int32).to(dev)


def _dual_args(variant: str, x: torch.Tensor) -> tuple[torch.Tensor, dict, int]:
    """(input, quantize_grouped_dual keyword arguments, quantized width) of a DUAL variant on x [M, K].

    grouped_dual_prep: x itself; swiglu_dual_prep: x plays a = (gate | up), h is [M, K/2]; swiglu_bwd_dual_prep:
    x plays a, with a bf16 dh [M, K/2] (the dgrad GEMM's output, and what expert_mlp_cuda passes), dA is [M, K].
    All take x in bf16 (the MoE path's activations and GEMM outputs).
    """
    a = x.to(torch.bfloat16)
    if variant == "grouped_dual_prep":
        return a, {}, a.shape[1]
    if variant == "swiglu_dual_prep":
        return a, {"apply_swiglu": True}, a.shape[1] // 2
    f = a.shape[1] // 2
    dh = (a[:, :f].float() * 0.5 - a[:, f:].float()).to(torch.bfloat16).contiguous()
    return a, {"swiglu_dh": dh}, a.shape[1]


def kernel_fn(variant: str, x: torch.Tensor, groups: int):
    """(closure launching the variant's kernels, bytes moved); outputs preallocated where the launcher takes them."""
    m, k = x.shape
    dev = x.device
    read = x.numel() * x.element_size()
    if variant in DUAL:
        xin, kw, kh = _dual_args(variant, x)
        sizes = _random_sizes(m, groups, dev)
        outs = mxfp8_cuda.quantize_grouped_dual(xin, sizes, **kw)[:3]  # (data, scale, prepared column operand)
        col = 2 * kh * refs.colwise_prep_rows_used(sizes)  # bf16 rows written: each group's rows up to the next 64
        nbytes = (
            sum(t.numel() * t.element_size() for t in (xin, *kw.values()) if isinstance(t, torch.Tensor))
            + m * kh
            + outs[1].numel()
            + col
        )
        return (lambda: mxfp8_cuda.quantize_grouped_dual_into(xin, sizes, *outs, **kw)), nbytes
    if variant == "row_plain":
        return (lambda: mxfp8_cuda.quantize(x, 1)), read + m * k + m * k // 32
    if variant == "col_nt":
        return (lambda: mxfp8_cuda.quantize(x, 0)), read + m * k + m * k // 32
    if variant == "weights_fused":
        w = x.view(EXPERTS, m // EXPERTS, k)
        outs = mxfp8_cuda.quantize_weights_fused(w)
        nbytes = read + sum(t.numel() * t.element_size() for t in outs)
        return (lambda: mxfp8_cuda.quantize_weights_fused_into(w, *outs)), nbytes
    raise ValueError(variant)


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
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--groups", type=int, default=32, help="groups of the grouped-dual variants")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    ms_list = [16384] if args.quick else [16384, 32768, 131072]
    ks = [2048, 7168]
    reps = args.reps or (20 if args.quick else 50)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
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
    hdr = (
        f"{'variant':<20} {'M':>7} {'K':>5}  {'ok':>3} {'us':>8} {'GB/s':>7} {'%copy':>6}  "
        f"{'compile us':>10} {'x vs compile':>12}  kernels"
    )
    print(hdr)
    print("-" * len(hdr), flush=True)
    for m in ms_list:
        for k in ks:
            x = torch.randn(m, k, device="cuda", dtype=torch.float32).mul_(4.0).to(dtype)
            # A copy of the same size as row-wise quantization's traffic (3 bytes per element, read + write): at
            # the small shapes launch and tail cost the copy too, so this is the ceiling of each shape.
            copy_same = copy_bandwidth(timer, 3 * m * k // 2)
            print(
                f"  same-size copy: {copy_same / 1e9:.0f} GB/s ({100 * copy_same / copy_bw:.1f}% of the large copy)",
                flush=True,
            )
            for v in variants:
                ok = check(v, x)
                fn, nbytes = kernel_fn(v, x, args.groups)
                kernels = [n for n, _, _ in recorded_launches(fn)]
                t = timer(fn)
                tc = None
                if v in compiled:
                    try:
                        f = compiled[v]
                        tc = timer(lambda f=f, x=x: f(x))
                    except Exception as e:  # noqa: BLE001
                        print(f"  torch.compile baseline failed for {v}: {type(e).__name__}: {e}", flush=True)
                bw = nbytes / (t * 1e-3)
                row = {
                    "variant": v,
                    "kernels": kernels,
                    "M": m,
                    "K": k,
                    "dtype": args.dtype,
                    "correct": ok,
                    "ms": t,
                    "bytes": nbytes,
                    "GBps": bw / 1e9,
                    "pct_copy": 100 * bw / copy_bw,
                    "copy_same_size_GBps": copy_same / 1e9,
                    "pct_copy_same_size": 100 * bw / copy_same,
                    "compile_ms": tc,
                    "ratio_vs_compile": (tc / t) if tc else None,
                }
                if v in TARGETS:
                    row["target_pct_copy"] = 100 * TARGETS[v]
                    row["meets_target"] = bool(bw >= TARGETS[v] * copy_bw and (tc is None or tc / t >= MIN_RATIO))
                rows.append(row)
                ctxt = f"{tc * 1e3:10.1f} {tc / t:11.2f}x" if tc else f"{'-':>10} {'-':>12}"
                print(
                    f"{v:<20} {m:>7} {k:>5}  {'yes' if ok else 'NO':>3} {t * 1e3:8.1f} {bw / 1e9:7.0f} "
                    f"{100 * bw / copy_bw:5.1f}%  {ctxt}  {','.join(kernels)}",
                    flush=True,
                )
                del fn
            del x
            torch.cuda.empty_cache()

    bad = [r for r in rows if not r["correct"]]
    print(f"\ncorrect: {len(rows) - len(bad)}/{len(rows)}")
    print(f"targets met {sum(1 for r in rows if r.get('meets_target'))}/{sum(1 for r in rows if 'meets_target' in r)}")
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
        M=ms_list,
        K=ks,
        targets_pct_copy=TARGETS,
        min_ratio_vs_compile=MIN_RATIO,
    )
    if bad:
        raise SystemExit(f"{len(bad)} configurations produced wrong bytes")


if __name__ == "__main__":
    main()
