"""Bar chart of a ``bench_layer.py`` result JSON (run wherever matplotlib is installed: ``pip install matplotlib``).

    python3 benchmarks/plot_layer.py [benchmarks/results/bench_layer.json] [--out bench_layer.png]

One row per shape, three panels:
  step time   forward + backward per variant (the forward stacked under the backward; medians, max over ranks),
              labelled with ms and the speedup against bf16 and torchtitan_bf16 (> 1: faster)
  phases      the profiled step's phase groups (router, layout, dispatch, gemms, swiglu_quant, combine,
              weight_prep, other; max over ranks per phase), stacked
  memory      act_mem_gb (peak during the step) and saved_gb (held for the backward) per variant; the dashed line
              is grad_gb (parameter gradients + dx, allocated inside the step and counted in both)
Variants that failed are left out, named in the panel. Writes a PNG (default: the JSON's path with .png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GROUPS = ("router", "layout", "dispatch", "gemms", "swiglu_quant", "combine", "weight_prep", "other")
COLORS = {
    "router": "#8c564b",
    "layout": "#7f7f7f",
    "dispatch": "#1f77b4",
    "gemms": "#2ca02c",
    "swiglu_quant": "#bcbd22",
    "combine": "#ff7f0e",
    "weight_prep": "#d62728",
    "other": "#c7c7c7",
}


def _speedups(r: dict, by: dict) -> str:
    parts = []
    for base in ("bf16", "torchtitan_bf16"):
        b = by.get(base)
        if b and r["variant"] != base and b.get("fwd_bwd_ms") and r.get("fwd_bwd_ms"):
            parts.append(f"{b['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x {'tt' if base.startswith('torchtitan') else base}")
    return "\n".join(parts)


def plot(data: dict, out: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit("plot_layer needs matplotlib: pip install matplotlib") from None

    meta, results = data["meta"], data["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(len(shapes), 3, figsize=(17, 4.6 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        rs = [r for r in results if r["shape"] == shape]
        ok = [r for r in rs if r.get("fwd_bwd_ms") is not None and "error" not in r]
        failed = [r["variant"] for r in rs if r not in ok]
        by = {r["variant"]: r for r in ok}
        names = [r["variant"] for r in ok]
        xs = range(len(ok))
        dims = meta.get("shapes", {}).get(shape, {})
        dim_s = ", ".join(f"{k}={dims[k]}" for k in ("T", "H", "F", "E", "K") if k in dims)

        ax = axes[row][0]
        fwd = [r["fwd_ms"] for r in ok]
        bwd = [r["fwd_bwd_ms"] - r["fwd_ms"] for r in ok]
        ax.bar(xs, fwd, color="#1f77b4", label="forward")
        ax.bar(xs, bwd, bottom=fwd, color="#aec7e8", label="backward")
        for i, r in enumerate(ok):
            label = f"{r['fwd_bwd_ms']:.2f} ms"
            sp = _speedups(r, by)
            ax.text(i, r["fwd_bwd_ms"], label + ("\n" + sp if sp else ""), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max((r["fwd_bwd_ms"] for r in ok), default=1) * 1.3)
        ax.set_ylabel("ms per step (median, slowest rank)")
        ax.set_title(f"{shape} ({dim_s}): forward + backward")
        ax.legend(loc="upper right", fontsize=8)

        ax = axes[row][1]
        bottom = [0.0] * len(ok)
        for grp in GROUPS:
            vals = [(r.get("phase_groups") or {}).get(grp, 0.0) for r in ok]
            if any(vals):
                ax.bar(xs, vals, bottom=bottom, color=COLORS[grp], label=grp)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylim(0, max(bottom, default=0.0) * 1.45 or 1.0)
        ax.set_ylabel("ms (one profiled step)")
        ax.set_title(f"{shape}: phases")
        ax.legend(loc="upper right", fontsize=7, ncol=2)

        ax = axes[row][2]
        width = 0.38
        act = [r.get("act_mem_gb") or 0.0 for r in ok]
        saved = [r.get("saved_gb") or 0.0 for r in ok]
        ax.bar([i - width / 2 for i in xs], act, width, color="#9467bd", label="act_mem_gb (peak)")
        ax.bar([i + width / 2 for i in xs], saved, width, color="#c5b0d5", label="saved_gb (after forward)")
        for i, r in enumerate(ok):
            if r.get("grad_gb"):
                ax.hlines(r["grad_gb"], i - 0.45, i + 0.45, colors="k", linestyles="dashed", linewidth=1)
            if act[i]:
                ax.text(i - width / 2, act[i], f"{act[i]:.2f}", ha="center", va="bottom", fontsize=7)
        top = max(act + [r.get("grad_gb") or 0.0 for r in ok], default=0.0)
        ax.set_ylim(0, top * 1.3 or 1.0)
        ax.set_ylabel("GB (torch allocator)")
        ax.set_title(f"{shape}: memory (dashed: grad_gb)")
        ax.legend(loc="upper right", fontsize=8)

        for ax in axes[row]:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        if failed:
            axes[row][0].set_title(axes[row][0].get_title() + "\nfailed: " + ", ".join(failed), fontsize=10)
    fig.suptitle(
        f"bench_layer: {meta.get('device')}, EP={meta.get('ep_size')}, commit {str(meta.get('commit'))[:12]}, "
        f"{meta.get('steps')} steps, transport {meta.get('transport')}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="?", default="benchmarks/results/bench_layer.json")
    p.add_argument("--out", default=None, help="PNG path (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    src = Path(args.json)
    data = json.loads(src.read_text())
    if "results" not in data:
        print(f"{src}: no results ({data.get('skipped', 'unknown format')})")
        return 1
    plot(data, Path(args.out) if args.out else src.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
