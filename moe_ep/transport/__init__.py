"""Token transport between EP ranks: layout, dispatch, combine (reference over torch.distributed)."""

from .autograd import combine, dispatch
from .handle import EPHandle
from .reference import RecvBuffers, build_layout, dispatch_send

__all__ = ["EPHandle", "RecvBuffers", "build_layout", "combine", "dispatch", "dispatch_send"]
