"""How ``bench_layer.py`` times a step: ranks aligned, a GPU spin so the CPU enqueues ahead, CUDA events around the
forward and forward + backward, peak memory; and the one profiled step per variant that records its phases."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from layer_variants import Variant
from torchtitan_moe import PhaseRecorder

SPIN_CYCLES = 2_000_000  # ~1 ms of GPU spinning before each timed step: the CPU enqueues the step meanwhile


def _stamp(dev: torch.device):
    if dev.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _ms(a, b, dev: torch.device) -> float:
    return a.elapsed_time(b) if dev.type == "cuda" else (b - a) * 1e3


def _align_ranks(dev: torch.device) -> None:
    """Every rank's previous work done and the ranks within a collective of each other."""
    flag = torch.zeros(1, device=dev)
    dist.all_reduce(flag)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed_step(v: Variant, x: torch.Tensor, g: torch.Tensor, dev: torch.device) -> dict:
    """One forward + backward of ``v``: times (ms) and memory (bytes; None on the CPU)."""
    cuda = dev.type == "cuda"
    v.prepare()
    x.grad = None
    _align_ranks(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        torch.cuda._sleep(SPIN_CYCLES)
    t0 = _stamp(dev)
    y, aux = v.forward(x)
    t1 = _stamp(dev)
    m1 = torch.cuda.memory_allocated() if cuda else None
    v.backward(y, aux, g)
    t2 = _stamp(dev)
    del y, aux
    if cuda:
        t2.synchronize()
    out = {"fwd_ms": _ms(t0, t1, dev), "fwd_bwd_ms": _ms(t0, t2, dev), "dropped": v.dropped()}
    if cuda:
        out.update(act=torch.cuda.max_memory_allocated() - m0, saved=m1 - m0)
    return out


def profiled_step(v: Variant, x: torch.Tensor, g: torch.Tensor, dev: torch.device) -> dict:
    """One step with the phase marks on: {"phases": {name: ms}, "total_ms": events around the step} or an error."""
    v.prepare()
    x.grad = None
    _align_ranks(dev)
    if dev.type == "cuda":
        torch.cuda._sleep(SPIN_CYCLES)  # as in the timed steps: the CPU runs ahead, the phases are GPU time
    if v.kind == "torchtitan":
        rec = PhaseRecorder(dev)
        v.module.phases = rec
        t0 = _stamp(dev)
        try:
            y, aux = v.forward(x)
            v.backward(y, aux, g)
            rec.mark("router_bwd")
        finally:
            v.module.phases = None
        timer = rec
    else:
        if dev.type != "cuda":
            return {"phases": {}, "error": "moe_ep.profiling records CUDA events: no phases on the CPU"}
        from moe_ep import profiling  # noqa: PLC0415

        t0 = _stamp(dev)
        with profiling.record_phases() as timer:
            y, aux = v.forward(x)
            v.backward(y, aux, g)
            profiling.mark("router_bwd")
    t1 = _stamp(dev)
    del y, aux
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ph = {k: float(val) for k, val in timer.summary().items()}
    return {"phases": ph, "total_ms": _ms(t0, t1, dev)}
