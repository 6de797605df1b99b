"""Launch plans of the quantization kernels in ``kernels/mxfp8/quantize.cu``: which kernel a call takes, its grid and
its shared memory (host arithmetic only; :mod:`moe_ep.mxfp8.cuda` launches what this module decides).

Kernels: ``mx_quant`` (``quantize(x, axis)``'s row-wise and column-wise modes, and the SwiGLU grouped dual where
``mx_swiglu_dual`` does not run), ``mx_quant_batch`` (3-D weights, both operands), ``mx_quant_dual`` (bf16 grouped
dual, kernels/mxfp8/quant_dual.cuh), ``mx_swiglu_dual`` (SwiGLU forward / backward, kernels/mxfp8/quant_swiglu.cuh),
``mx_dequant``. The grouped duals write the column-wise operand as the wgrad's prepared bf16 (CS "grouped_prep").
The mode codes (IN, RS, CS) are kernels/mxfp8/quantize.cu's. :func:`sm_count` is the one place that asks the device
(the CPU emulator of tests/quant_emu.py replaces it). Why each choice: docs/performance.md, "Quantization".
"""

from __future__ import annotations

import torch

from .. import _cuda

TILE = 128
IN = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
RS = {"none": 0, "plain": 1, "blocked": 2, "grouped": 3}
CS = {"none": 0, "blocked": 2, "nt": 3, "grouped_prep": 5}
IN_SWIGLU, IN_SWIGLU_BWD16 = 3, 5  # SwiGLU forward (bf16 a), backward (bf16 a and bf16 dh)
IN_MXROWS = 6  # mx_quant_dual: e4m3 rows + their per-group blocked scales, column output only

QUANT_COMBOS = (
    [(i, RS["plain"], 0) for i in range(3)]  # quantize(x, -1): row-wise, plain scales
    + [(i, 0, CS["nt"]) for i in range(3)]  # quantize(x, 0): column-wise in x's layout
    # grouped row-wise + the wgrad's prepared column operand of the SwiGLU inputs where mx_swiglu_dual does not run:
    # the forward (IN 3) where it does not fit next to the group table, the backward (IN 5) also for F % 128 != 0
    + [(i, RS["grouped"], CS["grouped_prep"]) for i in (IN_SWIGLU, IN_SWIGLU_BWD16)]
    + [(IN_SWIGLU, RS["grouped"], CS["none"])]  # the forward's row-only h, where mx_swiglu_dual does not fit
)
# column-only modes of 16-bit inputs, also compiled with pipe 4 (one tile per CTA on the cp.async path; chosen at
# launch for inputs of many tiles: requested_pipe)
ONE_COMBOS = [(i, 0, CS["nt"]) for i in (1, 2)]
# the register-tiled dual quantizers (kernels/mxfp8/quant_dual.cuh, quant_swiglu.cuh): grouped rows + the prepared
# columns
DUAL_CS = (CS["grouped_prep"],)
DUAL_STAGES = (2, 3, 4)  # cp.async stages of 32 KB (dual_plan); CTAs per SM: 3, 2, 1
# mx_quant_dual<in, cs, stages>: bf16 x (both outputs), and the saved MXFP8 rows (the backward's x column operand)
DUAL_KERNELS = tuple((i, c, st) for i in (IN[torch.bfloat16], IN_MXROWS) for c in DUAL_CS for st in DUAL_STAGES)
SWIGLU_STAGES = {False: 3, True: 2}  # mx_swiglu_dual's depth (forward, backward) before it must fit (swiglu_plan)
# mx_swiglu_dual<bwd, cs, stages> the product launches: the forward's row-only h (expert_mlp_mx_fwd: GEMM2 reads only
# the rows), the forward with the prepared column operand (the backward's recomputed h for dW2), the backward's dA;
# depths 2 and 3 for the forward (2 where 3 do not fit next to the group table)
SWIGLU_KERNELS = tuple((0, c, st) for c in (CS["none"], CS["grouped_prep"]) for st in (2, 3)) + (
    (1, CS["grouped_prep"], 2),
)
NAMES = (
    tuple(f"mx_quant<{i},{r},{c}>" for i, r, c in QUANT_COMBOS)
    + tuple(f"mx_quant<{i},{r},{c},4>" for i, r, c in ONE_COMBOS)
    + tuple(f"mx_dequant<{o},{c}>" for o in range(3) for c in range(2))
    + tuple(f"mx_quant_dual<{i},{c},{st}>" for i, c, st in DUAL_KERNELS)
    + tuple(f"mx_swiglu_dual<{b},{c},{st}>" for b, c, st in SWIGLU_KERNELS)
    + tuple(f"mx_quant_batch<{i}>" for i in range(2))  # the fused blocked mode over fp32 / bf16 weight batches
)


