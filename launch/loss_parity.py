"""Loss parity of the recipes: several seeds of every variant, trained the same way, compared on held-out loss.

    python3 launch/loss_parity.py --out DIR [--variants mxfp8,blockwise,bf16,torchtitan] [--seeds 0,1,2]
        [--parallel 6] [--repeat] -- <launch/train.py arguments shared by every run>

Each run is ``launch/train.py --deterministic --seed S --log-json DIR/<variant>_seed<S>.json`` on one process (runs
go ``--parallel`` at a time on the machine's first GPU, or on the CPU). ``--repeat`` runs seed 0 of every variant a
second time and checks that the two logs' losses are bitwise equal (reproducibility). Writes DIR/loss_parity.json:
``{"meta": {...}, "variants": {name: {"seeds", "eval_loss", "mean", "std"}}, "parity": {name: {...}}}``; an FP8
variant has parity when its mean held-out loss is within 1% of bf16's and within the bf16 seeds' spread (mean +- max
deviation of the bf16 seeds from their mean).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANT_ARGS = {
    "mxfp8": ["--recipe", "mxfp8"],
    "blockwise": ["--recipe", "blockwise"],
    "bf16": ["--recipe", "bf16"],
    "torchtitan": ["--baseline", "torchtitan"],
}


def _cmd(variant: str, seed: int, log: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
            str(ROOT / "launch" / "train.py"), *VARIANT_ARGS[variant], "--seed", str(seed), "--deterministic",
            "--no-progress", "--log-json", str(log), *extra]  # fmt: skip


def run_all(jobs: list[tuple[str, list[str], Path]], parallel: int, timeout_s: float) -> dict[str, int]:
    """Run (name, cmd, log file) jobs, ``parallel`` at a time; name -> exit status. Past ``timeout_s`` the running
    jobs are killed (status -9) and the pending ones are not started (status None)."""
    pending, running, rc = list(jobs), [], {}
    deadline = time.time() + timeout_s
    while pending or running:
        if time.time() > deadline:
            for name, p in running:
                p.kill()
                rc[name] = -9
            rc.update({name: None for name, _, _ in pending})
            break
        while pending and len(running) < parallel:
            name, cmd, out = pending.pop(0)
            running.append((name, subprocess.Popen(cmd, cwd=ROOT, stdout=out.open("w"), stderr=subprocess.STDOUT)))
        for name, p in list(running):
            if p.poll() is not None:
                rc[name] = p.returncode
                running.remove((name, p))
        time.sleep(0.5)
    return rc


def summarize(logs: dict[tuple[str, int], dict]) -> dict:
    """Per variant: seeds, held-out losses, mean and (population) std; parity of each variant against bf16."""
    variants: dict[str, dict] = {}
    for (v, seed), log in sorted(logs.items()):
        e = variants.setdefault(v, {"seeds": [], "eval_loss": [], "eval_curves": [], "train_loss": []})
        e["seeds"].append(seed)
        e["eval_loss"].append(log["summary"]["eval_loss"])
        e["eval_curves"].append([[p["step"], p["loss"]] for p in log["eval"]])  # [step, held-out loss] per eval
        e["train_loss"].append(log["loss"])
    for e in variants.values():
        xs = e["eval_loss"]
        e["mean"] = sum(xs) / len(xs)
        e["std"] = math.sqrt(sum((x - e["mean"]) ** 2 for x in xs) / len(xs))
    parity: dict[str, dict] = {}
    ref = variants.get("bf16")
    if ref:
        spread = max(abs(x - ref["mean"]) for x in ref["eval_loss"])
        for v, e in variants.items():
            rel = (e["mean"] - ref["mean"]) / ref["mean"]
            near = abs(e["mean"] - ref["mean"]) <= spread
            parity[v] = {"rel_vs_bf16": rel, "within_1pct": abs(rel) <= 0.01, "within_bf16_spread": near}
    return {"variants": variants, "parity": parity}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default=",".join(VARIANT_ARGS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--repeat", action="store_true", help="run seed 0 of every variant twice and compare bitwise")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for all runs (then summarize what finished)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANT_ARGS]
    if bad:
        p.error(f"unknown variants {bad}; known: {sorted(VARIANT_ARGS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for seed in seeds:
        for v in variants:
            jobs.append(
                (f"{v}_seed{seed}", _cmd(v, seed, out / f"{v}_seed{seed}.json", extra), out / f"{v}_seed{seed}.txt")
            )
    if args.repeat:
        for v in variants:
            log = out / f"{v}_seed{seeds[0]}_repeat.json"
            jobs.append((f"{v}_seed{seeds[0]}_repeat", _cmd(v, seeds[0], log, extra), out / f"{v}_repeat.txt"))
    t0 = time.time()
    rc = run_all(jobs, args.parallel, args.timeout)
    logs = {}
    for v in variants:
        for s in seeds:
            f = out / f"{v}_seed{s}.json"
            if rc.get(f"{v}_seed{s}") == 0 and f.exists():
                logs[(v, s)] = json.loads(f.read_text())
    res = summarize(logs)
    if "bf16" in res["variants"]:
        res["bf16_spread"] = max(abs(x - res["variants"]["bf16"]["mean"]) for x in res["variants"]["bf16"]["eval_loss"])
    if args.repeat:
        res["reproducible"] = {}
        for v in variants:
            a, b = out / f"{v}_seed{seeds[0]}.json", out / f"{v}_seed{seeds[0]}_repeat.json"
            if a.exists() and b.exists():
                la, lb = json.loads(a.read_text()), json.loads(b.read_text())
                res["reproducible"][v] = la["loss"] == lb["loss"] and la["eval"] == lb["eval"]
    first = next(iter(logs.values()), {})
    res["meta"] = {"device": first.get("device"), "commit": first.get("git_commit"), "torch": first.get("torch"),
                   "steps": len(first.get("loss", [])), "train_args": extra, "seconds": time.time() - t0,
                   "exit_codes": rc, "rule": "parity: |mean - bf16 mean| <= 1% of bf16's mean and <= the largest "
                   "deviation of a bf16 seed from the bf16 mean"}  # fmt: skip
    res = {"meta": res.pop("meta"), **res}
    (out / "loss_parity.json").write_text(json.dumps(res, indent=1))
    for v, e in res["variants"].items():
        par = res["parity"].get(v, {})
        print(f"{v:12s} eval {e['mean']:.4f} +- {e['std']:.4f}  {par}", flush=True)
    print(f"reproducible: {res.get('reproducible')}", flush=True)
    return 0 if all(c == 0 for c in rc.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
