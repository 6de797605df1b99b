"""FSDP2 all-gather of one MoE layer's expert weights in bf16 (the param dtype) against FP8 in each recipe: MXFP8
(``moe_ep.experts.fsdp_mxfp8``) and blockwise (``moe_ep.experts.fsdp_blockwise``), with the GEMM operands each path
prepares, per training step and per layer.

    python3 benchmarks/bench_fsdp_gather.py [--experts 128 --hidden 2048 --ffn 768] [--recipes mxfp8,blockwise]
                                            [--out PATH]
    (re-launches itself under torchrun on every visible GPU: dp = world size, ep = 1. With one GPU, dp = 1: FSDP2
    moves nothing over a wire and "gather" is its one-rank copy, so it measures the quantize + pack + unpack path)
    python3 benchmarks/bench_fsdp_gather.py --cpu-check
    (no GPU: one gloo process on the CPU, tiny shapes, runs the build and the bitwise checks of every variant)

Each rank holds fp32 master weights w13 [E, 2F, H] / w2 [E, H, F] sharded over "dp" (FSDP2, bf16 param dtype).
Variants: bf16 (bf16 gather, MXFP8 operands), mxfp8, bf16_blockwise (bf16 gather, blockwise operands), blockwise.
Timed with CUDA events (median of --reps after --warmup), per variant:
  gather     ``experts.unshard()`` then ``reshard()``: the pre-all-gather (bf16: the cast copy of the fp32 shard;
             FP8: the shard's quantized bytes, cached), the NCCL all-gather and the copy-out
  prep_fwd   the forward's GEMM operands (bf16: one pass writing both; mxfp8: the fprop operand from its bytes;
             bf16_blockwise: the 128x128 quantization, both copies; blockwise: views of the gathered bytes)
  prep_bwd   the backward's (bf16 / bf16_blockwise: both again; mxfp8: the dgrad operand; blockwise: ``data_t``, the
             gathered bytes transposed)
  quantize   FP8: the shard's quantization, once per optimizer step
  step       2 gathers (reshard after forward) + prep_fwd + prep_bwd + quantize: the experts' weight work of one step
Reported: gathered bytes per rank and per element, the all-gather's bus rate, and FP8 / bf16 ratios. Checked first: the
operands of every path equal the recipe's operands of the full weight they quantize (the bf16 cast; the fp32 master)
bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import relaunch_under_torchrun, time_ms  # noqa: E402

DEFAULT_OUT = "benchmarks/results/bench_fsdp_gather.json"


VARIANTS = {"mxfp8": ("bf16", "mxfp8"), "blockwise": ("bf16_blockwise", "blockwise")}  # recipe -> (bf16, FP8)


def build(mode: str, args, dp_mesh, dev):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    from moe_ep.experts.fsdp_blockwise import use_blockwise_all_gather  # noqa: PLC0415
    from moe_ep.experts.fsdp_mxfp8 import use_mxfp8_all_gather  # noqa: PLC0415
    from moe_ep.layer import Experts  # noqa: PLC0415

    m = Experts(args.experts, args.hidden, args.ffn, device=dev, dtype=torch.float32)
    gen = torch.Generator(device=dev).manual_seed(0)  # the same weights on every rank
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    full = {n: p.detach().clone() for n, p in m.named_parameters()}
    if mode == "mxfp8":
        use_mxfp8_all_gather(m, dp_mesh.size())
    elif mode == "blockwise":
        use_blockwise_all_gather(m, dp_mesh.size())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(m, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    return m, full


def prepare(mode: str, w, fprop: bool = True, dgrad: bool = True):
    """The GEMM operands the layer prepares from a gathered weight: mxfp8 recipe -> WeightOperands, blockwise ->
    BlockwiseWeight (on the CPU the plain weight's blockwise quantization is the reference's: the same bytes)."""
    from moe_ep.experts.fsdp_blockwise import BlockwiseExpertWeight  # noqa: PLC0415
    from moe_ep.experts.sm90.blockwise import HOPPER_BLOCKWISE, BlockwiseWeight  # noqa: PLC0415
    from moe_ep.experts.sm90.mlp import GEMMS  # noqa: PLC0415

    if mode in VARIANTS["mxfp8"]:
        return GEMMS.prepare(w, None, fprop=fprop, dgrad=dgrad)
    if w.is_cuda or isinstance(w, BlockwiseExpertWeight):
        return HOPPER_BLOCKWISE.prepare(w, None, fprop=fprop, dgrad=dgrad)
    from moe_ep.blockwise.reference import quantize_weight_torch  # noqa: PLC0415

    return BlockwiseWeight(*quantize_weight_torch(w.detach()))


def _want(mode: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The operands of the full weight w (fp32 master) that ``mode``'s path must give, by field name."""
    src = w if mode in ("mxfp8", "blockwise") else w.to(torch.bfloat16)
    if mode in VARIANTS["mxfp8"]:
        from moe_ep.experts.sm90.operands import weight_operands  # noqa: PLC0415

        o = weight_operands(src)
        return {"w_prepared": o.w_prepared, "wt_prepared": o.wt_prepared}
    if src.is_cuda:
        from moe_ep.blockwise import cuda as bw  # noqa: PLC0415

        data, data_t, scale = bw.quantize_weight(src)
    else:
        from moe_ep.blockwise.reference import quantize_weight_torch  # noqa: PLC0415

        data, data_t, scale = quantize_weight_torch(src)
    return {"data": data, "data_t": data_t, "scale": scale}


