"""Token transport between EP ranks: layout, dispatch, combine.

One interface (:class:`Transport`) with one folder or module per implementation: :data:`REFERENCE`
(:mod:`.reference`: pure PyTorch over ``torch.distributed.all_to_all_single``, the specification; it also serves
``transport="nccl"``) and :data:`CUDA` (:mod:`.nvshmem`: NVSHMEM kernels, one node, its ``Buffer``). The layer reads
``TRANSPORTS[cfg.transport]``; a new transport is a sibling implementing :class:`Transport` plus one entry there. Use
either through :func:`dispatch` / :func:`combine` (``transport=``); the NVSHMEM runtime is created first with
``moe_ep.transport.nvshmem.buffer.init_runtime`` (or ``Buffer.for_group``). GPU packages are imported lazily.
"""

from .autograd import Transport, combine, dispatch
from .handle import EPHandle
from .nvshmem.buffer import CUDA, CudaTransport
from .nvshmem.schedule import TransportSchedule
from .reference import REFERENCE, RecvBuffers, ReferenceTransport, build_layout, dispatch_send

# The transports by MoEConfig.transport name. "nccl" is the reference transport on the EP group's own backend
# (torch.distributed all_to_all with host-synced splits: works across nodes).
TRANSPORTS: dict[str, Transport] = {"nvshmem": CUDA, "nccl": REFERENCE}

__all__ = [
    "TRANSPORTS",
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