# kernels/mxfp8/quantize.cu's constants, read from the source (never copied by hand)
THREADS = _cuda.kernel_constant("mxfp8/quantize.cu", "NTHREADS")  # (pipe 5: half)
SMEM_FIXED = _cuda.kernel_constant("mxfp8/quantize.cu", "MX_SMEM_FIXED")
SMEM_GPREP = _cuda.kernel_constant("mxfp8/quantize.cu", "MX_SMEM_GPREP")  # CS_GPREP's dequantization multipliers

# Column-only 16-bit inputs with at least this many tiles per SM take pipe 4 (docs/performance.md).
ONE_MIN_TILES_PER_SM = 24


def requested_pipe(es: int, rs_mode: int, cs_mode: int, tiles: int, device: torch.device) -> int:
    """The pipe a launch asks for: 4 (one tile per CTA on the cp.async path) for a column-only 16-bit input of many
    tiles, else -1 (the mode's own pipe: :func:`effective_pipe`).

    Example (132 SMs): bf16 x [32768, 2048], column-only: 4096 tiles >= 24 * 132 = 3168 -> 4;
    [16384, 2048]: 2048 tiles -> -1 (the mode's own: 0).
    """
    if rs_mode == 0 and cs_mode != 0 and es == 2 and tiles >= ONE_MIN_TILES_PER_SM * sm_count(device):
        return 4
    return -1


def effective_pipe(es: int, rs_mode: int, cs_mode: int, pipe: int = -1) -> int:
    """The tile pipelining mx_quant compiles for a mode and requested pipe (kernels/mxfp8/quantize.cu QuantCfg): 5 for
    16-bit row-only plain scales (64-row tiles of 128 threads), 4 for 16-bit inputs asking for it and the fused
    blocked mode (one tile on the cp.async path), else 0 (the chunks in registers; every input staged as fp32
    words). Every pipe runs one tile per CTA."""
    if es == 4:
        return 0
    if rs_mode == RS["plain"] and cs_mode == 0:
        return 5
    return 4 if pipe == 4 or (rs_mode == RS["blocked"] and cs_mode == CS["blocked"]) else 0


# mx_quant_dual's depth: 4 stages (1 CTA per SM, 3 tiles in flight) from this many tiles per SM, else 2 (3 CTAs
# per SM); docs/performance.md.
DUAL_DEEP_TILES_PER_SM = 32


def dual_stages(tiles: int, device: torch.device) -> int:
    """cp.async stages mx_quant_dual asks for: 4 for inputs of at least 32 tiles per SM, 2 below.

    Example (132 SMs): bf16 [32768, 7168] with 32 groups: (256 + 32) * 56 = 16128 tiles >= 4224 -> 4;
    [16384, 2048]: (128 + 32) * 16 = 2560 tiles -> 2.
    """
    return 4 if tiles >= DUAL_DEEP_TILES_PER_SM * sm_count(device) else 2


SMEM_PER_SM = 233472  # Hopper: 228 KiB of shared memory per SM ...
SMEM_PER_CTA = 232448  # ... at most 227 KiB of it per CTA (static + dynamic), and 1 KiB reserved per resident CTA
SMEM_STATIC = 128  # static shared memory of the grouped kernels: grouped_table's warp partials (quant_sched.cuh)
SMEM_DYNAMIC_MAX = SMEM_PER_CTA - SMEM_STATIC  # the most dynamic shared memory such a launch may ask for