def check(mode: str, m, full) -> None:
    m.unshard()
    for name in ("w13", "w2"):
        got = prepare(mode, getattr(m, name))
        for f, want in _want(mode, full[name]).items():
            a, b = getattr(got, f).contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            if a.shape != b.shape or not torch.equal(a, b):
                raise AssertionError(f"{mode} {name}.{f}: differs from the full weight's ({int((a != b).sum())} bytes)")
    m.reshard()


def measure(mode: str, m, args) -> dict:
    from moe_ep.experts import fsdp_blockwise, fsdp_mxfp8  # noqa: PLC0415

    def gather():
        m.unshard()
        m.reshard()

    t = {"gather": time_ms(gather, args.warmup, args.reps)}
    m.unshard()
    t["prep_fwd"] = time_ms(
        lambda: (prepare(mode, m.w13, dgrad=False), prepare(mode, m.w2, dgrad=False)), args.warmup, args.reps
    )
    t["prep_bwd"] = time_ms(
        lambda: (prepare(mode, m.w13, fprop=False), prepare(mode, m.w2, fprop=False)), args.warmup, args.reps
    )
    m.reshard()
    quantize = {"mxfp8": fsdp_mxfp8.quantize_packed, "blockwise": fsdp_blockwise.quantize_packed}.get(mode)
    if quantize is not None:
        shards = [m.w13._local_tensor._data, m.w2._local_tensor._data]
        t["quantize"] = time_ms(lambda: [quantize(s) for s in shards], args.warmup, args.reps)
    else:
        t["quantize"] = 0.0
    t["step"] = 2 * t["gather"] + t["prep_fwd"] + t["prep_bwd"] + t["quantize"]
    return t


def gathered_bytes(mode: str, e: int, h: int, f: int) -> int:
    """Bytes one rank receives + holds for one layer's gathered w13 [E, 2F, H] and w2 [E, H, F]."""
    from moe_ep.experts import fsdp_blockwise, fsdp_mxfp8  # noqa: PLC0415

    if mode == "mxfp8":
        return fsdp_mxfp8.packed_bytes(e, 2 * f, h) + fsdp_mxfp8.packed_bytes(e, h, f)
    if mode == "blockwise":
        return fsdp_blockwise.packed_bytes(e, 2 * f, h) + fsdp_blockwise.packed_bytes(e, h, f)
    return 2 * 3 * e * h * f


