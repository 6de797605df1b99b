"""Launch plans of the quantization kernels in ``kernels/quantize.cu``: which kernel a call takes, its grid and its
shared memory (host arithmetic only; :mod:`moe_ep.mxfp8.cuda` launches what this module decides).

Kernels: ``mx_quant`` (every mode; tile pipelining by MOE_EP_QUANT_PIPE), ``mx_quant_dual`` (bf16 grouped dual,
kernels/quant_dual.cuh), ``mx_swiglu_dual`` (SwiGLU forward / backward, kernels/quant_swiglu.cuh), ``mx_dequant``.
The mode codes (IN, RS, CS) are kernels/quantize.cu's. :func:`sm_count` is the one place that asks the device
(the CPU emulator of tests/quant_emu.py replaces it).
"""

from __future__ import annotations

import os

import torch

from .. import _cuda

TILE = 128
IN = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
RS = {"none": 0, "plain": 1, "blocked": 2, "grouped": 3, "uniform": 4}
CS = {"none": 0, "plain": 1, "blocked": 2, "nt": 3, "grouped_nt": 4, "grouped_prep": 5}
IN_SWIGLU, IN_SWIGLU_BWD, IN_SWIGLU_BWD16 = 3, 4, 5

QUANT_COMBOS = (
    [(i, r, 0) for i in range(3) for r in (1, 2, 3, 4)]
    + [(i, 0, c) for i in range(3) for c in (1, 2, 3)]
    + [(i, r, c) for i in range(3) for r in (1, 2) for c in (1, 2)]
    # grouped row-wise + per-group column-wise (MXFP8, or 5: the wgrad's prepared bf16 operand); IN 3 = SwiGLU of
    # bf16 (gate | up), 4/5 = its backward (a, fp32/bf16 dh)
    + [(i, 3, c) for c in (4, 5) for i in (0, 1, 3, 4, 5)]
)
# column-only modes of 16-bit inputs, also compiled with pipe 4 (one tile per CTA on the cp.async path; chosen at
# launch for inputs of many tiles: requested_pipe)
ONE_COMBOS = [(i, 0, c) for i in (1, 2) for c in (1, 2, 3)]
# mx_quant_dyn (the dynamic tile schedule): the 16-bit row-only and fused modes. Under auto only the persistent
# launches use it (grouped rows and 3-D weight scales, on pipe 3); the others are there for MOE_EP_QUANT_PIPE=1-3.
# fp32 and the SwiGLU inputs take pipe 0 (one CTA per tile)
DYN_COMBOS = [(i, r, 0) for i in (1, 2) for r in (1, 2, 3, 4)] + [
    (i, r, c) for i in (1, 2) for r in (1, 2) for c in (1, 2)
]
# the register-tiled dual quantizer (kernels/quant_dual.cuh): bf16, grouped rows + per-group columns in x's layout
DUAL_CS = (4, 5)
DUAL_STAGES = (2, 3, 4, 5, 6)  # cp.async stages of 32 KB; CTAs per SM: 3, 2, then 1 (kernels/quant_dual.cuh)
NAMES = (
    tuple(f"mx_quant<{i},{r},{c}>" for i, r, c in QUANT_COMBOS)
    + tuple(f"mx_quant<{i},{r},{c},4>" for i, r, c in ONE_COMBOS)
    + tuple(f"mx_quant_dyn<{i},{r},{c}>" for i, r, c in DYN_COMBOS)
    + tuple(f"mx_dequant<{o},{c}>" for o in range(3) for c in range(2))
    + tuple(f"mx_quant_dual<1,{c},{st}>" for c in DUAL_CS for st in DUAL_STAGES)
    + tuple(f"mx_swiglu_dual<{b},{c},{st}>" for b, st in ((0, 2), (0, 3), (1, 2)) for c in DUAL_CS)
    + ("mx_swiglu_div_check",)
    + tuple(f"mx_quant_batch<{i}>" for i in range(3))  # the fused blocked mode over a batch (3-D weights)
)