def dual_plan(tiles: int, n_groups: int, device: torch.device) -> tuple[int, int, int] | None:
    """(stages, grid, shared memory) of mx_quant_dual; None when even 2 stages do not fit next to the group table.

    Shared memory = stages x 32 KB + two 512-byte row-scale tiles + group table 16 (G + 1). The depth from
    :func:`dual_stages` comes down while it does not fit one CTA; the persistent grid is every CTA slot, the
    fewer of the register bound (3, 2, then 1 CTA per SM for 2, 3, 4 stages) and the shared-memory bound.

    Example (132 SMs): 32 groups, 2 stages: 67088 B, 3 CTAs per SM, grid 396; 700 groups: 77776 B, 2 per SM (264).
    """
    fit = _fit_stages(dual_stages(tiles, device), lambda s: 16 * (n_groups + 1) + s * TILE * TILE * 2 + 2 * 512)
    if fit is None:
        return None
    st, smem = fit
    per_sm = min({2: 3, 3: 2}.get(st, 1), SMEM_PER_SM // (smem + SMEM_STATIC + 1024))
    return st, min(tiles, per_sm * sm_count(device)), smem


def swiglu_plan(bwd: bool, k: int, h_tiles: int, n_groups: int, device: torch.device) -> tuple[int, int, int] | None:
    """(stages, grid, shared memory) of mx_swiglu_dual (kernels/mxfp8/quant_swiglu.cuh); None: mx_quant runs instead.

    k: the output width (F forward, 2F backward); h_tiles: its 128 x 128 tiles of h. The backward needs
    F % 128 == 0 (its up tile must start on a tile of the blocked scales). A stage holds 2 (forward: gate, up)
    or 3 (backward: and dh) streams of 32 KB; depth SWIGLU_STAGES (3 forward, 2 backward; 1 CTA per SM either
    way), coming down while it does not fit.

    Example (132 SMs): forward, 32 groups: 528 + 3 * 65536 + 1024 = 198160 B, grid min(tiles, 132); backward of
    F = 2048 with 32 groups: 528 + 2 * 98304 + 2048 = 199184 B; backward of F = 96: None.
    """
    if bwd and k % (2 * TILE):
        return None
    streams = 3 if bwd else 2
    fit = _fit_stages(
        SWIGLU_STAGES[bwd], lambda s: 16 * (n_groups + 1) + s * streams * TILE * TILE * 2 + 2 * (1 + bwd) * 512
    )
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


def quant_smem(es: int, rs_mode: int, cs_mode: int, pipe: int, n_groups: int) -> int:
    """Dynamic shared memory of mx_quant (and mx_quant_batch) on an effective ``pipe`` (kernels/mxfp8/quantize.cu
    mx_quant_body): the staged tile (column modes on pipe 0), the fixed scale / multiplier area, the group table
    (RS_GROUPED, 16 bytes per group + 16) and the cp.async stage on 128 bytes (pipes 4 and 5; pipe 5: 64 rows)."""
    table = 16 * (n_groups + 1) if rs_mode == RS["grouped"] else 0  # per-CTA group table (long long + 2 int)
    cp_async = pipe in (4, 5)
    stage = (TILE // 2 if pipe == 5 else TILE) * TILE * 2 + 128 if cp_async else 0
    fixed = SMEM_FIXED + (SMEM_GPREP if cs_mode == CS["grouped_prep"] else 0)
    return (TILE * TILE * es if cs_mode and not cp_async else 0) + fixed + table + stage


def quant_plan(
    x: torch.Tensor, m: int, k: int, rs_mode: int, cs_mode: int, n_groups: int, n_row_tiles: int | None, in_code
) -> tuple[str, int, int, int, int, int] | None:
    """(kernel name, grid, shared memory, row tiles, column tiles, threads per CTA) of a quantization launch
    (mx_quant, mx_quant_dual or mx_swiglu_dual); None: nothing to do. Pipe 5's row tiles are 64 rows.
    x: [M, K] (or SwiGLU's [M, 2K], in_code=3); k is the quantized width. Grouped modes: rs_mode RS["grouped"]
    with cs_mode CS["grouped_prep"], for bf16 x (in_code None) and the SwiGLU codes, or with CS["none"] for the
    SwiGLU forward (row-only h); in_code IN_MXROWS (x e4m3, grouped tile order, column output only)."""
    ctiles = cdiv(k, TILE)
    if n_row_tiles is None:
        n_row_tiles = cdiv(m, TILE)
    tiles = n_row_tiles * ctiles
    if tiles == 0:
        return None
    in_code = IN[x.dtype] if in_code is None else in_code
    grouped = rs_mode == RS["grouped"] or in_code == IN_MXROWS  # IN_MXROWS: grouped tiles, no row output
    if grouped and cs_mode == CS["none"] and in_code != IN_SWIGLU:
        raise ValueError("grouped row-only quantization is compiled for the SwiGLU forward only")
    if grouped and in_code in (IN[torch.bfloat16], IN_MXROWS):
        plan = dual_plan(tiles, n_groups, x.device)
        if plan is None:
            raise ValueError(
                f"quantize_grouped_dual: {n_groups} groups: the group table leaves no room in shared memory"
            )
        st, grid, smem = plan
        return f"mx_quant_dual<{in_code},{cs_mode},{st}>", grid, smem, n_row_tiles, ctiles, THREADS
    if grouped and in_code not in (IN_SWIGLU, IN_SWIGLU_BWD16):
        raise ValueError(f"the grouped dual takes bf16 x or the SwiGLU inputs, got input code {in_code}")
    if grouped:
        bwd = in_code == IN_SWIGLU_BWD16
        plan = swiglu_plan(bwd, k, tiles // 2 if bwd else tiles, n_groups, x.device)
        if plan is not None:
            st, grid, smem = plan
            return f"mx_swiglu_dual<{int(bwd)},{cs_mode},{st}>", grid, smem, n_row_tiles, ctiles, THREADS
    # bytes of a staged element: the SwiGLU inputs stage their fp32 results
    es = 4 if in_code in (0, IN_SWIGLU, IN_SWIGLU_BWD16) else x.element_size()
    req = requested_pipe(es, rs_mode, cs_mode, tiles, x.device)
    eff = effective_pipe(es, rs_mode, cs_mode, req)
    threads = THREADS
    if eff == 5:  # the kernel's row tiles are 64 rows (kernels/mxfp8/quantize.cu QuantCfg::ROWS)
        n_row_tiles = cdiv(m, TILE // 2)
        tiles, threads = n_row_tiles * ctiles, THREADS // 2
    smem = quant_smem(es, rs_mode, cs_mode, eff, n_groups)
    name = f"mx_quant<{in_code},{rs_mode},{cs_mode}" + (f",{req}>" if req >= 0 else ">")
    return name, tiles, smem, n_row_tiles, ctiles, threads


def batch_plan(x: torch.Tensor, e: int, n: int, k: int) -> tuple[str, tuple[int, int], int, int, int] | None:
    """(name, grid (x, y), shared memory, row tiles, column tiles) of mx_quant_batch: the fused blocked mode
    (quantize_weights_fused) of e equal [n, k] problems in one launch, grid.y = problem, one CTA per tile (pipe 4
    for 16-bit inputs, 0 for fp32); None for e == 0 or empty problems.

    One launch per expert was host-bound for small weights (a few microseconds of GPU time per expert against tens
    of microseconds of Python per launch).

    Example: 4 x [8192, 5120] bf16 -> grid (64 x 40 = 2560, 4), 3584 + 32768 + 128 bytes of shared memory.
    """
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quantize_weights_fused: weights must be fp32 or bf16 (master weights), got {x.dtype}")
    if e > 65535:
        raise ValueError(f"quantize_weights_fused: {e} experts, more than one launch's grid.y (65535)")
    n_row_tiles, ctiles = cdiv(n, TILE), cdiv(k, TILE)
    if e == 0 or n_row_tiles * ctiles == 0:
        return None
    es = x.element_size()
    blocked, cblocked = RS["blocked"], CS["blocked"]
    smem = quant_smem(es, blocked, cblocked, effective_pipe(es, blocked, cblocked), 0)
    return f"mx_quant_batch<{IN[x.dtype]}>", (n_row_tiles * ctiles, e), smem, n_row_tiles, ctiles
