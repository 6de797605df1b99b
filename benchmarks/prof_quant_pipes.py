"""A/B of mx_quant builds and pipes in one process (a profiling aid; bench_quant.py is the benchmark).

    python benchmarks/prof_quant_pipes.py [--configs JSON] [--shapes 16384x2048,...] [--variants row_blocked,...]
                                          [--rounds 6] [--reps 20] [--json PATH]

A configuration is a set of environment variables set for its launches (MOE_EP_QUANT_PIPE, MOE_EP_QUANT_SCHED,
MOE_EP_NVRTC_OPTIONS), e.g. ``{"auto": {}, "p4": {"MOE_EP_QUANT_PIPE": "4"}}``; the first is the baseline.
MOE_EP_NVRTC_OPTIONS gives a configuration a build of its own, e.g. with a -D switch added to the sources for the
experiment (benchmarks/NOTES.md pass 10 compared CTAs per SM that way).
For each shape and variant every configuration is checked against the reference (bench_quant.check, 512 rows), and
its whole output, written into buffers prefilled with 0xAB, must equal the first configuration's byte for byte;
then all are timed in ``--rounds`` rounds in bench_gemm.round_order with bench_quant's flushed-L2 timer (median of
``--reps``), reported as the median over rounds in us and in % of the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_ab import ab_parser, ab_run  # noqa: E402

DEFAULT_CONFIGS = '{"auto": {}, "pipe4": {"MOE_EP_QUANT_PIPE": "4"}, "pipe3": {"MOE_EP_QUANT_PIPE": "3"}}'
KEYS = ("MOE_EP_QUANT_PIPE", "MOE_EP_NVRTC_OPTIONS", "MOE_EP_QUANT_SCHED")


def use(configs: dict[str, dict[str, str]], name: str | None) -> None:
    """Set configuration ``name``'s environment (None: none), first clearing every variable any configuration
    sets, so that no setting leaks from one configuration into the next."""
    for k in set(KEYS).union(*configs.values()):
        os.environ.pop(k, None)
    if name is not None:
        os.environ.update(configs[name])


def main() -> None:
    ap = ab_parser(__doc__, "row_blocked,row_plain,row_grouped,fused,col_blocked", rounds=6)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="JSON object: name -> environment")
    args = ap.parse_args()
    configs: dict[str, dict[str, str]] = json.loads(args.configs)
    if not torch.cuda.is_available():
        raise SystemExit("prof_quant_pipes.py needs a CUDA GPU")
    ab_run(args, lambda c: use(configs, c), list(configs))
    use(configs, None)


if __name__ == "__main__":
    main()
