"""FSDP2 all-gather of one MoE layer's expert weights: bf16 (the param dtype) against MXFP8
(``moe_ep.experts.fsdp_mxfp8``), with the GEMM operands each path prepares, per training step.

    python3 benchmarks/bench_fsdp_gather.py [--experts 128 --hidden 2048 --ffn 768] [--out PATH]
    (re-launches itself under torchrun on every visible GPU: dp = world size, ep = 1; skips with fewer than 2)

Each rank holds fp32 master weights w13 [E, 2F, H] / w2 [E, H, F] sharded over "dp" (FSDP2, bf16 param dtype).
Timed with CUDA events (median of --reps after --warmup), per variant:
  gather     ``experts.unshard()`` then ``reshard()``: the pre-all-gather (bf16: the cast copy of the fp32 shard;
             mxfp8: the shard's quantized bytes, cached), the NCCL all-gather and the copy-out
  prep_fwd   the forward's GEMM operands (bf16: one pass writing both; mxfp8: the fprop operand from its bytes)
  prep_bwd   the backward's (bf16: both again; mxfp8: the dgrad operand)
  quantize   mxfp8: the shard's quantization, once per optimizer step
  step       2 gathers (reshard after forward) + prep_fwd + prep_bwd + quantize: the experts' weight work of one step
Reported: gathered bytes per rank, the all-gather's bus rate, and mxfp8 / bf16 ratios. Checked first: the operands of
both paths equal ``weight_operands`` of the full weight they quantize (the bf16 cast; the fp32 master) bitwise.
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


def build(mode: str, args, dp_mesh, dev):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

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
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(m, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    return m, full


def check(mode: str, m, full) -> None:
    from moe_ep.experts.sm90.mlp import GEMMS  # noqa: PLC0415
    from moe_ep.experts.sm90.operands import weight_operands  # noqa: PLC0415

    m.unshard()
    for name in ("w13", "w2"):
        w = getattr(m, name)
        got = GEMMS.prepare(w, None)
        want = weight_operands(full[name] if mode == "mxfp8" else full[name].to(torch.bfloat16))
        for f in ("w_prepared", "wt_prepared"):
            a, b = getattr(got, f).view(torch.int16), getattr(want, f).view(torch.int16)
            if not torch.equal(a, b):
                raise AssertionError(f"{mode} {name}.{f}: {int((a != b).sum())} elements differ from the full weight's")
    m.reshard()


def measure(mode: str, m, args) -> dict:
    from moe_ep.experts.fsdp_mxfp8 import quantize_packed  # noqa: PLC0415
    from moe_ep.experts.sm90.mlp import GEMMS  # noqa: PLC0415

    def gather():
        m.unshard()
        m.reshard()

    t = {"gather": time_ms(gather, args.warmup, args.reps)}
    m.unshard()
    t["prep_fwd"] = time_ms(
        lambda: (GEMMS.prepare(m.w13, None, dgrad=False), GEMMS.prepare(m.w2, None, dgrad=False)),
        args.warmup,
        args.reps,
    )
    t["prep_bwd"] = time_ms(
        lambda: (GEMMS.prepare(m.w13, None, fprop=False), GEMMS.prepare(m.w2, None, fprop=False)),
        args.warmup,
        args.reps,
    )
    m.reshard()
    if mode == "mxfp8":
        shards = [m.w13._local_tensor._data, m.w2._local_tensor._data]
        t["quantize"] = time_ms(lambda: [quantize_packed(s) for s in shards], args.warmup, args.reps)
    else:
        t["quantize"] = 0.0
    t["step"] = 2 * t["gather"] + t["prep_fwd"] + t["prep_bwd"] + t["quantize"]
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128, help="experts of one EP rank (all of them at ep = 1)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", "--json", dest="out", default=None, help=f"result JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            msg = f"bench_fsdp_gather: skipped (needs >1 GPU; {n} visible)"
            print(msg)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"skipped": msg}))
            return 0
        return relaunch_under_torchrun(__file__, n, {"NCCL_NVLS_ENABLE": "0"})

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import moe_ep  # noqa: PLC0415
    from launch.provenance import code_version  # noqa: PLC0415
    from moe_ep.experts.fsdp_mxfp8 import packed_bytes  # noqa: PLC0415

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
    gathered = {"bf16": 2 * numel, "mxfp8": packed_bytes(e, 2 * f, h) + packed_bytes(e, h, f)}
    res: dict = {}
    for mode in ("bf16", "mxfp8"):
        m, full = build(mode, args, dp, dev)
        check(mode, m, full)
        del full
        t = measure(mode, m, args)
        # the slowest rank's time is the step's
        tt = torch.tensor([t[k] for k in sorted(t)], device=dev)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        t = dict(zip(sorted(t), [round(float(v), 4) for v in tt], strict=True))
        recv = gathered[mode] * (world - 1) / world
        t["bytes_gathered_per_rank"] = gathered[mode]
        t["bytes_received_per_rank"] = int(recv)
        t["bytes_per_element"] = round(gathered[mode] / numel, 4)
        t["gather_bus_GBps"] = round(recv / (t["gather"] * 1e-3) / 1e9, 1)
        res[mode] = t
        del m
        torch.cuda.empty_cache()
    ratios = {k: round(res["mxfp8"][k] / res["bf16"][k], 3) for k in ("gather", "prep_fwd", "prep_bwd", "step")}
    if dist.get_rank() == 0:
        meta = {
            "device": torch.cuda.get_device_name(dev),
            "world_size": world,
            "experts": e,
            "hidden": h,
            "ffn": f,
            "weights_per_rank_M": round(numel / 1e6, 1),
            "commit": code_version(Path(__file__).resolve().parent.parent),
            "torch": torch.__version__,
            "reps": args.reps,
            "statistic": "median over reps, max over ranks (ms)",
        }
        out = {"meta": meta, "results": res, "mxfp8_over_bf16": ratios}
        print(json.dumps(out, indent=1), flush=True)
        path = Path(args.out or DEFAULT_OUT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"step (ms): bf16 {res['bf16']['step']:.3f}, mxfp8 {res['mxfp8']['step']:.3f} ({ratios['step']}x)")
    dist.barrier()
    moe_ep.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
