"""Hugging Face transformers: swap the sparse MoE blocks of a model for :class:`moe_ep.MoE` (expert parallel).

    from moe_ep.integrations.hf import swap_moe_blocks
    model = AutoModelForCausalLM.from_config(config)        # or from_pretrained
    swap_moe_blocks(model, mesh=moe_ep.init_ep(ep_size=8))  # in place; every rank keeps its share of the experts

Families (transformers 5: experts stored as 3D ``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F], their layout
flags set by ``use_experts_implementation``): ``qwen3_moe`` (``Qwen3MoeSparseMoeBlock``: softmax, top-k,
``norm_topk_prob``), ``deepseek_v3`` (``DeepseekV3MoE``: sigmoid, ``e_score_correction_bias``, group-limited top-k,
``routed_scaling_factor``, shared experts), ``mixtral`` (``MixtralSparseMoeBlock``: softmax, top-k, renormalized).
Each block becomes an :class:`HFMoEBlock` that takes the block's input ``hidden_states`` [B, S, H] and returns a
tensor of the same shape, as the families' decoder layers expect in transformers 5 (``hidden_states =
self.mlp(hidden_states)``).

Weights: the router weight (kept in its HF dtype: DeepSeek-V3 keeps it in fp32), this rank's experts
[ep_rank * E_l, (ep_rank + 1) * E_l) of ``gate_up_proj`` (gate rows then up rows: our ``w13`` layout) and
``down_proj`` (our ``w2``), the expert bias, the shared expert's gate / up / down projections (our ``w13`` = [gate;
up], ``w2`` = down). :func:`unswap_moe_blocks` writes them back into new HF blocks (gathering the experts over the EP
group) for ``save_pretrained``.

Auxiliary loss: HF's ``output_router_logits`` loss reads its own router modules, which are gone after the swap, so
the swap sets ``config.output_router_logits = False``; our layer's load-balancing loss (Switch style, weighted by
``aux_loss_coef``: the config's ``router_aux_loss_coef``, 0 for DeepSeek-V3, which balances with the expert bias)
of the last forward is :func:`aux_loss` (model) -> add it to the loss. With DeepSeek-V3's expert bias, call
:func:`moe_ep.update_expert_bias` (model) after each optimizer step.
Not supported (raise): Mixtral's ``router_jitter_noise`` > 0, activations other than SiLU, expert biases.
The ``ExpertsInterface`` registry replaces only the experts' forward under HF's router, so it cannot carry our
router's device-side options or the EP dispatch; the whole block is swapped instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import MoEConfig
from ..layer import MoE
from ._weights import all_expert_weights, full

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")


def _block_class(family: str) -> type[nn.Module]:
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: PLC0415

        return Qwen3MoeSparseMoeBlock
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: PLC0415

        return DeepseekV3MoE
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: PLC0415

        return MixtralSparseMoeBlock
    raise ValueError(f"unsupported model_type {family!r}: moe_ep.integrations.hf swaps {FAMILIES}")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def moe_config_from_hf(config: Any, **overrides: Any) -> MoEConfig:
    """The :class:`MoEConfig` of an HF config of one of :data:`FAMILIES`, then ``overrides`` (e.g. ``quantize``,
    ``backend``, ``max_tokens_per_rank``: at least batch * sequence tokens per forward)."""
    c = _text_config(config)
    family = c.model_type
    if family not in FAMILIES:
        raise ValueError(f"unsupported model_type {family!r}: moe_ep.integrations.hf swaps {FAMILIES}")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"moe_ep's experts are SwiGLU (silu): {family} has hidden_act={c.hidden_act!r}")
    kw: dict[str, Any] = dict(hidden=c.hidden_size, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok)
    if family == "qwen3_moe":
        kw.update(ffn_hidden=c.moe_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob))
        kw.update(aux_loss_coef=float(c.router_aux_loss_coef))
    elif family == "mixtral":
        if getattr(c, "router_jitter_noise", 0.0):
            raise ValueError("Mixtral's router_jitter_noise > 0 is not supported by moe_ep's router")
        kw.update(ffn_hidden=c.intermediate_size, renormalize=True, aux_loss_coef=float(c.router_aux_loss_coef))
    else:  # deepseek_v3
        kw.update(
            ffn_hidden=c.moe_intermediate_size,
            score_func="sigmoid",
            norm_topk_prob=bool(c.norm_topk_prob),
            route_scale=float(c.routed_scaling_factor),
            n_group=c.n_group or 1,
            topk_group=c.topk_group or 1,
            expert_bias=True,
            aux_loss_coef=0.0,
            num_shared_experts=c.n_shared_experts or 0,
            shared_ffn_hidden=(c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None,
        )
    kw.update(overrides)
    return MoEConfig(**kw)


class HFMoEBlock(nn.Module):
    """An HF sparse MoE block's replacement: ``moe`` (:class:`moe_ep.MoE`) with the block's signature.

    forward(hidden_states: [B, S, H] (or [T, H]) bf16/fp32) -> [same shape] same dtype. ``aux_loss``: the weighted
    load-balancing loss of the last forward (fp32 scalar; see :func:`aux_loss`).
    """

    def __init__(self, moe: MoE, family: str) -> None:
        super().__init__()
        self.moe = moe
        self.family = family
        self.aux_loss: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y, self.aux_loss = self.moe(hidden_states)
        return y


def _expert_weights(experts: nn.Module, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """HF experts -> (gate_up [E, 2F, H] gate rows then up rows, down [E, H, F]) in our layout, by the layout flags
    of ``use_experts_implementation`` (is_transposed, is_concatenated, has_gate, has_bias)."""
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
        raise ValueError("moe_ep's experts are SwiGLU without biases: these HF experts have biases or no gate")
    gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):  # [E, H, 2F] / [E, F, H]
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    if not getattr(experts, "is_concatenated", True):  # interleaved rows gate0, up0, gate1, up1, ...
        gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
    want_gu = (cfg.num_experts, 2 * cfg.ffn_hidden, cfg.hidden)
    want_dn = (cfg.num_experts, cfg.hidden, cfg.ffn_hidden)
    if tuple(gu.shape) != want_gu or tuple(dn.shape) != want_dn:
        raise ValueError(f"HF expert weights {tuple(gu.shape)} / {tuple(dn.shape)}, expected {want_gu} / {want_dn}")
    return gu, dn


@torch.no_grad()
def load_hf_block(block: HFMoEBlock, hf_block: nn.Module) -> None:
    """Copy an HF block's weights into ``block`` (this rank's share of the experts)."""
    moe, cfg = block.moe, block.moe.cfg
    gu, dn = _expert_weights(hf_block.experts, cfg)
    lo, hi = moe.first_expert, moe.first_expert + moe.num_local_experts
    moe.experts.w13.copy_(gu[lo:hi])
    moe.experts.w2.copy_(dn[lo:hi])
    gate = hf_block.gate.weight.detach()
    moe.router.weight = nn.Parameter(gate.clone().to(moe.experts.w13.device))  # keeps the HF dtype (fp32 in DSv3)
    bias = getattr(hf_block.gate, "e_score_correction_bias", None)
    if bias is not None:
        moe.router.expert_bias.copy_(bias)
    shared = getattr(hf_block, "shared_experts", None)
    if shared is not None:
        se = moe.shared_experts
        se.w13.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0))
        se.w2.copy_(shared.down_proj.weight)


def _family_of(model: nn.Module) -> tuple[str, Any]:
    config = _text_config(model.config)
    if config.model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {config.model_type!r}: moe_ep.integrations.hf swaps {FAMILIES}")
    return config.model_type, config


def swap_moe_blocks(model: nn.Module, mesh: DeviceMesh | None = None, **moe_config_overrides: Any) -> int:
    """Replace every sparse MoE block of ``model`` (an HF model of :data:`FAMILIES`) by an :class:`HFMoEBlock` on
    ``mesh`` (a ("dp", "ep") mesh of :func:`moe_ep.init_ep`; None: this process owns every expert), in place, with
    the block's weights (this rank's share of the experts). Returns the number of blocks replaced.

    moe_config_overrides: :class:`MoEConfig` fields over those of the HF config (:func:`moe_config_from_hf`), e.g.
    ``quantize=False`` (bf16), ``backend``, ``max_tokens_per_rank`` (>= batch * sequence per forward; default 4096).
    The new modules get the device and dtype of the block they replace.
    """
    family, config = _family_of(model)
    cls = _block_class(family)
    cfg = moe_config_from_hf(config, **moe_config_overrides)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
    for name, hf_block in targets:
        p = hf_block.experts.gate_up_proj
        block = HFMoEBlock(MoE(cfg, mesh, device=p.device, dtype=p.dtype), family)
        load_hf_block(block, hf_block)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
    if targets and getattr(config, "output_router_logits", False):
        config.output_router_logits = False  # HF's aux loss reads its router modules: use aux_loss(model)
    return len(targets)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the swapped blocks' weighted load-balancing losses of the last forward (fp32 scalar; 0. if none)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, HFMoEBlock) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())


@torch.no_grad()
def unswap_moe_blocks(model: nn.Module) -> int:
    """The reverse of :func:`swap_moe_blocks` (e.g. before ``save_pretrained``): every :class:`HFMoEBlock` becomes a
    new HF block of its family holding the current weights, the experts all-gathered over the EP group (a collective:
    call on every rank). Returns the number of blocks restored."""
    family, config = _family_of(model)
    cls = _block_class(family)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    for name, block in targets:
        moe = block.moe
        w13, w2 = all_expert_weights(moe)
        with torch.device(w13.device):
            hf_block = cls(config).to(w13.dtype)
        ex = hf_block.experts
        gu, dn = w13, w2
        if not getattr(ex, "is_concatenated", True):
            f = moe.cfg.ffn_hidden
            gu = torch.stack([w13[:, :f], w13[:, f:]], dim=2).reshape(w13.shape)  # back to gate0, up0, gate1, ...
        if getattr(ex, "is_transposed", False):
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        ex.gate_up_proj.copy_(gu)
        ex.down_proj.copy_(dn)
        gate = full(moe.router.weight).detach()
        hf_block.gate.weight.data = gate.clone()
        if moe.router.expert_bias is not None and hasattr(hf_block.gate, "e_score_correction_bias"):
            hf_block.gate.e_score_correction_bias.copy_(moe.router.expert_bias)
        if moe.shared_experts is not None:
            s13, s2 = full(moe.shared_experts.w13).detach(), full(moe.shared_experts.w2).detach()
            gp, up = s13.chunk(2, dim=0)
            hf_block.shared_experts.gate_proj.weight.copy_(gp)
            hf_block.shared_experts.up_proj.weight.copy_(up)
            hf_block.shared_experts.down_proj.weight.copy_(s2)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, hf_block)
    return len(targets)


# ---------------------------------------------------------------------------------------------------------
# Training a tiny model of a family (launch/train.py --model hf:<family>)
# ---------------------------------------------------------------------------------------------------------


def tiny_config(family: str, *, dim: int, n_layers: int, n_heads: int, ffn_hidden: int, num_experts: int, top_k: int,
                vocab_size: int, seq_len: int) -> Any:  # fmt: skip
    """An HF config of ``family`` with our preset's sizes: every layer sparse, untied embeddings, ``head_dim`` =
    dim / n_heads. DeepSeek-V3: 2 expert groups when they hold top_k experts each (topk_group 1, else 2), one shared
    expert, MLA ranks from the head size."""
    import transformers  # noqa: PLC0415

    common = dict(vocab_size=vocab_size, hidden_size=dim, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  num_key_value_heads=n_heads, num_experts_per_tok=top_k, max_position_embeddings=seq_len,
                  tie_word_embeddings=False)  # fmt: skip
    hd = dim // n_heads
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=hd, intermediate_size=ffn_hidden,
                                           moe_intermediate_size=ffn_hidden, num_experts=num_experts,
                                           norm_topk_prob=True)  # fmt: skip
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=ffn_hidden, num_local_experts=num_experts)
    if family == "deepseek_v3":
        groups = 2 if num_experts % 2 == 0 else 1
        return transformers.DeepseekV3Config(
            **common, intermediate_size=ffn_hidden, moe_intermediate_size=ffn_hidden, n_routed_experts=num_experts,
            n_group=groups, topk_group=1 if top_k <= num_experts // groups else groups, n_shared_experts=1,
            first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=max(16, hd), qk_nope_head_dim=hd // 2,
            qk_rope_head_dim=hd // 2, v_head_dim=hd,
        )  # fmt: skip
    raise ValueError(f"unsupported family {family!r}: one of {FAMILIES}")


class HFCausalLM(nn.Module):
    """An HF causal LM with swapped MoE blocks, with the training interface of ``launch/train.py``'s model:
    forward(tokens [B, S] int64, targets [B, S] int64) -> (mean cross-entropy fp32, weighted aux loss fp32);
    ``blocks``: the decoder layers (the FSDP2 units); ``dropped_slots()``: slots dropped in the last forward, summed
    over the layers (device tensor or int, no host sync)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    @property
    def blocks(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.hf(input_ids=tokens).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return loss, aux_loss(self).to(loss.device)

    def dropped_slots(self) -> torch.Tensor | int:
        return sum(m.moe._num_dropped for m in self.modules() if isinstance(m, HFMoEBlock))


def build_causal_lm(
    family: str, mesh: DeviceMesh | None, sizes: dict[str, int], **moe_config_overrides: Any
) -> HFCausalLM:
    """A tiny HF model of ``family`` (:func:`tiny_config` with ``sizes``), built from its config (HF's init; seed the
    global generator first for the same weights on every rank), its MoE blocks swapped on ``mesh``."""
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **sizes))
    swap_moe_blocks(model, mesh=mesh, **moe_config_overrides)
    return HFCausalLM(model)
