"""Benchmark one expert-MLP training step (forward + backward) on the MXFP8 CUDA path against bf16 torch.

Per shape (M expert-sorted rows of hidden H, E experts of FFN width F; random uneven group sizes, fixed seed):
  mxfp8   x quantized (``quantize_grouped_dual``), then ``moe_ep.experts.sm90.mlp``'s ``expert_mlp_mx_fwd`` +
          ``expert_mlp_mx_bwd`` (the layer's expert path, which gets x already quantized) with the weights' MXFP8
          operands cached (what every micro-batch after the first of an optimizer step pays); the per-step weight
          quantization and preparation (``weight_operands`` of W13 and W2) is timed alone as ``weight_prep_ms``.
          ``step_with_weight_prep_ratio``: bf16 step / (ours + weight_prep_ms), the ratio of a step whose weights
          changed since the last one (under FSDP2 every step: its all-gather rewrites them);
          ``..._twice_ratio``: the same with 2 x weight_prep_ms (FSDP2's default reshard_after_forward gathers,
          hence prepares, again for the backward).
  bf16    the same step in bf16 with ``torch._grouped_mm`` (6 GEMMs; the wgrads take dY^T as a transposed view, no
          copy), SwiGLU forward/backward compiled with ``torch.compile`` (one fused elementwise kernel each).
It first checks ours against the reference recipe (``moe_ep.experts.reference.expert_mlp_fwd/bwd``, quantize=True):
the gap must be at most 1/10 of the recipe's own error against quantize=False (tests/test_expert_mlp_cuda.py explains
the bound). Then it times with CUDA events (median of --reps per round, --rounds rounds in bench_gemm.round_order) and
reports ms, tokens/s (M / step time), TFLOP/s (:func:`flops`), % of the H100/H200 dense bf16 peak (989 TFLOP/s) and
the ratio bf16 / ours per round (median; > 1: ours faster). Exits 1 when a shape's check fails.

Usage: python benchmarks/bench_expert_mlp.py [--shapes dsv3,small] [--rounds 3] [--reps 10] [--json PATH]
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
from bench_gemm import interleaved_ms, paired_ratio, rel_err, time_ms, uneven_sizes  # noqa: E402

from moe_ep.experts import reference as gemm  # noqa: E402
from moe_ep.experts.sm90.mlp import expert_mlp_mx_bwd, expert_mlp_mx_fwd  # noqa: E402
from moe_ep.experts.sm90.operands import weight_operands  # noqa: E402
from moe_ep.experts.weight_cache import WeightQuantCache  # noqa: E402
from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: E402

SHAPES = {  # name: (M rows, H hidden, F ffn, E experts): the GEMMs of bench_gemm's shapes
    "dsv3": (32768, 7168, 2048, 32),  # GEMM1 = dsv3_up (N = 2F = 4096), GEMM2 = dsv3_down
    "small": (32768, 2048, 768, 16),  # GEMM1 = small (N = 1536)
    "llama4": (16384, 5120, 4096, 4),  # GEMM1 = llama4 (N = 8192)
}
PEAK_TFLOPS = 989.0  # H100 SXM / H200 dense bf16 (datasheet)


def flops(m: int, h: int, f: int) -> float:
    """One step's GEMM flops: the forward's M x H x 2F and M x F x H multiply-adds are 3 M H F (6 M H F flops);
    the backward's two dgrads and two wgrads twice that; 18 M H F flops in all."""
    return 18.0 * m * h * f


def expert_mlp_cuda_fwd(x, w13, w2, sz, cache):
    """x bf16 [M, H] -> (out, saved): x quantized row-wise, then the layer's MXFP8 expert forward."""
    w13o, w2o = weight_operands(w13, cache), weight_operands(w2, cache)
    xq, xs = mxfp8_cuda.quantize_grouped_dual(x, sz)[:2]
    out, a = expert_mlp_mx_fwd(xq, xs, w13o, w2o, sz)
    return out, (xq, xs, a)


def expert_mlp_cuda_bwd(dout, saved, w13, w2, sz, cache):
    """-> (dx, dw13, dw2) of the layer's MXFP8 expert backward."""
    xq, xs, a = saved
    held = {"dout": dout, "xq": xq, "xs": xs, "a": a}  # consumed by expert_mlp_mx_bwd
    w13o, w2o = weight_operands(w13, cache), weight_operands(w2, cache)
    return expert_mlp_mx_bwd(held, w13, w2, w13o, w2o, sz, on_dx=lambda dx: dx)