def cpu_check() -> int:
    """No GPU: one gloo rank on the CPU builds every variant at tiny shapes and runs its bitwise check."""
    import socket  # noqa: PLC0415

    import moe_ep  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = moe_ep.init_ep(1)
    args = argparse.Namespace(experts=2, hidden=128, ffn=128)
    for modes in VARIANTS.values():
        for mode in modes:
            m, full = build(mode, args, mesh["dp"], torch.device("cpu"))
            check(mode, m, full)
            per = gathered_bytes(mode, 2, 128, 128) / (3 * 2 * 128 * 128)
            print(
                f"cpu-check {mode}: operands bitwise equal to the full weight's; {per:.4f} bytes per element gathered"
            )
    moe_ep.finish(mesh)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128, help="experts of one EP rank (all of them at ep = 1)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--recipes", default="mxfp8,blockwise", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", "--json", dest="out", default=None, help=f"result JSON (default {DEFAULT_OUT})")
    p.add_argument("--cpu-check", action="store_true", help="no timing: build and check every variant on the CPU")
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    if not recipes or any(r not in VARIANTS for r in recipes):
        p.error(f"argument --recipes: {args.recipes!r}, choose from {', '.join(VARIANTS)}")
    if "blockwise" in recipes and (args.hidden % 128 or args.ffn % 128):
        p.error(f"blockwise needs --hidden ({args.hidden}) and --ffn ({args.ffn}) to be multiples of 128")
    if args.cpu_check:
        return cpu_check()
    if "LOCAL_RANK" not in os.environ:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 1:
            msg = "bench_fsdp_gather: skipped (needs a GPU; none visible; --cpu-check runs the checks on the CPU)"
            print(msg)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"skipped": msg}))
            return 0
        return relaunch_under_torchrun(__file__, n, {"NCCL_NVLS_ENABLE": "0"})

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import moe_ep  # noqa: PLC0415
    from launch.provenance import code_version  # noqa: PLC0415

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    world = int(os.environ["WORLD_SIZE"])
    mesh = moe_ep.init_ep(1)  # ep = 1: the experts are sharded over every rank
    dp = mesh["dp"]
    e, h, f = args.experts, args.hidden, args.ffn
    if e % world:
        raise SystemExit(f"--experts {e} must split over {world} ranks")
    numel = 3 * e * h * f
    res: dict = {}
    for mode in [m for r in recipes for m in VARIANTS[r]]:
        m, full = build(mode, args, dp, dev)
        check(mode, m, full)
        del full
        t = measure(mode, m, args)
        # the slowest rank's time is the step's
        tt = torch.tensor([t[k] for k in sorted(t)], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        t = dict(zip(sorted(t), [round(float(v), 4) for v in tt], strict=True))
        gathered = gathered_bytes(mode, e, h, f)
        recv = gathered * (world - 1) / world
        t["bytes_gathered_per_rank"] = gathered
        t["bytes_received_per_rank"] = int(recv)
        t["bytes_per_element"] = round(gathered / numel, 6)
        t["gather_bus_GBps"] = round(recv / (t["gather"] * 1e-3) / 1e9, 1)  # 0 at dp = 1 (nothing on a wire)
        res[mode] = t
        del m
        torch.cuda.empty_cache()
    keys = ("gather", "prep_fwd", "prep_bwd", "step", "bytes_gathered_per_rank")
    ratios = {
        f"{fp8}_over_bf16": {k: round(res[fp8][k] / res[b][k], 3) if res[b][k] else None for k in keys}
        for b, fp8 in (VARIANTS[r] for r in recipes)
    }
    if dist.get_rank() == 0:
        meta = {
            "device": torch.cuda.get_device_name(dev),
            "world_size": world,
            "dp": world,
            "experts": e,
            "hidden": h,
            "ffn": f,
            "per": "one MoE layer's experts of one EP rank (w13 + w2)",
            "weights_per_rank_M": round(numel / 1e6, 1),
            "commit": code_version(Path(__file__).resolve().parent.parent),
            "torch": torch.__version__,
            "reps": args.reps,
            "statistic": "median over reps, max over ranks (ms)",
            "note": "dp = 1: no wire; gather = FSDP2's one-rank copy (the quantize + pack + unpack path)"
            if world == 1
            else "gather = pre-all-gather + NCCL all-gather + copy-out",
        }
        out = {"meta": meta, "results": res, **ratios}
        print(json.dumps(out, indent=1), flush=True)
        path = Path(args.out or DEFAULT_OUT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        for b, fp8 in (VARIANTS[r] for r in recipes):
            print(f"step (ms): {b} {res[b]['step']:.3f}, {fp8} {res[fp8]['step']:.3f} "
                  f"({ratios[f'{fp8}_over_bf16']['step']}x); gather {res[b]['gather']:.3f} -> {res[fp8]['gather']:.3f} "
                  f"ms, {res[b]['bytes_per_element']} -> {res[fp8]['bytes_per_element']} bytes/element")  # fmt: skip
    dist.barrier()
    moe_ep.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
