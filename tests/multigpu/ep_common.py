"""Shared state and checks of the NVSHMEM transport's torchrun tests (tests/multigpu/ep_nvshmem.py runs them): the
rank / device / group of this process (:func:`setup`), recorded (not raised) failed checks, bitwise and tolerance
comparisons, and the routings and inputs of the cases. The bounds are ep_nvshmem.py's module docstring.
"""

from __future__ import annotations

import math

import torch

from moe_ep import mxfp8
from moe_ep.transport.nvshmem import runtime as nvs

TMAX, HMAX, KMAX, EMAX = 512, 1024, 8, 64
TIMEOUT_S = 20.0  # spin-wait timeout of the runtime (a hung case fails in 20 s instead of 60)
RANK = WORLD = 0
DEV = None
GROUP = None


def setup(rank: int, world: int, dev: torch.device, group) -> None:
    """This process's rank, world size, device and EP group (read by every helper and case as ``C.RANK`` ...)."""
    global RANK, WORLD, DEV, GROUP
    RANK, WORLD, DEV, GROUP = rank, world, dev, group


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
