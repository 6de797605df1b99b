"""The transport phases of the cuda layer by recipe payload, on one GPU (EP = 1: the NVSHMEM kernels with the region
in ordinary memory, so the NVLink half is absent and what is timed is the quantize + copy + expansion in HBM):

    python benchmarks/bench_dispatch_blockwise.py --json out.json      (one GPU; T=8192 H=7168 E=64 top-8 default)

  dispatch  transport.dispatch_fwd_quantized (x [T, H] bf16 -> expert-sorted e4m3 rows + the recipe's scales):
            mxfp8 and blockwise through the fused kernel (ep_dispatch_mx<1, 32> / <1, 128>)
  combine_bwd  transport.combine_bwd (dy [T, H] bf16 sent quantized, dequantized on arrival, dy * w and dw):
            mxfp8, blockwise (ep_dispatch<1, 128> + ep_expand<MODE_BWD, 128, bf16>)
benchmarks/results/bench_dispatch_blockwise.json (9e4045a) also holds blockwise_unfused, the paths the fused kernels
replaced (bf16 rows dispatched, then quantize_rowwise on arrival; dy rounded by a 1x128 round trip, then sent as
bf16), timed by this script until they were deleted (git keeps them).
Before timing, the blockwise bytes are checked against moe_ep.blockwise.reference.quantize_rowwise_torch of the token
rows and the dy path against the reference transport (torch.equal). Times: median of --iters CUDA-event timings
of one call each, the CPU enqueuing ahead of the GPU (a GPU spin before the start event).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPIN_CYCLES = 2_000_000  # ~1 ms of GPU spinning: the CPU enqueues the timed call meanwhile


def _time(fn, iters: int, warmup: int = 3) -> float:
    """Median microseconds of fn() over ``iters`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda._sleep(SPIN_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_dispatch_blockwise: skipped (needs a CUDA GPU)")
        return 0
    from launch.provenance import code_version  # noqa: PLC0415
    from moe_ep.blockwise.reference import quantize_rowwise_torch  # noqa: PLC0415
    from moe_ep.recipe import BLOCKWISE  # noqa: PLC0415
    from moe_ep.transport import reference as ref  # noqa: PLC0415
    from moe_ep.transport.nvshmem import buffer as ct  # noqa: PLC0415

    t, h, e, k = args.tokens, args.hidden, args.experts, args.top_k
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, generator=gen, device=dev).bfloat16()
    idx = torch.rand(t, e, generator=gen, device=dev).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(t, k, generator=gen, device=dev)
    dy = torch.randn(t, h, generator=gen, device=dev).bfloat16()
    rt = ct.init_runtime(None, t, h, k, e)
    handle = ct.build_layout(idx, e, None, expand_capacity=t * k)  # ep 1: every slot is local (the layer's sizing)
    n = t * k
    y = torch.randn(n, h, generator=gen, device=dev).bfloat16()
    wy = torch.rand(n, generator=gen, device=dev)

    # bytes first: the fused blockwise payload == the rowwise reference of the token rows; dy path == the reference
    rh = ref.build_layout(idx.long(), e, None)
    tok = rh.send_token[rh.expand_row]
    data, scale, _ = ct.dispatch_fwd_quantized(x, w, handle, "blockwise")
    dq, sq = quantize_rowwise_torch(x)
    bytes_ok = torch.equal(data.view(torch.uint8), dq.view(torch.uint8)[tok]) and torch.equal(scale, sq[tok])
    del data, scale, dq, sq
    dyr, _ = ct.combine_bwd(dy, y, wy, handle, BLOCKWISE)
    dy_ok = torch.equal(dyr, ref.combine_bwd(dy, y, wy, rh, BLOCKWISE)[0])
    del dyr, rh, tok
    rt.check_errors()

    res = {
        "shape": dict(tokens=t, hidden=h, experts=e, top_k=k, ep=1, expanded_rows=n),
        "device": torch.cuda.get_device_name(dev),
        "commit": code_version(),  # set MOE_EP_COMMIT on a device copy of the tree (launch/provenance.py)
        "blockwise_bytes_equal_reference": bool(bytes_ok),
        "blockwise_dy_equal_reference": bool(dy_ok),
        "dispatch_us": {
            "mxfp8": _time(lambda: ct.dispatch_fwd_quantized(x, w, handle, "mxfp8"), args.iters),
            "blockwise": _time(lambda: ct.dispatch_fwd_quantized(x, w, handle, "blockwise"), args.iters),
        },
        "combine_bwd_us": {
            "mxfp8": _time(lambda: ct.combine_bwd(dy, y, wy, handle, "mxfp8"), args.iters),
            "blockwise": _time(lambda: ct.combine_bwd(dy, y, wy, handle, "blockwise"), args.iters),
        },
        "iters": args.iters,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if bytes_ok and dy_ok else 1


if __name__ == "__main__":
    sys.exit(main())