THREADS = 256  # kernels/quantize.cu NTHREADS (pipe 5: half)
SMEM_FIXED = 3584  # kernels/quantize.cu MX_SMEM_FIXED
SMEM_GPREP = 2048  # kernels/quantize.cu MX_SMEM_GPREP (CS_GPREP's dequantization multipliers)


def pipe_switch() -> int:
    """Tile pipelining of mx_quant (MOE_EP_QUANT_PIPE): 0 one tile per CTA, 1 persistent, 2 persistent + register
    prefetch, 3 persistent + cp.async double buffer in shared memory, 4 one tile per CTA on 3's cp.async path
    (2-5: 16-bit inputs, fp32 falls back to 0; column-wise/fused modes take 3 or 4, else 0), 5 pipe 4 on 64-row
    tiles of 128 threads (16-bit row-only plain / blocked; the other modes take 4); unset or "auto" (-1):
    the per-mode best measured (kernels/quantize.cu QuantCfg, and :func:`requested_pipe`)."""
    v = os.environ.get("MOE_EP_QUANT_PIPE", "auto")
    if v not in ("auto", "0", "1", "2", "3", "4", "5"):
        raise ValueError(f"MOE_EP_QUANT_PIPE must be auto or 0-5, got {v!r}")
    return -1 if v == "auto" else int(v)


def options() -> tuple[str, ...]:
    soft = ("-DMX_SOFT_CVT=1",) if os.environ.get("MOE_EP_MXFP8_SOFT_CVT", "0") == "1" else ()
    return soft + (f"-DMX_PIPE={pipe_switch()}",)


# Column-only 16-bit inputs with at least this many tiles per SM take pipe 4 under "auto". Measured on H200
# (benchmarks/NOTES.md, pass 10): pipe 4 ahead of pipe 0 from 31 tiles per SM (32768 x 2048: +2.5 points of copy;
# against the persistent pipe 3 +1.2 to +4.3 at M = 131072), behind at 15.5 (16384 x 2048: -5.3).
ONE_MIN_TILES_PER_SM = 24
PIPE3_CTAS_PER_SM = 3  # kernels/quantize.cu QuantCfg::MINB of pipes 1 and 3 (pipe 3: two 32 KB stages per CTA)


def requested_pipe(es: int, rs_mode: int, cs_mode: int, tiles: int, device: torch.device) -> int:
    """The pipe a launch asks for: MOE_EP_QUANT_PIPE, except that under "auto" (-1) a column-only 16-bit input of
    many tiles takes 4 (one tile per CTA on the cp.async path; pipe 0 wins on fewer tiles).

    Example (132 SMs): bf16 x [32768, 2048], column-only: 4096 tiles >= 24 * 132 = 3168 -> 4;
    [16384, 2048]: 2048 tiles -> -1 (the kernel's auto: 0).
    """
    pipe = pipe_switch()
    if pipe < 0 and rs_mode == 0 and cs_mode != 0 and es == 2 and tiles >= ONE_MIN_TILES_PER_SM * sm_count(device):
        return 4
    return pipe


def effective_pipe(es: int, rs_mode: int, cs_mode: int, pipe: int | None = None) -> int:
    """The pipelining the kernel compiles for this mode and requested pipe (default: MOE_EP_QUANT_PIPE; see
    kernels/quantize.cu QuantCfg)."""
    pipe = pipe_switch() if pipe is None else pipe
    if pipe < 0:  # kernels/quantize.cu QuantCfg::WANT0
        if cs_mode != 0:
            pipe = 0 if rs_mode == 0 else (3 if rs_mode == RS["grouped"] else 4)
        else:
            pipe = 3 if rs_mode in (RS["grouped"], RS["uniform"]) else (5 if rs_mode == RS["plain"] else 4)
    if pipe == 5 and not (es == 2 and cs_mode == 0 and rs_mode in (RS["plain"], RS["blocked"])):
        pipe = 4  # kernels/quantize.cu QuantCfg::HALF
    return 0 if (es == 4 and pipe >= 2) or (cs_mode != 0 and pipe not in (3, 4)) else pipe


