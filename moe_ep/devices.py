"""Why CUDA cannot be used here, in words a user can act on (no GPU packages imported).

:func:`cuda_unavailable_reason` names the real blocker (a CPU-only torch build, or no visible GPU);
:func:`check_device` turns a ``device="cuda"`` request on such a machine into an error that says what to do instead
of torch's bare "Torch not compiled with CUDA enabled".
"""

from __future__ import annotations

import torch


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable, else why not: a CPU-only torch build, or no GPU visible to a CUDA build."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None); a GPU needs a CUDA "
            "build of torch on a machine with an NVIDIA GPU"
        )
    return (
        f"no CUDA GPU is visible (torch {torch.__version__}, CUDA {torch.version.cuda}: torch.cuda.is_available() is "
        "False; check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    )


def check_device(device, what: str) -> None:
    """Raise RuntimeError when ``device`` (anything ``torch.device`` takes, or None) asks for CUDA that is not here.

    what: the call to name in the message, e.g. ``"MoE(device='cuda')"``."""
    if device is None or torch.device(device).type != "cuda":
        return
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"{what}: {reason}. On this machine use device='cpu' (or leave device out): backend 'auto' then runs the "
            "pure-PyTorch reference path"
        )
