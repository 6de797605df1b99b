"""torchrun script: the MoE layer's CUDA backend (issue 29) against the reference backend, on 2 or more GPUs.

    torchrun --standalone --nproc-per-node=N tests/multigpu/moe_cuda.py [--only a,b] [--skip c]
    (N = 2 or 4; needs CuPy + nvshmem4py; --only / --skip: substrings of case names, the same on every rank)

Every rank runs every case; ranks agree on each verdict through an all-reduce (tests/multigpu/_cases.py), rank 0
prints ``PASS/FAIL name`` and ``N passed, N failed``; exit code 1 when any case failed on any rank. Failed checks are
recorded, not raised (``fail``), so every rank keeps issuing the same transport calls; a failing check prints the
rank and the numbers.

Cases: the layer (router included) cuda vs reference for both transports, quantize True and False, also on a ("dp",
"ep") mesh with ep = world / 2; awkward routing given by hand through ``moe_ep.layer.routed_experts`` (zero-token
experts, every token on one expert, unequal counts, a rank or every rank with no tokens, H = 160 / 224 with F = 96,
top_k 1 and 8, int32 ids); drop mode (``capacity_factor``) with ``num_dropped`` exact; no host sync under
``torch.cuda.set_sync_debug_mode("error")`` with a capacity and with worst-case dropless sizing (== exact sizing
bitwise); a CUDA graph of forward + backward replayed on new
inputs equals eager bitwise, also after an in-place weight update and with shared experts (their side-stream fork /
join inside the capture) and DeepSeek-V3 routing (sigmoid, groups, expert bias); the layer with shared experts and
that routing cuda vs reference; the experts as an FSDP2 unit on "dp" (ep = world / 2), gathered plain and in MXFP8,
over two weight versions; two runs are bitwise equal (also with shared experts); 1000 iterations with flat memory; an
invalid expert id raises ValueError naming it; last, a rank that skips a call makes the others raise
EPTransportError("timeout...") instead of hanging (the runtime is unusable afterwards, so nothing runs after it).

The reference runs with MOE_EP_FORCE_REFERENCE=1 (the pure-PyTorch quantizer, the specification) set only around its
own forward and backward; the cuda layer always runs the kernels (the variable is removed from the environment at
start).

Tolerances (cuda vs reference; x bf16, parameters bf16, results compared per rank on its own tokens / experts).
  quantize=True: both sides run the same MXFP8 recipe (same routing: the same router code; same kept slots; the
    transport is bitwise the reference's, tests/multigpu/ep_nvshmem.py). They differ only in the fp32 summation
    order inside the expert GEMMs, which can move an intermediate (A and dh rounded to bf16, h and dA rounded to
    e4m3) across a rounding boundary: a few elements then take the neighbouring value, up to one e4m3 step (2^-3
    relative) of that element. As in tests/test_expert_mlp_cuda.py the bound is relative to the reference's
    magnitude and to the recipe's own error, measured here on the same inputs (the reference with quantize=False):
        ||cuda - ref||_F / ||ref||_F <= 0.1 * ||ref - ref_bf16||_F / ||ref||_F + 2^-8
    (2^-8: one bf16 rounding of results that are rounded to bf16 after a reordered fp32 sum, e.g. bf16 weight
    gradients). The recipe error is one e4m3 rounding on every element (several %); the gap is a rounding step on a
    few elements (measured 2-4e-4 for the expert MLP alone); an indexing, scale or routing bug is of the order of
    the values. Per row (token rows of y / x.grad / topk_w.grad, expert rows of the weight gradients, expert rows
    of the router gradient): ||row gap|| <= 0.25 ||ref row||. One crossing moves a row by at most 2^-3 of one term
    of its sum over H or F (~1 % of the row); a token that lost or gained an expert's contribution moves by about
    1 / top_k of it, so the per-row bound sees one lost slot up to top_k 4 (the top_k 8 cases rely on the
    whole-tensor bound and the exact-zero rows for that). Where the reference row is exactly zero (a token whose
    every slot was dropped, an expert that got no rows) the cuda row must be exactly zero.
  quantize=False: the reference computes h = silu(gate) * up and dA in fp32 and multiplies them unrounded; the cuda
    path computes the SwiGLU and its backward elementwise in bf16 and feeds torch._grouped_mm bf16 operands, so
    every element of h and dA carries a few bf16 roundings (each <= 2^-9 relative, random signs): a gap on every
    element, 3.7e-3 to 4.3e-3 relative (Frobenius) in y and the gradients on 2 H200 (quantize=True gives 0 to
    1e-4). Bound: ||gap||_F <= 2^-6 ||ref||_F (~4x the measured gap; a statistic over every element, so it does
    not fluctuate much), rows <= 2^-4.
  aux loss: the same router code on the same logits: |gap| <= 1e-5 |ref| + 1e-7 (fp32 sums in another order).
  num_dropped: exact. Determinism, CUDA graph replay vs eager: bitwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("MOE_EP_COMM_TIMEOUT_S", "20")  # a hung case fails in 20 s instead of 60
os.environ.pop("MOE_EP_FORCE_REFERENCE", None)  # the cuda layer must run its kernels; see spec_quantizer()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import moe_ep.layer  # noqa: E402
from moe_ep import MoE, MoEConfig, finish, init_ep  # noqa: E402
from moe_ep.transport.nvshmem import runtime as nvs  # noqa: E402
from tests.multigpu._cases import run_cases  # noqa: E402

SHARED_KW = dict(num_shared_experts=1, shared_ffn_hidden=192)
DSV3_KW = dict(score_func="sigmoid", n_group=4, topk_group=2, route_scale=2.5, expert_bias=True)
TMAX = 512  # max_tokens_per_rank of every layer here (sizes the NVSHMEM buffers)
TIMEOUT_S = 2.0  # the runtime's timeout in the missing-peer case
RANK = WORLD = 0
DEV = None
MESH = None
_HALF_MESH = []  # the ("dp", "ep") mesh with ep = world / 2, made on first use
PARAMS = ("router.weight", "experts.w13", "experts.w2")
SHARED = ("shared_experts.w13", "shared_experts.w2")  # the layers with num_shared_experts > 0 also have these


def _param_names(layer: MoE) -> tuple[str, ...]:
    return PARAMS + (SHARED if layer.shared_experts is not None else ())


class CheckError(AssertionError):
    pass


ERRS: list[str] = []  # failed checks of the current case: recorded, not raised (see the module docstring)
WORST: list = []  # the current case's largest gap / bound of close_to_ref on this rank: [(ratio, what)]


def fail(msg: str) -> None:
    ERRS.append(f"[rank {RANK}] {msg}")


def checked(fn) -> None:
    """Run a case; its recorded failed checks make it fail after it has issued all its collectives."""
    ERRS.clear()
    WORST.clear()
    fn()
    if WORST and RANK == 0:  # the margin of the tolerance, for the log
        print(f"  rank 0: largest gap / bound {WORST[0][0]:.3g} ({WORST[0][1]})", flush=True)
    if ERRS:
        raise CheckError("\n".join(ERRS))


def attempt(fn, what: str):
    """fn() -> its result, or None after recording its exception as a failed check."""
    try:
        return fn()
    except Exception:  # noqa: BLE001  (recorded; the ranks then agree to stop the case together)
        fail(f"{what} raised:\n{traceback.format_exc()}")
        return None


def agree(ok: bool) -> bool:
    """True when ``ok`` on every rank (an all-reduce: every rank calls it at the same point of a case). A rank that
    raised inside a layer call stops issuing its collectives; without this the others would pair their next
    collective with a different one of that rank and hang. (Its peers' NVSHMEM waits time out meanwhile.)"""
    flag = torch.tensor([int(ok)], device=DEV)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# --------------------------------------------------------------------------------------------------- checks
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    ne = a != b
    n = int(ne.sum())
    if n == 0:
        return "equal"
    idx = ne.nonzero()[0].tolist()
    return f"{n} of {a.numel()} differ; first at {idx}: mine {a[tuple(idx)].item()!r} ref {b[tuple(idx)].item()!r}"


def same_bytes(mine: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (NaN payloads too: both sides come from the same code)."""
    if mine.shape != want.shape or mine.dtype != want.dtype:
        return fail(f"{what}: {tuple(mine.shape)} {mine.dtype} vs {tuple(want.shape)} {want.dtype}")
    if not torch.equal(_bits(mine), _bits(want)):
        fail(f"{what}: not bitwise equal: {_first_diff(mine.float(), want.float())}")


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    return float(diff.norm() / ref.norm())


def close_to_ref(
    mine: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None, quantize: bool, what: str, rows: bool = True
) -> None:
    """The bound of the module docstring: relative Frobenius gap (quantize: against the recipe's error ``ref -
    base``), per row (dim 0) unless ``rows`` is False, and exact zeros where the reference is exactly zero."""
    if mine.shape != ref.shape or mine.dtype != ref.dtype:
        return fail(f"{what}: {tuple(mine.shape)} {mine.dtype} vs reference {tuple(ref.shape)} {ref.dtype}")
    if mine.numel() == 0:
        return
    if not bool(torch.isfinite(mine).all()):
        return fail(f"{what}: {int((~torch.isfinite(mine)).sum())} non-finite values")
    a, b = mine.double(), ref.double()
    if float(b.norm()) == 0.0:
        if bool((a != 0).any()):
            fail(f"{what}: the reference is exactly zero, mine has {int((a != 0).sum())} nonzero values")
        return
    gap = _rel(a - b, b)
    if quantize:
        recipe = _rel(b - base.double(), b)
        bound, why = 0.1 * recipe + 2**-8, f"0.1 x recipe error {recipe:.3e} + 2^-8"
        row_bound = 0.25
    else:
        bound, why, row_bound = 2**-6, "2^-6", 2**-4
    if gap > bound:
        fail(f"{what}: relative gap {gap:.3e} > {bound:.3e} ({why}); max |diff| {float((a - b).abs().max()):.3e}")
    if not WORST or gap / bound > WORST[0][0]:
        WORST[:] = [(gap / bound, f"{what}: gap {gap:.2e}, bound {bound:.2e}")]
    if not rows:
        return
    a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    rn, dn = b2.norm(dim=1), (a2 - b2).norm(dim=1)
    zero = rn == 0
    bad_zero = zero & (a2 != 0).any(1)
    if bool(bad_zero.any()):
        fail(f"{what}: rows {bad_zero.nonzero().flatten()[:8].tolist()} are exactly zero in the reference, not here")
    rel = torch.where(zero, torch.zeros_like(rn), dn / torch.where(zero, torch.ones_like(rn), rn))
    if float(rel.max()) > row_bound:
        i = int(rel.argmax())
        fail(f"{what}: row {i} relative gap {float(rel[i]):.3e} > {row_bound} ({int((rel > row_bound).sum())} rows)")


def compare(mine: dict, want: dict, base: dict | None, quantize: bool, what: str) -> None:
    for key, ref in want.items():
        if key == "aux":
            a, b = float(mine[key]), float(ref)
            if abs(a - b) > 1e-5 * abs(b) + 1e-7:
                fail(f"{what} aux loss: {a!r} vs reference {b!r}")
        else:
            # topk_w.grad rows are top_k dot products over H that can cancel to near zero: no per-row bound
            rows = key != "topk_w.grad"
            close_to_ref(mine[key], ref, base[key] if base else None, quantize, f"{what} {key}", rows)


def same_results(mine: dict, want: dict, what: str) -> None:
    for key in want:
        same_bytes(mine[key], want[key], f"{what} {key}")


# -------------------------------------------------------------------------------------------- layers and runs
@contextmanager
def spec_quantizer():
    """MOE_EP_FORCE_REFERENCE=1 (the pure-PyTorch MXFP8 quantizer) for the reference's forward and backward."""
    os.environ["MOE_EP_FORCE_REFERENCE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("MOE_EP_FORCE_REFERENCE", None)


def half_mesh():
    if not _HALF_MESH:
        _HALF_MESH.append(init_ep(ep_size=max(1, WORLD // 2)))  # collective: every rank runs this case
    return _HALF_MESH[0]


def make_layers(mesh=None, seed: int = 0, **kw) -> tuple[MoE, MoE, MoE]:
    """(cuda layer, reference layer, reference layer with quantize=False), the same parameters.

    kw: MoEConfig fields over hidden=256, ffn_hidden=128, num_experts=8, top_k=2, transport="nvshmem"."""
    fields = dict(hidden=256, ffn_hidden=128, num_experts=8, top_k=2, max_tokens_per_rank=TMAX, transport="nvshmem")
    cfg = MoEConfig(**{**fields, **kw, "backend": "cuda"})
    mesh = mesh if mesh is not None else MESH
    fast = MoE(cfg, mesh, device=DEV, dtype=torch.bfloat16, seed=seed)
    ref = MoE(dataclasses.replace(cfg, backend="reference"), mesh, device=DEV, dtype=torch.bfloat16, seed=seed + 1)
    plain = dataclasses.replace(cfg, backend="reference", quantize=False, recipe="bf16")  # (any FP8 recipe's baseline)
    base = MoE(plain, mesh, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        src = dict(fast.named_parameters())
        for layer in (ref, base):
            for name, p in layer.named_parameters():
                p.copy_(src[name])
    return fast, ref, base


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _zero_grads(layer: MoE) -> None:
    for p in layer.parameters():
        p.grad = None


def run_layer(layer: MoE, x: torch.Tensor, g: torch.Tensor, spec: bool = False) -> dict:
    """Forward + backward of loss = sum(y * g) + aux on a fresh leaf copy of x -> outputs and every gradient.
    No host sync of its own (used under sync-debug mode and inside CUDA graph capture)."""
    _zero_grads(layer)
    xx = x.clone().requires_grad_(True)
    with spec_quantizer() if spec else nullcontext():
        y, aux = layer(xx)
        ((y.float() * g).sum() + aux).backward()
    params = dict(layer.named_parameters())
    out = {"y": y.detach(), "aux": aux.detach(), "x.grad": _grad(xx)}
    out.update({f"{n}.grad": _grad(params[n]) for n in _param_names(layer)})
    _zero_grads(layer)
    return out


def run_routed(layer: MoE, x, idx, w, g, spec: bool = False) -> tuple[dict, int]:
    """routed_experts (the layer without its router) forward + backward of sum(y * g) -> (results, num_dropped)."""
    _zero_grads(layer)
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with spec_quantizer() if spec else nullcontext():
        y, dropped = moe_ep.layer.routed_experts(xx, idx, ww, layer.experts, layer.cfg, layer.ep_group)
        (y.float() * g).sum().backward()
    out = {"y": y.detach(), "x.grad": _grad(xx), "topk_w.grad": _grad(ww)}
    out.update({f"{n}.grad": _grad(p) for n, p in layer.experts.named_parameters(prefix="experts")})
    _zero_grads(layer)
    return out, int(dropped)  # NOTE: host sync (the cuda backend's count is a device tensor)


# ---------------------------------------------------------------------------------------------------- inputs
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + RANK)


def tokens(counts: list[int], h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's x [n, H] bf16 (rows of different magnitudes) and output gradient g [n, H] fp32."""
    gen = _gen(seed)
    n = counts[RANK % len(counts)]
    x = torch.randn(n, h, generator=gen) * torch.exp(0.5 * torch.randn(n, 1, generator=gen))
    g = torch.randn(n, h, generator=gen)
    return x.bfloat16().to(DEV), g.to(DEV)


def routing(kind: str, n: int, e: int, k: int, seed: int, dtype=torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-made routing, distinct ids per token: "random"; "one_expert" (first choice expert 3); "sparse" (only
    experts 0 and 5, k <= 2)."""
    gen = _gen(seed + 7)
    rows = []
    for _ in range(n):
        if kind == "one_expert":
            rows.append([3] + [j for j in torch.randperm(e, generator=gen).tolist() if j != 3][: k - 1])
        elif kind == "sparse":
            rows.append((torch.randperm(2, generator=gen)[:k] * 5).tolist())
        else:
            rows.append(torch.randperm(e, generator=gen)[:k].tolist())
    idx = torch.tensor(rows, dtype=dtype).reshape(n, k)
    return idx.to(DEV), (torch.rand(n, k, generator=gen) + 0.1).to(DEV)


# ----------------------------------------------------------------------------------------------------- cases
def case_layer(transport: str, quantize: bool, counts=(64, 37, 100, 0), mesh=None, capacity=None, **kw) -> None:
    """The whole layer (router included): cuda vs reference outputs, aux loss and every gradient; num_dropped."""
    fast, ref, base = make_layers(mesh, transport=transport, quantize=quantize, capacity_factor=capacity, **kw)
    x, g = tokens(list(counts), fast.cfg.hidden, seed=1)
    mine = attempt(lambda: run_layer(fast, x, g), "the cuda layer")
    if not agree(mine is not None):
        return
    want = run_layer(ref, x, g, spec=True)
    got_dropped, want_dropped = fast.num_dropped, ref.num_dropped
    recipe = run_layer(base, x, g, spec=True) if quantize else None
    compare(mine, want, recipe, quantize, f"layer {transport} q={quantize}")
    if got_dropped != want_dropped:
        fail(f"num_dropped {got_dropped} != reference {want_dropped}")
    if capacity is None and want_dropped:
        fail(f"dropless layer dropped {want_dropped} slots")
    if capacity is not None and x.shape[0] == min(counts[: min(WORLD, len(counts))]) and not want_dropped:
        fail("the rank with the fewest tokens (the smallest capacity) dropped nothing: the case tests no drops")


def case_routed(
    kind,
    counts,
    e,
    k,
    h,
    f,
    transport="nvshmem",
    quantize=True,
    capacity=None,
    idx_dtype=torch.int64,
    must_drop_rank=None,
) -> None:
    """routed_experts with a hand-made routing: cuda vs reference (and num_dropped exact)."""
    fast, ref, base = make_layers(
        None,
        seed=2,
        num_experts=e,
        top_k=k,
        hidden=h,
        ffn_hidden=f,
        transport=transport,
        quantize=quantize,
        capacity_factor=capacity,
    )
    x, g = tokens(counts, h, seed=3)
    idx, w = routing(kind, x.shape[0], e, k, seed=3, dtype=idx_dtype)
    res = attempt(lambda: run_routed(fast, x, idx, w, g), "the cuda routed_experts")
    if not agree(res is not None):
        return
    mine, got_dropped = res
    want, want_dropped = run_routed(ref, x, idx, w, g, spec=True)
    recipe = run_routed(base, x, idx, w, g, spec=True)[0] if quantize else None
    compare(mine, want, recipe, quantize, f"routed {kind} {transport} q={quantize}")
    if got_dropped != want_dropped:
        fail(f"num_dropped {got_dropped} != reference {want_dropped}")
    if capacity is None and want_dropped:
        fail(f"dropless call dropped {want_dropped} slots")
    if must_drop_rank is not None and RANK == must_drop_rank(WORLD) and not want_dropped:
        fail("this rank should drop slots (the case is built so): it dropped none")


def case_sync_free(quantize: bool) -> None:
    """capacity_factor set, nvshmem: forward + backward with no host sync (after a warm-up that compiles kernels,
    grows buffers and fills the weight cache), and bitwise the same results as the eager run that follows."""
    fast, _, _ = make_layers(None, seed=4, quantize=quantize, capacity_factor=0.75)
    x, g = tokens([40, 17, 33, 8], fast.cfg.hidden, seed=4)
    run_layer(fast, x, g)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine = run_layer(fast, x, g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    same_results(mine, run_layer(fast, x, g), "sync-free run vs the next eager run")
    nvs.get_runtime(fast.ep_group).check_errors()


def case_dropless_worst_case(quantize: bool) -> None:
    """Dropless with ``dropless_sizing="worst_case"``, nvshmem: forward + backward with no host sync (after a
    warm-up), bitwise the results of the same layer sized exactly (``"exact"``: the layout's row count read on the
    host), on tokens whose expanded rows are far below the worst case (rows past them are never read)."""
    fast, _, _ = make_layers(None, seed=6, quantize=quantize, dropless_sizing="worst_case")
    exact, _, _ = make_layers(None, seed=6, quantize=quantize)
    x, g = tokens([40, 17, 33, 8], fast.cfg.hidden, seed=6)
    run_layer(fast, x, g)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine = run_layer(fast, x, g)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    same_results(mine, run_layer(exact, x, g), "dropless worst-case sizing vs exact sizing")
    nvs.get_runtime(fast.ep_group).check_errors()


def case_graph(quantize: bool, **kw) -> None:
    """capacity_factor set, nvshmem: forward + backward captured once, replayed on new inputs copied into the static
    input; every replay equals the eager run on the same input bitwise, with eager calls between replays.
    kw: more MoEConfig fields (num_shared_experts: the side-stream fork / join inside the capture)."""
    fast, _, _ = make_layers(None, seed=5, quantize=quantize, capacity_factor=0.75, **kw)
    counts = [40, 17, 33, 8]
    sets = [tokens(counts, fast.cfg.hidden, seed=s)[0] for s in (21, 22, 23)]
    g = tokens(counts, fast.cfg.hidden, seed=24)[1]
    want = [run_layer(fast, x, g) for x in sets]
    params = dict(fast.named_parameters())

    xs = sets[0].clone().requires_grad_(True)

    def step():
        y, aux = fast(xs)
        ((y.float() * g).sum() + aux).backward()
        return y, aux

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks for autograd
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    _zero_grads(fast)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_s, aux_s = step()
    static = {"y": y_s, "aux": aux_s, "x.grad": xs.grad}
    static.update({f"{n}.grad": params[n].grad for n in _param_names(fast)})
    xs.grad = None  # eager runs allocate their own gradients; the graph keeps writing the static ones
    _zero_grads(fast)
    for i, j in enumerate((1, 2, 0, 1)):
        with torch.no_grad():
            xs.copy_(sets[j])
        graph.replay()
        same_results(static, want[j], f"replay {i} (input {j})")
        if i == 1:
            same_results(run_layer(fast, sets[0], g), want[0], "eager between replays")
    torch.cuda.synchronize()
    del graph
    same_results(run_layer(fast, sets[2], g), want[2], "eager after the replays")
    nvs.get_runtime(fast.ep_group).check_errors()


def case_graph_weight_update() -> None:
    """mxfp8, capacity set: a CUDA graph captured with a warm operand cache, then an in-place weight update (what
    ``optimizer.step`` does: same storage, new version): the replay reads the new weights (the capture bypasses the
    cache, so the graph holds the weight preparation, not a cached result) and equals the eager run bitwise."""
    fast, _, _ = make_layers(None, seed=8, quantize=True, capacity_factor=0.75)
    counts = [40, 17, 33, 8]
    x, g = tokens(counts, fast.cfg.hidden, seed=25)
    xs = x.clone().requires_grad_(True)

    def step():
        y, aux = fast(xs)
        ((y.float() * g).sum() + aux).backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    _zero_grads(fast)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_s = step()
    static_w = fast.experts.w13.grad
    xs.grad = None
    _zero_grads(fast)
    with torch.no_grad():  # exact (a power of two): only the scales move, which a stale operand would miss
        for p in fast.experts.parameters():
            p.mul_(-0.5)
    want = run_layer(fast, x, g)
    graph.replay()
    same_results({"y": y_s, "experts.w13.grad": static_w}, {k: want[k] for k in ("y", "experts.w13.grad")}, "replay")
    torch.cuda.synchronize()
    del graph
    nvs.get_runtime(fast.ep_group).check_errors()


def case_fsdp(reshard: bool, mx: bool = False, recipe: str = "mxfp8") -> None:
    """The experts as an FSDP2 unit on the "dp" sub-mesh (ep = world / 2, dp = 2): the cuda layer gathers them
    through its FSDP forward method, and its gradients are reduce-scattered; two weight versions with an in-place
    update of the shards between them (FSDP2's gathered weights keep their version counter, so an operand cache
    keyed on it would go stale). Against the reference layer with the full weights and its expert gradients
    averaged over "dp" (FSDP's default reduction). mx: the all-gather moves FP8 bytes in the layer's ``recipe``
    (experts.fsdp_mxfp8 / experts.fsdp_blockwise), quantized once per weight version from the bf16 master weights,
    which is what the reference quantizes."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from moe_ep.experts.fsdp_blockwise import use_blockwise_all_gather  # noqa: PLC0415
    from moe_ep.experts.fsdp_mxfp8 import use_mxfp8_all_gather  # noqa: PLC0415

    mesh = half_mesh()
    fast, ref, base = make_layers(mesh, seed=9, num_experts=8, top_k=2, recipe=recipe)
    if mx:
        gather = {"mxfp8": use_mxfp8_all_gather, "blockwise": use_blockwise_all_gather}[recipe]
        gather(fast.experts, mesh["dp"].size())
    fully_shard(fast.experts, mesh=mesh["dp"], reshard_after_forward=reshard)
    dp = mesh.get_group("dp")
    x, g = tokens([48, 31, 64, 9], fast.cfg.hidden, seed=9)

    def averaged(res: dict) -> dict:
        for k in ("experts.w13.grad", "experts.w2.grad"):
            t = res[k]
            if hasattr(t, "full_tensor"):
                res[k] = t.full_tensor()
            else:
                res[k] = t.clone()
                dist.all_reduce(res[k], op=dist.ReduceOp.AVG, group=dp)
        return res

    for version in range(2):
        mine = attempt(lambda: averaged(run_layer(fast, x, g)), f"the FSDP2 cuda layer, weights v{version}")
        if not agree(mine is not None):
            return
        want = averaged(run_layer(ref, x, g, spec=True))
        recipe_err = averaged(run_layer(base, x, g, spec=True))
        compare(mine, want, recipe_err, True, f"fsdp {recipe} reshard={reshard} mx={mx} v{version}")
        with torch.no_grad():
            for layer in (fast, ref, base):
                for p in layer.experts.parameters():
                    p.mul_(-0.5)
    if mx:  # once per weight version, not again for the backward's re-gather
        counts = [p._local_tensor.quantizations for p in fast.experts.parameters()]
        if counts != [2, 2]:
            fail(f"{recipe} gather: the shards were quantized {counts} times over 2 weight versions")


def case_determinism(transport: str, quantize: bool, capacity, **kw) -> None:
    fast, _, _ = make_layers(None, seed=6, transport=transport, quantize=quantize, capacity_factor=capacity, **kw)
    x, g = tokens([64, 37, 100, 5], fast.cfg.hidden, seed=6)
    first = attempt(lambda: run_layer(fast, x, g), "the first run")
    if not agree(first is not None):
        return
    same_results(run_layer(fast, x, g), first, f"second run ({transport}, q={quantize}, capacity={capacity})")


def case_memory(capacity, new_weight_versions: bool, iters: int = 1000) -> None:
    """``iters`` forward + backward on three inputs in turn: memory_allocated after iteration 10 == after the last,
    the peak does not grow after iteration 10, one more iteration equals iteration 3 (same input) bitwise.
    new_weight_versions: every iteration bumps w13 / w2's version (an optimizer step), so the weight cache prepares
    them again each time."""
    fast, _, _ = make_layers(None, seed=7, hidden=128, ffn_hidden=64, capacity_factor=capacity)
    counts = [32, 16, 8, 24]
    xs = [tokens(counts, 128, seed=s)[0] for s in (31, 32, 33)]
    g = tokens(counts, 128, seed=34)[1]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # earlier, larger cases must not hide a growing peak
    first = None
    mem = {}
    for it in range(1, iters + 1):
        res = run_layer(fast, xs[it % 3], g)
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
        fail(f"memory_allocated after iteration 10: {mem[10][0]} B, after {iters}: {mem[iters][0]} B")
    if mem[iters][1] != mem[10][1]:
        fail(f"max_memory_allocated after iteration 10: {mem[10][1]} B, after {iters}: {mem[iters][1]} B")
    same_results(run_layer(fast, xs[0], g), first, f"iteration {iters + 1} vs iteration 3 (same input)")


def case_invalid_expert(transport: str) -> None:
    """Every rank routes one slot to expert 2E + rank (out of range): ValueError naming that id on every rank
    (dropless: the layout's error is raised right after it, before any other transport call), and the layer
    still works afterwards."""
    e = 8
    fast, _, _ = make_layers(None, seed=8, hidden=128, ffn_hidden=64, transport=transport)
    x, g = tokens([9, 4, 6, 1], 128, seed=8)
    idx, w = routing("random", x.shape[0], e, 2, seed=8)
    bad = 2 * e + RANK
    idx[x.shape[0] - 1, 1] = bad
    try:
        run_routed(fast, x, idx, w, g)
        if transport == "nvshmem":
            nvs.get_runtime(fast.ep_group).check_errors()
        msg = None
    except ValueError as exc:
        msg = str(exc)
    if msg is None or "out of range" not in msg or str(bad) not in msg:
        fail(f"invalid expert id {bad} not reported as a ValueError naming it: {msg!r}")
    if not agree(msg is not None):
        return
    case_routed("random", [5, 3, 8, 2], e, 2, 128, 64, transport=transport)  # still usable


def case_missing_peer() -> None:
    """The last rank skips a layer call that the others make: their waits time out after TIMEOUT_S and they raise
    EPTransportError naming the timeout, instead of hanging. Leaves their runtime unusable: the last case."""
    fast, _, _ = make_layers(None, seed=9, hidden=128, ffn_hidden=64, capacity_factor=1.0)
    x, g = tokens([12, 7, 9, 3], 128, seed=9)
    run_layer(fast, x, g)  # warm-up: every rank has compiled, sized and used the runtime
    cfg = fast.cfg
    rt = nvs.init_runtime(
        fast.ep_group, cfg.max_tokens_per_rank, cfg.hidden, cfg.top_k, cfg.num_experts, timeout_s=TIMEOUT_S
    )
    rt.check_errors()
    dist.barrier()
    if RANK == WORLD - 1:
        return
    t0 = time.monotonic()
    try:
        run_layer(fast, x, g)
        rt.check_errors()
        msg = None
    except Exception as exc:  # noqa: BLE001  (the type is checked below)
        msg = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    if msg is None or not msg.startswith("EPTransportError") or "timeout" not in msg:
        fail(f"a call without its peer did not raise EPTransportError('timeout ...'): {msg!r} after {took:.1f} s")
    elif RANK == 0:
        print(f"  (raised after {took:.1f} s: {msg[:160]})", flush=True)


# (name, routing kind, tokens per rank (cycled over the ranks), E, top_k, H, F, more arguments of case_routed)
AWKWARD = [
    ("sparse: zero-token experts, a rank with 0 tokens", "sparse", [10, 0, 17, 2], 8, 2, 128, 64, {}),
    ("all on expert 3, top_k 1, int32 ids", "one_expert", [5, 9, 1, 3], 8, 1, 128, 64, {"idx_dtype": torch.int32}),
    ("top_k 8 of 8, H=224 F=96", "random", [6, 11, 4, 0], 8, 8, 224, 96, {}),
    ("first choice expert 3, H=160 F=96, unequal counts", "one_expert", [9, 0, 3, 30], 8, 2, 160, 96, {}),
    ("every rank empty", "random", [0], 8, 2, 128, 64, {}),
    ("16 experts top_k 4, >128 rows per expert", "random", [200, 150, 256, 7], 16, 4, 256, 128, {}),
    ("bf16: top_k 8 of 8, H=224 F=96", "random", [6, 11, 4, 0], 8, 8, 224, 96, {"quantize": False}),
    ("bf16: first choice expert 3, H=160 F=96", "one_expert", [9, 0, 3, 30], 8, 2, 160, 96, {"quantize": False}),
]
# drop mode through routed_experts: (name, kind, tokens per rank, E, top_k, capacity_factor, a rank that must drop)
DROPS = [
    # expert 3's rank receives every token's first choice, more than its ceil(0.75 * T * 2) rows
    ("first choice expert 3, capacity 0.75", "one_expert", [9, 16, 3, 5], 8, 2, 0.75, lambda w: 3 // (8 // w)),
    # every rank receives 16 slots and keeps ceil(2 * 8 / 16) = 1 row
    ("top_k 8 of 8, capacity 1 row (c=1/16, 2 tokens)", "random", [2], 8, 8, 0.0625, lambda w: 0),
    # rank 1 has no tokens: capacity 0, every slot routed to it drops
    ("a rank with 0 tokens has capacity 0", "random", [12, 0, 7, 3], 8, 2, 0.5, lambda w: 1),
]


def main() -> int:
    global RANK, WORLD, DEV, MESH
    p = argparse.ArgumentParser(description="the cuda MoE layer vs the reference (torchrun)")
    p.add_argument("--only", default="", help="comma-separated substrings: run the cases whose name has one")
    p.add_argument("--skip", default="", help="comma-separated substrings: skip the cases whose name has one")
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # A rank that dies inside a collective leaves its peers waiting: 2 minutes, not NCCL's default 10 (the first
    # calls compile kernels outside any collective, so no legitimate wait comes near it).
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=120))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    DEV = torch.device("cuda", local)
    MESH = init_ep(ep_size=WORLD)
    cases = []
    for tr in ("nvshmem", "nccl"):
        for q in (True, False):
            cases.append((f"layer cuda vs reference, {tr}, quantize={q}", lambda t=tr, q=q: case_layer(t, q)))
        for name, *a, kw in AWKWARD:
            cases.append((f"routed {tr}: {name}", lambda a=a, t=tr, kw=kw: case_routed(*a, transport=t, **kw)))
        for q in (True, False):
            cases.append(
                (
                    f"drop {tr}: layer, capacity 0.5, quantize={q}",
                    lambda t=tr, q=q: case_layer(t, q, counts=(64, 37, 100, 20), capacity=0.5),
                )
            )
        for name, kind, counts, e, k, c, rank in DROPS:
            cases.append(
                (
                    f"drop {tr}: {name}",
                    lambda a=(kind, counts, e, k, 128, 64), t=tr, c=c, r=rank: case_routed(
                        *a, transport=t, capacity=c, must_drop_rank=r
                    ),
                )
            )
    half = max(1, WORLD // 2)
    cases += [
        (
            f"layer on a dp x ep mesh (ep={half}), 16 experts top_k 4, H=384 F=192",
            lambda: case_layer("nvshmem", True, mesh=half_mesh(), num_experts=16, top_k=4, hidden=384, ffn_hidden=192),
        ),
        ("no host sync with a capacity (sync debug mode error), mxfp8", lambda: case_sync_free(True)),
        ("no host sync with a capacity (sync debug mode error), bf16", lambda: case_sync_free(False)),
        ("dropless worst-case sizing: no host sync, == exact sizing, mxfp8", lambda: case_dropless_worst_case(True)),
        ("dropless worst-case sizing: no host sync, == exact sizing, bf16", lambda: case_dropless_worst_case(False)),
        ("CUDA graph of forward + backward: replays = eager, mxfp8", lambda: case_graph(True)),
        ("CUDA graph of forward + backward: replays = eager, bf16", lambda: case_graph(False)),
        ("CUDA graph replay after an in-place weight update = eager, mxfp8", case_graph_weight_update),
        ("CUDA graph with shared experts (side stream): replays = eager, mxfp8", lambda: case_graph(True, **SHARED_KW)),
        ("CUDA graph with shared experts (side stream): replays = eager, bf16", lambda: case_graph(False, **SHARED_KW)),
        (
            "CUDA graph with shared experts + DeepSeek-V3 routing (expert-bias counts in the graph): replays = eager",
            lambda: case_graph(True, **SHARED_KW, **DSV3_KW),
        ),
        (
            "layer with shared experts + DeepSeek-V3 routing, cuda vs reference, nvshmem, mxfp8",
            lambda: case_layer("nvshmem", True, **SHARED_KW, **DSV3_KW),
        ),
        (
            "layer with shared experts + DeepSeek-V3 routing, cuda vs reference, nccl, bf16",
            lambda: case_layer("nccl", False, **SHARED_KW, **DSV3_KW),
        ),
        ("FSDP2 experts on dp (ep = world / 2), reshard after forward", lambda: case_fsdp(True)),
        ("FSDP2 experts on dp (ep = world / 2), kept after forward", lambda: case_fsdp(False)),
        ("FSDP2 experts on dp, MXFP8 all-gather, reshard after forward", lambda: case_fsdp(True, mx=True)),
        ("FSDP2 experts on dp, MXFP8 all-gather, kept after forward", lambda: case_fsdp(False, mx=True)),
        ("FSDP2 experts on dp, blockwise, bf16 all-gather", lambda: case_fsdp(True, recipe="blockwise")),
        (
            "FSDP2 experts on dp, blockwise all-gather, reshard after forward",
            lambda: case_fsdp(True, mx=True, recipe="blockwise"),
        ),
        (
            "FSDP2 experts on dp, blockwise all-gather, kept after forward",
            lambda: case_fsdp(False, mx=True, recipe="blockwise"),
        ),
        ("deterministic: nvshmem dropless", lambda: case_determinism("nvshmem", True, None)),
        ("deterministic: nccl dropless", lambda: case_determinism("nccl", True, None)),
        ("deterministic: nvshmem capacity bf16", lambda: case_determinism("nvshmem", False, 0.5)),
        (
            "deterministic: shared experts, nvshmem dropless",
            lambda: case_determinism("nvshmem", True, None, **SHARED_KW),
        ),
        ("1000 iterations, flat memory: dropless", lambda: case_memory(None, False)),
        ("1000 iterations, flat memory: capacity, new weight versions", lambda: case_memory(0.75, True)),
        ("invalid expert id raises ValueError naming it: nvshmem", lambda: case_invalid_expert("nvshmem")),
        ("invalid expert id raises ValueError naming it: nccl", lambda: case_invalid_expert("nccl")),
        ("a missing peer raises a timeout instead of hanging (last)", case_missing_peer),
    ]
    only = [t for t in args.only.split(",") if t]
    skip = [t for t in args.skip.split(",") if t]
    cases = [c for c in cases if (not only or any(t in c[0] for t in only)) and not any(t in c[0] for t in skip)]
    t0 = time.monotonic()
    _, failed = run_cases([(name, lambda fn=fn: checked(fn)) for name, fn in cases], DEV)
    if RANK == 0:
        print(f"{time.monotonic() - t0:.0f} s", flush=True)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish(MESH)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