def quant_ctas(tiles: int, es: int, rs_mode: int, cs_mode: int, device: torch.device, pipe: int | None = None) -> int:
    """Grid of mx_quant over ``tiles`` tiles: one CTA per tile (pipes 0, 4 and 5; pipe 5's tiles are 64 rows,
    :func:`quant_plan` counts them) or a persistent grid of CTAs-per-SM x SMs (kernels' QuantCfg)."""
    return grid_for(tiles, effective_pipe(es, rs_mode, cs_mode, pipe), device)


def grid_for(tiles: int, pipe: int, device: torch.device) -> int:
    """:func:`quant_ctas` for an effective pipe already known (:func:`effective_pipe`)."""
    if pipe in (0, 4, 5):
        return tiles
    per_sm = 2 if pipe == 2 else PIPE3_CTAS_PER_SM
    full = min(tiles, per_sm * sm_count(device))
    if os.environ.get("MOE_EP_QUANT_GRID", "full").strip().lower() != "balanced":
        # Default: every CTA slot of the GPU. Measured on H200 (benchmarks/NOTES.md, pass 4): more bytes in
        # flight beat an even tile count; the balanced grid lost 0-6 points of copy bandwidth.
        return full
    # Balanced: as few CTAs as still give every CTA the same number of tiles (+-1), so no short last round runs
    # with a fraction of the CTAs (2048 tiles: 342 CTAs x 6 instead of 396 x 5.17).
    return cdiv(tiles, cdiv(tiles, full))


# Tiles per CTA from which "auto" takes the dynamic tile schedule: launches with a column-wise and a row-wise output
# (fused), and the others. Measured on H200 (benchmarks/NOTES.md, pass 9): fused gains from 5.2 tiles per CTA
# (+2.3 points of copy at 16384 x 2048, +3.6 at 10.3); row_blocked gains 4.5 points at 18.1 (16384 x 7168), is even
# at 10.3 and loses 2.4 at 5.2; row_grouped on pipe 2 loses 2.6 at 9.7 and is even at 17.5. Pass 10, row_grouped on
# pipe 3 (its auto pipe since): dynamic -0.9 at 6.5, +1.0 at 11.6, +6.4 to +9.4 from 22.6 tiles per CTA.
DYN_MIN_TILES_FUSED = 4
DYN_MIN_TILES_OTHER = 12


def sched_switch() -> str:
    """MOE_EP_QUANT_SCHED, checked: ``auto`` (the default), ``static`` or ``dynamic``."""
    v = os.environ.get("MOE_EP_QUANT_SCHED", "auto").strip().lower()
    if v not in ("auto", "static", "dynamic"):
        raise ValueError(f"MOE_EP_QUANT_SCHED must be auto, static or dynamic, got {v!r}")
    return v


def dynamic_schedule(name: str, grid: int, tiles: int) -> bool:
    """Whether the mx_quant launch ``name`` (``mx_quant<...>``) with ``grid`` CTAs over ``tiles`` tiles (128 x 128;
    pipe 5's are 64 x 128) takes the dynamic tile schedule instead (``mx_quant_dyn<...>``; kernels/quantize.cu
    mx_sched_done: after each CTA's first two tiles, tiles come from an atomic ticket counter, so CTAs that run
    faster take more of them).

    Only persistent launches (fewer CTAs than tiles) of the modes compiled for it (DYN_COMBOS) have
    one. ``static`` / ``dynamic`` (MOE_EP_QUANT_SCHED) force it; ``auto`` takes it from DYN_MIN_TILES_FUSED
    tiles per CTA for the fused modes and DYN_MIN_TILES_OTHER for the others. The bytes written are the same either
    way. mx_quant_dual and mx_swiglu_dual keep the static order (with tickets they lost up to 16 points of copy
    bandwidth: benchmarks/NOTES.md, pass 9).

    Example (persistent, MOE_EP_QUANT_PIPE=3): mx_quant<1,2,0> over 14336 tiles (32768 x 7168) on 396 CTAs: 36 per
    CTA -> True; 4096 tiles (32768 x 2048): 10.3 -> False; fused mx_quant<1,2,2> over 2048 tiles: 5.2 -> True; one
    CTA per tile (pipes 0, 4 and 5, the auto pipes of these modes) -> False.
    """
    v = sched_switch()
    if v == "static" or grid >= tiles or name.replace("mx_quant<", "mx_quant_dyn<", 1) not in NAMES:
        return False
    _, rs_mode, cs_mode = (int(c) for c in name[name.index("<") + 1 : -1].split(",")[:3])
    least = DYN_MIN_TILES_FUSED if rs_mode and cs_mode else DYN_MIN_TILES_OTHER
    return v == "dynamic" or tiles >= least * grid


