"""The NVSHMEM transport's fault and lifecycle cases (tests/multigpu/ep_nvshmem.py runs them under torchrun): invalid
expert ids, overflow, 1000 iterations, a timeout, schedules set collectively (and refused when ranks differ).
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist

from moe_ep import mxfp8
from moe_ep.recipe import BLOCKWISE, MXFP8
from moe_ep.transport import reference as ref
from moe_ep.transport.nvshmem import buffer as ct
from moe_ep.transport.nvshmem import runtime as nvs
from moe_ep.transport.nvshmem.schedule import TransportSchedule
from tests import refs
from tests.multigpu import ep_common as C
from tests.multigpu.ep_common import check_drop_counts, fail, make_inputs, same_bytes, zeros_past
from tests.multigpu.ep_nvshmem_cases import case_transport


def case_invalid_index():
    x, idx, w = make_inputs("random", [9, 4, 6, 1], 16, 2, 64, torch.bfloat16, 3)
    if C.RANK == 0 and idx.shape[0]:
        idx[idx.shape[0] - 1, 1] = 16  # == num_experts: out of range
    ct.build_layout(idx, 16, C.GROUP)
    rt = nvs.get_runtime(C.GROUP)
    try:
        rt.check_errors()
        raised = None
    except ValueError as exc:
        raised = str(exc)
    if C.RANK == 0 and (raised is None or "out of range" not in raised or "= 16" not in raised):
        fail(f"[rank 0] invalid expert id not reported: {raised!r}")
    if C.RANK != 0 and raised is not None:
        fail(f"[rank {C.RANK}] unexpected error {raised}")
    case_transport("random", [5, 3, 8, 2], 16, 2, 64, torch.bfloat16, seed=4)  # still usable afterwards


def case_overflow():
    """Dropless with an expand_capacity the routing overflows: every rank reports the overflow, and the layout is
    clamped to the capacity all the same (group sizes, group starts, tile offsets and N count the kept rows only,
    the rows the reference keeps with capacity=16), so the grouped GEMMs and the fused dispatch's blocked scales
    stay inside their buffers. Then the argument checks of capacity=."""
    rt = nvs.get_runtime(C.GROUP)
    x, idx, w = make_inputs("one_expert", [40, 40, 40, 40], 8, 1, 64, torch.bfloat16, 6)
    handle = ct.build_layout(idx, 8, C.GROUP, expand_capacity=16)  # expert 3's rank receives 40 * WORLD rows
    try:
        rt.check_errors()
        msg = None
    except nvs.EPTransportError as exc:
        msg = str(exc)
    if msg is None or "expand_capacity" not in msg or "16" not in msg:
        fail(f"[rank {C.RANK}] expand overflow not reported: {msg!r}")
    rh = ref.build_layout(idx, 8, C.GROUP, capacity=16)
    hc = refs.host_counts(handle)
    if hc["group_sizes"] != rh.group_sizes_host or hc["N"] != rh.num_expanded or sum(hc["group_sizes"]) > 16:
        fail(
            f"[rank {C.RANK}] overflowed layout not clamped: group sizes {hc['group_sizes']} N {hc['N']}, "
            f"ref (capacity 16) {rh.group_sizes_host} N {rh.num_expanded}"
        )
    check_drop_counts(handle, rh, hc, None)
    # The kernels clamp every expanded row index to the capacity; this case checks that the call completes and
    # keeps the capacity. A write past the allocation itself would only show under compute-sanitizer.
    rows, _ = ct.dispatch_fwd(x, w, handle, MXFP8)
    rt.check_errors()
    if rows.shape[0] != 16:
        fail(f"[rank {C.RANK}] expanded rows {rows.shape[0]} != capacity 16")
    n = rh.num_expanded
    rrows, _ = ref.dispatch_fwd(x, w, rh, MXFP8)
    same_bytes(rows[:n], rrows, "overflowed dispatch: kept rows")
    data, scale, _ = ct.dispatch_fwd_mxfp8(x, w, handle)
    rt.check_errors()
    q = ref.dispatch_send(x, w, rh, MXFP8)
    same_bytes(data[:n], q.data[rh.expand_row], "overflowed MXFP8 dispatch: kept rows")
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    same_bytes(scale[: want.numel()], want, "overflowed MXFP8 dispatch: blocked scales of the clamped groups")
    xb = make_inputs("one_expert", [40, 40, 40, 40], 8, 1, 128, torch.bfloat16, 6)[0]  # the same routing, H = 128
    data, scale, _ = ct.dispatch_fwd_blockwise(xb, w, handle)
    rt.check_errors()
    rdata, rscale, _ = ref.dispatch_fwd_quantized(xb, w, rh, BLOCKWISE)
    same_bytes(data[:n], rdata, "overflowed blockwise dispatch: kept rows")
    same_bytes(scale[:n], rscale, "overflowed blockwise dispatch: scales of the kept rows")
    zeros_past(scale, n, "overflowed blockwise dispatch: scales")
    for bad in ({"capacity": -1}, {"capacity": True}, {"capacity": 4.0}, {"capacity": 8, "expand_capacity": 9}):
        try:
            ct.build_layout(idx, 8, C.GROUP, **bad)
            fail(f"[rank {C.RANK}] build_layout({bad}) accepted")
        except ValueError:
            pass
    try:
        ct.build_layout(torch.zeros(C.TMAX + 1, 1, dtype=torch.int32, device=C.DEV), 8, C.GROUP)
        fail(f"[rank {C.RANK}] T > max_tokens_per_rank accepted")
    except ValueError as exc:
        if "max_tokens_per_rank" not in str(exc):
            fail(f"[rank {C.RANK}] T > max_tokens_per_rank: unexpected message {exc}")


def case_repeat(iters=1000):
    """1000 x (layout + MXFP8 dispatch + combine): no hang, no memory growth, identical results."""
    h, e, k = 256, 16, 4
    x, idx, w = make_inputs("random", [200, 150, 256, 7], e, k, h, torch.bfloat16, 8)
    rt = nvs.get_runtime(C.GROUP)
    first = None
    mem0 = mem1 = 0
    for it in range(iters):
        handle = ct.build_layout(idx, e, C.GROUP)
        data, scale, wm = ct.dispatch_fwd_mxfp8(x, w, handle)
        y = data.to(torch.bfloat16)
        out = ct.combine_fwd(y, wm, handle)
        if it == 0:
            first = out.clone()
        if it in (1, iters - 1):
            torch.cuda.synchronize()
            gc.collect()
            if it == 1:
                mem0 = torch.cuda.memory_allocated()
            else:
                mem1 = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    rt.check_errors()
    same_bytes(out, first, "repeat: last result vs first")
    if mem1 > mem0 + (1 << 20):
        fail(f"[rank {C.RANK}] memory grew over {iters} iterations: {mem0} -> {mem1} bytes")


def case_timeout():
    """Only rank 0 combines: its wait must time out (2 s) and raise, not hang. Leaves the runtime unusable."""
    rt = nvs.get_runtime(C.GROUP)
    x, idx, w = make_inputs("random", [6, 6, 6, 6], 8, 2, 64, torch.bfloat16, 9)
    handle = ct.build_layout(idx, 8, C.GROUP)
    rows, wr = ct.dispatch_fwd(x, w, handle, MXFP8)
    rt.check_errors()
    dist.barrier()
    if C.RANK != 0:
        return
    rt.timeout_ns = int(2e9)
    ct.combine_fwd(rows, wr, handle)
    try:
        rt.check_errors()
        msg = None
    except nvs.EPTransportError as exc:
        msg = str(exc)
    if msg is None or "timeout" not in msg:
        fail(f"[rank 0] lone combine did not time out: {msg!r}")


def with_schedule(fn, schedule: TransportSchedule, via_init: bool = False):
    """fn() under another schedule of the fused kernels (collective: every rank sets the same), restored after.
    via_init: set through init_runtime(..., schedule=) on the existing runtime instead of EPRuntime.set_schedule."""

    def run():
        rt = nvs.get_runtime(C.GROUP)
        old = rt.schedule
        if via_init:
            same = ct.init_runtime(C.GROUP, C.TMAX, C.HMAX, C.KMAX, C.EMAX, wire_bytes=4, schedule=schedule)
            if same is not rt or rt.schedule != schedule:
                fail(f"[rank {C.RANK}] init_runtime(schedule=) did not update the existing runtime's schedule")
        else:
            rt.set_schedule(schedule)
        try:
            fn()
        finally:
            rt.set_schedule(old)

    return run


def case_schedule_mismatch():
    """Ranks passing different schedules: set_schedule raises on every rank, and the old schedule stays."""
    rt = nvs.get_runtime(C.GROUP)
    old = rt.schedule
    mine = dataclasses.replace(old, combine_send_warps=1 + C.RANK % 2)
    try:
        rt.set_schedule(mine)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    if msg is None or "differs between EP ranks" not in msg:
        fail(f"[rank {C.RANK}] mismatched schedules not rejected: {msg!r}")
    if rt.schedule != old:
        fail(f"[rank {C.RANK}] schedule changed to {rt.schedule} after a rejected set_schedule")
    case_transport("random", [5, 3, 8, 2], 16, 2, 64, torch.bfloat16, seed=11)  # still usable afterwards
