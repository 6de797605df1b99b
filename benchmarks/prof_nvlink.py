"""NVLink store-path probe (kernels/bench_nvlink.cu): all-to-all pushes into the peers' symmetric buffers.

    python benchmarks/prof_nvlink.py --json out.json   (re-launches itself under torchrun on all GPUs)

Every rank writes --mb MB to each other rank at once (the dispatch's traffic shape without quantization),
through 16-byte st.global (`nvl_st`, what the transport kernels do) or TMA bulk copies from shared memory
(`nvl_tma`), for several grid sizes. Reported: median time of --iters launches (max over ranks), GB/s per rank of
remote bytes and % of 450 GB/s. The received bytes are checked against each sender's pattern first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_dispatch import NVLINK_GBS  # noqa: E402


def _pattern(rank: int, n: int, dev) -> torch.Tensor:
    return ((torch.arange(n, device=dev, dtype=torch.int64) * 7 + 13 * rank) % 251).to(torch.uint8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="")
    p.add_argument("--mb", type=int, default=48)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--grids", default="132,66,33,264")
    args = p.parse_args()
    if "LOCAL_RANK" not in os.environ:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            print(f"prof_nvlink: skipped ({n} GPUs)")
            return 0
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *sys.argv]
        return subprocess.call(cmd, env={**os.environ, "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
    from moe_ep import _cuda, finish  # noqa: PLC0415
    from moe_ep.comm import nvshmem as nvs  # noqa: PLC0415
    from moe_ep.provenance import code_version  # noqa: PLC0415

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    rt = nvs.init_runtime(dist.group.WORLD, 4096, 7168, 8, 256)
    per_peer = args.mb * 2**20
    cap = rt.ep_size * 4096 * 7168 * 2  # bytes of disp_data
    if per_peer * world > cap:
        raise SystemExit(f"--mb {args.mb} x {world} ranks exceeds the {cap >> 20} MB region")
    off = rt.region("disp_data")
    src = _pattern(rank, per_peer, dev)
    flag = torch.zeros(1, device=dev)
    cp = _cuda.cupy()
    mem = cp.cuda.UnownedMemory(int(rt.peers[rank].item()) + off, per_peer * world, None)
    region = torch.as_tensor(
        cp.ndarray((per_peer * world,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0)), device=dev
    )
    rows = []
    for kern in ("nvl_st", "nvl_tma"):
        fn = _cuda.get_function("bench_nvlink.cu", kern)
        smem = 16 * 2 * 4096 if kern == "nvl_tma" else 0
        for grid in [int(g) for g in args.grids.split(",") if g]:
            if kern == "nvl_tma" and grid > _cuda.num_sms(dev):
                continue  # 128 KB of shared memory per CTA: one CTA per SM
            a = (
                _cuda.ptr(src),
                _cuda.ptr(rt.peers),
                _cuda.i64(off),
                _cuda.i32(world),
                _cuda.i32(rank),
                _cuda.i64(per_peer),
            )

            def go(fn=fn, grid=grid, a=a, smem=smem):
                _cuda.launch(fn, grid, 512, a, shared_mem=smem, device=dev)

            # correctness: my region zeroed, everyone sends once, then every sender's slice is checked
            region.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            go()
            torch.cuda.synchronize()
            dist.barrier()
            ok = True
            for s in range(world):
                if s != rank and not torch.equal(region[s * per_peer : (s + 1) * per_peer], _pattern(s, per_peer, dev)):
                    ok = False
            ts = []
            for it in range(args.iters + 2):
                dist.all_reduce(flag)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                go()
                e1.record()
                e1.synchronize()
                if it >= 2:
                    ts.append(e0.elapsed_time(e1) * 1e3)
            med = torch.tensor([float(np.median(ts)), float(not ok)], device=dev)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            us, bad = float(med[0]), bool(med[1])
            gbs = (world - 1) * per_peer / us / 1e3
            row = dict(
                kernel=kern, grid=grid, us=us, GBps_per_rank=gbs, pct_nvlink=100 * gbs / NVLINK_GBS, correct=not bad
            )
            rows.append(row)
            if rank == 0:
                print(
                    f"{kern:8s} grid {grid:4d}: {us:8.1f} us  {gbs:6.1f} GB/s  {row['pct_nvlink']:5.1f} %  "
                    f"ok={not bad}",
                    flush=True,
                )
    if rank == 0 and args.json:
        meta = dict(
            device=torch.cuda.get_device_name(),
            world=world,
            mb_per_peer=args.mb,
            iters=args.iters,
            commit=code_version(),
        )
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish()
    return 0 if all(r["correct"] for r in rows) else 1  # a wrong received byte fails the run, as in bench_dispatch


if __name__ == "__main__":
    sys.exit(main())
