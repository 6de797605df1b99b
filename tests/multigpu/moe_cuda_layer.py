"""torchrun script: the MoE layer's CUDA backend (issue 29) against the reference backend, on 2 or more GPUs: the
layer and ``routed_experts``, forward and backward.

    torchrun --standalone --nproc-per-node=N tests/multigpu/moe_cuda_layer.py [--only a,b] [--skip c] [--list]
    (N = 2 or 4; needs CuPy + nvshmem4py; shared helpers, tolerances and driver: tests/multigpu/_moe_cuda.py)

Cases: the layer (router included) cuda vs reference for both transports, quantize True and False, also on a ("dp",
"ep") mesh with ep = world / 2; awkward routing given by hand through ``moe_ep.layer.routed_experts`` (zero-token
experts, every token on one expert, unequal counts, a rank or every rank with no tokens, H = 160 / 224 with F = 96,
top_k 1 and 8, int32 ids); drop mode (``capacity_factor``) with ``num_dropped`` exact; the layer with shared experts
and DeepSeek-V3 routing (sigmoid, groups, expert bias) cuda vs reference; an invalid expert id raises ValueError
naming it, and the layer still works afterwards.

Also here: tests/multigpu/moe_cuda_fsdp.py (the experts as an FSDP2 unit, gathered in bf16 and in FP8) and
tests/multigpu/moe_cuda_graph.py (no host sync, CUDA graph capture, determinism, memory, a missing peer).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402

import tests.multigpu._moe_cuda as mc  # noqa: E402  (sets the NVSHMEM / NCCL environment before any init)
from moe_ep.transport.nvshmem import runtime as nvs  # noqa: E402


def case_layer(transport: str, quantize: bool, counts=(64, 37, 100, 0), mesh=None, capacity=None, **kw) -> None:
    """The whole layer (router included): cuda vs reference outputs, aux loss and every gradient; num_dropped."""
    fast, ref, base = mc.make_layers(mesh, transport=transport, quantize=quantize, capacity_factor=capacity, **kw)
    x, g = mc.tokens(list(counts), fast.cfg.hidden, seed=1)
    mine = mc.attempt(lambda: mc.run_layer(fast, x, g), "the cuda layer")
    if not mc.agree(mine is not None):
        return
    want = mc.run_layer(ref, x, g, spec=True)
    got_dropped, want_dropped = fast.num_dropped, ref.num_dropped
    recipe = mc.run_layer(base, x, g, spec=True) if quantize else None
    mc.compare(mine, want, recipe, quantize, f"layer {transport} q={quantize}")
    if got_dropped != want_dropped:
        mc.fail(f"num_dropped {got_dropped} != reference {want_dropped}")
    if capacity is None and want_dropped:
        mc.fail(f"dropless layer dropped {want_dropped} slots")
    if capacity is not None and x.shape[0] == min(counts[: min(mc.WORLD, len(counts))]) and not want_dropped:
        mc.fail("the rank with the fewest tokens (the smallest capacity) dropped nothing: the case tests no drops")


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
    fast, ref, base = mc.make_layers(
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
    x, g = mc.tokens(counts, h, seed=3)
    idx, w = mc.routing(kind, x.shape[0], e, k, seed=3, dtype=idx_dtype)
    res = mc.attempt(lambda: mc.run_routed(fast, x, idx, w, g), "the cuda routed_experts")
    if not mc.agree(res is not None):
        return
    mine, got_dropped = res
    want, want_dropped = mc.run_routed(ref, x, idx, w, g, spec=True)
    recipe = mc.run_routed(base, x, idx, w, g, spec=True)[0] if quantize else None
    mc.compare(mine, want, recipe, quantize, f"routed {kind} {transport} q={quantize}")
    if got_dropped != want_dropped:
        mc.fail(f"num_dropped {got_dropped} != reference {want_dropped}")
    if capacity is None and want_dropped:
        mc.fail(f"dropless call dropped {want_dropped} slots")
    if must_drop_rank is not None and mc.RANK == must_drop_rank(mc.WORLD) and not want_dropped:
        mc.fail("this rank should drop slots (the case is built so): it dropped none")


def case_invalid_expert(transport: str) -> None:
    """Every rank routes one slot to expert 2E + rank (out of range): ValueError naming that id on every rank
    (dropless: the layout's error is raised right after it, before any other transport call), and the layer
    still works afterwards."""
    e = 8
    fast, _, _ = mc.make_layers(None, seed=8, hidden=128, ffn_hidden=64, transport=transport)
    x, g = mc.tokens([9, 4, 6, 1], 128, seed=8)
    idx, w = mc.routing("random", x.shape[0], e, 2, seed=8)
    bad = 2 * e + mc.RANK
    idx[x.shape[0] - 1, 1] = bad
    try:
        mc.run_routed(fast, x, idx, w, g)
        if transport == "nvshmem":
            nvs.get_runtime(fast.ep_group).check_errors()
        msg = None
    except ValueError as exc:
        msg = str(exc)
    if msg is None or "out of range" not in msg or str(bad) not in msg:
        mc.fail(f"invalid expert id {bad} not reported as a ValueError naming it: {msg!r}")
    if not mc.agree(msg is not None):
        return
    case_routed("random", [5, 3, 8, 2], e, 2, 128, 64, transport=transport)  # still usable


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


def build_cases() -> mc.Cases:
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
    half = max(1, mc.WORLD // 2)
    return cases + [
        (
            f"layer on a dp x ep mesh (ep={half}), 16 experts top_k 4, H=384 F=192",
            lambda: case_layer(
                "nvshmem", True, mesh=mc.half_mesh(), num_experts=16, top_k=4, hidden=384, ffn_hidden=192
            ),
        ),
        (
            "layer with shared experts + DeepSeek-V3 routing, cuda vs reference, nvshmem, mxfp8",
            lambda: case_layer("nvshmem", True, **mc.SHARED_KW, **mc.DSV3_KW),
        ),
        (
            "layer with shared experts + DeepSeek-V3 routing, cuda vs reference, nccl, bf16",
            lambda: case_layer("nccl", False, **mc.SHARED_KW, **mc.DSV3_KW),
        ),
        ("invalid expert id raises ValueError naming it: nvshmem", lambda: case_invalid_expert("nvshmem")),
        ("invalid expert id raises ValueError naming it: nccl", lambda: case_invalid_expert("nccl")),
    ]


if __name__ == "__main__":
    sys.exit(mc.main(build_cases, "the cuda MoE layer vs the reference: layer and routed_experts (torchrun)"))
