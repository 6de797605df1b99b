"""The blockwise recipe's expert wgrads on bf16 tensor cores over exactly dequantized 128x1 operands, and the
backward's quantizers of their operands (one GPU, CUDA events, warm-up then the median; interleaved rounds).

benchmarks/results/bench_wgrad_blockwise.json was measured at bfa5169, when this script also timed what has since
been deleted (git keeps it there): fp8_wgrad_ms, the FP8 k-grouped blockwise wgrad kernel on e4m3 transposed
operands + scales, and quant_old_ms, the e4m3 transposed column quantizers of those operands (quant_new_ms and
new_total_ms there are quant_ms and total_ms here). The bf16 path beat the FP8 one (GEMM + quantizers) at the layer
shapes, and the FP8 wgrad and its quantizers were deleted.

Per case (shape, groups):
  bf16_wgrad_ms   the MXFP8 recipe's bf16 wgrad kernel (moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out) on the
                  prepared bf16 operands (the recipe's 128x1 blocks, exactly dequantized);
  quant_ms        the backward's quantizers of that wgrad's two operands, as
                  moe_ep.experts.sm90.blockwise.expert_mlp_bw_bwd calls them: wgrad1 (dW13 [G, 2F, H]):
                  dA = swiglu_bwd_quantize_prepared(a, dh) (its 1x128 rows too: dgrad1 reads them) + x's column
                  operand from the 1x128 payload (xq, xs); wgrad2 (dW2 [G, H, F]): dy's column operand + h's
                  recomputed from a, column-only (swiglu_colwise_prepared);
  total_ms        bf16_wgrad_ms + quant_ms.
Outputs fp32 [G, N, K] (the layer's dW buffer for fp32 master weights). Check: the largest group against an fp32
torch matmul of its prepared rows (summation order only: ~1e-6 expected; a layout bug gives O(1)).

Shapes (M rows, G groups, N, K): the dsv3 layer (64 local experts, H 7168, F 2048, ~512 rows per expert):
wgrad1 N = 2F = 4096, K = H = 7168; wgrad2 N = H = 7168, K = F = 2048; small (32 experts, H 2048, F 768,
~1024 rows per expert): wgrad1 N = 1536, K = 2048; wgrad2 N = 2048, K = 768. Groups uniform and skewed
(bench_gemm.uneven_sizes).

Usage: python benchmarks/bench_wgrad_blockwise.py [--quick] --json PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import interleaved_ms, uneven_sizes  # noqa: E402

from moe_ep.blockwise import cuda as bwq  # noqa: E402
from moe_ep.experts.sm90 import gemm as mx_gemm  # noqa: E402

# name -> (M, G, N, K, role)
SHAPES = {
    "dsv3_wgrad1": (32768, 64, 4096, 7168, "wgrad1"),
    "dsv3_wgrad2": (32768, 64, 7168, 2048, "wgrad2"),
    "small_wgrad1": (32768, 32, 1536, 2048, "wgrad1"),
    "small_wgrad2": (32768, 32, 2048, 768, "wgrad2"),
}


def _sizes(kind: str, m: int, g: int, name: str) -> list[int]:
    if kind == "uniform":
        return [m // g] * (g - 1) + [m - (m // g) * (g - 1)]
    return uneven_sizes(m, g, seed=sum(map(ord, name)))


def _quantizers(role, m, n, k, sz, gen):
    """The backward's quantizers of this wgrad's two operands, as a closure returning them."""
    dev = "cuda"
    if role == "wgrad1":  # a: dA [M, 2F = N] from (a [M, 2F], dh [M, F]); b: x [M, K = H] from its 1x128 payload
        a = (torch.randn(m, n, generator=gen, device=dev) * 2).bfloat16()
        dh = torch.randn(m, n // 2, generator=gen, device=dev).bfloat16()
        xq, xs = bwq.quantize_rowwise(torch.randn(m, k, generator=gen, device=dev).bfloat16())

        def quant():
            return bwq.swiglu_bwd_quantize_prepared(a, dh, sz)[2], bwq.quantize_colwise_prepared((xq, xs), sz)

    else:  # a: dy [M, N = H] bf16; b: h [M, K = F] recomputed from a [M, 2F]
        dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
        a = (torch.randn(m, 2 * k, generator=gen, device=dev) * 2).bfloat16()

        def quant():
            return bwq.quantize_colwise_prepared(dy, sz), bwq.swiglu_colwise_prepared(a, sz)

    return quant


def run_case(name, kind, args, details) -> dict:
    m, g, n, k, role = SHAPES[name]
    sizes = _sizes(kind, m, g, name)
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    quant = _quantizers(role, m, n, k, sz, gen)
    ap, bp = quant()
    out = torch.empty(g, n, k, device="cuda")
    fns = {
        "bf16_wgrad": lambda: mx_gemm.grouped_wgrad_prepared_out(ap, bp, sz, out, m),
        "quant": quant,
    }
    fns["bf16_wgrad"]()
    gi = max(range(g), key=lambda i: sizes[i])  # the largest group: its prepared rows start at 64 sum ceil(n/64)
    r0 = 64 * sum(-(-v // 64) for v in sizes[:gi])
    want = ap[r0 : r0 + sizes[gi]].float().t() @ bp[r0 : r0 + sizes[gi]].float()
    rel = ((out[gi].double() - want.double()).norm() / want.double().norm()).item()
    errors: dict[str, str] = {}
    times = interleaved_ms(fns, args.rounds, args.warmup, args.reps, errors)
    ms = {kk: statistics.median(v) for kk, v in times.items() if v}
    flops = 2.0 * m * n * k
    row = {
        "shape": name,
        "groups": kind,
        "M": m,
        "G": g,
        "N": n,
        "K": k,
        "role": role,
        "bf16_wgrad_ms": ms.get("bf16_wgrad"),
        "quant_ms": ms.get("quant"),
        "bf16_wgrad_tflops": flops / ms["bf16_wgrad"] / 1e9 if "bf16_wgrad" in ms else None,
        "rel_err_vs_fp32_matmul": rel,
    }
    if row["bf16_wgrad_ms"] is not None and row["quant_ms"] is not None:
        row["total_ms"] = row["bf16_wgrad_ms"] + row["quant_ms"]
    details[f"{name}/{kind}"] = {"sizes": sizes, "errors": errors, "all_ms": times}
    print(f"[{name}/{kind}] " + json.dumps({kk: v for kk, v in row.items() if kk.endswith(("ms", "fp32_matmul"))}))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--groups", default="uniform,skewed")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.warmup, args.reps = (2, 6) if args.quick else (5, 20)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from launch.provenance import code_version  # noqa: PLC0415

    meta = {
        "device": torch.cuda.get_device_name(),
        "commit": code_version(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python benchmarks/bench_wgrad_blockwise.py " + " ".join(sys.argv[1:]),
        "config": {"warmup": args.warmup, "reps": args.reps, "rounds": args.rounds},
        "shapes": {kk: SHAPES[kk] for kk in args.shapes.split(",") if kk},
        "note": "ms: median of CUDA-event times (median over rounds); fp32 [G, N, K] outputs; quant_ms: the backward's "
        "quantizers of the wgrad's two operands (module docstring)",
        "details": {},
    }
    rows = []
    for name in [s for s in args.shapes.split(",") if s]:
        for kind in [s for s in args.groups.split(",") if s]:
            rows.append(run_case(name, kind, args, meta["details"]))
            torch.cuda.empty_cache()
    result = {"meta": meta, "results": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\n{meta['device']}  {meta['commit']}")
    head = ("bf16 wg", "quant", "total")
    print(f"{'shape':<13} {'groups':<8} " + " ".join(f"{h:>8}" for h in head))
    for r in rows:
        keys = ("bf16_wgrad_ms", "quant_ms", "total_ms")
        vals = (format(r[kk], "8.3f") if r.get(kk) is not None else f"{'-':>8}" for kk in keys)
        print(f"{r['shape']:<13} {r['groups']:<8} " + " ".join(vals))


if __name__ == "__main__":
    main()
