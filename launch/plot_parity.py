"""Held-out loss curves of a loss-parity run (launch/loss_parity.py's loss_parity.json): per variant the mean over
seeds with the band of the seeds' min .. max, and the final held-out loss per seed.

    python3 launch/plot_parity.py runs/parity/loss_parity.json --out loss_parity.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="loss_parity.json")
    p.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    args = p.parse_args(argv)
    path = Path(args.json)
    try:
        res = json.loads(path.read_text())
        variants = res["variants"]
    except (OSError, ValueError, KeyError) as e:
        p.error(f"{path}: not a loss_parity.json ({e})")
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, v in variants.items():
        steps = [s for s, _ in v["eval_curves"][0]]
        per_step = list(zip(*[[loss for _, loss in c] for c in v["eval_curves"]], strict=True))
        mean = [sum(xs) / len(xs) for xs in per_step]
        (line,) = ax.plot(steps, mean, label=f"{name} ({len(v['seeds'])} seeds)")
        ax.fill_between(steps, [min(xs) for xs in per_step], [max(xs) for xs in per_step], alpha=0.2,
                        color=line.get_color())  # fmt: skip
        bx.scatter([name] * len(v["eval_loss"]), v["eval_loss"], color=line.get_color())
        bx.errorbar([name], [v["mean"]], yerr=[[v["std"]], [v["std"]]], fmt="_", color="black", capsize=6)
    meta = res.get("meta", {})
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (mean, band: min..max over seeds)")
    ax.legend()
    bx.set_ylabel("final held-out loss per seed (bar: mean +- std)")
    fig.suptitle(f"loss parity: {meta.get('device')}, commit {meta.get('commit')}, {meta.get('steps')} steps")
    fig.tight_layout()
    out = Path(args.out) if args.out else path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
