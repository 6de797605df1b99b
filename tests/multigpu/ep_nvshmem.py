"""torchrun script: the NVSHMEM transport against the reference transport (run over nccl in the same process).

    torchrun --standalone --nproc-per-node=N tests/multigpu/ep_nvshmem.py      (N = 2 or 4; needs nvshmem4py)

Every rank runs every case; ranks agree on each verdict through an all-reduce, and rank 0 prints
``PASS/FAIL name`` and ``N passed, N failed``; exit code 1 when any case failed on any rank. Failing checks print
per-rank diagnostics (first mismatching index, values, counts).

Bounds. Received bytes (e4m3 data, scales, local expert ids, weights), the expanded order and the blocked scales
must be identical. Combine and dispatch-backward sum in the reference's order (top-k slot order in fp32 on the
expert side with separate multiply and add, rank order in fp32 on the source), so they are expected to be
bitwise equal; the hard check is |mine - ref| <= 2^-7 |ref| + 1e-6 (one bf16 rounding of the result, which is
where a different fp32 summation order of <= top_k + ep_size terms would show). ``dw`` of combine-backward is a
dot product over H in a different order than torch's sum: |mine - ref| <= 1e-5 * sum_h |v_h y_h| + 1e-6.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys

os.environ.setdefault("MOE_EP_FORCE_REFERENCE", "1")  # the reference quantizer is pure torch: the specification
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_ep import finish, mxfp8  # noqa: E402
from moe_ep.transport import autograd as ops  # noqa: E402
from moe_ep.transport import reference as ref  # noqa: E402
from moe_ep.transport.nvshmem import buffer as ct  # noqa: E402
from moe_ep.transport.nvshmem import runtime as nvs  # noqa: E402
from moe_ep.transport.nvshmem.schedule import TransportSchedule  # noqa: E402
from tests import refs  # noqa: E402
from tests.multigpu._cases import run_cases  # noqa: E402

TMAX, HMAX, KMAX, EMAX = 512, 1024, 8, 64
TIMEOUT_S = 20.0  # spin-wait timeout of the runtime (a hung case fails in 20 s instead of 60)
RANK = WORLD = 0
DEV = None
GROUP = None


class CheckError(AssertionError):
    pass


ERRS: list[str] = []  # failed checks of the current case: recorded, not raised, so every rank keeps issuing the
# same transport calls (a rank leaving a case early would make its peers' waits time out)


def fail(msg: str) -> None:
    ERRS.append(msg)


def checked(fn) -> None:
    """Run a case; its recorded failed checks (``fail``) make it fail after it has issued all its collectives."""
    ERRS.clear()
    fn()
    if ERRS:
        raise CheckError("\n".join(ERRS))


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    ne = a != b
    if a.is_floating_point():
        ne &= ~(torch.isnan(a) & torch.isnan(b))
    n = int(ne.sum())
    if n == 0:
        return "equal"
    idx = ne.nonzero()[0].tolist()
    return f"{n} of {a.numel()} differ; first at {idx}: mine {a[tuple(idx)].item()!r} ref {b[tuple(idx)].item()!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bytes(mine: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (floats: NaN positions must agree, NaN payloads may differ)."""
    if mine.shape != want.shape:
        return fail(f"[rank {RANK}] {what}: shape {tuple(mine.shape)} vs reference {tuple(want.shape)}")
    if mine.is_floating_point() and mine.dtype != torch.float8_e4m3fn:
        nan = torch.isnan(mine)
        if not torch.equal(nan, torch.isnan(want)) or not torch.equal(_bits(mine)[~nan], _bits(want)[~nan]):
            fail(f"[rank {RANK}] {what}: {_first_diff(mine.float(), want.float())}")
        return
    if not torch.equal(_bits(mine), _bits(want)):
        fail(f"[rank {RANK}] {what}: {_first_diff(_bits(mine).long(), _bits(want).long())}")


