"""torchrun script: the MoE layer's CUDA backend without host syncs, under CUDA graph capture, run twice, run 1000
times, and with a missing peer, on 2 or more GPUs.

    torchrun --standalone --nproc-per-node=N tests/multigpu/moe_cuda_graph.py [--only a,b] [--skip c] [--list]
    (N = 2 or 4; needs CuPy + nvshmem4py; shared helpers and driver: tests/multigpu/_moe_cuda.py)

Cases: no host sync under ``torch.cuda.set_sync_debug_mode("error")`` with a capacity and with worst-case dropless
sizing (== exact sizing bitwise); a CUDA graph of forward + backward replayed on new inputs equals eager bitwise,
also after an in-place weight update and with shared experts (their side-stream fork / join inside the capture) and
DeepSeek-V3 routing (sigmoid, groups, expert bias); two runs are bitwise equal (also with shared experts); 1000
iterations with flat memory; last, a rank that skips a call makes the others raise EPTransportError("timeout...")
instead of hanging (the runtime is unusable afterwards, so nothing runs after it).
"""

from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tests.multigpu._moe_cuda as mc  # noqa: E402  (sets the NVSHMEM / NCCL environment before any init)
from moe_ep.transport.nvshmem import runtime as nvs  # noqa: E402

TIMEOUT_S = 2.0  # the runtime's timeout in the missing-peer case


