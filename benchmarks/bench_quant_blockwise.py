"""Benchmark of the blockwise FP8 quantizers (moe_ep.blockwise.cuda) at the layer's shapes, against a same-size copy.

    python benchmarks/bench_quant_blockwise.py [--json PATH] [--reps N] [--shapes dsv3,small]

Shapes (one EP rank's expert MLP): dsv3 M = 32768 rows, H = 7168, F = 2048, 64 local experts; small M = 32768,
H = 2048, F = 768, 32 experts; group sizes uniform (M / E rows each). Kernels:
  rowwise_x          quantize_rowwise(x [M, H] bf16)                     (the dispatch's source-side quantization)
  colwise_x_bf16     quantize_colwise_grouped(x [M, H] bf16)             (128x1 grouped, transposed)
  colwise_x_requant  quantize_colwise_grouped((x e4m3, scale))           (x^T / dy^T from the dispatched bytes)
  weight_w13_bf16 / weight_w13_fp32 / weight_w2_fp32
                     quantize_weight(w13 [E, 2F, H] / w2 [E, H, F])      (data, data_t and scales in one pass)
  swiglu_fwd         swiglu_quantize(a [M, 2F])                          (h row-wise: inference / no wgrad)
  swiglu_fwd_col     swiglu_quantize(a, sizes, colwise=True)             (h row-wise + colwise grouped)
  swiglu_bwd         swiglu_bwd_quantize(a, dh, sizes)                   (dA row-wise + colwise grouped)

The SwiGLU kernels run in their launch configuration (moe_ep.blockwise.cuda.SWIGLU_CFG: threads, inputs staged
in registers or by cp.async in shared memory), named kernel[config]. Each kernel's bytes are checked against
moe_ep.blockwise.reference first (on the GPU; the weights on 4 experts), then timed with CUDA events (median of
--reps, L2 flushed by a 256 MiB read before each rep, the CPU kept ahead by a spin kernel). Bytes moved = input bytes
read + e4m3 data and scale bytes written. The same-size copy is a torch device-to-device copy of (bytes moved) / 2
bytes (its read + write equals the kernel's traffic), timed the same way; pct_of_copy = kernel GB/s / copy GB/s.
Writes JSON {"meta": {...}, "results": [...]}.
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


def _colwise_eq(got, want, sizes) -> bool:
    pg = ref.padded_group_offsets(sizes)[-1]
    return _eq(got[0][:, :pg], want[0][:, :pg]) and _eq(got[1][: pg // 128], want[1][: pg // 128])


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
    cols = ref.colwise_cols(m, e)
    pg = ref.padded_group_offsets(sizes_l)[-1]
    wsub = 4  # experts checked against the reference (its fp32 intermediates of all 64 would be ~30 GB)

    def chk_weight(w):
        got = bw.quantize_weight(w)
        want = ref.quantize_weight_torch(w[:wsub])
        return all(_eq(a_[:wsub], b_) for a_, b_ in zip(got, want, strict=True))

    def chk_fwd_col():
        got = bw.swiglu_quantize(a, sizes, colwise=True)
        hv = swiglu(a)
        return _eq(got[0], ref.quantize_rowwise_torch(hv)[0]) and _colwise_eq(
            got[2:], ref.quantize_colwise_grouped_torch(hv, sizes_l, cols), sizes_l
        )

    def chk_bwd():
        got = bw.swiglu_bwd_quantize(a, dh, sizes)
        da = swiglu_bwd(a, dh)
        want_r = ref.quantize_rowwise_torch(da)
        return (
            _eq(got[0], want_r[0])
            and _eq(got[1], want_r[1])
            and _colwise_eq(got[2:], ref.quantize_colwise_grouped_torch(da, sizes_l, cols), sizes_l)
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
            "colwise_x_bf16",
            lambda: bw.quantize_colwise_grouped(x, sizes),
            lambda: _colwise_eq(
                bw.quantize_colwise_grouped(x, sizes), ref.quantize_colwise_grouped_torch(x, sizes_l), sizes_l
            ),
            2 * m * h + h * pg + sc(h * pg),
        ),
        (
            "colwise_x_requant",
            lambda: bw.quantize_colwise_grouped(xq, sizes),
            lambda: _colwise_eq(
                bw.quantize_colwise_grouped(xq, sizes),
                ref.quantize_colwise_grouped_torch(ref.dequantize_rowwise_torch(*xq), sizes_l),
                sizes_l,
            ),
            m * h + sc(m * h) + h * pg + sc(h * pg),
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
            "swiglu_fwd_col",
            lambda: bw.swiglu_quantize(a, sizes, colwise=True),
            chk_fwd_col,
            4 * m * f + m * f + sc(m * f) + f * pg + sc(f * pg),
        ),
        (
            "swiglu_bwd",
            lambda: bw.swiglu_bwd_quantize(a, dh, sizes),
            chk_bwd,
            6 * m * f + 2 * m * f + sc(2 * m * f) + 2 * f * pg + sc(2 * f * pg),
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
