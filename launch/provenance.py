"""Which code produced a result: the one helper every benchmark, the harness and the training log call."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def code_version(repo: Path | str = _REPO) -> str:
    """``$MOE_EP_COMMIT`` if set, else git HEAD of ``repo`` (``-dirty`` when tracked files changed), else "unknown".

    The environment variable comes first: the copy of the tree that reaches a GPU machine may carry git metadata
    from an older commit (results of one session were all stamped with the session's first HEAD that way), so
    the device command states the commit it runs.
    """
    env = os.environ.get("MOE_EP_COMMIT")
    if env:
        return env
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, timeout=10)
        head = run("rev-parse", "HEAD")
        if head.returncode:
            return "unknown"
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
