"""Dispatch / combine benchmark: the NVSHMEM transport vs NCCL baselines (docs/design-transport.md).

    torchrun --standalone --nproc-per-node=4 benchmarks/bench_dispatch.py --json out.json
    python benchmarks/bench_dispatch.py --json out.json     (re-launches itself under torchrun on all GPUs;
                                                            skips cleanly with fewer than 2 GPUs)

Per shape (dsv3: T=4096 H=7168 E=256 top-8; small: T=8192 H=2048 E=128 top-8, per rank) and routing (uniform,
skewed = Zipf(1.2) expert popularity), after checking bytes/values against the reference transport:
  layout          ct.build_layout (device counts exchange + offsets)
  dispatch        ct.dispatch_fwd_mxfp8: fused quantize + NVLink stores + expert-sorted rows + blocked scales
  combine         ct.combine_fwd (bf16 rows back, slot- and rank-ordered fp32 sums)
  (a) nccl_bf16   split exchange + host sync + gather + all_to_all_single of bf16 rows, one row per
                  (token, expert) pair grouped by expert (T * top_k rows per rank)
  (b) nccl_mxfp8  quantize (torch.compile of the reference, or --quant) + the same with e4m3 rows + scales
  nccl_combine    all_to_all_single of the bf16 pair rows back (splits already on the host)
Times: median of --iters CUDA-event timings, max over ranks. Bytes on the wire = rows sent to OTHER ranks x row
bytes (dispatch: H e4m3 + H/32 scales + 12*top_k metadata; combine: 2H). GB/s per rank and % of 450 GB/s NVLink.
--schedules: the fused kernels under other TransportSchedules (EPRuntime.set_schedule), each timed against the
same baselines in the same process ("sweep" entries of each result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import relaunch_under_torchrun  # noqa: E402

from moe_ep.transport.nvshmem.schedule import TransportSchedule  # noqa: E402
from tests import refs  # noqa: E402

SHAPES = {"dsv3": dict(T=4096, H=7168, E=256, K=8), "small": dict(T=8192, H=2048, E=128, K=8)}
NVLINK_GBS = 450.0  # H100 / H200 NVLink 4, per GPU and direction: the physical limit the GB/s are compared with


def _spawn_or_skip(args) -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2 or args.no_spawn:
        msg = f"bench_dispatch: skipped (needs torchrun with >1 GPU; {n} visible)"
        print(msg)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": msg}, f)
        return 0
    return relaunch_under_torchrun(__file__, n, {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})


def _commit() -> str:
    from launch.provenance import code_version  # noqa: PLC0415

    return code_version()


def _routing(kind: str, t: int, e: int, k: int, gen: torch.Generator, dev) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "uniform":
        probs = torch.ones(e)
    else:
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
        probs = probs[torch.randperm(e, generator=torch.Generator().manual_seed(7))].float()  # same on all ranks
    idx = torch.multinomial(probs.expand(t, e), k, replacement=False, generator=gen)
    w = torch.rand(t, k, generator=gen)
    return idx.to(torch.int32).to(dev), (w / w.sum(1, keepdim=True)).to(dev)


SPIN_CYCLES = 2_000_000  # ~1 ms of GPU spinning: the CPU enqueues fn()'s launches meanwhile


def _time(fn, iters: int, warmup: int = 3, cpu_ahead: bool = True) -> float:
    """Median microseconds of fn() over iters (ranks aligned by a tiny all_reduce before each run).

    cpu_ahead: a GPU spin between the all_reduce and the start event lets the CPU enqueue fn() before the GPU
    reaches it, as in a training step where the CPU runs ahead: the time is the GPU's, not Python's launch
    latency. Host syncs inside fn() (the NCCL baselines' split exchange) still cost what they cost. With
    cpu_ahead=False the time is max(GPU time, CPU launch time).
    """
    flag = torch.zeros(1, device="cuda")
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        dist.all_reduce(flag)
        if cpu_ahead:
            torch.cuda._sleep(SPIN_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    med = torch.tensor([ts[len(ts) // 2]], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def _quantizer(kind: str):
    from moe_ep import mxfp8  # noqa: PLC0415

    if kind == "cuda":
        from moe_ep.mxfp8 import cuda as mxfp8_cuda  # noqa: PLC0415

        return lambda x: (lambda t: (t.data, t.scale))(mxfp8_cuda.quantize(x, x.dim() - 1)), "mxfp8_cuda.quantize"

    def q(x):
        t = mxfp8.quantize_torch(x)
        return t.data, t.scale

    if kind == "compile":
        try:
            return torch.compile(q, dynamic=False), "torch.compile(quantize_torch)"
        except Exception as exc:  # noqa: BLE001
            print(f"torch.compile unavailable ({exc}); eager reference quantizer", flush=True)
    return q, "quantize_torch (eager)"


def parse_schedules(spec: str) -> list[tuple[dict, TransportSchedule]]:
    """'dispatch_send_warps=8,dispatch_pieces=1;combine_pieces=4' -> [(fields, schedule)], each schedule the
    defaults with those fields replaced (checked: ValueError for an unknown field or a value out of range)."""
    names = {f.name for f in dataclasses.fields(TransportSchedule)}
    out = []
    for entry in (e for e in spec.split(";") if e.strip()):
        kw = {}
        for kv in (x for x in entry.split(",") if x.strip()):
            key, sep, val = kv.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(
                    f"--schedules: {kv!r} is not field=value with a field of TransportSchedule {sorted(names)}"
                )
            try:
                kw[key] = int(val)
            except ValueError:
                raise ValueError(f"--schedules: {kv!r}: expected an integer") from None
        out.append((kw, TransportSchedule(**kw)))
    return out


def run_case(shape: str, routing: str, args, quant, quant_name, schedules) -> dict:
    from moe_ep import mxfp8  # noqa: PLC0415
    from moe_ep.transport import reference as ref  # noqa: PLC0415
    from moe_ep.transport.nvshmem import buffer as ct  # noqa: PLC0415

    cfg = SHAPES[shape]
    t, h, e, k = cfg["T"], cfg["H"], cfg["E"], cfg["K"]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
    idx, w = _routing(routing, t, e, k, gen, dev)
    group = dist.group.WORLD
    probe = ct.build_layout(idx, e, group)
    hc = refs.host_counts(probe)
    ncap = torch.tensor([hc["N"]], device=dev)
    dist.all_reduce(ncap, op=dist.ReduceOp.MAX)
    ncap = int(ncap.item()) + 128
    handle = ct.build_layout(idx, e, group, expand_capacity=ncap)

    # ---- correctness against the reference before timing
    rh = ref.build_layout(idx, e, group)
    n = rh.num_expanded
    q = ref.dispatch_send(x, w, rh, "mxfp8")
    want_data = q.data[rh.expand_row].view(torch.uint8)
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    y = (torch.randn(ncap, h, device=dev) * 0.1).to(torch.bfloat16)
    _, _, wm = ct.dispatch_fwd_mxfp8(x, w, handle)
    rout = ref.combine_fwd(y[:n], wm[:n], rh)
    del q

    def check() -> tuple[bool, bool, bool, bool]:
        """(data, scales, combine) of the current settings equal to the reference; the last: all ranks agree."""
        d, sc, wv = ct.dispatch_fwd_mxfp8(x, w, handle)
        od = torch.equal(d[:n].view(torch.uint8), want_data)
        osc = torch.equal(sc[: want.numel()], want)
        oc = torch.equal(ct.combine_fwd(y, wv, handle).view(torch.int16), rout.view(torch.int16))
        ok = torch.tensor([int(od and osc and oc)], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return od, osc, oc, bool(ok.item())

    ok_data, ok_scale, ok_comb, ok_all = check()

    # ---- timings
    res = {
        "shape": shape,
        "routing": routing,
        **cfg,
        "ep_size": world,
        "expand_capacity": ncap,
        "correct": ok_all,
        "correct_rank0": dict(data=ok_data, scales=ok_scale, combine=ok_comb),
    }
    res["layout_us"] = _time(lambda: ct.build_layout(idx, e, group, expand_capacity=ncap), args.iters)
    res["dispatch_us"] = _time(lambda: ct.dispatch_fwd_mxfp8(x, w, handle), args.iters)
    res["layout_dispatch_us"] = _time(
        lambda: ct.dispatch_fwd_mxfp8(x, w, ct.build_layout(idx, e, group, expand_capacity=ncap)), args.iters
    )
    res["combine_us"] = _time(lambda: ct.combine_fwd(y, wm, handle), args.iters)
    # the same three without the CPU running ahead: includes Python/CuPy launch latency (host-bound when larger)
    res["layout_us_cpu_bound"] = _time(
        lambda: ct.build_layout(idx, e, group, expand_capacity=ncap), args.iters, cpu_ahead=False
    )
    res["dispatch_us_cpu_bound"] = _time(lambda: ct.dispatch_fwd_mxfp8(x, w, handle), args.iters, cpu_ahead=False)
    res["combine_us_cpu_bound"] = _time(lambda: ct.combine_fwd(y, wm, handle), args.iters, cpu_ahead=False)

    # baselines: one row per (token, expert) pair, grouped by expert (hence by rank), host-synced splits
    lcl = e // world

    def nccl_dispatch(payload_fn):
        def run():
            flat = idx.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            tok = order // k
            sc = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(0, flat // lcl, torch.ones_like(flat))
            rc = torch.empty_like(sc)
            dist.all_to_all_single(rc, sc)
            ss, rs = sc.tolist(), rc.tolist()
            rows = payload_fn(tok)
            outb = torch.empty(sum(rs), rows.shape[1], dtype=rows.dtype, device=dev)
            dist.all_to_all_single(outb, rows, rs, ss)
            return outb

        return run

    def bf16_rows(tok):
        return x[tok]

    def mx_rows(tok):
        d, s = quant(x)
        return torch.cat([d.view(torch.uint8), s], dim=1)[tok]

    res["baseline_rows"] = "one per (token, expert) pair"
    res["nccl_bf16_dispatch_us"] = _time(nccl_dispatch(bf16_rows), args.iters)
    res["nccl_mxfp8_dispatch_us"] = _time(nccl_dispatch(mx_rows), args.iters)
    pair_cnt = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(
        0, idx.reshape(-1).long() // lcl, torch.ones(t * k, dtype=torch.int64, device=dev)
    )
    pair_recv = torch.empty_like(pair_cnt)
    dist.all_to_all_single(pair_recv, pair_cnt)
    pss, prs = pair_cnt.tolist(), pair_recv.tolist()
    back = torch.randn(sum(prs), h, device=dev).to(torch.bfloat16)
    back_out = torch.empty(sum(pss), h, dtype=torch.bfloat16, device=dev)
    res["nccl_bf16_combine_us"] = _time(lambda: dist.all_to_all_single(back_out, back, pss, prs), args.iters)
    ss = rh.send_splits
    remote_rows = sum(ss) - ss[rank]
    rr = torch.tensor([remote_rows], device=dev, dtype=torch.float64)
    dist.all_reduce(rr, op=dist.ReduceOp.MAX)
    remote_rows = int(rr.item())  # the busiest sender
    disp_bytes = remote_rows * (h + h // 32 + 12 * k)
    comb_bytes = remote_rows * 2 * h
    res["quantizer"] = quant_name
    res["dispatch_remote_bytes"] = disp_bytes
    res["combine_remote_bytes"] = comb_bytes
    res["dispatch_GBps"] = disp_bytes / res["dispatch_us"] / 1e3
    res["combine_GBps"] = comb_bytes / res["combine_us"] / 1e3
    res["dispatch_pct_nvlink"] = 100 * res["dispatch_GBps"] / NVLINK_GBS
    res["combine_pct_nvlink"] = 100 * res["combine_GBps"] / NVLINK_GBS
    res["speedup_dispatch_vs_nccl_mxfp8"] = res["nccl_mxfp8_dispatch_us"] / res["dispatch_us"]
    res["speedup_layout_dispatch_vs_nccl_mxfp8"] = res["nccl_mxfp8_dispatch_us"] / res["layout_dispatch_us"]
    res["speedup_dispatch_vs_nccl_bf16"] = res["nccl_bf16_dispatch_us"] / res["dispatch_us"]
    res["speedup_combine_vs_nccl_bf16"] = res["nccl_bf16_combine_us"] / res["combine_us"]
    # --schedules: the fused kernels under other schedules, against this case's baselines (same process)
    res["sweep"] = []
    rt = handle.runtime
    base = rt.schedule
    for kw, schedule in schedules:
        rt.set_schedule(schedule)
        try:
            od, osc, oc, oka = check()
            du = _time(lambda: ct.dispatch_fwd_mxfp8(x, w, handle), args.iters)
            cu = _time(lambda: ct.combine_fwd(y, wm, handle), args.iters)
        finally:
            rt.set_schedule(base)
        res["sweep"].append(
            dict(
                schedule=kw,
                correct=oka,
                correct_rank0=dict(data=od, scales=osc, combine=oc),
                dispatch_us=du,
                combine_us=cu,
                speedup_dispatch_vs_nccl_mxfp8=res["nccl_mxfp8_dispatch_us"] / du,
                dispatch_pct_nvlink=100 * disp_bytes / du / 1e3 / NVLINK_GBS,
                speedup_combine_vs_nccl_bf16=res["nccl_bf16_combine_us"] / cu,
            )
        )
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default="dsv3,small")
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--quant", default="compile", choices=("compile", "cuda", "eager"))
    p.add_argument("--no-spawn", action="store_true", help="skip instead of re-launching under torchrun")
    p.add_argument(
        "--schedules",
        default="",
        help="other schedules of the fused kernels timed per case against the same baselines, ';'-separated, each "
        "the defaults with some fields replaced, e.g. 'dispatch_send_warps=8,dispatch_pieces=1;combine_pieces=4' "
        "(fields of moe_ep.transport.nvshmem.schedule.TransportSchedule)",
    )
    args = p.parse_args()
    schedules = parse_schedules(args.schedules)  # checked before any process is launched
    if "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return _spawn_or_skip(args)
    os.environ.setdefault("MOE_EP_FORCE_REFERENCE", "1")  # the reference check uses the pure-torch quantizer
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    from moe_ep import finish  # noqa: PLC0415
    from moe_ep.transport.nvshmem import buffer as ct  # noqa: PLC0415
    from moe_ep.transport.nvshmem import runtime as nvs  # noqa: PLC0415

    shapes = [s for s in args.shapes.split(",") if s]
    rt = ct.init_runtime(
        dist.group.WORLD,
        max(SHAPES[s]["T"] for s in shapes),
        max(SHAPES[s]["H"] for s in shapes),
        max(SHAPES[s]["K"] for s in shapes),
        max(SHAPES[s]["E"] for s in shapes),
    )
    quant, quant_name = _quantizer(args.quant)
    results = []
    for shape in shapes:
        for routing in [r for r in args.routing.split(",") if r]:
            t0 = time.time()
            res = run_case(shape, routing, args, quant, quant_name, schedules)
            results.append(res)
            if dist.get_rank() == 0:
                print(
                    f"{shape:6s} {routing:8s} ok={res['correct']} layout {res['layout_us']:8.1f}us  dispatch "
                    f"{res['dispatch_us']:8.1f}us ({res['dispatch_GBps']:6.1f} GB/s, "
                    f"{res['dispatch_pct_nvlink']:5.1f}% NVLink)  combine {res['combine_us']:8.1f}us "
                    f"({res['combine_GBps']:6.1f} GB/s)  | nccl bf16 {res['nccl_bf16_dispatch_us']:8.1f}  mxfp8 "
                    f"{res['nccl_mxfp8_dispatch_us']:8.1f}  comb {res['nccl_bf16_combine_us']:8.1f}us | x"
                    f"{res['speedup_dispatch_vs_nccl_mxfp8']:.2f} vs (b), combine x"
                    f"{res['speedup_combine_vs_nccl_bf16']:.2f}  (launch-bound: layout "
                    f"{res['layout_us_cpu_bound']:.0f}"
                    f" dispatch {res['dispatch_us_cpu_bound']:.0f} combine {res['combine_us_cpu_bound']:.0f})"
                    f"  [{time.time() - t0:.0f}s]",
                    flush=True,
                )
                for sw in res["sweep"]:
                    print(
                        f"    {','.join(f'{k}={v}' for k, v in sw['schedule'].items())}: ok={sw['correct']} dispatch "
                        f"{sw['dispatch_us']:7.1f}us x{sw['speedup_dispatch_vs_nccl_mxfp8']:.2f} "
                        f"{sw['dispatch_pct_nvlink']:5.1f}% NVLink  combine {sw['combine_us']:7.1f}us "
                        f"x{sw['speedup_combine_vs_nccl_bf16']:.2f}",
                        flush=True,
                    )
    if dist.get_rank() == 0 and args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "commit": _commit(),
            "ep_size": dist.get_world_size(),
            "torch": torch.__version__,
            "iters": args.iters,
            "nvlink_GBps": NVLINK_GBS,
            "schedule": dataclasses.asdict(rt.schedule),  # the defaults of the fused kernels (sweep: per entry)
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    ok = all(r["correct"] and all(sw["correct"] for sw in r["sweep"]) for r in results)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
