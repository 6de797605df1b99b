"""A small MoE transformer (bytewise LM) used by ``launch/train.py`` and the benchmarks.

Each block is pre-norm: ``x + attn(norm(x))`` then ``x + moe(norm(x))``; every block's FFN is an
expert-parallel :class:`moe_ep.MoE` (or, for baselines, a layer built by ``moe_factory``, see
:class:`MoETransformer`). Positions are rotary (no learned position table, so ``seq_len`` only sizes the cached
rotary tables). The model owns no process groups: pass the ("dp", "ep") mesh and it is handed to every MoE layer;
FSDP wrapping is a separate step (:func:`moe_ep.parallel.apply_fsdp`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from moe_ep.config import MoEConfig
from moe_ep.layer import MoE

# (MoEConfig of the layer, the ("dp", "ep") mesh or None) -> an MoE-like module; see MoETransformer.
MoEFactory = Callable[[MoEConfig, "DeviceMesh | None"], nn.Module]


@dataclass
class ModelConfig:
    """Shape of the MoE transformer. The MoE fields mirror :class:`MoEConfig` (``hidden`` is ``dim``).

    vocab:       vocabulary size (256: bytes).
    dim:         model width; also the MoE ``hidden`` (multiple of 32 when quantizing).
    n_layers:    number of transformer blocks (each with attention and one MoE).
    n_heads:     attention heads; ``dim // n_heads`` must be even (rotary pairs).
    seq_len:     longest sequence the rotary tables are built for.
    rope_theta:  rotary base.
    norm_eps:    RMSNorm epsilon.
    activation_checkpoint: recompute each block's attention half (norm, attention, residual) in the backward
                 instead of keeping its activations (``torch.utils.checkpoint``, non-reentrant). The MoE half is not
                 recomputed: recomputing it would issue its dispatch and combine (and dropless mode's host read)
                 again, and it already keeps its rows in MXFP8 (1 byte per element) for the backward.
    init_std:    std of the normal init of every non-expert matrix (output projections are scaled down by
                 ``1/sqrt(2*n_layers)``, GPT-2 style, so the residual stream does not grow with depth).
    ffn_hidden, num_experts, top_k, max_tokens_per_rank, capacity_factor, renormalize, aux_loss_coef, quantize,
    backend, transport, recipe:
                 passed to every layer's :class:`MoEConfig` (see there).
    """

    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    activation_checkpoint: bool = False
    ffn_hidden: int = 64
    num_experts: int = 4
    top_k: int = 2
    max_tokens_per_rank: int = 4096
    capacity_factor: float | None = None
    renormalize: bool = True
    aux_loss_coef: float = 1e-2
    quantize: bool = True
    backend: str = "auto"
    transport: str = "nvshmem"
    recipe: str = "mxfp8"

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.n_heads} heads of even size")
        self.moe_config()  # validates the MoE fields (ValueError naming the field)

    def moe_config(self) -> MoEConfig:
        """The :class:`MoEConfig` of every MoE layer of this model."""
        return MoEConfig(
            hidden=self.dim,
            ffn_hidden=self.ffn_hidden,
            num_experts=self.num_experts,
            top_k=self.top_k,
            max_tokens_per_rank=self.max_tokens_per_rank,
            capacity_factor=self.capacity_factor,
            renormalize=self.renormalize,
            aux_loss_coef=self.aux_loss_coef,
            quantize=self.quantize,
            backend=self.backend,
            transport=self.transport,
            init_std=self.init_std,
            recipe=self.recipe,
        )


class RMSNorm(nn.Module):
    """RMSNorm over the last axis. Computes in fp32 and returns the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] any float dtype -> [..., dim] same dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each fp32 [seq_len, head_dim // 2] (one angle per rotated pair)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return ang.cos().float(), ang.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x: [B, heads, S, d] by the angles of cos/sin: [S, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions (F.scaled_dot_product_attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, S, dim] -> [B, S, dim] (same dtype); cos/sin: fp32 [S, head_dim // 2]."""
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention then an expert-parallel MoE, each with a residual.

    ``moe_factory``: None builds :class:`MoE`; else ``moe_factory(cfg.moe_config(), mesh)`` (see
    :class:`MoETransformer`)."""

    def __init__(self, cfg: ModelConfig, mesh: DeviceMesh | None, moe_factory: MoEFactory | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mcfg = cfg.moe_config()
        if moe_factory is None:
            # Built on "meta" (MoE skips its own init there), then allocated: MoETransformer draws every weight itself
            # (init_expert_weights), so the layer's per-expert draws would be thrown away (seconds at 10^9 weights).
            self.moe = MoE(mcfg, mesh=mesh, device="meta").to_empty(device="cpu")
        else:
            self.moe = moe_factory(mcfg, mesh)

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.attn_norm(x), cos, sin)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, checkpoint_attention: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, dim] -> (x': [B, S, dim] same dtype, aux_loss: fp32 scalar of this block's MoE).
        ``checkpoint_attention``: recompute the attention half in the backward (see ModelConfig)."""
        if checkpoint_attention:
            x = checkpoint(self._attention, x, cos, sin, use_reentrant=False)
        else:
            x = self._attention(x, cos, sin)
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class MoETransformer(nn.Module):
    """Token embedding -> ``n_layers`` x Block -> RMSNorm -> LM head.

    With a mesh, every MoE holds only its EP rank's ``num_experts / ep`` experts, and ``forward`` must be
    called on every rank of the EP group in lockstep (dispatch and combine are collectives).

    Initialization: :meth:`reset_parameters` (the global RNG: seed it identically on every rank) and
    :meth:`init_expert_weights` with ``seed`` (per global expert, independent of the EP size).

    ``moe_factory`` (baselines, e.g. ``launch/train.py --baseline torchtitan``): builds every block's MoE from the
    layer's :class:`MoEConfig` and the mesh instead of :class:`MoE`. The layer must provide ``forward(x [..., H]) ->
    (y, aux_loss)`` (aux already weighted), ``router_weight`` (the [E, H] gate parameter, drawn like ``MoE``'s),
    ``set_expert_weights_(i, w13 [2F, H], w2 [H, F])`` (local expert i, from moe_ep's layout: the model draws the
    same values as for ``MoE``), and its expert parameters in a submodule named ``experts`` (its own FSDP unit on
    "dp": :func:`moe_ep.parallel.apply_fsdp` wraps only ``MoE.experts``, so shard it before calling that).
    """

    def __init__(
        self, cfg: ModelConfig, mesh: DeviceMesh | None = None, moe_factory: MoEFactory | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        self.cfg = cfg
        # EP rank and size of this process (0 and 1 without a mesh): it owns global experts [ep_rank*E_local, ...).
        self.ep_rank = 0 if mesh is None else mesh["ep"].get_local_rank()
        self.ep_size = 1 if mesh is None else mesh["ep"].size()
        if cfg.num_experts % self.ep_size:
            raise ValueError(f"num_experts {cfg.num_experts} is not divisible by the EP size {self.ep_size}")
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, mesh, moe_factory) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.n_heads, cfg.rope_theta)
        # Non-persistent buffers: recomputed at construction, never sharded or checkpointed.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        self.init_expert_weights(seed)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every non-expert matrix; residual output projections scaled down.

        Router weights are drawn here too (from the global RNG, so seed it identically on every rank). Expert
        weights are drawn by :meth:`init_expert_weights` (the constructor calls it with its ``seed``).
        """
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.head.weight, std=std)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.qkv.weight, std=std)
            nn.init.normal_(blk.attn.out.weight, std=std / math.sqrt(2 * self.cfg.n_layers))
            nn.init.normal_(_router_weight(blk.moe), std=std)

    @torch.no_grad()
    def init_expert_weights(self, seed: int) -> None:
        """Draw every expert weight so that global expert ``e`` of layer ``l`` gets the same values whatever the EP
        size and the MoE implementation: Normal(0, init_std) from a CPU generator seeded by (seed, l, e). The
        constructor calls it with its ``seed``; call it again to re-draw with another.

        A 1-process run and an EP run then start from the same function, and ranks of one EP index (the
        "dp" replicas FSDP shards an expert over) hold identical experts. Call it before
        :func:`moe_ep.parallel.apply_fsdp` (the parameters must still be plain tensors).
        """
        c = self.cfg
        e_local = c.num_experts // self.ep_size
        for layer, blk in enumerate(self.blocks):
            for i in range(e_local):
                e = self.ep_rank * e_local + i
                g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007 + e)
                w13 = torch.randn((2 * c.ffn_hidden, c.dim), generator=g, device="cpu") * c.init_std
                w2 = torch.randn((c.dim, c.ffn_hidden), generator=g, device="cpu") * c.init_std
                if isinstance(blk.moe, MoE):
                    blk.moe.experts.w13[i].copy_(w13)
                    blk.moe.experts.w2[i].copy_(w2)
                else:
                    blk.moe.set_expert_weights_(i, w13, w2)

    def dropped_slots(self) -> torch.Tensor | int:
        """Slots this rank dropped at its capacity in the last forward, summed over the MoE layers: an int, or a 0-dim
        device tensor when a layer keeps its count on the GPU (cuda backend, nvshmem transport). No host sync here;
        reading a tensor result is one. Baseline layers (``moe_factory``) count as dropless."""
        counts = [blk.moe._num_dropped for blk in self.blocks if isinstance(blk.moe, MoE)]
        dev = [c for c in counts if isinstance(c, torch.Tensor)]
        host = sum(int(c) for c in counts if not isinstance(c, torch.Tensor))
        if not dev:
            return host
        return torch.stack([c.reshape(()).to(torch.int64) for c in dev]).sum() + host

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the LM.

        tokens:  int64 [B, S] (S <= cfg.seq_len), values in [0, vocab).
        targets: optional int64 [B, S], the next tokens.
        Returns (logits [B, S, vocab] in the compute dtype, or with targets the mean cross-entropy as an fp32
        scalar; total aux loss: fp32 scalar, the sum of every MoE's already-weighted load-balancing loss).
        Train on ``loss + aux``.
        """
        s = tokens.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds cfg.seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed(tokens)
        aux_total = torch.zeros((), dtype=torch.float32, device=x.device)
        for blk in self.blocks:
            x, aux = blk(x, cos, sin, checkpoint_attention=self.cfg.activation_checkpoint and torch.is_grad_enabled())
            aux_total = aux_total + aux.float()
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, aux_total
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, aux_total


def _router_weight(moe: nn.Module) -> torch.Tensor:
    """The [E, H] gate parameter of a :class:`MoE` or of a ``moe_factory`` layer."""
    return moe.router.weight if isinstance(moe, MoE) else moe.router_weight