def _run_sync_free(layer, x: torch.Tensor, g: torch.Tensor) -> dict:
    """mc.run_layer after a warm-up (kernels compiled, buffers grown, weights cached), under sync-debug mode "error":
    any host-device sync inside the forward + backward raises."""
    mc.run_layer(layer, x, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return mc.run_layer(layer, x, g)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def case_sync_free(quantize: bool) -> None:
    """capacity_factor set, nvshmem: forward + backward with no host sync (after a warm-up that compiles kernels,
    grows buffers and fills the weight cache), and bitwise the same results as the eager run that follows."""
    fast, _, _ = mc.make_layers(None, seed=4, quantize=quantize, capacity_factor=0.75)
    x, g = mc.tokens([40, 17, 33, 8], fast.cfg.hidden, seed=4)
    mine = _run_sync_free(fast, x, g)
    mc.same_results(mine, mc.run_layer(fast, x, g), "sync-free run vs the next eager run")
    nvs.get_runtime(fast.ep_group).check_errors()


def case_dropless_worst_case(quantize: bool) -> None:
    """Dropless with ``dropless_sizing="worst_case"``, nvshmem: forward + backward with no host sync (after a
    warm-up), bitwise the results of the same layer sized exactly (``"exact"``: the layout's row count read on the
    host), on tokens whose expanded rows are far below the worst case (rows past them are never read)."""
    fast, _, _ = mc.make_layers(None, seed=6, quantize=quantize, dropless_sizing="worst_case")
    exact, _, _ = mc.make_layers(None, seed=6, quantize=quantize)
    x, g = mc.tokens([40, 17, 33, 8], fast.cfg.hidden, seed=6)
    mine = _run_sync_free(fast, x, g)
    mc.same_results(mine, mc.run_layer(exact, x, g), "dropless worst-case sizing vs exact sizing")
    nvs.get_runtime(fast.ep_group).check_errors()


def _capture(step, xs: torch.Tensor, layer):
    """step() (forward + backward on the static input xs) warmed up 3 times on a side stream, as torch.cuda.graph asks
    for autograd, then captured with the gradients cleared -> (the graph, what the captured step returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    mc.zero_grads(layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def case_graph(quantize: bool, **kw) -> None:
    """capacity_factor set, nvshmem: forward + backward captured once, replayed on new inputs copied into the static
    input; every replay equals the eager run on the same input bitwise, with eager calls between replays.
    kw: more MoEConfig fields (num_shared_experts: the side-stream fork / join inside the capture)."""
    fast, _, _ = mc.make_layers(None, seed=5, quantize=quantize, capacity_factor=0.75, **kw)
    counts = [40, 17, 33, 8]
    sets = [mc.tokens(counts, fast.cfg.hidden, seed=s)[0] for s in (21, 22, 23)]
    g = mc.tokens(counts, fast.cfg.hidden, seed=24)[1]
    want = [mc.run_layer(fast, x, g) for x in sets]
    params = dict(fast.named_parameters())

    xs = sets[0].clone().requires_grad_(True)

    def step():
        y, aux = fast(xs)
        ((y.float() * g).sum() + aux).backward()
        return y, aux

    graph, (y_s, aux_s) = _capture(step, xs, fast)
    static = {"y": y_s, "aux": aux_s, "x.grad": xs.grad}
    static.update({f"{n}.grad": params[n].grad for n in mc.param_names(fast)})
    xs.grad = None  # eager runs allocate their own gradients; the graph keeps writing the static ones
    mc.zero_grads(fast)
    for i, j in enumerate((1, 2, 0, 1)):
        with torch.no_grad():
            xs.copy_(sets[j])
        graph.replay()
        mc.same_results(static, want[j], f"replay {i} (input {j})")
        if i == 1:
            mc.same_results(mc.run_layer(fast, sets[0], g), want[0], "eager between replays")
    torch.cuda.synchronize()
    del graph
    mc.same_results(mc.run_layer(fast, sets[2], g), want[2], "eager after the replays")
    nvs.get_runtime(fast.ep_group).check_errors()


def case_graph_weight_update() -> None:
    """mxfp8, capacity set: a CUDA graph captured with a warm operand cache, then an in-place weight update (what
    ``optimizer.step`` does: same storage, new version): the replay reads the new weights (the capture bypasses the
    cache, so the graph holds the weight preparation, not a cached result) and equals the eager run bitwise."""
    fast, _, _ = mc.make_layers(None, seed=8, quantize=True, capacity_factor=0.75)
    counts = [40, 17, 33, 8]
    x, g = mc.tokens(counts, fast.cfg.hidden, seed=25)
    xs = x.clone().requires_grad_(True)

    def step():
        y, aux = fast(xs)
        ((y.float() * g).sum() + aux).backward()
        return y

    graph, y_s = _capture(step, xs, fast)
    static_w = fast.experts.w13.grad
    xs.grad = None
    mc.zero_grads(fast)
    with torch.no_grad():  # exact (a power of two): only the scales move, which a stale operand would miss
        for p in fast.experts.parameters():
            p.mul_(-0.5)
    want = mc.run_layer(fast, x, g)
    graph.replay()
    mc.same_results({"y": y_s, "experts.w13.grad": static_w}, {k: want[k] for k in ("y", "experts.w13.grad")}, "replay")
    torch.cuda.synchronize()
    del graph
    nvs.get_runtime(fast.ep_group).check_errors()


def case_determinism(transport: str, quantize: bool, capacity, **kw) -> None:
    fast, _, _ = mc.make_layers(None, seed=6, transport=transport, quantize=quantize, capacity_factor=capacity, **kw)
    x, g = mc.tokens([64, 37, 100, 5], fast.cfg.hidden, seed=6)
    first = mc.attempt(lambda: mc.run_layer(fast, x, g), "the first run")
    if not mc.agree(first is not None):
        return
    mc.same_results(mc.run_layer(fast, x, g), first, f"second run ({transport}, q={quantize}, capacity={capacity})")


def case_memory(capacity, new_weight_versions: bool, iters: int = 1000) -> None:
    """``iters`` forward + backward on three inputs in turn: memory_allocated after iteration 10 == after the last,
    the peak does not grow after iteration 10, one more iteration equals iteration 3 (same input) bitwise.
    new_weight_versions: every iteration bumps w13 / w2's version (an optimizer step), so the weight cache prepares
    them again each time."""
    fast, _, _ = mc.make_layers(None, seed=7, hidden=128, ffn_hidden=64, capacity_factor=capacity)
    counts = [32, 16, 8, 24]
    xs = [mc.tokens(counts, 128, seed=s)[0] for s in (31, 32, 33)]
    g = mc.tokens(counts, 128, seed=34)[1]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # earlier, larger cases must not hide a growing peak
    first = None
    mem = {}
    for it in range(1, iters + 1):
        res = mc.run_layer(fast, xs[it % 3], g)
        if new_weight_versions:
            with torch.no_grad():
                fast.experts.w13.mul_(1.0)
                fast.experts.w2.mul_(1.0)
        if it == 3:
            first = res  # held from here on: the same live tensors at both measurements
        del res
        if it in (10, iters):
            torch.cuda.synchronize()
            gc.collect()
            mem[it] = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
    nvs.get_runtime(fast.ep_group).check_errors()
    if mem[iters][0] != mem[10][0]:
        mc.fail(f"memory_allocated after iteration 10: {mem[10][0]} B, after {iters}: {mem[iters][0]} B")
    if mem[iters][1] != mem[10][1]:
        mc.fail(f"max_memory_allocated after iteration 10: {mem[10][1]} B, after {iters}: {mem[iters][1]} B")
    mc.same_results(mc.run_layer(fast, xs[0], g), first, f"iteration {iters + 1} vs iteration 3 (same input)")


def case_missing_peer() -> None:
    """The last rank skips a layer call that the others make: their waits time out after TIMEOUT_S and they raise
    EPTransportError naming the timeout, instead of hanging. Leaves their runtime unusable: the last case."""
    fast, _, _ = mc.make_layers(None, seed=9, hidden=128, ffn_hidden=64, capacity_factor=1.0)
    x, g = mc.tokens([12, 7, 9, 3], 128, seed=9)
    mc.run_layer(fast, x, g)  # warm-up: every rank has compiled, sized and used the runtime
    cfg = fast.cfg
    rt = nvs.init_runtime(
        fast.ep_group, cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k, cfg.num_experts, timeout_s=TIMEOUT_S
    )
    rt.check_errors()
    dist.barrier()
    if mc.RANK == mc.WORLD - 1:
        return
    t0 = time.monotonic()
    try:
        mc.run_layer(fast, x, g)
        rt.check_errors()
        msg = None
    except Exception as exc:  # noqa: BLE001  (the type is checked below)
        msg = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    if msg is None or not msg.startswith("EPTransportError") or "timeout" not in msg:
        mc.fail(f"a call without its peer did not raise EPTransportError('timeout ...'): {msg!r} after {took:.1f} s")
    elif mc.RANK == 0:
        print(f"  (raised after {took:.1f} s: {msg[:160]})", flush=True)


def build_cases() -> mc.Cases:
    shared, dsv3 = mc.SHARED_KW, mc.DSV3_KW
    return [
        ("no host sync with a capacity (sync debug mode error), mxfp8", lambda: case_sync_free(True)),
        ("no host sync with a capacity (sync debug mode error), bf16", lambda: case_sync_free(False)),
        ("dropless worst-case sizing: no host sync, == exact sizing, mxfp8", lambda: case_dropless_worst_case(True)),
        ("dropless worst-case sizing: no host sync, == exact sizing, bf16", lambda: case_dropless_worst_case(False)),
        ("CUDA graph of forward + backward: replays = eager, mxfp8", lambda: case_graph(True)),
        ("CUDA graph of forward + backward: replays = eager, bf16", lambda: case_graph(False)),
        ("CUDA graph replay after an in-place weight update = eager, mxfp8", case_graph_weight_update),
        ("CUDA graph with shared experts (side stream): replays = eager, mxfp8", lambda: case_graph(True, **shared)),
        ("CUDA graph with shared experts (side stream): replays = eager, bf16", lambda: case_graph(False, **shared)),
        (
            "CUDA graph with shared experts + DeepSeek-V3 routing (expert-bias counts in the graph): replays = eager",
            lambda: case_graph(True, **shared, **dsv3),
        ),
        ("deterministic: nvshmem dropless", lambda: case_determinism("nvshmem", True, None)),
        ("deterministic: nccl dropless", lambda: case_determinism("nccl", True, None)),
        ("deterministic: nvshmem capacity bf16", lambda: case_determinism("nvshmem", False, 0.5)),
        ("deterministic: shared experts, nvshmem dropless", lambda: case_determinism("nvshmem", True, None, **shared)),
        ("1000 iterations, flat memory: dropless", lambda: case_memory(None, False)),
        ("1000 iterations, flat memory: capacity, new weight versions", lambda: case_memory(0.75, True)),
        ("a missing peer raises a timeout instead of hanging (last)", case_missing_peer),
    ]


if __name__ == "__main__":
    sys.exit(mc.main(build_cases, "the cuda MoE layer: no host sync, CUDA graphs, determinism, memory (torchrun)"))
