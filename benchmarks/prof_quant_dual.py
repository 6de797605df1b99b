"""A/B of the grouped-dual quantization kernels in one process (a profiling aid; bench_quant.py is the benchmark).

    python benchmarks/prof_quant_dual.py [--configs smem,reg2,reg4] [--variants grouped_dual,grouped_dual_prep]
                                         [--rounds 4] [--reps 20] [--json PATH]

Configurations (each may end in ``@DIR``: kernels from the sources in DIR, see config_env): ``smem`` is
mx_quant's shared-memory transpose (MOE_EP_QUANT_DUAL=smem); ``regN`` is the register-tiled mx_quant_dual with N
cp.async stages (MOE_EP_QUANT_DUAL=reg, MOE_EP_QUANT_DUAL_STAGES=N), or for the SwiGLU variants
(``--variants swiglu_dual_prep,swiglu_bwd_dual_prep``) mx_swiglu_dual (forward: 2 or 3 stages). For each
shape and variant every configuration is first checked byte for byte against the reference (bench_quant.check) and,
whole output, against the first configuration's (quant_ab.ab_row), then timed in ``--rounds`` rounds in
bench_gemm.round_order, each the median of ``--reps`` launches with
bench_quant's flushed-L2 timer; reported: the median over rounds, in us and in % of the copy bandwidth measured in
the same process (bytes as bench_quant counts them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_ab import ab_parser, ab_run  # noqa: E402

from moe_ep import _cuda  # noqa: E402

KERNELS_DIR = _cuda.kernels_dir()  # the sources of configurations without @DIR (read before any config sets it)


def config_env(name: str) -> dict[str, str]:
    """Environment of a configuration: ``smem``, ``reg`` or ``regN``, optionally ``/static`` or ``/dynamic`` (the
    tile schedule, MOE_EP_QUANT_SCHED; default auto), optionally ``@DIR``: the kernels compiled from the sources in
    DIR (MOE_EP_KERNELS_DIR, e.g. ``git archive <rev> kernels`` unpacked) for an A/B of two revisions in one process;
    without it, the sources this process started with (the checkout's, or MOE_EP_KERNELS_DIR if the shell set it).
    DIR's quantize.cu must define every name in quant_plan.NAMES and take mx_quant's 14 arguments (the counter
    last): older sources need both added (benchmarks/results/README.md, prof_quant_sched_h200.json).
    The schedule reaches only mx_quant's persistent launches (under auto: row_grouped; row_*, fused and col_blocked
    with MOE_EP_QUANT_PIPE=3); the dual kernels have the static order alone. Sources older than the schedule switch
    ignore it."""
    name, _, kdir = name.partition("@")
    name, _, sched = name.partition("/")
    env = {
        "MOE_EP_KERNELS_DIR": str(Path(kdir).resolve() if kdir else KERNELS_DIR),
        "MOE_EP_QUANT_SCHED": sched or "auto",
    }
    if name == "smem":
        return {**env, "MOE_EP_QUANT_DUAL": "smem", "MOE_EP_QUANT_DUAL_STAGES": "auto"}
    if name.startswith("reg"):
        return {**env, "MOE_EP_QUANT_DUAL": "reg", "MOE_EP_QUANT_DUAL_STAGES": name.removeprefix("reg") or "auto"}
    raise ValueError(f"unknown configuration {name!r} (smem, reg, reg2 ... reg6, each with an optional @DIR)")


def main() -> None:
    ap = ab_parser(__doc__, "grouped_dual,grouped_dual_prep", rounds=4)
    ap.add_argument("--configs", default="smem,reg2,reg4")
    args = ap.parse_args()
    ab_run(args, lambda c: os.environ.update(config_env(c)), args.configs.split(","))


if __name__ == "__main__":
    main()
