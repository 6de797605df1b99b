"""MoE layer configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

BACKENDS = ("auto", "reference", "cuda")
TRANSPORTS = ("nvshmem", "nccl")
SCORE_FUNCS = ("softmax", "sigmoid")


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
    dropless_sizing:     how dropless mode (capacity_factor None) sizes a rank's expanded buffers on the nvshmem
                         transport when ep_size > 1 (at ep_size 1 the row count is tokens * top_k, known on the host:
                         exact, no host read, either way):
                         "exact" (default): read the expanded row count N once per layer call after the layout
                         (NOTE: host sync; not CUDA-graph capturable) and allocate N rows;
                         "worst_case": no host read: ``ep_size * max_tokens_per_rank * min(top_k, local experts)``
                         rows, the most a rank can receive (CUDA-graph capturable); group sizes stay on the device
                         and the expert passes work on the real rows, but the memory is the worst case's (ep_size
                         times a balanced load: at dsv3, 4096 tokens per rank, +2.7 GiB of held activations per
                         layer at EP 4, +6.4 GiB at EP 8; docs/design-kernels.md, "Dropless sizing").
    renormalize:         renormalize the top-k gate weights to sum to 1 (w / (sum + 1e-20)).
    aux_loss_coef:       weight of the load-balancing loss (Switch/GShard style, E * sum_e f_e * P_e); 0 turns it off
                         (the router then does not compute it and returns a zero).
    Routing options (names as Hugging Face / DeepSeek-V3 / torchtitan use them; the defaults are the router above:
    softmax over all experts, top-k, renormalized). The math is in :func:`moe_ep.router.route`, in fp32 on the device.
    score_func:          "softmax" (over all experts) or "sigmoid" (per expert, DeepSeek-V3).
    norm_topk_prob:      alias of ``renormalize`` under its Hugging Face name, accepted at construction only: when
                         given (not None) it sets ``renormalize`` and is stored back as None, so
                         ``dataclasses.replace(cfg, renormalize=...)`` keeps working. Read ``renormalize``.
    route_scale:         factor applied to the top-k weights after the renormalization (DeepSeek-V3's
                         ``routed_scaling_factor``, torchtitan's ``route_scale``).
    n_group, topk_group: group-limited top-k (DeepSeek-V3): the E experts form n_group groups of E / n_group
                         consecutive experts; a group's score is the sum of its two best selection scores (its best one
                         when it has one expert); only the experts of the topk_group best groups can be chosen.
                         1, 1: no limit.
    expert_bias:         aux-loss-free load balancing (DeepSeek-V3): a per-expert bias buffer
                         (``MoE.router.expert_bias``, fp32 [E], not trainable) added to the scores for the top-k
                         SELECTION only (the weights are the unbiased scores). Training forwards accumulate the
                         per-expert counts on the device;
                         :meth:`moe_ep.MoE.update_expert_bias` (or :func:`moe_ep.update_expert_bias` on a model), called
                         once after each optimizer step, all-reduces them over the ranks that route and applies
                         ``bias += bias_update_rate * sign(mean_load - load)``, with no host sync.
    bias_update_rate:    the rate of that update (DeepSeek-V3: 1e-3).
    Shared experts (DeepSeek-V3 / Qwen-MoE style; :mod:`moe_ep.shared_experts`):
    num_shared_experts:  0: none. n > 0: one dense SwiGLU run on every token, its output added to the routed output.
    shared_ffn_hidden:   the width of that SwiGLU (all shared experts merged, as DeepSeek-V3 does); None:
                         num_shared_experts * ffn_hidden. It computes in x's dtype (bf16 on the cuda backend, no MXFP8),
                         on a side CUDA stream overlapping the dispatch on the cuda backend.
    recipe:              the quantization recipe of the dispatch payloads and the expert GEMMs, a row of
                         :data:`moe_ep.recipe.RECIPES` or "bf16": "mxfp8" (default; E4M3 with one E8M0 scale per 32
                         values, exact on Hopper, native on Blackwell), "blockwise" (1x128 activations, 128x128
                         weights: Hopper's FP8 tensor-core rate; hidden and ffn_hidden multiples of 128), "bf16" (no
                         quantization: the bf16 baseline of the same module).
    quantize:            the earlier switch, kept: False means recipe "bf16" (an FP8 recipe other than the default
                         with quantize=False is an error); after construction it reads ``recipe != "bf16"``.
    backend:             "reference": the pure-PyTorch path (the specification). "cuda": the fast layer (CuPy kernels,
                         NVSHMEM or NCCL transport; needs ``moe_ep[gpu]``, a GPU and torch.distributed). "auto":
                         "cuda" when x is on a GPU, CuPy and nvshmem4py import and torch.distributed is
                         initialized, else "reference".
    transport:           the cuda backend's all-to-all. "nvshmem": one node, NVLink stores from the kernels, no host
                         sync when ``capacity_factor`` is set, at EP 1, or with ``dropless_sizing="worst_case"``
                         (CUDA-graph capturable). "nccl": torch.distributed
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
    recipe: str = "mxfp8"
    transport: str = "nvshmem"
    init_std: float = 0.02
    score_func: str = "softmax"
    norm_topk_prob: bool | None = None
    route_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    num_shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    dropless_sizing: str = "exact"  # last: positional construction of the older fields is unchanged

    def __post_init__(self) -> None:
        if self.norm_topk_prob is not None:  # the alias: sets renormalize, then steps aside (see the docstring)
            if not isinstance(self.norm_topk_prob, bool):
                raise ValueError(f"MoEConfig.norm_topk_prob must be a bool or None, got {self.norm_topk_prob!r}")
            self.renormalize, self.norm_topk_prob = self.norm_topk_prob, None
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
        if self.dropless_sizing not in ("exact", "worst_case"):
            raise ValueError(f"MoEConfig.dropless_sizing must be 'exact' or 'worst_case', got {self.dropless_sizing!r}")
        for name in ("renormalize", "quantize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        from .recipe import RECIPE_NAMES, get_recipe  # noqa: PLC0415

        if self.recipe not in RECIPE_NAMES:
            raise ValueError(f"MoEConfig.recipe must be one of {RECIPE_NAMES}, got {self.recipe!r}")
        if not self.quantize:
            if self.recipe not in ("mxfp8", "bf16"):
                raise ValueError(f"quantize=False contradicts recipe={self.recipe!r}; pass recipe='bf16' alone")
            self.recipe = "bf16"
        self.quantize = self.recipe != "bf16"
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        row = get_recipe(self.recipe)
        if row is not None:
            blk = max(row.act_block, *row.weight_block)
            if self.hidden % blk or self.ffn_hidden % blk:
                raise ValueError(
                    f"recipe {self.recipe!r} needs hidden and ffn_hidden to be multiples of {blk}, got {self.hidden} "
                    f"and {self.ffn_hidden}"
                )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        self._check_routing()

    def _check_routing(self) -> None:
        """The routing and shared-expert options (see the class docstring)."""
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if not _finite(self.route_scale) or self.route_scale <= 0:
            raise ValueError(f"MoEConfig.route_scale must be a finite number > 0, got {self.route_scale!r}")
        if not _finite(self.bias_update_rate) or self.bias_update_rate < 0:
            raise ValueError(f"MoEConfig.bias_update_rate must be a finite number >= 0, got {self.bias_update_rate!r}")
        if not isinstance(self.expert_bias, bool):
            raise ValueError(f"MoEConfig.expert_bias must be a bool, got {self.expert_bias!r}")
        for name in ("n_group", "topk_group"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.top_k > reachable:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts of the topk_group={self.topk_group} best groups "
                f"({self.topk_group} x {self.num_experts // self.n_group} = {reachable})"
            )
        n = self.num_shared_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be an int >= 0, got {n!r}")
        f = self.shared_ffn_hidden
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f <= 0):
            raise ValueError(f"MoEConfig.shared_ffn_hidden must be None or a positive int, got {f!r}")
        if f is not None and n == 0:
            raise ValueError("MoEConfig.shared_ffn_hidden is set but num_shared_experts is 0")

    @property
    def shared_width(self) -> int:
        """Width of the merged shared-expert SwiGLU (0: no shared experts)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_ffn_hidden or self.num_shared_experts * self.ffn_hidden

    @property
    def recipe_row(self):
        """The :class:`moe_ep.recipe.Recipe` of ``recipe`` (None for "bf16")."""
        from .recipe import get_recipe  # noqa: PLC0415

        return get_recipe(self.recipe)

    def dropless_rows(self, num_tokens: int, ep_size: int) -> int | None:
        """Expanded rows of a dropless rank's buffers, known on the host without reading the device count: at
        ep_size 1 every slot is local, so exactly ``num_tokens * top_k`` (the layout's own N); with
        ``dropless_sizing="worst_case"`` the most a rank can receive, ``ep_size * max_tokens_per_rank * min(top_k,
        num_experts // ep_size)``; None when the count must be read (``"exact"`` at ep_size > 1; NOTE: host sync in
        the transport) or when not dropless. At least 1 (an empty buffer has no device pointer to pass).

        Example: 4096 tokens, top_k 8, 256 experts, max_tokens_per_rank 4096: ep_size 1 -> 32768; ep_size 8 with
        "worst_case" -> 8 * 4096 * 8 = 262144 (32 local experts); with "exact" -> None.
        """
        if self.capacity_factor is not None:
            return None
        if ep_size == 1:
            return max(num_tokens * self.top_k, 1)
        if self.dropless_sizing == "worst_case":
            return max(ep_size * self.max_tokens_per_rank * min(self.top_k, self.num_experts // ep_size), 1)
        return None

    def capacity_rows(self, num_tokens: int) -> int | None:
        """Expanded rows one rank keeps for ``num_tokens`` tokens: ceil(capacity_factor * num_tokens * top_k), in exact
        arithmetic on the factor's decimal value (0.1 * 3 * 10 is 3, not 4); None when dropless.

        Example: capacity_factor 0.5, 13 tokens, top_k 2 -> 13.
        """
        if self.capacity_factor is None:
            return None
        return math.ceil(Fraction(str(self.capacity_factor)) * num_tokens * self.top_k)