def dual_impl() -> str:
    """MOE_EP_QUANT_DUAL: ``reg`` (default) runs bf16 grouped-dual inputs through the register-tiled
    ``mx_quant_dual`` (kernels/quant_dual.cuh) and the SwiGLU forward / backward (bf16 dh) through
    ``mx_swiglu_dual`` (kernels/quant_swiglu.cuh); ``smem`` keeps all of them on mx_quant's shared-memory
    transpose (the kernel they replaced, kept for A/B measurements). Both write the same bytes."""
    v = os.environ.get("MOE_EP_QUANT_DUAL", "reg").strip().lower()
    if v not in ("reg", "smem"):
        raise ValueError(f"MOE_EP_QUANT_DUAL must be reg or smem, got {v!r}")
    return v


# mx_quant_dual's depth under "auto": 4 stages (1 CTA per SM, 3 tiles in flight) from this many tiles per SM, else
# 2 (3 CTAs per SM). Measured on H200 (benchmarks/NOTES.md, "Register-tiled grouped dual"): 4 stages ahead by 1.4-6.3
# points of copy from 35 tiles per SM, behind by 3.5 at 19 (16384 x 2048, where the last round dominates).
DUAL_DEEP_TILES_PER_SM = 32


def dual_stages(tiles: int, device: torch.device) -> int:
    """cp.async stages of mx_quant_dual: MOE_EP_QUANT_DUAL_STAGES (2-6), or under "auto" (default) 4 for inputs of
    at least 32 tiles per SM and 2 below.

    Example (132 SMs): bf16 [32768, 7168] with 32 groups: (256 + 32) * 56 = 16128 tiles >= 4224 -> 4;
    [16384, 2048]: (128 + 32) * 16 = 2560 tiles -> 2.
    """
    v = _dual_stages_switch()
    if v == "auto":
        return 4 if tiles >= DUAL_DEEP_TILES_PER_SM * sm_count(device) else 2
    return int(v)


def _dual_stages_switch() -> str:
    """MOE_EP_QUANT_DUAL_STAGES, checked: "auto" (the default) or "2" ... "6"."""
    v = os.environ.get("MOE_EP_QUANT_DUAL_STAGES", "auto").strip().lower()
    if v not in ("auto", "2", "3", "4", "5", "6"):
        raise ValueError(f"MOE_EP_QUANT_DUAL_STAGES must be auto or 2-6, got {v!r}")
    return v


SMEM_PER_SM = 233472  # Hopper: 228 KiB of shared memory per SM ...
SMEM_PER_CTA = 232448  # ... at most 227 KiB of it per CTA (static + dynamic), and 1 KiB reserved per resident CTA
SMEM_STATIC = 128  # static shared memory of the grouped kernels: grouped_table's warp partials (quant_sched.cuh)
SMEM_DYNAMIC_MAX = SMEM_PER_CTA - SMEM_STATIC  # the most dynamic shared memory such a launch may ask for


