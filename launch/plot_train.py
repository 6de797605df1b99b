"""PNG plots of launch/train.py JSON logs: loss vs step for several runs, tokens/s/GPU and peak memory per variant.

    python3 launch/plot_train.py runs/medium_mxfp8_*.json runs/medium_bf16_*.json runs/medium_torchtitan_*.json \
        [--out-dir DIR] [--prefix train_medium] [--smooth 10]

Writes ``<prefix>_loss.png`` (one line per run, labelled by its variant; ``--smooth N``: a trailing N-step mean, the
raw curve faint behind it) and ``<prefix>_throughput.png`` (bars: ``summary.tokens_per_sec_per_gpu`` per run, and
its peak memory: the GPU allocator's peak, max over ranks, or the host's peak RSS for CPU runs) into ``--out-dir``
(default: the first log's folder). Runs on the CPU; needs matplotlib (``pip install -e '.[train]'``), imported only
in :func:`main`: :func:`load_runs` (the data the plots show) works without it. The legend sits right of the loss plot
and the bars are horizontal, one row per run, so many runs stay readable. A missing or unreadable log is an error
naming the file (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def run_label(log: dict) -> str:
    """The variant, with the transport when it is not the default, the capacity factor when dropping, and the
    expert all-gather when an MXFP8 variant gathers plain weights."""
    label = log.get("variant") or "unknown"
    if log.get("quantize") and log.get("config", {}).get("args", {}).get("expert_gather") == "plain":
        label += " plain-gather"
    if log.get("transport") not in (None, "nvshmem"):
        label += f" ({log['transport']})"
    if log.get("capacity_factor") is not None:
        label += f" cf={log['capacity_factor']}"
    return label


def load_runs(paths: list[str | Path]) -> list[dict]:
    """Read train.py logs -> one dict per run, in the given order: label (unique: a repeated label gets the file name
    appended, then a number), variant, path, preset, device, world_size, ep, steps [1..n], loss, aux_loss,
    tokens_per_sec_per_gpu, memory_gib and memory_kind ("gpu": the allocator's peak, max over ranks; "gpu_rank0": an
    unfinished run's, from rank 0's windows; "host_rss" on
    CPU; None if unknown), final_loss, mean_loss_last_50 (None when the run is unfinished: no summary yet).
    Raises ValueError naming the file when it is missing, not JSON, or a log without the per-step ``loss`` list."""
    runs = []
    for path in paths:
        path = Path(path)
        try:
            log = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read it ({e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e}); launch/train.py writes its log with --log-json") from None
        loss = log.get("loss") if isinstance(log, dict) else None
        if not isinstance(loss, list) or not loss:
            raise ValueError(f"{path}: not a launch/train.py log (no per-step 'loss' list)")
        summary = log.get("summary") or {}
        windows = log.get("windows") or []
        tps = summary.get("tokens_per_sec_per_gpu")
        prof = ((log.get("config") or {}).get("args") or {}).get("profile_step")
        if windows and (tps is None or prof is not None):
            # an unfinished run, or a run with a profiled step (whose window the profiler slows): the windows after
            # the first without the profiled one, as train.py's summary counts them
            steady = [w for w in windows[1:] if prof is None or not (w["step"] - w["steps"] <= prof < w["step"])]
            steady = steady or windows[1:] or windows
            tps = sum(w["steps"] for w in steady) * log["tokens_per_rank_per_step"] / sum(w["seconds"] for w in steady)
        mem, kind = summary.get("max_memory_gib"), "gpu"
        if mem is None and windows and windows[-1].get("max_memory_gib") is not None:  # unfinished: rank 0's
            mem, kind = max(w.get("max_memory_gib") or 0.0 for w in windows), "gpu_rank0"  # peaks in its windows
        if mem is None:
            mem, kind = summary.get("max_rss_gib"), "host_rss"
        if mem is None:
            kind = None
        runs.append(
            {
                "label": run_label(log),
                "variant": log.get("variant"),
                "path": str(path),
                "preset": log.get("preset"),
                "device": log.get("device"),
                "device_type": log.get("device_type"),
                "world_size": log.get("world_size"),
                "ep": log.get("ep"),
                "steps": list(range(1, len(loss) + 1)),
                "loss": loss,
                "aux_loss": log.get("aux_loss") or [],
                "tokens_per_sec_per_gpu": tps,
                "memory_gib": mem,
                "memory_kind": kind,
                "final_loss": summary.get("final_loss"),
                "mean_loss_last_50": summary.get("mean_loss_last_50"),
            }
        )
    _make_unique(runs, lambda r: f" [{Path(r['path']).stem}]")
    _make_unique(runs, lambda r: "")  # the same file twice: numbered
    return runs


def _make_unique(runs: list[dict], suffix) -> None:
    """Append ``suffix(run)`` to every label that more than one run has (then " #n" if still repeated)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    for same in groups.values():
        if len(same) > 1:
            extra = [suffix(r) for r in same]
            numbered = len(set(extra)) < len(extra)
            for n, (r, e) in enumerate(zip(same, extra, strict=True), 1):
                r["label"] += e + (f" #{n}" if numbered else "")


