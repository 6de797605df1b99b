"""Device harness: every GPU test and benchmark in one call, one summary JSON and one log under $OUT.

    python launch/device_harness.py [--out DIR] [--only step,step] [--skip step,step] [--train-steps 50]

Steps (each a subprocess with its own timeout; a failing step does not stop the others):
  env          GPU, driver, torch / CuPy / nvshmem4py versions
  gpu_tests    pytest -m gpu (single-GPU kernel tests vs the reference; skip markers on CPU)
  ep_reference torchrun over all GPUs: the EP layer tests over nccl, reference backend
  ep_nvshmem_N torchrun on 2 and on all GPUs: the NVSHMEM transport vs the reference transport
  moe_cuda_{layer,fsdp,graph}_N  torchrun on 2 and on all GPUs: the MoE layer's cuda backend (both transports) vs
               the reference (tests/multigpu/moe_cuda_layer.py, moe_cuda_fsdp.py, moe_cuda_graph.py)
  train        torchrun launch/train.py for --train-steps steps (tokens/sec/GPU)
  bench_*      every single-process benchmarks/bench_*.py with --json (each checks correctness before timing)
  bench_layer  torchrun on all GPUs: benchmarks/bench_layer.py --out bench_layer.json (the whole layer)
The summary holds each step's status, seconds, the last lines of its output and any JSON it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git_commit() -> str:
    sys.path.insert(0, str(ROOT))
    from launch.provenance import code_version  # noqa: PLC0415

    return code_version(ROOT)


def _num_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU"))
    except Exception:  # noqa: BLE001
        return 0


def _steps(args, out: Path, ngpu: int) -> list[tuple[str, list[str], dict, int, Path | None]]:
    py = sys.executable
    trun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpu}"]
    trun2 = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env_ref = {"MOE_EP_FORCE_REFERENCE": "1"}
    steps = [
        (
            "env",
            [
                py,
                "-c",
                (
                    "import torch,importlib.util as u;print('torch',torch.__version__,'cuda',torch.version.cuda);"
                    "print([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]);"
                    "print({m: u.find_spec(m) is not None for m in ('cupy','nvshmem','triton')})"
                ),
            ],
            {},
            120,
            None,
        ),
        ("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"], {}, 900, None),
        ("ep_reference", [*trun, "tests/multigpu/ep_reference.py"], env_ref, 900, None),
        ("ep_nvshmem_2", [*trun2, "tests/multigpu/ep_nvshmem.py"], {}, 600, None),
        (f"ep_nvshmem_{ngpu}", [*trun, "tests/multigpu/ep_nvshmem.py"], {}, 600, None),
        *[
            (f"moe_cuda_{part}_{n}", [*t, f"tests/multigpu/moe_cuda_{part}.py"], {}, 600, None)
            for n, t in ((2, trun2), (ngpu, trun))
            for part in ("layer", "fsdp", "graph")
        ],
        (
            "train",
            [
                *trun,
                "launch/train.py",
                "--steps",
                str(args.train_steps),
                "--preset",
                "small",
                "--log-json",
                str(out / "train.json"),
            ],
            {},
            1200,
            out / "train.json",
        ),
    ]
    if ngpu < 2:
        steps = [s for s in steps if not s[0].startswith(("ep_", "moe_cuda_", "train"))]
    elif ngpu == 2:  # the ep_nvshmem / moe_cuda_* pairs are both named *_2: keep one of each
        names: set[str] = set()
        steps = [s for s in steps if not (s[0] in names or names.add(s[0]))]
    for bench in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        if bench.stem == "bench_layer":  # a torchrun benchmark: its own step below
            continue
        js = out / f"{bench.stem}.json"
        cmd = [py, str(bench.relative_to(ROOT)), "--json", str(js)]
        steps.append((bench.stem, cmd, {}, 1200, js))
    if ngpu >= 2:  # (bench_layer needs more than one GPU)
        js = out / "bench_layer.json"
        steps.append(("bench_layer", [*trun, "benchmarks/bench_layer.py", "--out", str(js)], {}, 1200, js))
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "harness_out"))
    p.add_argument("--only", default="", help="comma-separated step names to run")
    p.add_argument("--skip", default="", help="comma-separated step names to skip")
    p.add_argument("--train-steps", type=int, default=50)
    p.add_argument("--max-step-s", type=int, default=0, help="cap every step's timeout (0: per-step defaults)")
    args = p.parse_args()
    out = Path(args.out)
    ngpu = _num_gpus()
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    valid = [s[0] for s in _steps(args, out, ngpu)]
    for flag, names in (("--only", only), ("--skip", skip)):
        unknown = sorted(names - set(valid))
        if unknown:  # a typo would otherwise run nothing (or everything) and still exit 0
            p.error(
                f"argument {flag}: unknown step {', '.join(unknown)}; the steps on this machine ({ngpu} GPUs): "
                f"{', '.join(valid)}"
            )
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "commit": _git_commit(),
        "num_gpus": ngpu,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "steps": {},
    }
    env_base = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    with open(out / "log.txt", "a") as log:
        for name, cmd, extra_env, timeout, js in _steps(args, out, ngpu):
            if (only and name not in only) or name in skip:
                continue
            log.write(f"\n===== {name}: {' '.join(cmd)}\n")
            log.flush()
            if args.max_step_s:
                timeout = min(timeout, args.max_step_s)
            t0 = time.time()
            try:
                r = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env={**env_base, **extra_env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=timeout,
                )
                rc, text = r.returncode, r.stdout
            except subprocess.TimeoutExpired as e:
                partial = e.stdout or ""
                text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
                rc, text = 124, text + f"\n[harness] TIMEOUT after {timeout}s"
            log.write(text)
            log.flush()
            rec = {
                "rc": rc,
                "ok": rc == 0,
                "seconds": round(time.time() - t0, 1),
                "tail": text.strip().splitlines()[-25:],
            }
            if js is not None and js.exists():
                try:
                    rec["json"] = json.loads(js.read_text())
                except json.JSONDecodeError as e:
                    rec["json_error"] = str(e)
            summary["steps"][name] = rec
            print(f"[harness] {name}: {'ok' if rc == 0 else f'FAILED rc={rc}'} ({rec['seconds']} s)", flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [n for n, r in summary["steps"].items() if not r["ok"]]
    print(f"[harness] {len(summary['steps']) - len(failed)} passed, {len(failed)} failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
