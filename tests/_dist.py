"""The one helper for multi-process CPU tests: start ``world_size`` gloo ranks, run ``fn`` on each.

Every rank reports its status through a queue; the caller fails with every rank's traceback if any rank
failed, so all ranks end with the same verdict. Ranks are forked from a forkserver that imported torch and moe_ep
once per test session (each rank a fresh, single-threaded process as with "spawn", without importing torch again:
on 2 CPU cores that import was most of a small test's time).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # one thread per rank: the ranks share 2 CPU cores (idle OpenMP threads spin)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        if dist.is_initialized():  # (fn may have torn the group down itself, e.g. with moe_ep.finish)
            dist.barrier()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001  (report everything, including assertion failures)
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once by the forkserver (an ImportError there is ignored: the rank then imports what it needs).
_PRELOAD = ["torch", "torch.distributed.fsdp", "moe_ep", "moe_ep.model", "moe_ep.parallel", "pytest", "tests._dist"]


def _context():
    """The start method of the ranks: forkserver with torch and moe_ep preloaded ("spawn" where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; raise if any rank failed.

    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, str | None] = {}
    try:
        for _ in range(world_size):
            rank, err = queue.get(timeout=timeout)
            results[rank] = err
    except Exception as e:  # queue.Empty: a rank hung or died without reporting
        results.setdefault(-1, f"timed out / died after {timeout}s waiting for ranks: {e!r}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = {r: e for r, e in results.items() if e}
    missing = set(range(world_size)) - set(results)
    if failed or missing:
        msg = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(failed.items()))
        raise AssertionError(f"distributed test failed (missing ranks: {sorted(missing)})\n{msg}")