def smooth(values: list[float], n: int) -> list[float]:
    """Trailing mean over up to ``n`` values (non-finite values skipped; NaN when a window has none)."""
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - n + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="train.py JSON logs")
    p.add_argument("--out-dir", default=None, help="where the PNGs go (default: the first log's folder)")
    p.add_argument("--prefix", default="train", help="file name prefix (default: train)")
    p.add_argument("--smooth", type=int, default=1, help="trailing mean over N steps for the loss lines (default 1)")
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error(f"argument --smooth: must be >= 1, got {args.smooth}")
    try:
        runs = load_runs(args.logs)
    except ValueError as e:
        p.error(str(e))
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit(
            "plot_train.py needs matplotlib: pip install -e '.[train]' (or pip install matplotlib)"
        ) from None

    out_dir = Path(args.out_dir) if args.out_dir else Path(args.logs[0]).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    title = ", ".join(sorted({f"{r['preset']} on {r['world_size']}x {r['device']} (ep={r['ep']})" for r in runs}))

    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    wide = max(len(r["label"]) for r in runs)  # the legend goes right of the axes: widen the figure for it
    fig, ax = plt.subplots(figsize=(9 + min(wide, 60) * 0.07, max(5, 0.22 * len(runs) + 1)))
    for r in runs:
        if args.smooth > 1:
            (line,) = ax.plot(r["steps"], r["loss"], alpha=0.25, linewidth=0.8)
            ax.plot(r["steps"], smooth(r["loss"], args.smooth), color=line.get_color(), label=r["label"])
        else:
            ax.plot(r["steps"], r["loss"], label=r["label"])
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("training loss (cross-entropy, nats/byte)")
    smoothed = f" (mean over {args.smooth} steps)" if args.smooth > 1 else ""
    ax.set_title(f"loss vs step: {title}{smoothed}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8 if len(runs) <= 12 else 6, borderaxespad=0)
    fig.tight_layout()
    loss_png = out_dir / f"{args.prefix}_loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    # horizontal bars, one row per run (first run on top): long labels and many runs stay readable
    height = max(4.5, 0.3 * len(runs) + 1.5)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12 + min(wide, 60) * 0.05, height), sharey=True)
    labels = [r["label"] for r in runs]
    rows = list(range(len(runs)))
    colors = [f"C{i % 10}" for i in rows]
    per = "rank" if runs and all(r["device_type"] == "cpu" for r in runs) else "GPU"
    tps = [r["tokens_per_sec_per_gpu"] or 0.0 for r in runs]
    bars = ax_t.barh(rows, tps, color=colors)
    ax_t.bar_label(bars, labels=[f"{v:,.0f}" for v in tps], fontsize=7, padding=2)
    ax_t.set_xlabel(f"tokens / s / {per} (first logging window excluded)")
    ax_t.set_title("throughput", fontsize=9)
    ax_t.set_yticks(rows, labels, fontsize=8 if len(runs) <= 12 else 6)
    ax_t.invert_yaxis()
    mem = [r["memory_gib"] or 0.0 for r in runs]
    kinds = {r["memory_kind"] for r in runs if r["memory_kind"]}
    bars = ax_m.barh(rows, mem, color=colors)
    ax_m.bar_label(bars, labels=[f"{v:.2f}" for v in mem], fontsize=7, padding=2)
    what = {
        "gpu": "GPU allocator peak, max over ranks",
        "gpu_rank0": "rank 0's (unfinished run)",
        "host_rss": "host peak RSS, max over ranks",
    }
    ax_m.set_xlabel("peak memory (GiB)")
    ax_m.set_title("peak memory: " + " / ".join(what[k] for k in sorted(kinds)), fontsize=9)
    for a, vals in ((ax_t, tps), (ax_m, mem)):
        a.set_xlim(0, max(vals + [1e-9]) * 1.18)  # room for the value labels
        a.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tput_png = out_dir / f"{args.prefix}_throughput.png"
    fig.savefig(tput_png, dpi=120)
    plt.close(fig)
    for f in (loss_png, tput_png):
        print(f"wrote {f}")
    return [loss_png, tput_png]


if __name__ == "__main__":
    main()
