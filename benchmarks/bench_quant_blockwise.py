"""Benchmark of the blockwise FP8 quantizers the recipe runs (moe_ep.blockwise.cuda) at the layer's shapes, against a
same-size copy.

    python benchmarks/bench_quant_blockwise.py [--json PATH] [--reps N] [--shapes dsv3,small]

Shapes (one EP rank's expert MLP): dsv3 M = 32768 rows, H = 7168, F = 2048, 64 local experts; small M = 32768,
H = 2048, F = 768, 32 experts; group sizes uniform (M / E rows each). Kernels (what
moe_ep.experts.sm90.blockwise runs; "prepared": 128x1 blocks per group written exactly dequantized in bf16, the bf16
wgrad kernel's operand layout):
  rowwise_x             quantize_rowwise(x [M, H] bf16)                    (x / dy 1x128 rows)
  colwise_prep_bf16     quantize_colwise_prepared(dy [M, H] bf16, sizes)   (wgrad2's dy operand)
  colwise_prep_requant  quantize_colwise_prepared((x e4m3, scale), sizes)  (wgrad1's x, from the payload)
  weight_w13_bf16 / weight_w13_fp32 / weight_w2_fp32
                        quantize_weight(w13 [E, 2F, H] / w2 [E, H, F])     (data, data_t and scales in one pass)
  swiglu_fwd            swiglu_quantize(a [M, 2F])                         (h row-wise: the forward)
  swiglu_col_prep       swiglu_colwise_prepared(a, sizes)                  (h's column operand alone: wgrad2's)
  swiglu_bwd_prep       swiglu_bwd_quantize_prepared(a, dh, sizes)         (dA row-wise + its column operand)

The SwiGLU kernels run in their launch configuration (moe_ep.blockwise.cuda.SWIGLU_CFG). Each kernel's bytes are
checked against moe_ep.blockwise.reference first (on the GPU; the weights on 4 experts; the prepared operands on the
groups' rows), then timed with CUDA events (median of --reps, L2 flushed by a 256 MiB read before each rep, the CPU
kept ahead by a spin kernel). Bytes moved = input bytes read + bytes written (e4m3 data and scales; 2 per element of
a prepared operand's rows). The same-size copy is a torch device-to-device copy of (bytes moved) / 2 bytes (its read
+ write equals the kernel's traffic), timed the same way; pct_of_copy = kernel GB/s / copy GB/s.
Writes JSON {"meta": {...}, "results": [...]}.

benchmarks/results/bench_quant_blockwise.json was measured at its commit (meta.commit), with the kernels of that
time: its colwise_* and swiglu_fwd_col / swiglu_bwd rows are the e4m3 transposed column quantizers since deleted
(git keeps them), not the prepared ones timed here.
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

from moe_ep.blockwise import cuda as bw  # noqa: E402
from moe_ep.blockwise import reference as ref  # noqa: E402
from moe_ep.experts.reference import swiglu, swiglu_bwd  # noqa: E402

SHAPES = {"dsv3": (32768, 7168, 2048, 64), "small": (32768, 2048, 768, 32)}  # M, H, F, experts


class Timer:
    """Median GPU time (ms) of fn() with the L2 flushed (a 256 MiB read: clean lines) and the CPU ahead."""

    def __init__(self, reps: int, warmup: int = 3):
        self.reps, self.warmup = reps, warmup
        self.flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        for s, e in ev:
            torch.cuda._sleep(200_000)
            self.flush.max()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev)


def copy_gbps(timer: Timer, nbytes: int) -> float:
    """GB/s (read + write) of a device-to-device copy of nbytes bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _prep_eq(got: torch.Tensor, want: torch.Tensor, sizes) -> bool:
    """A prepared operand on the rows the kernels write (each group's rows and the zero rows padding it to 64)."""
    n = 64 * sum(-(-v // 64) for v in sizes)
    return _eq(got[:n], want[:n])


def cases(shape: str, dev) -> list[tuple]:
    """(kernel, fn, check, bytes moved) of one shape; inputs allocated here."""
    m, h, f, e = SHAPES[shape]
    g = torch.Generator(device=dev).manual_seed(0)
    sizes_l = [m // e] * e
    sizes = torch.tensor(sizes_l, dtype=torch.int32, device=dev)
    x = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    xq = ref.quantize_rowwise_torch(x)
    a = (torch.randn(m, 2 * f, generator=g, device=dev) * 2).to(torch.bfloat16)
    dh = torch.randn(m, f, generator=g, device=dev).to(torch.bfloat16) * 1e-3
    w13 = torch.randn(e, 2 * f, h, generator=g, device=dev) * 0.02
    w2 = torch.randn(e, h, f, generator=g, device=dev) * 0.02
    w13b = w13.to(torch.bfloat16)
    prows = 64 * sum(-(-v // 64) for v in sizes_l)  # rows of the prepared operands the kernels write
    wsub = 4  # experts checked against the reference (its fp32 intermediates of all 64 would be ~30 GB)

    def chk_weight(w):
        got = bw.quantize_weight(w)
        want = ref.quantize_weight_torch(w[:wsub])
        return all(_eq(a_[:wsub], b_) for a_, b_ in zip(got, want, strict=True))

    def chk_bwd():
        got = bw.swiglu_bwd_quantize_prepared(a, dh, sizes)
        da = swiglu_bwd(a, dh)
        want_r = ref.quantize_rowwise_torch(da)
        return (
            _eq(got[0], want_r[0])
            and _eq(got[1], want_r[1])
            and _prep_eq(got[2], ref.quantize_colwise_prepared_torch(da, sizes_l), sizes_l)
        )

    sc = lambda n: n // 128  # scale bytes of n elements
    return [
        (
            "rowwise_x",
            lambda: bw.quantize_rowwise(x),
            lambda: all(_eq(p, q) for p, q in zip(bw.quantize_rowwise(x), xq, strict=True)),
            2 * m * h + m * h + sc(m * h),
        ),
        (
            "colwise_prep_bf16",
            lambda: bw.quantize_colwise_prepared(x, sizes),
            lambda: _prep_eq(
                bw.quantize_colwise_prepared(x, sizes), ref.quantize_colwise_prepared_torch(x, sizes_l), sizes_l
            ),
            2 * m * h + 2 * h * prows,
        ),
        (
            "colwise_prep_requant",
            lambda: bw.quantize_colwise_prepared(xq, sizes),
            lambda: _prep_eq(
                bw.quantize_colwise_prepared(xq, sizes),
                ref.quantize_colwise_prepared_torch(ref.dequantize_rowwise_torch(*xq), sizes_l),
                sizes_l,
            ),
            m * h + sc(m * h) + 2 * h * prows,
        ),
        ("weight_w13_bf16", lambda: bw.quantize_weight(w13b), lambda: chk_weight(w13b), 4 * w13.numel()),
        ("weight_w13_fp32", lambda: bw.quantize_weight(w13), lambda: chk_weight(w13), 6 * w13.numel()),
        ("weight_w2_fp32", lambda: bw.quantize_weight(w2), lambda: chk_weight(w2), 6 * w2.numel()),
        (
            "swiglu_fwd",
            lambda: bw.swiglu_quantize(a),
            lambda: all(
                _eq(p, q) for p, q in zip(bw.swiglu_quantize(a), ref.quantize_rowwise_torch(swiglu(a)), strict=True)
            ),
            4 * m * f + m * f + sc(m * f),
        ),
        (
            "swiglu_col_prep",
            lambda: bw.swiglu_colwise_prepared(a, sizes),
            lambda: _prep_eq(
                bw.swiglu_colwise_prepared(a, sizes), ref.quantize_colwise_prepared_torch(swiglu(a), sizes_l), sizes_l
            ),
            4 * m * f + 2 * f * prows,
        ),
        (
            "swiglu_bwd_prep",
            lambda: bw.swiglu_bwd_quantize_prepared(a, dh, sizes),
            chk_bwd,
            6 * m * f + 2 * m * f + sc(2 * m * f) + 2 * 2 * f * prows,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="dsv3,small")
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = Timer(args.reps)
    commit = os.environ.get("MOE_EP_COMMIT", "unknown")
    meta = {"device": torch.cuda.get_device_name(), "commit": commit, "torch": torch.__version__, "reps": args.reps}
    print(meta)
    results = []
    for shape in args.shapes.split(","):
        m, h, f, e = SHAPES[shape]
        label = f"{shape} M={m} H={h} F={f} E={e}"
        runs = []
        for kernel, fn, check, nbytes in cases(shape, dev):
            runs.append((kernel, fn, check, nbytes))
        for kernel, fn, check, nbytes in runs:
            ok = bool(check())
            torch.cuda.empty_cache()
            ms = timer(fn)
            gbps = nbytes / (ms * 1e-3) / 1e9
            cp = copy_gbps(timer, nbytes // 2)
            row = {"kernel": kernel, "shape": label, "ms": round(ms, 4), "gbps": round(gbps, 1),
                   "pct_of_copy": round(100 * gbps / cp, 1), "copy_gbps": round(cp, 1), "bytes": nbytes,
                   "bytes_equal_reference": ok}  # fmt: skip
            results.append(row)
            print(f"{kernel:<18} {label:<34} ok={ok!s:<5} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s  copy {cp:6.0f}  "
                  f"{100 * gbps / cp:5.1f}%", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
