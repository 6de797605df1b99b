"""The NVSHMEM transport's data cases against the reference transport (tests/multigpu/ep_nvshmem.py runs them under
torchrun; bounds in its module docstring): every pass with every payload (raw rows, MXFP8 1x32, blockwise 1x128),
autograd through the public dispatch / combine, and CUDA-graph replays.
"""

from __future__ import annotations

import torch

from moe_ep import mxfp8
from moe_ep.recipe import BLOCKWISE, MXFP8
from moe_ep.transport import autograd as ops
from moe_ep.transport import reference as ref
from moe_ep.transport.nvshmem import buffer as ct
from moe_ep.transport.nvshmem import runtime as nvs
from tests import refs
from tests.multigpu import ep_common as C
from tests.multigpu.ep_common import (
    capacity_of,
    check_drop_counts,
    close,
    expect_no_error,
    fail,
    make_inputs,
    same_bytes,
    zeros_past,
)


def payloads(h: int) -> tuple:
    """The payloads a hidden size allows: raw rows and MXFP8 always (h % 32 == 0), blockwise when h % 128 == 0."""
    return (None, MXFP8, BLOCKWISE) if h % 128 == 0 else (None, MXFP8)


def check_blockwise_hidden_refused(x, w, handle) -> None:
    """h % 128 != 0: the blockwise payload raises a clear ValueError before any kernel runs (so no rank's epochs move
    and the next case starts in step)."""
    for what, call in (
        ("fused dispatch", lambda: ct.dispatch_fwd_quantized(x, w, handle, "blockwise")),
        ("value dispatch", lambda: ct.dispatch_fwd(x, w, handle, BLOCKWISE)),
    ):
        try:
            call()
            fail(f"[rank {C.RANK}] blockwise {what} with hidden {x.shape[1]} accepted")
        except ValueError as exc:
            if "multiple of 128" not in str(exc) or "blockwise" not in str(exc):
                fail(f"[rank {C.RANK}] blockwise {what}: unclear message {exc}")


