"""NVSHMEM runtime of the CUDA transport: one initialization per process, symmetric buffers, peer-pointer table.

* :func:`init_nvshmem` initializes NVSHMEM once per process from torch.distributed (call
  ``torch.cuda.set_device`` first): rank 0 creates the unique id, ``broadcast_object_list`` hands it to every rank,
  PE = global rank. ``NVSHMEM_DISABLE_NVLS=1`` is forced (NVLink multicast is never used). Finalized at exit
  (:func:`shutdown`, registered with ``atexit``; call it yourself before ``destroy_process_group`` to be tidy).
* :func:`init_runtime` returns the :class:`EPRuntime` of an EP process group, shared by every MoE layer of the
  process. Its configuration: the fused kernels' work split (``schedule``, a
  :class:`~moe_ep.transport.nvshmem.schedule.TransportSchedule`, agreed on by every EP rank) and the spin-wait timeout
  (``timeout_s``). It holds ONE symmetric byte region per rank (identical offsets on every rank) holding
      flags      [F_NUM][8] u64      written by peers (release/acquire; see kernels/transport/nvshmem/ep_sync.cuh)
      counts_in  [W][W + E] int32    count rows of every rank (layout exchange)
      disp_meta  [cap][3K] int32     received (local expert | weight bits | expanded row) per top-k slot
      disp_scale [cap][H/32] u8      received E8M0 scales
      disp_data  [cap][H * wire] u8  received e4m3 rows (or raw rows of `wire` bytes per element)
      comb_meta  [cap][K] fp32       returned top-k weight gradients (dispatch backward)
      comb_data  [cap][H * wire] u8  returned rows (combine)
      disp_flag  [cap][4] u64        per received row and column piece: epoch of the fused dispatch that completed it
      comb_flag  [cap][4] u64        per returned row and column piece: epoch of the fused combine that completed it
  with cap = ep_size * max_tokens_per_rank: each token reaches a rank at most once, so this is a true worst case.
  ``peers`` is a device int64 table of the region's address on every EP rank (nvshmem_ptr through
  ``get_peer_tensor``); kernels store through it. With ep_size 1 the region is ordinary device memory and
  NVSHMEM is not needed at all.
* Errors found on the GPU (invalid expert id, receive/expand overflow, a wait that timed out) are recorded in
  host-mapped pinned memory. :meth:`EPRuntime.raise_pending` reads it WITHOUT a CUDA sync and raises; every transport
  call runs it first, so an error surfaces at the first transport call issued after the faulty kernel has
  executed (typically the next call or the next step). :meth:`EPRuntime.check_errors` synchronizes the current
  stream first (tests, end of a step). Timeouts (per wait: ``init_runtime(..., timeout_s=...)``, else the
  ``MOE_EP_COMM_TIMEOUT_S`` environment variable, a debugging aid, else 60 s) are fatal: the runtime refuses
  further work.

Across nodes (peers without a peer pointer) a second implementation of the same kernels' interface would stage
rows locally and move them with ``nvshmemx_putmem_signal_on_stream``; see docs/design-transport.md.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from . import kernels
from .schedule import MAX_PIECES, TransportSchedule, agree

F_NUM = 6
MAX_RANKS = 8
MAX_EXPERTS = 1024
MAX_TOPK = 32
_ALIGN = 256

ERR_INVALID_EXPERT, ERR_RECV_OVERFLOW, ERR_EXPAND_OVERFLOW, ERR_TIMEOUT = 1, 2, 3, 4
DEFAULT_TIMEOUT_S = 60.0
_EPOCH_INDEX = {"layout": 0, "disp": 1, "comb": 2}
_FLAG_NAMES = ("LAYOUT_READY", "LAYOUT_FREE", "DISP_READY", "DISP_FREE", "COMB_READY", "COMB_FREE")

_state: dict = {"nvshmem": False, "runtimes": {}, "atexit": False}


class EPTransportError(RuntimeError):
    """An error detected on the GPU by the NVSHMEM transport (overflow, timeout)."""


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _nvshmem():
    try:
        import nvshmem.core as nvc  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("the CUDA transport needs nvshmem4py (pip install 'moe_ep[gpu]')") from e
    return nvc


def timeout_seconds(timeout_s: float | None = None) -> float:
    """The spin-wait timeout in seconds: ``timeout_s`` if given, else ``$MOE_EP_COMM_TIMEOUT_S``, else 60.

    Raises ValueError unless it is a finite number > 0.
    """
    src = "timeout_s"
    if timeout_s is None:
        raw = os.environ.get("MOE_EP_COMM_TIMEOUT_S", "")
        if not raw:
            return DEFAULT_TIMEOUT_S
        src = "MOE_EP_COMM_TIMEOUT_S"
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"MOE_EP_COMM_TIMEOUT_S={raw!r}: expected seconds (a number > 0)") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"{src}={timeout_s!r}: expected seconds (a number > 0)")
    return float(timeout_s)


def init_nvshmem(min_heap_bytes: int = 0) -> None:
    """Initialize NVSHMEM once per process (all ranks of the default group must call it together).

    ``min_heap_bytes``: raise ``NVSHMEM_SYMMETRIC_SIZE`` to at least this (plus slack) unless the user set it.
    """
    if _state["nvshmem"]:
        return
    if not dist.is_initialized():
        raise RuntimeError("init_nvshmem needs torch.distributed to be initialized (torchrun + init_process_group)")
    if not torch.cuda.is_available():
        raise RuntimeError("init_nvshmem needs CUDA (call torch.cuda.set_device(local_rank) first)")
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if min_heap_bytes and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        want = min_heap_bytes + (256 << 20)
        if want > (1 << 30):
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(-(-want // (64 << 20)) * (64 << 20))
    nvc = _nvshmem()
    from cuda.core import Device  # noqa: PLC0415

    dev = Device(torch.cuda.current_device())
    dev.set_current()
    rank, world = dist.get_rank(), dist.get_world_size()
    uid = nvc.get_unique_id(empty=rank != 0)
    payload = [uid._data.view(np.uint8).tobytes() if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    if rank != 0:
        uid._data.view(np.uint8)[:] = np.frombuffer(payload[0], dtype=np.uint8)
    nvc.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
    _state["nvshmem"] = True
    if not _state["atexit"]:
        atexit.register(shutdown)
        _state["atexit"] = True


def shutdown() -> None:
    """Free every runtime's symmetric memory and finalize NVSHMEM (collective; idempotent)."""
    rts = list(_state["runtimes"].values())
    _state["runtimes"].clear()
    if torch.cuda.is_available() and (rts or _state["nvshmem"]):
        torch.cuda.synchronize()  # NOTE: host sync (shutdown)
    for rt in rts:
        rt._free()
    if _state["nvshmem"]:
        _nvshmem().finalize()
        _state["nvshmem"] = False