def close(mine: torch.Tensor, want: torch.Tensor, what: str, rtol: float, atol) -> None:
    a, b = mine.float(), want.float()
    if a.shape != b.shape:
        return fail(f"[rank {RANK}] {what}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    tol = atol + rtol * b.abs()
    bad = ((a - b).abs() > tol) | (torch.isnan(a) != torch.isnan(b))
    if bool(bad.any()):
        i = bad.nonzero()[0].tolist()
        fail(
            f"[rank {RANK}] {what}: {int(bad.sum())} beyond tolerance; first {i}: mine "
            f"{a[tuple(i)].item()} ref {b[tuple(i)].item()} (max |diff| {(a - b).abs().max().item()})"
        )


def zeros_past(t: torch.Tensor, n: int, what: str) -> None:
    rest = t[n:]
    if rest.numel() and not bool((_bits(rest) == 0).all()):
        fail(f"[rank {RANK}] {what}: rows past N={n} are not zero")


# -------------------------------------------------------------------------------------------------- routing
def routing(case: str, n: int, e: int, k: int, gen: torch.Generator):
    if case == "one_expert":  # every token's only expert is 3
        idx = torch.full((n, k), 3, dtype=torch.int64)
    elif case == "sparse":  # only experts 0 and 5 get tokens (whole ranks get none at ep 4 with 8 experts)
        idx = torch.stack([torch.randperm(2, generator=gen)[:k] * 5 for _ in range(n)]) if n else None
    else:
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if n else None
    if idx is None:
        idx = torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(n, k, generator=gen) + 0.1
    return idx.to(DEV), w.to(DEV)


def make_inputs(case, counts, e, k, h, dtype, seed, specials=False):
    gen = torch.Generator().manual_seed(seed * 1000 + RANK)
    n = counts[RANK % len(counts)]
    x = torch.randn(n, h, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 3)
    if specials and n >= 3 and h >= 96:
        x[0, 5] = float("inf")
        x[1, 40] = float("nan")
        x[2, 64:96] = 0.0
        x[2, 70] = 1e-30
        if n >= 4:  # a block of subnormals only (E = -127, nonzero e4m3 bytes), one with a subnormal amax
            x[3, 0:32] = torch.linspace(-3e-39, 3e-39, 32)
            x[3, 32:64] = torch.linspace(-1e-40, 2e-40, 32)
    idx, w = routing(case, n, e, k, gen)
    return x.to(dtype).to(DEV), idx, w


def capacity_of(spec, num_tokens: int, k: int) -> int | None:
    """The drop-mode capacity of this rank: None (dropless), an int (the same on every rank) or a float c, the
    layer's ``ceil(c * own tokens * top_k)`` (so ranks with different token counts get different capacities)."""
    if spec is None or isinstance(spec, int):
        return spec
    return math.ceil(spec * num_tokens * k)


def check_drop_counts(handle, rh, hc: dict, cap: int | None) -> None:
    """The drop-mode statistics and the clamped group starts / tile offsets against the reference handle."""
    nd = handle.num_dropped
    if nd.dim() != 0 or nd.dtype != torch.int32 or nd.device.type != "cuda":
        fail(f"[rank {RANK}] num_dropped: {nd.dim()}-dim {nd.dtype} on {nd.device}, want a 0-dim int32 CUDA tensor")
    elif nd.untyped_storage().data_ptr() != handle.info.untyped_storage().data_ptr():
        fail(f"[rank {RANK}] num_dropped is not a view of handle.info")
    if int(nd) != rh.num_dropped or hc["dropped"] != rh.num_dropped:
        fail(f"[rank {RANK}] num_dropped: mine {int(nd)} / host_counts {hc['dropped']} ref {rh.num_dropped}")
    if cap is not None and handle.expand_capacity != cap:
        fail(f"[rank {RANK}] expand_capacity {handle.expand_capacity} != capacity {cap}")
    sizes = rh.group_sizes_host
    gstart = [0]
    for v in sizes:
        gstart.append(gstart[-1] + v)
    if hc["gstart"] != gstart:
        fail(f"[rank {RANK}] group starts: mine {hc['gstart']} ref {gstart}")
    tiles = mxfp8.group_tile_offsets(torch.tensor(sizes, dtype=torch.int64)).tolist()
    if hc["tile_off"] != tiles:
        fail(f"[rank {RANK}] tile offsets: mine {hc['tile_off']} ref {tiles}")


def expect_no_error(what: str) -> None:
    try:
        nvs.get_runtime(GROUP).check_errors()
    except (nvs.EPTransportError, ValueError) as exc:
        fail(f"[rank {RANK}] {what}: unexpected transport error {exc}")


# ---------------------------------------------------------------------------------------------------- cases
def case_transport(case, counts, e, k, h, dtype, seed=1, specials=False, capacity=None):
    """Layout, received bytes, expanded rows (value and MXFP8 paths), combine, both backward passes.

    capacity (see :func:`capacity_of`): drop mode on both transports (``build_layout(capacity=)``); every check
    then compares the kept rows with the reference's, and the dropped slots' contributions and gradients are 0.
    """
    x, idx, w = make_inputs(case, counts, e, k, h, dtype, seed, specials)
    cap = capacity_of(capacity, x.shape[0], k)
    rh = ref.build_layout(idx, e, GROUP, capacity=cap)
    handle = ct.build_layout(idx, e, GROUP) if cap is None else ct.build_layout(idx, e, GROUP, capacity=cap)
    expect_no_error("layout")  # drop mode never reports an overflow
    hc = refs.host_counts(handle)
    n = rh.num_expanded
    for key, want in (
        ("R", rh.num_recv),
        ("N", n),
        ("send_splits", rh.send_splits),
        ("recv_splits", rh.recv_splits),
        ("group_sizes", rh.group_sizes_host),
    ):
        if hc[key] != want:
            fail(f"[rank {RANK}] layout {key}: mine {hc[key]} ref {want} (capacity {cap})")
    check_drop_counts(handle, rh, hc, cap)
    same_bytes(handle.send_row_of.long(), rh.send_row_of, "send_row_of")

    for quantize in (True, False):
        rows, wrows = ct.dispatch_fwd(x, w, handle, quantize)
        recv = refs.recv_buffers(handle, quantize, h, dtype)
        rrecv = ref.dispatch_send(x, w, rh, quantize)
        tag = f"q={quantize}"
        same_bytes(recv.data, rrecv.data, f"received data {tag}")
        if quantize:
            same_bytes(recv.scale, rrecv.scale, "received scales")
        same_bytes(recv.local, rrecv.local, f"received local experts {tag}")
        same_bytes(recv.weight, rrecv.weight, f"received weights {tag}")
        same_bytes(handle.expand_row[:n].long(), rh.expand_row, f"expand_row {tag}")
        same_bytes(handle.expand_slot[:n].long(), rh.expand_slot, f"expand_slot {tag}")
        rrows, rw = ref.dispatch_fwd(x, w, rh, quantize)
        same_bytes(rows[:n], rrows, f"expanded rows {tag}")
        same_bytes(wrows[:n], rw, f"expanded weights {tag}")
        zeros_past(rows, n, f"expanded rows {tag}")
        zeros_past(wrows, n, f"expanded weights {tag}")

    data, scale, w_mx = ct.dispatch_fwd_mxfp8(x, w, handle)
    q = ref.dispatch_send(x, w, rh, True)
    same_bytes(data[:n], q.data[rh.expand_row], "MXFP8 expanded data")
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    same_bytes(scale[: want.numel()], want, "MXFP8 blocked grouped scales")
    if bool((scale[want.numel() :] != 0).any()):
        fail(f"[rank {RANK}] blocked scales: bytes past the used tiles are not zero")
    same_bytes(w_mx[:n], q.weight[rh.expand_row, rh.expand_slot], "MXFP8 expanded weights")

    gen = torch.Generator().manual_seed(seed * 7 + RANK)
    ncap = handle.expand_capacity

    def padded(t):
        out = torch.zeros(ncap, *t.shape[1:], dtype=t.dtype, device=DEV)
        out[:n] = t
        return out

    def tiny_columns(t):
        # specials: columns 0-7 of every row subnormal (in fp32 and bf16; ~4 % round to 0 in bf16), so the terms of
        # those output columns of combine, dispatch backward dx and the unquantized combine backward dy * w are
        # subnormal: a kernel that flushes them (-ftz arithmetic) writes 0 where the reference keeps the value.
        # Not covered: the quantized combine backward (the columns share an MXFP8 block with N(0, 1) values and
        # quantize to 0) and dw (subnormal products underflow on both sides; compared with a tolerance).
        if specials and t.shape[0] and t.shape[1] >= 8:
            t[:, :8] = (torch.randn(t.shape[0], 8, generator=gen) * 1e-39).to(t.dtype).to(t.device)
        return t

    y = tiny_columns((torch.randn(n, h, generator=gen)).to(dtype).to(DEV))
    wy = (torch.rand(n, generator=gen) + 0.5).to(DEV)
    out = ct.combine_fwd(padded(y), padded(wy), handle)
    rout = ref.combine_fwd(y, wy, rh)
    close(out, rout, "combine", 2**-7, 1e-6)
    same_bytes(out, rout, "combine (bitwise: same summation order)")

    g_rows = tiny_columns(torch.randn(n, h, generator=gen).to(dtype).to(DEV))
    g_w = torch.randn(n, generator=gen).to(DEV)
    dx, dtw = ct.dispatch_bwd(padded(g_rows), padded(g_w), handle, dtype)
    rdx, rdtw = ref.dispatch_bwd(g_rows, g_w, rh, dtype)
    close(dx, rdx, "dispatch backward dx", 2**-7, 1e-6)
    same_bytes(dx, rdx, "dispatch backward dx (bitwise)")
    same_bytes(dtw, rdtw, "dispatch backward d topk_w")

    dy = tiny_columns(torch.randn(x.shape[0], h, generator=gen).to(dtype).to(DEV))
    for quantize in (True, False):
        dyr, dw = ct.combine_bwd(dy, padded(y), padded(wy), handle, quantize)
        rdyr, rdw = ref.combine_bwd(dy, y, wy, rh, quantize)
        same_bytes(dyr[:n], rdyr, f"combine backward dy*w q={quantize}")
        zeros_past(dyr, n, "combine backward dy*w")
        dq = ref._rows(*ref.send_rows(dy, rh, quantize), dtype)[rh.expand_row].float()
        scale_abs = (dq * y.float()).abs().sum(-1)
        close(dw[:n], rdw, f"combine backward dw q={quantize}", 0.0, 1e-5 * scale_abs + 1e-6)
        zeros_past(dw, n, "combine backward dw")
    nvs.get_runtime(GROUP).check_errors()


def case_autograd(case, counts, e, k, h, dtype, sync_debug=True, capacity=None):
    """dispatch -> rows * 2 -> combine -> loss, forward and backward, vs the reference autograd path
    (capacity: drop mode on both, through ``dispatch(..., capacity=)``; see :func:`capacity_of`)."""
    x, idx, w = make_inputs(case, counts, e, k, h, dtype, 5)
    gen = torch.Generator().manual_seed(99 + RANK)
    g = torch.randn(x.shape[0], h, generator=gen).to(DEV)
    cap = capacity_of(capacity, x.shape[0], k)
    opts = {} if cap is None else {"capacity": cap}

    def run(fast: bool):
        xx = x.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        tr = ct.CUDA if fast else ref.REFERENCE
        rows, rw, handle = ops.dispatch(xx, idx, ww, e, GROUP, True, transport=tr, **opts)
        out = ops.combine(rows * 2.0, rw, handle, True, transport=tr)
        (out.float() * g).sum().backward()
        return out.detach(), xx.grad, ww.grad

    run(True)  # warm-up: kernels compiled, caches filled
    torch.cuda.synchronize()
    if sync_debug:
        torch.cuda.set_sync_debug_mode("error")
    try:
        mine = run(True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = run(False)
    # bf16 results: both sides round an fp32 sum of the same terms to bf16; a different summation order can move
    # the fp32 value across a rounding boundary, i.e. one bf16 ulp = 2^-7 relative at most. fp32 results: sums
    # of <= top_k + ep_size terms in another order differ by <= n * 2^-24 of the sum of |terms| (~1e-6 here);
    # 1e-5 leaves room for cancellation in that sum.
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(("out", "x.grad", "topk_w.grad"), mine, want, strict=True):
        # topk_w.grad holds dot products over H summed in another order than torch's: an absolute bound scaled by
        # the largest entry (a simplification of the module docstring's sum_h |v_h y_h| bound, which it exceeds)
        atol = 1e-5 * float(b.abs().max()) + 1e-6 if name == "topk_w.grad" and b.numel() else 1e-5
        close(a, b, f"autograd {name}", rtol, atol)
    nvs.get_runtime(GROUP).check_errors()


def case_graph(e=16, k=4, h=256, capacity=None):
    """Layout + fused dispatch + combine, forward and backward, captured once in a CUDA graph and replayed on three
    input sets (and the first again): every replay gives bitwise the eager results, and eager calls interleaved with
    replays stay correct (the epochs live on the device, not in the captured launch arguments). capacity: drop mode
    (see :func:`capacity_of`; the capacity depends on the token count only, so every replay has the same one)."""
    counts = [37, 11, 64, 0]
    sets = [make_inputs("random", counts, e, k, h, torch.bfloat16, seed) for seed in (21, 22, 23)]
    sets.append(sets[0])
    gen = torch.Generator().manual_seed(77 + RANK)
    g = torch.randn(sets[0][0].shape[0], h, generator=gen).to(DEV)
    cap = capacity_of(capacity, sets[0][0].shape[0], k)
    opts = {} if cap is None else {"capacity": cap}

    def fwd_bwd(xx, idx, ww):
        rows, rw, handle = ops.dispatch(xx, idx, ww, e, GROUP, True, transport=ct.CUDA, **opts)
        mx = ct.dispatch_fwd_mxfp8(xx.detach(), ww.detach(), handle)  # the fused kernel on the same layout
        out = ops.combine(rows * 2.0, rw, handle, True, transport=ct.CUDA)
        (out.float() * g).sum().backward()
        return (out, *mx, handle.group_sizes)

    names = ("out", "mxfp8 data", "mxfp8 scales", "mxfp8 weights", "group sizes", "x.grad", "topk_w.grad")

    def compare(mine, want, what):
        n = int(want[4].sum())  # rows past the expanded count are unspecified in the MXFP8 outputs
        for name, a, b in zip(names, mine, want, strict=True):
            if name in ("mxfp8 data", "mxfp8 weights"):
                a, b = a[:n], b[:n]
            same_bytes(a, b, f"{what}: {name}")

    def eager(x, idx, w):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        res = fwd_bwd(xx, idx, ww)
        return tuple(t.detach().clone() for t in (*res, xx.grad, ww.grad))

    want = [eager(*inp) for inp in sets[:3]]
    xs = sets[0][0].clone().requires_grad_(True)
    ws = sets[0][2].clone().requires_grad_(True)
    idxs = sets[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks for autograd
        for _ in range(2):
            fwd_bwd(xs, idxs, ws)
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = ws.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = fwd_bwd(xs, idxs, ws)
    for i, (x, idx, w) in enumerate(sets):
        with torch.no_grad():
            xs.copy_(x)
            ws.copy_(w)
            idxs.copy_(idx)
        graph.replay()
        compare((*out_s, xs.grad, ws.grad), want[i % 3], f"graph replay {i}")
        if i == 1:  # an eager call between two replays
            compare(eager(*sets[2]), want[2], "eager between replays")
    torch.cuda.synchronize()
    del graph
    compare(eager(*sets[1]), want[1], "eager after the replays")
    nvs.get_runtime(GROUP).check_errors()


def case_invalid_index():
    x, idx, w = make_inputs("random", [9, 4, 6, 1], 16, 2, 64, torch.bfloat16, 3)
    if RANK == 0 and idx.shape[0]:
        idx[idx.shape[0] - 1, 1] = 16  # == num_experts: out of range
    ct.build_layout(idx, 16, GROUP)
    rt = nvs.get_runtime(GROUP)
    try:
        rt.check_errors()
        raised = None
    except ValueError as exc:
        raised = str(exc)
    if RANK == 0 and (raised is None or "out of range" not in raised or "= 16" not in raised):
        fail(f"[rank 0] invalid expert id not reported: {raised!r}")
    if RANK != 0 and raised is not None:
        fail(f"[rank {RANK}] unexpected error {raised}")
    case_transport("random", [5, 3, 8, 2], 16, 2, 64, torch.bfloat16, seed=4)  # still usable afterwards


def case_overflow():
    """Dropless with an expand_capacity the routing overflows: every rank reports the overflow, and the layout is
    clamped to the capacity all the same (group sizes, group starts, tile offsets and N count the kept rows only,
    the rows the reference keeps with capacity=16), so the grouped GEMMs and the fused dispatch's blocked scales
    stay inside their buffers. Then the argument checks of capacity=."""
    rt = nvs.get_runtime(GROUP)
    x, idx, w = make_inputs("one_expert", [40, 40, 40, 40], 8, 1, 64, torch.bfloat16, 6)
    handle = ct.build_layout(idx, 8, GROUP, expand_capacity=16)  # expert 3's rank receives 40 * WORLD rows
    try:
        rt.check_errors()
        msg = None
    except nvs.EPTransportError as exc:
        msg = str(exc)
    if msg is None or "expand_capacity" not in msg or "16" not in msg:
        fail(f"[rank {RANK}] expand overflow not reported: {msg!r}")
    rh = ref.build_layout(idx, 8, GROUP, capacity=16)
    hc = refs.host_counts(handle)
    if hc["group_sizes"] != rh.group_sizes_host or hc["N"] != rh.num_expanded or sum(hc["group_sizes"]) > 16:
        fail(
            f"[rank {RANK}] overflowed layout not clamped: group sizes {hc['group_sizes']} N {hc['N']}, "
            f"ref (capacity 16) {rh.group_sizes_host} N {rh.num_expanded}"
        )
    check_drop_counts(handle, rh, hc, None)
    # The kernels clamp every expanded row index to the capacity; this case checks that the call completes and
    # keeps the capacity. A write past the allocation itself would only show under compute-sanitizer.
    rows, _ = ct.dispatch_fwd(x, w, handle, True)
    rt.check_errors()
    if rows.shape[0] != 16:
        fail(f"[rank {RANK}] expanded rows {rows.shape[0]} != capacity 16")
    n = rh.num_expanded
    rrows, _ = ref.dispatch_fwd(x, w, rh, True)
    same_bytes(rows[:n], rrows, "overflowed dispatch: kept rows")
    data, scale, _ = ct.dispatch_fwd_mxfp8(x, w, handle)
    rt.check_errors()
    q = ref.dispatch_send(x, w, rh, True)
    same_bytes(data[:n], q.data[rh.expand_row], "overflowed MXFP8 dispatch: kept rows")
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    same_bytes(scale[: want.numel()], want, "overflowed MXFP8 dispatch: blocked scales of the clamped groups")
    for bad in ({"capacity": -1}, {"capacity": True}, {"capacity": 4.0}, {"capacity": 8, "expand_capacity": 9}):
        try:
            ct.build_layout(idx, 8, GROUP, **bad)
            fail(f"[rank {RANK}] build_layout({bad}) accepted")
        except ValueError:
            pass
    try:
        ct.build_layout(torch.zeros(TMAX + 1, 1, dtype=torch.int32, device=DEV), 8, GROUP)
        fail(f"[rank {RANK}] T > max_tokens_per_rank accepted")
    except ValueError as exc:
        if "max_tokens_per_rank" not in str(exc):
            fail(f"[rank {RANK}] T > max_tokens_per_rank: unexpected message {exc}")


def case_repeat(iters=1000):
    """1000 x (layout + MXFP8 dispatch + combine): no hang, no memory growth, identical results."""
    h, e, k = 256, 16, 4
    x, idx, w = make_inputs("random", [200, 150, 256, 7], e, k, h, torch.bfloat16, 8)
    rt = nvs.get_runtime(GROUP)
    first = None
    mem0 = mem1 = 0
    for it in range(iters):
        handle = ct.build_layout(idx, e, GROUP)
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
        fail(f"[rank {RANK}] memory grew over {iters} iterations: {mem0} -> {mem1} bytes")


def case_timeout():
    """Only rank 0 combines: its wait must time out (2 s) and raise, not hang. Leaves the runtime unusable."""
    rt = nvs.get_runtime(GROUP)
    x, idx, w = make_inputs("random", [6, 6, 6, 6], 8, 2, 64, torch.bfloat16, 9)
    handle = ct.build_layout(idx, 8, GROUP)
    rows, wr = ct.dispatch_fwd(x, w, handle, True)
    rt.check_errors()
    dist.barrier()
    if RANK != 0:
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
        rt = nvs.get_runtime(GROUP)
        old = rt.schedule
        if via_init:
            same = ct.init_runtime(GROUP, TMAX, HMAX, KMAX, EMAX, wire_bytes=4, schedule=schedule)
            if same is not rt or rt.schedule != schedule:
                fail(f"[rank {RANK}] init_runtime(schedule=) did not update the existing runtime's schedule")
        else:
            rt.set_schedule(schedule)
        try:
            fn()
        finally:
            rt.set_schedule(old)

    return run


def case_schedule_mismatch():
    """Ranks passing different schedules: set_schedule raises on every rank, and the old schedule stays."""
    rt = nvs.get_runtime(GROUP)
    old = rt.schedule
    mine = dataclasses.replace(old, combine_send_warps=1 + RANK % 2)
    try:
        rt.set_schedule(mine)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    if msg is None or "differs between EP ranks" not in msg:
        fail(f"[rank {RANK}] mismatched schedules not rejected: {msg!r}")
    if rt.schedule != old:
        fail(f"[rank {RANK}] schedule changed to {rt.schedule} after a rejected set_schedule")
    case_transport("random", [5, 3, 8, 2], 16, 2, 64, torch.bfloat16, seed=11)  # still usable afterwards


def main() -> int:
    global RANK, WORLD, DEV, GROUP
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    DEV = torch.device("cuda", local)
    GROUP = dist.group.WORLD
    ct.init_runtime(GROUP, TMAX, HMAX, KMAX, EMAX, wire_bytes=4, schedule=TransportSchedule(), timeout_s=TIMEOUT_S)
    bf, f32 = torch.bfloat16, torch.float32
    cases = [
        ("random bf16 H=256 top2", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 256, bf, specials=True)),
        (
            "random fp32 H=160 top2 (C%4!=0)",
            lambda: case_transport("random", [9, 16, 3, 5], 8, 2, 160, f32, specials=True),
        ),
        ("one expert top1", lambda: case_transport("one_expert", [5, 9, 1, 3], 8, 1, 64, bf)),
        ("top8 of 8, a rank with 0 tokens", lambda: case_transport("random", [6, 11, 4, 0], 8, 8, 96, bf)),
        ("sparse: zero-token experts/ranks", lambda: case_transport("sparse", [10, 0, 17, 2], 8, 2, 128, bf)),
        ("large: 64 experts top8 H=1024", lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 1024, bf)),
        ("all ranks empty", lambda: case_transport("random", [0, 0, 0, 0], 8, 2, 64, bf)),
        # the fused kernels' schedules: 1 or 16 sender warps per CTA; dispatch rows sent as 3 column pieces of
        # which the first is empty (H=1024: 2 steps of 512 -> 0 + 1 + 1; piece 0 still carries the metadata) or as
        # 2 pieces, the second a partial step (H=992); combine rows as 3 pieces of 256-element steps (4 -> 1+1+2)
        # or 4 (H=992: 4 steps, the last partial)
        (
            "schedule: 1 sender warp, 3 pieces, H=1024",
            with_schedule(
                lambda: case_transport("random", [300, 41, 0, 257], 32, 8, 1024, bf, specials=True),
                TransportSchedule(dispatch_send_warps=1, combine_send_warps=1, dispatch_pieces=3, combine_pieces=3),
                via_init=True,
            ),
        ),
        (
            "schedule: 16 sender warps, 2 / 4 pieces, H=992",
            with_schedule(
                lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 992, bf),
                TransportSchedule(dispatch_send_warps=16, combine_send_warps=16, dispatch_pieces=2, combine_pieces=4),
            ),
        ),
        ("schedules that differ between ranks raise", case_schedule_mismatch),
        ("autograd bf16 under sync_debug_mode error", lambda: case_autograd("random", [40, 17, 0, 33], 16, 4, 128, bf)),
        ("autograd fp32 top8", lambda: case_autograd("random", [20, 9, 31, 3], 16, 8, 64, f32)),
        ("CUDA graph of forward + backward: replays = eager", case_graph),
        # drop mode (capacity=) vs the reference with the same capacity; a float is the layer's capacity factor c:
        # ceil(c * own tokens * top_k) per rank, so ranks with unequal token counts get unequal capacities, and a
        # rank with 0 tokens gets capacity 0 while it still receives rows
        (
            "capacity: one expert top1, capacities differ per rank",
            lambda: case_transport("one_expert", [5, 9, 1, 3], 8, 1, 64, bf, capacity=0.5),
        ),
        ("capacity: 1 row per rank, top2", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 128, bf, capacity=1)),
        ("capacity: 0 rows (all dropped)", lambda: case_transport("random", [13, 7, 0, 21], 8, 2, 64, bf, capacity=0)),
        (
            "capacity: top8 of 8, a rank with 0 tokens (capacity 0)",
            lambda: case_transport("random", [6, 11, 4, 0], 8, 8, 96, bf, capacity=0.6),
        ),
        (
            "capacity: bf16 H=256 top2, specials, unequal capacities",
            lambda: case_transport("random", [40, 3, 17, 0], 8, 2, 256, bf, specials=True, capacity=0.5),
        ),
        (
            "capacity: fp32 H=160 top2 (C%4!=0)",
            lambda: case_transport("random", [9, 16, 3, 5], 8, 2, 160, f32, specials=True, capacity=0.75),
        ),
        (
            "capacity: 64 experts top8 H=1024, multi-tile groups",
            lambda: case_transport("random", [512, 300, 477, 64], 64, 8, 1024, bf, capacity=0.3),
        ),
        (
            "capacity above the load: nothing dropped",  # every rank has tokens, so no capacity is 0
            lambda: case_transport("sparse", [10, 5, 17, 2], 8, 2, 128, bf, capacity=4.0),
        ),
        (
            "capacity: autograd bf16 under sync_debug_mode error",
            lambda: case_autograd("random", [40, 17, 0, 33], 16, 4, 128, bf, capacity=0.4),
        ),
        ("capacity: autograd fp32 top8", lambda: case_autograd("random", [20, 9, 31, 3], 16, 8, 64, f32, capacity=0.3)),
        ("capacity: CUDA graph of forward + backward", lambda: case_graph(capacity=0.5)),
        ("invalid expert index raises", case_invalid_index),
        ("overflow raises, group sizes clamped to the capacity", case_overflow),
        ("1000 dispatch/combine iterations", case_repeat),
        ("timeout raises instead of hanging", case_timeout),
    ]
    _, failed = run_cases([(name, lambda fn=fn: checked(fn)) for name, fn in cases], DEV)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
