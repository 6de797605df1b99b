"""What the launch/ scripts tell a user on a CPU machine (launch/train_checks.py and its callers), cheaply: argument
errors once from rank 0, the CPU preset note and the cost warning of a big preset, ``--transport`` on CPU,
``--no-progress`` log lines, an unwritable ``--log-json`` found by every rank before training, plot_train.py's
errors on missing / non-JSON logs, device_harness.py's unknown steps."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests.test_train import PLOT, REPO, TRAIN, _script

sys.path.insert(0, str(REPO / "launch"))
import train_checks  # noqa: E402

HARNESS = REPO / "launch" / "device_harness.py"


def _parse(train, monkeypatch, argv: list[str], world: int = 2):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return train.parse_args(argv)


def test_argument_error_is_one_line_from_rank_0_only(monkeypatch, capsys) -> None:
    """Rank 0 prints one short line (no usage block), the other ranks nothing; every rank exits with code 2."""
    train = _script(TRAIN)
    monkeypatch.setattr(train_checks.time, "sleep", lambda s: None)  # the other ranks' grace period
    for rank, want_lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            _parse(train, monkeypatch, ["--ep", "3"])
        assert exc.value.code == 2
        out = capsys.readouterr()
        lines = out.err.splitlines()
        assert len(lines) == want_lines and out.out == "", (rank, out)
        if want_lines:
            assert lines[0].startswith(f"{Path(sys.argv[0]).name}: error: argument --ep: 3 does not divide"), lines
            assert "--help lists the arguments" in lines[0] and "usage:" not in out.err


def test_cpu_preset_note_and_cost(monkeypatch, capsys) -> None:
    """On CPU: no --preset runs tiny and says so; an explicit GPU preset warns with its memory and time per step
    (the estimate reproduces the measured small run within 15 %: 10.7 GiB, 29 tokens/s per rank on 2 ranks); an
    explicit --transport warns that it does not apply; an explicit tiny says nothing."""
    monkeypatch.delenv("RANK", raising=False)
    train = _script(TRAIN)
    a = _parse(train, monkeypatch, [])
    assert a.preset == "tiny" and "running preset 'tiny'" in capsys.readouterr().out
    small = _parse(train, monkeypatch, ["--preset", "small"])
    out = capsys.readouterr().out
    assert out.startswith("WARNING: --preset small on CPU") and "GiB of memory per rank" in out and "s per step" in out
    gib, sec = train_checks.cpu_cost(small, 2)
    assert gib == pytest.approx(10.7, rel=0.15)
    assert small.batch_size * small.seq_len / sec == pytest.approx(29, rel=0.15)  # tokens/s per rank
    medium = _parse(train, monkeypatch, ["--preset", "medium"])
    gib_m, sec_m = train_checks.cpu_cost(medium, 2)
    assert gib_m > 5 * gib and sec_m > 10 * sec and f"~{gib_m:.0f} GiB" in capsys.readouterr().out
    _parse(train, monkeypatch, ["--preset", "tiny", "--transport", "nccl"])
    out = capsys.readouterr()
    assert out.out == "" and "WARNING: --transport nccl" in out.err and "gloo" in out.err


def test_no_progress_prints_log_lines(capsys) -> None:
    """--no-progress: no bar, one ``step i/N ...`` line per logging point; other ranks print nothing."""
    train = _script(TRAIN)
    p = train.Progress(4, enabled=True, bar=False)
    p.update(2, "loss 5.0 tok/s/rank 100")
    p.update(4, "loss 4.0 tok/s/rank 110")
    p.close()
    want = ["step 2/4 loss 5.0 tok/s/rank 100", "step 4/4 loss 4.0 tok/s/rank 110"]
    assert capsys.readouterr().out.splitlines() == want
    train.Progress(4, enabled=False, bar=False).update(2, "x")
    assert capsys.readouterr().out == ""


def test_log_path_check(tmp_path: Path) -> None:
    """log_path_error: a writable path is None and leaves nothing behind (its folders are made); a folder, a path
    under a file, or one in a folder that cannot be written name the path."""
    ok = tmp_path / "new" / "dir" / "log.json"
    assert train_checks.log_path_error(str(ok)) is None and not ok.exists() and ok.parent.is_dir()
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert train_checks.log_path_error(str(existing)) is None and existing.read_text() == "{}"
    assert "is a directory" in train_checks.log_path_error(str(tmp_path))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    err = train_checks.log_path_error(str(a_file / "log.json"))
    assert err.startswith("argument --log-json: cannot write") and "is a file, not a folder" in err


def _bad_log_rank(rank: int, world: int, log: str) -> None:
    """train.main on every rank with rank 0's log under a file: every rank exits with code 2 before any step,
    rank 0 naming the path, after a clean teardown (no rank left in a collective)."""
    train = _script(TRAIN)
    err = io.StringIO()
    argv = ["--steps", "2", "--no-progress", "--data-bytes", "100000", "--log-json", log]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    if rank == 0:
        assert f"error: argument --log-json: cannot write {log}" in err.getvalue(), err.getvalue()
    else:
        assert "error" not in err.getvalue(), err.getvalue()
    assert not torch.distributed.is_initialized()  # finish() ran on every rank


def test_unwritable_log_json_stops_every_rank_before_training(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    run_distributed(_bad_log_rank, 2, str(a_file / "log.json"))
    assert a_file.read_text() == ""


def test_plot_train_errors_name_the_file(tmp_path: Path, capsys) -> None:
    """A missing file or a non-JSON file: load_runs raises ValueError naming it; main exits with code 2 and that
    message (before matplotlib is needed)."""
    plot = _script(PLOT)
    text = tmp_path / "notes.txt"
    text.write_text("loss went down\n")
    for path, words in ((tmp_path / "missing.json", "no such file"), (text, "not JSON")):
        with pytest.raises(ValueError, match=words) as e:
            plot.load_runs([path])
        assert str(path) in str(e.value)
        with pytest.raises(SystemExit) as exc:
            plot.main([str(path), "--out-dir", str(tmp_path / "png")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {path}: {words}" in err, err
    assert not (tmp_path / "png").exists()


def test_device_harness_rejects_an_unknown_step(tmp_path: Path) -> None:
    """--only / --skip with a step that does not exist here: exit code 2 naming it and listing the valid steps,
    nothing run and no output folder made."""
    for flag in ("--only", "--skip"):
        out = tmp_path / f"out{flag}"
        r = subprocess.run(
            [sys.executable, str(HARNESS), flag, "env,nosuch", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"argument {flag}: unknown step nosuch;" in r.stderr and "env, gpu_tests" in r.stderr, r.stderr
        assert "[harness]" not in r.stdout and not out.exists()