@dataclass(frozen=True)
class RuntimeConfig:
    max_tokens_per_rank: int
    hidden: int
    top_k: int
    num_experts: int
    wire_bytes: int = 2  # bytes per element of raw (unquantized) payloads: 2 = bf16, 4 = fp32

    def covers(self, other: RuntimeConfig) -> bool:
        return all(getattr(self, f) >= getattr(other, f) for f in self.__dataclass_fields__)

    def union(self, other: RuntimeConfig) -> RuntimeConfig:
        return RuntimeConfig(*(max(getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__))


class EPRuntime:
    """Symmetric buffers, peer table, epochs and error state of one EP process group (see the module doc).

    ``schedule``: the fused kernels' work split (None: ``TransportSchedule()``, the defaults); ``timeout_s``: see
    :func:`timeout_seconds`. Create it through :func:`init_runtime` (collective when ep_size > 1).
    """

    def __init__(
        self, group, cfg: RuntimeConfig, schedule: TransportSchedule | None = None, timeout_s: float | None = None
    ) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.ep_size > MAX_RANKS:
            raise ValueError(f"the NVSHMEM transport supports up to {MAX_RANKS} EP ranks, got {self.ep_size}")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_ns = int(timeout_seconds(timeout_s) * 1e9)  # read by every kernel launch (ctl_args)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.broken: str | None = None
        self.sym: torch.Tensor | None = None
        self._symmetric = False
        self.err = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.ctr = torch.zeros(8, dtype=torch.int32, device=self.device)
        self.epochs = torch.zeros(len(_EPOCH_INDEX), dtype=torch.int64, device=self.device)  # completed uses per phase
        self.herr = torch.zeros(8, dtype=torch.int32, pin_memory=True)  # host-mapped (UVA): kernels store here
        self._herr_np = self.herr.numpy()
        self.cfg: RuntimeConfig | None = None
        self._allocate(cfg)
        self.schedule = agree(TransportSchedule() if schedule is None else schedule, group)

    def set_schedule(self, schedule: TransportSchedule) -> None:
        """Use ``schedule`` for the following fused dispatches / combines (collective: every rank, same value;
        raises on every rank if they differ). Stream order keeps kernels already enqueued on the old one."""
        self.schedule = agree(schedule, self.group)

    # ---------------------------------------------------------------------------------------------------- memory
    def _layout(self, cfg: RuntimeConfig) -> dict[str, int]:
        w, cap = self.ep_size, self.ep_size * cfg.max_tokens_per_rank
        sizes = [
            ("flags", F_NUM * MAX_RANKS * 8),
            ("counts", w * (w + cfg.num_experts) * 4),
            ("disp_meta", cap * 3 * cfg.top_k * 4),
            ("disp_scale", cap * (cfg.hidden // 32)),
            ("disp_data", cap * cfg.hidden * max(2, cfg.wire_bytes)),
            ("comb_meta", cap * cfg.top_k * 4),
            ("comb_data", cap * cfg.hidden * max(2, cfg.wire_bytes)),
            ("disp_flag", cap * 8 * MAX_PIECES),
            ("comb_flag", cap * 8 * MAX_PIECES),
        ]
        off, out = 0, {}
        for name, n in sizes:
            out[name] = off
            off += _align(n)
        out["total"] = off
        return out

    def _allocate(self, cfg: RuntimeConfig) -> None:
        if cfg.num_experts > MAX_EXPERTS or cfg.top_k > MAX_TOPK:
            raise ValueError(f"the transport supports num_experts <= {MAX_EXPERTS} and top_k <= {MAX_TOPK}")
        offs = self._layout(cfg)
        if self.ep_size == 1:
            self.sym = torch.zeros(offs["total"], dtype=torch.uint8, device=self.device)
            self.peers = torch.tensor([self.sym.data_ptr()], dtype=torch.int64, device=self.device)
        else:
            init_nvshmem(offs["total"])
            nvc = _nvshmem()
            self.sym = nvc.tensor((offs["total"],), dtype=torch.uint8)  # collective over all PEs
            self._symmetric = True
            self.sym.zero_()
            pes = dist.get_process_group_ranks(self.group)
            ptrs = []
            for r, pe in enumerate(pes):
                if r == self.rank:
                    ptrs.append(self.sym.data_ptr())
                    continue
                try:
                    p = nvc.get_peer_tensor(self.sym, pe).data_ptr()
                except Exception as e:  # noqa: BLE001
                    raise NotImplementedError(
                        f"EP rank {r} (PE {pe}) has no peer pointer (not NVLink/P2P reachable); peers across nodes "
                        "need the put_signal transport (docs/design-transport.md), not implemented yet"
                    ) from e
                if not p:
                    raise NotImplementedError(f"EP rank {r} (PE {pe}) has no peer pointer (across nodes?)")
                ptrs.append(p)
            self.peers = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
            torch.cuda.synchronize()  # NOTE: host sync (buffer allocation, once per size)
            dist.barrier()  # every region is zeroed before any peer writes a flag into it
        self.offsets = offs
        self.cfg = cfg
        self.epochs.zero_()
        self.ctr.zero_()

    def _free(self) -> None:
        if self.sym is not None and self._symmetric and _state["nvshmem"]:
            _nvshmem().free_tensor(self.sym)
        self.sym = None

    def ensure(self, cfg: RuntimeConfig) -> None:
        """Grow the buffers to cover ``cfg`` (collective: every rank must call it with the same config).

        Growing synchronizes the device (once, outside the steady state) and resets the epochs; CUDA graphs
        captured before a growth hold the old buffers' addresses and must be captured again.
        """
        if self.cfg is not None and self.cfg.covers(cfg):
            return
        new = cfg if self.cfg is None else self.cfg.union(cfg)
        torch.cuda.synchronize()  # NOTE: host sync (growing the buffers; not per step)
        self._free()
        self._allocate(new)

    def epoch_ptr(self, kind: str) -> np.uint64:
        """Device address of the completed-use count of phase ``kind`` ("layout", "disp" or "comb"): the kernels read
        their epoch there and the kernel that ends a use advances it (kernels/transport/nvshmem/ep_sync.cuh), so no
        launch argument carries an epoch and a captured CUDA graph replays correctly."""
        return np.uint64(self.epochs.data_ptr() + 8 * _EPOCH_INDEX[kind])

    def region(self, name: str) -> int:
        return self.offsets[name]

    # ---------------------------------------------------------------------------------------------------- errors
    def ctl_args(self) -> tuple:
        return (
            np.uint64(self.err.data_ptr()),
            np.uint64(self.herr.data_ptr()),
            np.uint64(self.ctr.data_ptr()),
            np.int64(self.timeout_ns),
        )

    def _message(self, code: int, a: int, b: int, c: int) -> str:
        if code == ERR_INVALID_EXPERT:
            return f"expert index out of range: topk_idx[{a}, {b}] = {c} (valid: [0, num_experts))"
        if code == ERR_RECV_OVERFLOW:
            return (
                f"receive buffer overflow: EP rank {a} would receive {b} rows > {c} = ep_size * "
                "max_tokens_per_rank (raise max_tokens_per_rank)"
            )
        if code == ERR_EXPAND_OVERFLOW:
            return (
                f"expand overflow: EP rank {a} gets {b} expanded (token, expert) rows > expand_capacity {c} "
                "(raise expand_capacity, or drop the rows past a capacity without an error: build_layout("
                "capacity=) / MoEConfig.capacity_factor; rows past it were dropped)"
            )
        if code == ERR_TIMEOUT:
            name = _FLAG_NAMES[a] if 0 <= a < len(_FLAG_NAMES) else str(a)
            return (
                f"timeout: EP rank {c} waited more than {self.timeout_ns / 1e9:g} s (init_runtime's timeout_s or "
                f"MOE_EP_COMM_TIMEOUT_S) for flag {name} of EP rank {b} (a peer died, hung, or called a different "
                "sequence of transport ops)"
            )
        return f"unknown transport error {code} ({a}, {b}, {c})"

    def raise_pending(self) -> None:
        """Raise the first error recorded by an already-executed kernel (no CUDA sync; host-mapped read)."""
        if self.broken:
            raise EPTransportError(f"NVSHMEM transport unusable after: {self.broken}")
        code = int(self._herr_np[0])
        if code == 0:
            return
        a, b, c = (int(v) for v in self._herr_np[1:4])
        msg = self._message(code, a, b, c)
        self._herr_np[:] = 0
        if code == ERR_TIMEOUT:
            self.broken = msg
            raise EPTransportError(msg)
        self.err[:1].zero_()  # stream-ordered re-arm of the device-side error election
        if code == ERR_INVALID_EXPERT:
            raise ValueError(msg)
        raise EPTransportError(msg)

    def check_errors(self) -> None:
        """Synchronize the current stream, then :meth:`raise_pending` (host sync: tests and step boundaries)."""
        torch.cuda.current_stream(self.device).synchronize()  # NOTE: host sync (tests, step boundaries)
        self.raise_pending()


def _key(group) -> tuple:
    return (group if group is not None else "single", torch.cuda.current_device())


def init_runtime(
    group,
    max_tokens_per_rank: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    wire_bytes: int = 2,
    *,
    schedule: TransportSchedule | None = None,
    timeout_s: float | None = None,
) -> EPRuntime:
    """The runtime of ``group`` (None: one rank owns every expert), created or grown to cover the sizes.

    Collective over every rank of the default group when ep_size > 1 (symmetric allocation, schedule agreement).
    ``wire_bytes``: element size of unquantized payloads (2: bf16; 4 if fp32 rows are dispatched or combined).
    ``schedule``: the fused kernels' work split, the same on every rank (ValueError on every rank otherwise). None:
    ``TransportSchedule()`` (the measured defaults) for a new runtime, the current schedule for an existing one; a
    schedule given for an existing runtime replaces its schedule (:meth:`EPRuntime.set_schedule`).
    ``timeout_s``: seconds a transport wait spins before the runtime records a fatal timeout (None: a new runtime
    takes :func:`timeout_seconds`, an existing one keeps its timeout).
    Arguments are checked before any collective or CUDA call (ValueError / TypeError).
    """
    if hidden % 32:
        raise ValueError(f"hidden ({hidden}) must be a multiple of 32 for the CUDA transport")
    if schedule is not None and not isinstance(schedule, TransportSchedule):
        raise TypeError(f"schedule must be a TransportSchedule or None, got {type(schedule).__name__}")
    timeout = None if timeout_s is None else timeout_seconds(timeout_s)
    cfg = RuntimeConfig(int(max_tokens_per_rank), int(hidden), int(top_k), int(num_experts), int(wire_bytes))
    rt = _state["runtimes"].get(_key(group))
    if rt is None:
        kernels.precompile()  # before the barrier that ends the runtime's creation
        rt = EPRuntime(group, cfg, schedule, timeout)  # ends with a barrier when ep_size > 1
        _state["runtimes"][_key(group)] = rt
    else:
        rt.ensure(cfg)
        if schedule is not None:
            rt.set_schedule(schedule)
        if timeout is not None:
            rt.timeout_ns = int(timeout * 1e9)
    return rt


def get_runtime(group) -> EPRuntime:
    """The existing runtime of ``group``; raises if :func:`init_runtime` was not called for it."""
    rt = _state["runtimes"].get(_key(group))
    if rt is None:
        raise RuntimeError(
            "no NVSHMEM transport runtime for this EP group: call moe_ep.transport.nvshmem.buffer.init_runtime("
            "group, max_tokens_per_rank, hidden, top_k, num_experts) first (on every rank)"
        )
    return rt
