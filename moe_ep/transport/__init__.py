"""Token transport between EP ranks: layout, dispatch, combine.

One interface (:class:`Transport`) with two implementations: :data:`REFERENCE` (pure PyTorch over
``torch.distributed.all_to_all_single``, the specification) and :data:`CUDA` (NVSHMEM kernels, one node). Use either
through :func:`dispatch` / :func:`combine` (``transport=``); the CUDA runtime is created first with
``moe_ep.transport.nvshmem.buffer.init_runtime``. GPU packages are imported lazily.
"""

from .autograd import Transport, combine, dispatch
from .nvshmem.buffer import CUDA, CudaTransport
from .handle import EPHandle
from .reference import REFERENCE, RecvBuffers, ReferenceTransport, build_layout, dispatch_send
from .nvshmem.schedule import TransportSchedule

__all__ = [
    "CUDA",
    "REFERENCE",
    "CudaTransport",
    "EPHandle",
    "RecvBuffers",
    "ReferenceTransport",
    "Transport",
    "TransportSchedule",
    "build_layout",
    "combine",
    "dispatch",
    "dispatch_send",
]