def dual_plan(tiles: int, n_groups: int, device: torch.device) -> tuple[int, int, int] | None:
    """(stages, grid, shared memory) of mx_quant_dual; None when even 2 stages do not fit next to the group table.

    Shared memory = stages x 32 KB + two 512-byte row-scale tiles + group table 16 (G + 1). The depth from
    :func:`dual_stages` comes down while it does not fit one CTA; the persistent grid is every CTA slot, the
    fewer of the register bound (3, 2, then 1 CTA per SM for 2, 3, >= 4 stages) and the shared-memory bound.

    Example (132 SMs): 32 groups, 2 stages: 67088 B, 3 CTAs per SM, grid 396; 700 groups: 77776 B, 2 per SM (264).
    """
    fit = _fit_stages(dual_stages(tiles, device), lambda s: 16 * (n_groups + 1) + s * TILE * TILE * 2 + 2 * 512)
    if fit is None:
        return None
    st, smem = fit
    per_sm = min({2: 3, 3: 2}.get(st, 1), SMEM_PER_SM // (smem + SMEM_STATIC + 1024))
    return st, min(tiles, per_sm * sm_count(device)), smem


def swiglu_plan(bwd: bool, k: int, h_tiles: int, n_groups: int, device: torch.device) -> tuple[int, int, int] | None:
    """(stages, grid, shared memory) of mx_swiglu_dual (kernels/quant_swiglu.cuh); None: mx_quant runs instead.

    k: the output width (F forward, 2F backward); h_tiles: its 128 x 128 tiles of h. The backward needs
    F % 128 == 0 (its up tile must start on a tile of the blocked scales). A stage holds 2 (forward: gate, up)
    or 3 (backward: and dh) streams of 32 KB; depth 3 forward and 2 backward (1 CTA per SM either way; under
    MOE_EP_QUANT_DUAL_STAGES=2 the forward takes 2 as well), coming down while it does not fit.

    Example (132 SMs): forward, 32 groups: 528 + 3 * 65536 + 1024 = 198160 B, grid min(tiles, 132); backward of
    F = 2048 with 32 groups: 528 + 2 * 98304 + 2048 = 199184 B; backward of F = 96: None.
    """
    if bwd and k % (2 * TILE):
        return None
    streams = 3 if bwd else 2
    st = 2 if bwd or _dual_stages_switch() == "2" else 3
    fit = _fit_stages(st, lambda s: 16 * (n_groups + 1) + s * streams * TILE * TILE * 2 + 2 * (1 + bwd) * 512)
    if fit is None:
        return None
    return fit[0], min(h_tiles, sm_count(device)), fit[1]


def _fit_stages(st: int, smem_of) -> tuple[int, int] | None:
    """(stages, dynamic shared memory): st, brought down to no fewer than 2 while smem_of(stages) bytes do not fit
    one CTA; None when even that does not fit."""
    while st > 2 and smem_of(st) > SMEM_DYNAMIC_MAX:
        st -= 1
    return None if smem_of(st) > SMEM_DYNAMIC_MAX else (st, smem_of(st))


def sm_count(device: torch.device) -> int:
    return _cuda.num_sms(device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quant_plan(
    x: torch.Tensor, m: int, k: int, rs_mode: int, cs_mode: int, n_groups: int, n_row_tiles: int | None, in_code
) -> tuple[str, int, int, int, int, int] | None:
    """(kernel name, grid, shared memory, row tiles, column tiles, threads per CTA) of a quantization launch
    (mx_quant, mx_quant_dual or mx_swiglu_dual); None: nothing to do. Pipe 5's row tiles are 64 rows.
    x: [M, K] (or SwiGLU's [M, 2K], in_code=3); k is the quantized width."""
    ctiles = cdiv(k, TILE)
    if n_row_tiles is None:
        n_row_tiles = cdiv(m, TILE)
    tiles = n_row_tiles * ctiles
    if tiles == 0:
        return None
    in_code = IN[x.dtype] if in_code is None else in_code
    reg = rs_mode == RS["grouped"] and cs_mode in DUAL_CS and dual_impl() == "reg"
    if reg and in_code == IN[torch.bfloat16]:
        plan = dual_plan(tiles, n_groups, x.device)
        if plan is not None:
            st, grid, smem = plan
            return f"mx_quant_dual<1,{cs_mode},{st}>", grid, smem, n_row_tiles, ctiles, THREADS
    if reg and in_code in (IN_SWIGLU, IN_SWIGLU_BWD16):
        bwd = in_code == IN_SWIGLU_BWD16
        plan = swiglu_plan(bwd, k, tiles // 2 if bwd else tiles, n_groups, x.device)
        if plan is not None:
            st, grid, smem = plan
            return f"mx_swiglu_dual<{int(bwd)},{cs_mode},{st}>", grid, smem, n_row_tiles, ctiles, THREADS
    # bytes of a staged element: the SwiGLU inputs stage their fp32 results
    es = 4 if in_code in (0, IN_SWIGLU, IN_SWIGLU_BWD, IN_SWIGLU_BWD16) else x.element_size()
    env_pipe = pipe_switch()
    req = requested_pipe(es, rs_mode, cs_mode, tiles, x.device)
    eff = effective_pipe(es, rs_mode, cs_mode, req)
    threads = THREADS
    if eff == 5:  # the kernel's row tiles are 64 rows (kernels/quantize.cu QuantCfg::ROWS); blocked scales: both
        # halves of every 128-row scale tile, so that its padding rows are written too
        n_row_tiles = 2 * n_row_tiles if rs_mode == RS["blocked"] else cdiv(m, TILE // 2)
        tiles, threads = n_row_tiles * ctiles, THREADS // 2
    grid = grid_for(tiles, eff, x.device)
    table = 16 * (n_groups + 1) if rs_mode == RS["grouped"] else 0  # per-CTA group table (long long + 2 int)
    cp_async = eff in (3, 4, 5)  # the tile lands in shared-memory stages (pipes 4 and 5: one)
    # PIPE 3 buffers on 128 bytes (also the column modes' tile); 4: one tile per CTA, one buffer; 5: a 64-row one
    stage = (TILE // 2 if eff == 5 else TILE) * TILE * 2
    stages = (1 if eff in (4, 5) else 2) * stage + 128 if cp_async else 0
    fixed = SMEM_FIXED + (SMEM_GPREP if cs_mode == CS["grouped_prep"] else 0)
    smem = (TILE * TILE * es if cs_mode and not cp_async else 0) + fixed + table + stages
    name = f"mx_quant<{in_code},{rs_mode},{cs_mode}" + (f",{req}>" if req != env_pipe else ">")
    if dynamic_schedule(name, grid, tiles):
        name = name.replace("mx_quant<", "mx_quant_dyn<", 1)
    return name, grid, smem, n_row_tiles, ctiles, threads


def batch_plan(x: torch.Tensor, e: int, n: int, k: int) -> tuple[str, tuple[int, int], int, int, int] | None:
    """(name, grid (x, y), shared memory, row tiles, column tiles) of mx_quant_batch: the fused blocked mode
    (quantize_weights_fused) of e equal [n, k] problems in one launch, grid.y = problem; None for e == 0.

    One launch per expert was host-bound for small weights (16 x [1536, 2048]: a few microseconds of GPU time per
    expert against ~30 us of Python per launch). A persistent grid (fewer CTAs than one expert's tiles) is shared
    out between the experts: at most the one-problem grid's CTAs in all, so none waits for a slot and then strides
    alone through a whole share (e not dividing the grid leaves up to e - 1 slots idle; e > grid gives one CTA per
    expert, in waves). A grid of one CTA per tile stays per expert.

    Example (132 SMs): under auto (pipe 4, one CTA per tile) 4 x [8192, 5120] bf16 (2560 tiles each) -> grid
    (2560, 4); with MOE_EP_QUANT_PIPE=3 (396 CTA slots) -> (99, 4), and 16 x [1536, 2048] (192 tiles each, fewer
    than the slots: one CTA per tile) -> (192, 16).
    """
    if e > 65535:
        raise ValueError(f"quantize_weights_fused: {e} experts, more than one launch's grid.y (65535)")
    plan = quant_plan(x, n, k, RS["blocked"], CS["blocked"], 0, None, None)  # the same for every problem
    if plan is None or e == 0:
        return None
    _, grid, smem, n_row_tiles, ctiles, _ = plan  # (mx_quant_batch has no dynamic schedule: it reads only the grid)
    gx = grid if grid >= n_row_tiles * ctiles else max(1, grid // e)
    return f"mx_quant_batch<{IN[x.dtype]}>", (gx, e), smem, n_row_tiles, ctiles
