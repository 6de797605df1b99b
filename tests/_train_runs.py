"""launch/train.py runs for tests/test_train.py: each distinct run launched once per session, as a user would
(torchrun for several processes, plain ``python launch/train.py`` for one), and the planned ones started in the
background as soon as collection ends.

A run is keyed by (processes, default-log variant or None, arguments). Tests that compare against the same run share
it; the runs a selected test needs (its module's ``PREFETCH``) start on one background worker while the other test
files run, so on 2 CPU cores the launches (mostly interpreter and torch start-up, one core each) overlap the
single-process tests instead of following them. What each test asserts is unchanged: it still reads the logs of
runs with exactly its arguments. CPU training is deterministic, so a run's log does not depend on when it ran.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "launch" / "train.py"
# CUDA_VISIBLE_DEVICES="": the CPU/gloo path even on a GPU machine; one thread per rank (2-core CI).
ENV = dict(
    os.environ,
    CUDA_VISIBLE_DEVICES="",
    OMP_NUM_THREADS="1",
    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
)
TIMEOUT_S = 300

Key = tuple  # (nproc, default_log or None, *args)


class RunResult:
    """A finished launch: return code, output, and where its log is (the file, or the folder of the default log)."""

    def __init__(self, returncode: int, stdout: str, stderr: str, where: Path) -> None:
        self.returncode, self.stdout, self.stderr, self.where = returncode, stdout, stderr, where


class TrainRuns:
    """The session's train.py runs: ``get(key)`` returns a run's result, launching it if nobody did yet."""

    def __init__(self) -> None:
        self._futures: dict[Key, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._dir: Path | None = None

    def _workdir(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="moe_ep_train_runs_"))
            atexit.register(shutil.rmtree, self._dir, True)
        return self._dir

    def _launch(self, key: Key, where: Path) -> RunResult:
        nproc, default_log, *args = key
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        log = where / "log.json"
        cmd = [
            *(launcher if nproc > 1 else [sys.executable]),
            str(TRAIN),
            "--preset",
            "tiny",
            "--no-progress",
            "--data-bytes",
            "4000000",
            *(["--log-json", str(log)] if default_log is None else []),
            *args,
        ]
        cwd = REPO if default_log is None else where
        try:
            p = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = 124, str(e.stdout or ""), f"{e.stderr or ''}\n[timed out after {TIMEOUT_S} s]"
        return RunResult(rc, out, err, log if default_log is None else where)

    def _future(self, key: Key, background: bool) -> Future:
        with self._lock:
            fut = self._futures.get(key)
            # a background run still queued behind others: a test waiting for it runs it itself, now
            if fut is not None and not (not background and fut.cancel()):
                return fut
            where = Path(tempfile.mkdtemp(dir=self._workdir()))
            if background:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train_runs")
                fut = self._pool.submit(self._launch, key, where)
            else:
                fut = Future()
            self._futures[key] = fut
        if not background:  # run it here, now (outside the lock: other keys may be asked for meanwhile)
            try:
                fut.set_result(self._launch(key, where))
            except BaseException as e:  # noqa: BLE001  (hand the failure to whoever waits on it)
                fut.set_exception(e)
        return fut

    def prefetch(self, keys: list[Key]) -> None:
        """Start ``keys`` (in order, one at a time) in the background."""
        for key in keys:
            self._future(key, background=True)

    def get(self, key: Key) -> RunResult:
        """The result of run ``key``: waits for it when it was started, else runs it now."""
        return self._future(key, background=False).result(timeout=3 * TIMEOUT_S)


RUNS = TrainRuns()


def prefetch_for(items) -> None:
    """Start in the background the runs of the collected ``items`` (pytest items) whose module lists them in
    ``PREFETCH`` ({test function name: [keys]}, longest runs first): in that order, each once."""
    selected: dict[int, tuple[dict, set]] = {}
    for item in items:
        plan = getattr(getattr(item, "module", None), "PREFETCH", None)
        name = getattr(item, "originalname", None) or item.name
        if plan and name in plan:
            selected.setdefault(id(plan), (plan, set()))[1].add(name)
    for plan, names in selected.values():
        keys: list[Key] = []
        for test, test_keys in plan.items():
            keys += [k for k in test_keys if test in names and k not in keys]
        RUNS.prefetch(keys)