def check_fused(x, w, handle, rh, n: int) -> None:
    """The fused quantized dispatch of each recipe the hidden size allows == the reference's bytes."""
    data, scale, w_mx = ct.dispatch_fwd_mxfp8(x, w, handle)
    q = ref.dispatch_send(x, w, rh, MXFP8)
    same_bytes(data[:n], q.data[rh.expand_row], "MXFP8 expanded data")
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    same_bytes(scale[: want.numel()], want, "MXFP8 blocked grouped scales")
    if bool((scale[want.numel() :] != 0).any()):
        fail(f"[rank {C.RANK}] blocked scales: bytes past the used tiles are not zero")
    same_bytes(w_mx[:n], q.weight[rh.expand_row, rh.expand_slot], "MXFP8 expanded weights")
    if x.shape[1] % 128:
        return check_blockwise_hidden_refused(x, w, handle)
    # blockwise: row-major [expand_capacity, H/128] scales, rows past N zero (the reference's contract: [N, H/128])
    data, scale, w_bw = ct.dispatch_fwd_quantized(x, w, handle, "blockwise")
    rdata, rscale, rw = ref.dispatch_fwd_quantized(x, w, rh, "blockwise")
    if scale.shape != (handle.expand_capacity, x.shape[1] // 128):
        fail(f"[rank {C.RANK}] blockwise scales: shape {tuple(scale.shape)}")
    same_bytes(data[:n], rdata, "blockwise expanded data")
    same_bytes(scale[:n], rscale, "blockwise scales")
    zeros_past(scale, n, "blockwise scales")
    same_bytes(w_bw[:n], rw, "blockwise expanded weights")


def case_transport(case, counts, e, k, h, dtype, seed=1, specials=False, capacity=None):
    """Layout, received bytes, expanded rows (value and fused paths, every payload), combine, both backward passes.

    capacity (see :func:`~tests.multigpu.ep_common.capacity_of`): drop mode on both transports
    (``build_layout(capacity=)``); every check then compares the kept rows with the reference's, and the dropped
    slots' contributions and gradients are 0.
    """
    x, idx, w = make_inputs(case, counts, e, k, h, dtype, seed, specials)
    cap = capacity_of(capacity, x.shape[0], k)
    rh = ref.build_layout(idx, e, C.GROUP, capacity=cap)
    handle = ct.build_layout(idx, e, C.GROUP) if cap is None else ct.build_layout(idx, e, C.GROUP, capacity=cap)
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
            fail(f"[rank {C.RANK}] layout {key}: mine {hc[key]} ref {want} (capacity {cap})")
    check_drop_counts(handle, rh, hc, cap)
    same_bytes(handle.send_row_of.long(), rh.send_row_of, "send_row_of")

    for recipe in payloads(h):
        rows, wrows = ct.dispatch_fwd(x, w, handle, recipe)
        recv = refs.recv_buffers(handle, recipe, h, dtype)
        rrecv = ref.dispatch_send(x, w, rh, recipe)
        tag = f"payload {recipe.name if recipe else None}"
        same_bytes(recv.data, rrecv.data, f"received data {tag}")
        if recipe is not None:
            same_bytes(recv.scale, rrecv.scale, f"received scales {tag}")
        same_bytes(recv.local, rrecv.local, f"received local experts {tag}")
        same_bytes(recv.weight, rrecv.weight, f"received weights {tag}")
        same_bytes(handle.expand_row[:n].long(), rh.expand_row, f"expand_row {tag}")
        same_bytes(handle.expand_slot[:n].long(), rh.expand_slot, f"expand_slot {tag}")
        rrows, rw = ref.dispatch_fwd(x, w, rh, recipe)
        same_bytes(rows[:n], rrows, f"expanded rows {tag}")
        same_bytes(wrows[:n], rw, f"expanded weights {tag}")
        zeros_past(rows, n, f"expanded rows {tag}")
        zeros_past(wrows, n, f"expanded weights {tag}")

    check_fused(x, w, handle, rh, n)

    gen = torch.Generator().manual_seed(seed * 7 + C.RANK)
    ncap = handle.expand_capacity

    def padded(t):
        out = torch.zeros(ncap, *t.shape[1:], dtype=t.dtype, device=C.DEV)
        out[:n] = t
        return out

    def tiny_columns(t):
        # specials: columns 0-7 of every row subnormal (in fp32 and bf16; ~4 % round to 0 in bf16), so the terms of
        # those output columns of combine, dispatch backward dx and the unquantized combine backward dy * w are
        # subnormal: a kernel that flushes them (-ftz arithmetic) writes 0 where the reference keeps the value.
        # Not covered: the quantized combine backward (the columns share a scale block with N(0, 1) values and
        # quantize to 0) and dw (subnormal products underflow on both sides; compared with a tolerance).
        if specials and t.shape[0] and t.shape[1] >= 8:
            t[:, :8] = (torch.randn(t.shape[0], 8, generator=gen) * 1e-39).to(t.dtype).to(t.device)
        return t

    y = tiny_columns((torch.randn(n, h, generator=gen)).to(dtype).to(C.DEV))
    wy = (torch.rand(n, generator=gen) + 0.5).to(C.DEV)
    out = ct.combine_fwd(padded(y), padded(wy), handle)
    rout = ref.combine_fwd(y, wy, rh)
    close(out, rout, "combine", 2**-7, 1e-6)
    same_bytes(out, rout, "combine (bitwise: same summation order)")

    g_rows = tiny_columns(torch.randn(n, h, generator=gen).to(dtype).to(C.DEV))
    g_w = torch.randn(n, generator=gen).to(C.DEV)
    dx, dtw = ct.dispatch_bwd(padded(g_rows), padded(g_w), handle, dtype)
    rdx, rdtw = ref.dispatch_bwd(g_rows, g_w, rh, dtype)
    close(dx, rdx, "dispatch backward dx", 2**-7, 1e-6)
    same_bytes(dx, rdx, "dispatch backward dx (bitwise)")
    same_bytes(dtw, rdtw, "dispatch backward d topk_w")

    dy = tiny_columns(torch.randn(x.shape[0], h, generator=gen).to(dtype).to(C.DEV))
    if specials and dy.shape[0] >= 2 and h >= 160:  # a NaN and an Inf block in dy (0xFF scales, 0x7F bytes)
        dy[0, 140] = float("nan")
        dy[1, 3] = float("-inf")
    for recipe in payloads(h):
        tag = f"payload {recipe.name if recipe else None}"
        dyr, dw = ct.combine_bwd(dy, padded(y), padded(wy), handle, recipe)
        rdyr, rdw = ref.combine_bwd(dy, y, wy, rh, recipe)
        same_bytes(dyr[:n], rdyr, f"combine backward dy*w {tag}")
        zeros_past(dyr, n, "combine backward dy*w")
        dq = ref._rows(*ref.send_rows(dy, rh, recipe), dtype)[rh.expand_row].float()
        scale_abs = (dq * y.float()).abs().sum(-1)
        close(dw[:n], rdw, f"combine backward dw {tag}", 0.0, 1e-5 * scale_abs + 1e-6)
        zeros_past(dw, n, "combine backward dw")
    nvs.get_runtime(C.GROUP).check_errors()


def case_autograd(case, counts, e, k, h, dtype, sync_debug=True, capacity=None, recipe=MXFP8):
    """dispatch -> rows * 2 -> combine -> loss, forward and backward, vs the reference autograd path (capacity:
    drop mode on both, through ``dispatch(..., capacity=)``; see :func:`~tests.multigpu.ep_common.capacity_of`;
    recipe: the payload of both directions)."""
    x, idx, w = make_inputs(case, counts, e, k, h, dtype, 5)
    gen = torch.Generator().manual_seed(99 + C.RANK)
    g = torch.randn(x.shape[0], h, generator=gen).to(C.DEV)
    cap = capacity_of(capacity, x.shape[0], k)
    opts = {} if cap is None else {"capacity": cap}

    def run(fast: bool):
        xx = x.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        tr = ct.CUDA if fast else ref.REFERENCE
        rows, rw, handle = ops.dispatch(xx, idx, ww, e, C.GROUP, recipe, transport=tr, **opts)
        out = ops.combine(rows * 2.0, rw, handle, recipe, transport=tr)
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
    nvs.get_runtime(C.GROUP).check_errors()


def case_graph(e=16, k=4, h=256, capacity=None, recipe=MXFP8):
    """Layout + fused dispatch + combine, forward and backward, captured once in a CUDA graph and replayed on three
    input sets (and the first again): every replay gives bitwise the eager results, and eager calls interleaved with
    replays stay correct (the epochs live on the device, not in the captured launch arguments). capacity: drop mode
    (see :func:`~tests.multigpu.ep_common.capacity_of`; the capacity depends on the token count only, so every
    replay has the same one). recipe: the payload (of the fused dispatch and of both autograd directions)."""
    counts = [37, 11, 64, 0]
    sets = [make_inputs("random", counts, e, k, h, torch.bfloat16, seed) for seed in (21, 22, 23)]
    sets.append(sets[0])
    gen = torch.Generator().manual_seed(77 + C.RANK)
    g = torch.randn(sets[0][0].shape[0], h, generator=gen).to(C.DEV)
    cap = capacity_of(capacity, sets[0][0].shape[0], k)
    opts = {} if cap is None else {"capacity": cap}

    def fwd_bwd(xx, idx, ww):
        rows, rw, handle = ops.dispatch(xx, idx, ww, e, C.GROUP, recipe, transport=ct.CUDA, **opts)
        fused = ct.dispatch_fwd_quantized(xx.detach(), ww.detach(), handle, recipe)  # the same layout
        out = ops.combine(rows * 2.0, rw, handle, recipe, transport=ct.CUDA)
        (out.float() * g).sum().backward()
        return (out, *fused, handle.group_sizes)

    names = ("out", "fused data", "fused scales", "fused weights", "group sizes", "x.grad", "topk_w.grad")

    def compare(mine, want, what):
        n = int(want[4].sum())  # rows past the expanded count are unspecified in the fused outputs
        for name, a, b in zip(names, mine, want, strict=True):
            if name in ("fused data", "fused weights"):
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
    nvs.get_runtime(C.GROUP).check_errors()
