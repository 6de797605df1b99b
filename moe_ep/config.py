"""MoE layer configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

BACKENDS = ("auto", "reference", "cuda")
TRANSPORTS = ("nvshmem", "nccl")


def _finite(v: object) -> bool:
    """A finite int or float (bools excluded)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass
class MoEConfig:
    """Configuration of one expert-parallel MoE layer.

    hidden:              model width H (multiple of 32 when quantizing).
    ffn_hidden:          expert MLP width F (SwiGLU: up-projection to 2F, down-projection to H).
    num_experts:         global expert count E (divisible by the EP size).
    top_k:               experts per token.
    max_tokens_per_rank: the most tokens one rank may pass to forward; sizes the receive buffers
                         (a token is sent at most once per destination rank).
    capacity_factor:     None: dropless (every routed slot is computed). c > 0: each rank keeps at most
                         ``capacity_rows(tokens)`` = ceil(c * tokens * top_k) expanded rows (tokens: this rank's
                         tokens in the call); the slots past it in the expanded order (local expert, source rank,
                         source token) are dropped: they contribute zero to the output and get zero gradient.
                         ``MoE.num_dropped`` counts them. The order is expert-major, so the drops fall on the rank's
                         highest-numbered local experts that have slots, whichever expert is overloaded.
    renormalize:         renormalize the top-k gate weights to sum to 1.
    aux_loss_coef:       weight of the load-balancing loss (Switch/GShard style, E * sum_e f_e * P_e).
    quantize:            MXFP8 at the dispatch payload, the SwiGLU output, the dy payload and the grouped-GEMM
                         operands (the recipe); False gives the pure-bf16 baseline of the same module.
    backend:             "reference": the pure-PyTorch path (the specification). "cuda": the fast layer (CuPy kernels,
                         NVSHMEM or NCCL transport; needs ``moe_ep[gpu]``, a GPU and torch.distributed). "auto":
                         "cuda" when x is on a GPU, CuPy and nvshmem4py import and torch.distributed is
                         initialized, else "reference".
    transport:           the cuda backend's all-to-all. "nvshmem": one node, NVLink stores from the kernels, no host
                         sync when ``capacity_factor`` is set (CUDA-graph capturable). "nccl": torch.distributed
                         all_to_all (works across nodes) with MXFP8 payloads and host-synced split sizes.
    init_std:            standard deviation of the normal initialization of the router and expert weights.
    """

    hidden: int
    ffn_hidden: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int = 4096
    capacity_factor: float | None = None
    renormalize: bool = True
    aux_loss_coef: float = 1e-2
    quantize: bool = True
    backend: str = "auto"
    transport: str = "nvshmem"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_hidden", "num_experts", "top_k", "max_tokens_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        for name in ("aux_loss_coef", "init_std"):
            if not _finite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"MoEConfig.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        c = self.capacity_factor
        if c is not None and (not _finite(c) or c <= 0):
            raise ValueError(f"MoEConfig.capacity_factor must be None (dropless) or a finite number > 0, got {c!r}")
        for name in ("renormalize", "quantize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.quantize and (self.hidden % 32 or self.ffn_hidden % 32):
            raise ValueError(
                f"MXFP8 needs hidden and ffn_hidden to be multiples of 32, got {self.hidden} and {self.ffn_hidden}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")

    def capacity_rows(self, num_tokens: int) -> int | None:
        """Expanded rows one rank keeps for ``num_tokens`` tokens: ceil(capacity_factor * num_tokens * top_k), in exact
        arithmetic on the factor's decimal value (0.1 * 3 * 10 is 3, not 4); None when dropless.

        Example: capacity_factor 0.5, 13 tokens, top_k 2 -> 13.
        """
        if self.capacity_factor is None:
            return None
        return math.ceil(Fraction(str(self.capacity_factor)) * num_tokens * self.top_k)
