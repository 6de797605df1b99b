"""tests/multigpu/_cases.py (the torchrun scripts' verdict loop) over gloo: every rank gets the same counts; the
cuda layer's torchrun scripts import on CPU and list their cases (``--list``: no GPU, no process group)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests._dist import run_distributed
from tests.multigpu._cases import run_cases


def _ok() -> None:
    pass


def _ranks(rank: int, world: int) -> None:
    def fails_on_rank1() -> None:
        if rank == 1:
            raise AssertionError("only rank 1 fails")

    def fails_everywhere() -> None:
        raise RuntimeError("boom")

    got = run_cases([("ok", _ok), ("one rank", fails_on_rank1), ("all ranks", fails_everywhere), ("ok2", _ok)], "cpu")
    assert got == (2, 2), f"rank {rank}: {got}"  # the rank-1-only failure counts as a failure on rank 0 too


def test_verdicts_agree_across_ranks():
    run_distributed(_ranks, 2)


REPO = Path(__file__).resolve().parents[1]
# the scripts of tests/multigpu/_moe_cuda.py's driver -> their number of cases (any world size)
LISTED = {"moe_cuda_layer": 35, "moe_cuda_fsdp": 7, "moe_cuda_graph": 17, "hf_cuda": 14}
_LIST = """
import contextlib, io, json, os, runpy, sys
out, scripts = {}, sys.argv[1:]
for world in (2, 4):
    os.environ["WORLD_SIZE"] = str(world)
    for name in scripts:
        sys.argv[1:] = ["--list"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path(f"tests/multigpu/{name}.py", run_name="__main__")
                code = None
            except SystemExit as exc:
                code = exc.code
        out[f"{name} {world}"] = [code, buf.getvalue().splitlines()]
print(json.dumps(out))
"""


def test_cuda_scripts_list_their_cases_on_cpu():
    """One CPU process runs each script with --list for 2 and 4 ranks: exit 0, the expected number of distinct case
    names, no name in two scripts, the missing-peer case (it breaks the runtime) last, the dp x ep mesh named by
    world / 2."""
    r = subprocess.run(
        [sys.executable, "-c", _LIST, *LISTED], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    for world in (2, 4):
        seen: set[str] = set()
        for name, count in LISTED.items():
            code, names = got[f"{name} {world}"]
            assert code == 0, (name, world, code)
            assert len(names) == count and len(set(names)) == count, (name, world, names)
            assert not seen & set(names), (name, sorted(seen & set(names)))
            seen |= set(names)
        graph = got[f"moe_cuda_graph {world}"][1]
        assert graph[-1] == "a missing peer raises a timeout instead of hanging (last)", graph[-1]
        mesh = [n for n in got[f"moe_cuda_layer {world}"][1] if n.startswith("layer on a dp x ep mesh")]
        assert mesh == [f"layer on a dp x ep mesh (ep={world // 2}), 16 experts top_k 4, H=384 F=192"], mesh
