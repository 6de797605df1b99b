"""Temporary overrides of the ``MOE_EP_*`` environment switches (the kernels' launchers read them at every call)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def env_override(env: dict[str, str]) -> Iterator[None]:
    """Set the variables of ``env`` for the ``with`` block and restore the previous values (or absence) after.

    Example: ``with env_override({"MOE_EP_DISPATCH_PIECES": "1"}): ...`` -- the switch holds inside the block only.
    Multi-rank code must enter the same override on every rank (the transport assumes identical settings).
    """
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
