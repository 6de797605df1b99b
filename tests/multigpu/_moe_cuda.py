"""What the torchrun scripts of the cuda MoE layer share: tests/multigpu/moe_cuda_layer.py (the layer and
routed_experts vs the reference), moe_cuda_fsdp.py (the experts as an FSDP2 unit, gathered in bf16 and in FP8),
moe_cuda_graph.py (no host sync, CUDA graph capture, determinism, memory, a missing peer); tests/multigpu/hf_cuda.py
reuses it too. It holds the environment (set on import, before any init), this rank's state (RANK, WORLD, DEV, MESH:
set by ``main``; read them as attributes of this module), the checks and their tolerances, the layers, the runs, the
inputs, and ``main``, the scripts' driver.

    torchrun --standalone --nproc-per-node=N tests/multigpu/moe_cuda_<part>.py [--only a,b] [--skip c] [--list]
    (N = 2 or 4; needs CuPy + nvshmem4py; --only / --skip: substrings of case names, the same on every rank;
    --list: print the selected case names for WORLD_SIZE ranks (default 2) and exit: no GPU, no process group)

Every rank runs every case; ranks agree on each verdict through an all-reduce (tests/multigpu/_cases.py), rank 0
prints ``PASS/FAIL name`` and ``N passed, N failed``; exit code 1 when any case failed on any rank. Failed checks are
recorded, not raised (``fail``), so every rank keeps issuing the same transport calls; a failing check prints the
rank and the numbers.

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
import os
import sys
import time
import traceback
from collections.abc import Callable
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
RANK = WORLD = 0
DEV = None
MESH = None
_HALF_MESH = []  # the ("dp", "ep") mesh with ep = world / 2, made on first use
PARAMS = ("router.weight", "experts.w13", "experts.w2")
SHARED = ("shared_experts.w13", "shared_experts.w2")  # the layers with num_shared_experts > 0 also have these


def param_names(layer: MoE) -> tuple[str, ...]:
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
    mine: torch.Tensor,
    ref: torch.Tensor,
    base: torch.Tensor | None,
    quantize: bool,
    what: str,
    rows: bool = True,
    recipe_share: float = 0.1,
) -> None:
    """The bound of the module docstring: relative Frobenius gap (quantize: ``recipe_share`` x the recipe's error
    ``ref - base`` + 2^-8), per row (dim 0) unless ``rows`` is False, and exact zeros where the reference is exactly
    zero."""
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
        bound, why = recipe_share * recipe + 2**-8, f"{recipe_share} x recipe error {recipe:.3e} + 2^-8"
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


def compare(mine: dict, want: dict, base: dict | None, quantize: bool, what: str, recipe_share: float = 0.1) -> None:
    for key, ref in want.items():
        if key == "aux":
            a, b = float(mine[key]), float(ref)
            if abs(a - b) > 1e-5 * abs(b) + 1e-7:
                fail(f"{what} aux loss: {a!r} vs reference {b!r}")
        else:
            # topk_w.grad rows are top_k dot products over H that can cancel to near zero: no per-row bound
            rows = key != "topk_w.grad"
            close_to_ref(mine[key], ref, base[key] if base else None, quantize, f"{what} {key}", rows, recipe_share)


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


def zero_grads(layer: MoE) -> None:
    for p in layer.parameters():
        p.grad = None


def run_layer(layer: MoE, x: torch.Tensor, g: torch.Tensor, spec: bool = False) -> dict:
    """Forward + backward of loss = sum(y * g) + aux on a fresh leaf copy of x -> outputs and every gradient.
    No host sync of its own (used under sync-debug mode and inside CUDA graph capture)."""
    zero_grads(layer)
    xx = x.clone().requires_grad_(True)
    with spec_quantizer() if spec else nullcontext():
        y, aux = layer(xx)
        ((y.float() * g).sum() + aux).backward()
    params = dict(layer.named_parameters())
    out = {"y": y.detach(), "aux": aux.detach(), "x.grad": _grad(xx)}
    out.update({f"{n}.grad": _grad(params[n]) for n in param_names(layer)})
    zero_grads(layer)
    return out


def run_routed(layer: MoE, x, idx, w, g, spec: bool = False) -> tuple[dict, int]:
    """routed_experts (the layer without its router) forward + backward of sum(y * g) -> (results, num_dropped)."""
    zero_grads(layer)
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with spec_quantizer() if spec else nullcontext():
        y, dropped = moe_ep.layer.routed_experts(xx, idx, ww, layer.experts, layer.cfg, layer.ep_group)
        (y.float() * g).sum().backward()
    out = {"y": y.detach(), "x.grad": _grad(xx), "topk_w.grad": _grad(ww)}
    out.update({f"{n}.grad": _grad(p) for n, p in layer.experts.named_parameters(prefix="experts")})
    zero_grads(layer)
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


# ---------------------------------------------------------------------------------------------------- driver
Cases = list[tuple[str, Callable[[], None]]]


def main(build_cases: Callable[[], Cases], description: str) -> int:
    """A script's entry: --only / --skip / --list, then this rank's process group, device and EP mesh (RANK, WORLD,
    DEV, MESH), the selected cases of ``build_cases()`` (called after them: names may depend on WORLD) through
    tests/multigpu/_cases.py, each under ``checked``, and the teardown. Returns the exit code: 1 when a case failed."""
    global RANK, WORLD, DEV, MESH
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--only", default="", help="comma-separated substrings: run the cases whose name has one")
    p.add_argument("--skip", default="", help="comma-separated substrings: skip the cases whose name has one")
    p.add_argument("--list", action="store_true", help="print the selected case names (WORLD_SIZE ranks, default 2)")
    args = p.parse_args()
    only = [t for t in args.only.split(",") if t]
    skip = [t for t in args.skip.split(",") if t]

    def selected() -> Cases:
        cases = build_cases()
        return [c for c in cases if (not only or any(t in c[0] for t in only)) and not any(t in c[0] for t in skip)]

    if args.list:
        WORLD = int(os.environ.get("WORLD_SIZE", "2"))
        for name, _ in selected():
            print(name)
        return 0
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # A rank that dies inside a collective leaves its peers waiting: 2 minutes, not NCCL's default 10 (the first
    # calls compile kernels outside any collective, so no legitimate wait comes near it).
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timedelta(seconds=120))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    DEV = torch.device("cuda", local)
    MESH = init_ep(ep_size=WORLD)
    t0 = time.monotonic()
    _, failed = run_cases([(name, lambda fn=fn: checked(fn)) for name, fn in selected()], DEV)
    if RANK == 0:
        print(f"{time.monotonic() - t0:.0f} s", flush=True)
    torch.cuda.synchronize()
    dist.barrier()  # every rank is done with symmetric memory before NVSHMEM finalizes
    nvs.shutdown()
    finish(MESH)
    return 1 if failed else 0