def run_shape(name: str, rounds: int, reps: int) -> dict:
    m, h, f, e = SHAPES[name]
    sizes = uneven_sizes(m, e, seed=sum(map(ord, name)))
    sz = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    offs = torch.cumsum(sz, 0, dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, h, generator=gen, device="cuda").bfloat16()
    w13 = (torch.randn(e, 2 * f, h, generator=gen, device="cuda") * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, f, generator=gen, device="cuda") * f**-0.5).bfloat16()
    dout = torch.randn(m, h, generator=gen, device="cuda").bfloat16()
    row: dict = {"M": m, "H": h, "F": f, "E": e, "group_sizes": sizes}

    # ---- check against the reference recipe
    cache = WeightQuantCache()
    out, saved = expert_mlp_cuda_fwd(x, w13, w2, sz, cache)
    got = (out, *expert_mlp_cuda_bwd(dout, saved, w13, w2, sz, cache))
    check = {}
    for q in (True, False):
        r_out, r_a = gemm.expert_mlp_fwd(x, w13, w2, sizes, q)
        ref = (r_out, *gemm.expert_mlp_bwd(dout, x, r_a, w13, w2, sizes, q))
        check["ref" if q else "bf16"] = ref
        del r_a
    ok = True
    for i, what in enumerate(("out", "dx", "dw13", "dw2")):
        gap, recipe = rel_err(got[i], check["ref"][i]), rel_err(check["ref"][i], check["bf16"][i])
        row[f"check_{what}"] = {"gap_to_recipe": gap, "recipe_error": recipe}
        ok &= gap <= 0.1 * recipe
    row["correct"] = ok
    del check, got, saved, out
    torch.cuda.empty_cache()
    print(f"[{name}] check vs the reference recipe: {'ok' if ok else 'FAILED'} {row}", flush=True)

    # ---- timing
    swiglu_c = torch.compile(lambda a: gemm.swiglu(a).bfloat16())
    swiglu_bwd_c = torch.compile(lambda a, dh: gemm.swiglu_bwd(a, dh).bfloat16())

    def bf16_step():
        a = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        hh = swiglu_c(a)
        torch._grouped_mm(hh, w2.transpose(-2, -1), offs=offs)
        dh = torch._grouped_mm(dout, w2, offs=offs)
        torch._grouped_mm(dout.t(), hh, offs=offs)  # dW2 [E, H, F]
        da = swiglu_bwd_c(a, dh)
        torch._grouped_mm(da, w13, offs=offs)  # dX
        torch._grouped_mm(da.t(), x, offs=offs)  # dW13 [E, 2F, H]

    def bf16_fwd():
        a = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        torch._grouped_mm(swiglu_c(a), w2.transpose(-2, -1), offs=offs)

    def ours_step():
        o, s = expert_mlp_cuda_fwd(x, w13, w2, sz, cache)
        expert_mlp_cuda_bwd(dout, s, w13, w2, sz, cache)

    def ours_fwd():
        expert_mlp_cuda_fwd(x, w13, w2, sz, cache)

    fns = {"mxfp8_step": ours_step, "bf16_step": bf16_step, "mxfp8_fwd": ours_fwd, "bf16_fwd": bf16_fwd}
    errors: dict = {}
    times = interleaved_ms(fns, rounds, 2, reps, errors)
    row["errors"] = errors
    row["ms_rounds"] = times
    row["ms"] = {k: statistics.median(v) for k, v in times.items() if v}
    if times["mxfp8_step"] and times["bf16_step"]:
        row["step_ratio_bf16_over_mxfp8"] = paired_ratio(times["bf16_step"], times["mxfp8_step"])
    if times["mxfp8_fwd"] and times["bf16_fwd"]:
        row["fwd_ratio_bf16_over_mxfp8"] = paired_ratio(times["bf16_fwd"], times["mxfp8_fwd"])
    fl = flops(m, h, f)
    for k in ("mxfp8_step", "bf16_step"):
        if k in row["ms"]:
            row[f"{k}_tokens_per_s"] = m / row["ms"][k] * 1e3
            row[f"{k}_tflops"] = fl / row["ms"][k] / 1e9
            row[f"{k}_pct_peak"] = 100 * row[f"{k}_tflops"] / PEAK_TFLOPS
    row["weight_prep_ms"] = time_ms(lambda: (weight_operands(w13), weight_operands(w2)), 1, 3)
    if "mxfp8_step" in row["ms"] and "bf16_step" in row["ms"]:
        # a step whose weights changed since the last one: every step under FSDP2, whose all-gather rewrites them
        # (once; twice with reshard_after_forward=True, FSDP2's default, which gathers again for the backward)
        ms, prep = row["ms"], row["weight_prep_ms"]
        row["step_with_weight_prep_ratio"] = ms["bf16_step"] / (ms["mxfp8_step"] + prep)
        row["step_with_weight_prep_twice_ratio"] = ms["bf16_step"] / (ms["mxfp8_step"] + 2 * prep)
    print(f"[{name}] {json.dumps({k: v for k, v in row.items() if k not in ('ms_rounds', 'group_sizes')})}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from launch.provenance import code_version  # noqa: PLC0415

    res = {
        "benchmark": "bench_expert_mlp",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": code_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(args),
        "shapes": {},
    }
    for name in args.shapes.split(","):
        res["shapes"][name] = run_shape(name, args.rounds, args.reps)
        torch.cuda.empty_cache()
    nan = float("nan")
    head = f"{'shape':8s} {'mxfp8 ms':>9s} {'bf16 ms':>9s} {'ratio':>6s} {'fwd':>6s} {'%peak':>6s} {'wprep ms':>8s}"
    print(head + f" {'ratio+wprep':>11s} {'+2 wprep':>8s}")
    for name, r in res["shapes"].items():
        ms = r["ms"]
        step, fwd = r.get("step_ratio_bf16_over_mxfp8", nan), r.get("fwd_ratio_bf16_over_mxfp8", nan)
        print(
            f"{name:8s} {ms.get('mxfp8_step', nan):9.3f} {ms.get('bf16_step', nan):9.3f} {step:6.3f} {fwd:6.3f} "
            f"{r.get('mxfp8_step_pct_peak', nan):6.1f} {r['weight_prep_ms']:8.3f} "
            f"{r.get('step_with_weight_prep_ratio', nan):11.3f} {r.get('step_with_weight_prep_twice_ratio', nan):8.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if not all(r["correct"] for r in res["shapes"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
