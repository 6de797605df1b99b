"""moe_ep.integrations.hf against Hugging Face transformers' own code: tiny Qwen3-MoE, DeepSeek-V3 and Mixtral models
built from their configs (no download), reference backend, fp32, on 1 process and on 2 gloo ranks (EP 2).

Checks: the swapped block's output and every gradient (input, router, experts, shared expert) equal HF's block; the
whole model's logits equal HF's; unswap gives back HF blocks with the same weights; a few FSDP2 steps of a tiny
Qwen3-MoE with our layer reduce the loss.

Tolerance (rtol 1e-5, atol 1e-6): both sides compute the same fp32 function with the same weights and pick the same
experts (the router logits are the same fp32 dot products; random inputs put no two scores within a rounding of
each other); they differ only in the order of fp32 sums (HF: index_add per expert; ours: per (token, slot) after the
dispatch; the router gradient's sum over tokens), i.e. a few ulps of values of order 1e-3..1.
"""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_ep import MoE, init_ep  # noqa: E402
from moe_ep.integrations import hf  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
SWAP = dict(quantize=False, backend="reference", max_tokens_per_rank=64)


def tiny_config(family: str):
    """A tiny config of ``family`` (2 layers; hidden 32; 8 experts, top-2)."""
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")  # fmt: skip
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                           moe_intermediate_size=16, num_experts=8, norm_topk_prob=True)  # fmt: skip
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
            n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        )  # fmt: skip
    return transformers.MixtralConfig(**common, num_key_value_heads=1, intermediate_size=16, num_local_experts=8)


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    with torch.no_grad():  # larger MoE weights (sharper routing, outputs of order 0.1) and a non-zero expert bias
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif ".mlp.experts." in name or ".mlp.shared_experts." in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    return model.float()


def _hf_blocks(model, family):
    return [m for m in model.modules() if isinstance(m, hf._block_class(family))]


def _block_grads(hf_block) -> dict:
    g = {"gate": hf_block.gate.weight.grad, "w13": hf_block.experts.gate_up_proj.grad,
         "w2": hf_block.experts.down_proj.grad}  # fmt: skip
    if getattr(hf_block, "shared_experts", None) is not None:
        s = hf_block.shared_experts
        g["s13"] = torch.cat([s.gate_proj.weight.grad, s.up_proj.weight.grad])
        g["s2"] = s.down_proj.weight.grad
    return g


def _our_grads(block) -> dict:
    m = block.moe
    g = {"gate": m.router.weight.grad, "w13": m.experts.w13.grad, "w2": m.experts.w2.grad}
    if m.shared_experts is not None:
        g["s13"], g["s2"] = m.shared_experts.w13.grad, m.shared_experts.w2.grad
    return g


def check_family(family: str, rank: int, world: int, mesh=None) -> None:
    """Block outputs and gradients, model logits and unswap on this rank (mesh: ("dp", "ep") with ep = world; None
    on one process)."""
    ref = tiny_model(family)
    ours = copy.deepcopy(ref)
    n = hf.swap_moe_blocks(ours, mesh=mesh, **SWAP)
    want_blocks = _hf_blocks(ref, family)
    assert n == len(want_blocks) > 0 and not _hf_blocks(ours, family)
    blocks = [m for m in ours.modules() if isinstance(m, hf.HFMoEBlock)]

    # the block: this rank's tokens [2, 5, H] vs HF's block on every rank's tokens
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 5, 32, generator=gen) for _ in range(world)]
    dys = [torch.randn(2, 5, 32, generator=gen) for _ in range(world)]
    x = xs[rank].clone().requires_grad_()
    y = blocks[0](x)
    assert y.shape == x.shape and y.dtype == x.dtype
    (y * dys[rank]).sum().backward()
    xr = torch.cat(xs).requires_grad_()
    yr = want_blocks[0](xr)
    (yr * torch.cat(dys)).sum().backward()
    ctx = f"{family} rank {rank}/{world}"
    torch.testing.assert_close(y, yr[2 * rank : 2 * rank + 2].detach(), **TOL, msg=lambda m: f"{ctx} y: {m}")
    torch.testing.assert_close(x.grad, xr.grad[2 * rank : 2 * rank + 2], **TOL, msg=lambda m: f"{ctx} dx: {m}")
    mine, want = _our_grads(blocks[0]), _block_grads(want_blocks[0])
    assert mine.keys() == want.keys()
    e_l = blocks[0].moe.num_local_experts
    for k in mine:
        g = mine[k]
        if k in ("w13", "w2"):
            w = want[k][rank * e_l : (rank + 1) * e_l]
        else:  # replicated parameters: each rank has its tokens' share of the gradient
            w = want[k]
            if world > 1:
                g = g.clone()
                dist.all_reduce(g)
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, k=k: f"{ctx} grad {k}: {m}")

    # the whole model: logits of this rank's sequences
    ids = torch.randint(0, 96, (world, 2, 7), generator=gen)
    with torch.no_grad():
        got = ours(input_ids=ids[rank]).logits
        exp = ref(input_ids=ids[rank]).logits
    torch.testing.assert_close(got, exp, **TOL, msg=lambda m: f"{ctx} logits: {m}")

    # unswap: HF blocks again, with the same weights as the reference (the experts gathered over EP)
    assert hf.unswap_moe_blocks(ours) == n
    back = _hf_blocks(ours, family)
    for a, b in zip(back, want_blocks, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{ctx} unswap {k}"


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_swap_matches_hf_one_process(family):
    check_family(family, 0, 1)


def test_config_mapping_and_errors():
    c = hf.moe_config_from_hf(tiny_config("deepseek_v3"), quantize=False)
    assert (c.score_func, c.n_group, c.topk_group, c.route_scale, c.expert_bias) == ("sigmoid", 4, 2, 2.5, True)
    assert (c.num_shared_experts, c.shared_width, c.aux_loss_coef, c.renormalize) == (1, 16, 0.0, True)
    q = hf.moe_config_from_hf(tiny_config("qwen3_moe"), quantize=False)
    assert (q.score_func, q.ffn_hidden, q.num_experts, q.top_k) == ("softmax", 16, 8, 2)
    bad = tiny_config("mixtral")
    bad.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="jitter"):
        hf.moe_config_from_hf(bad)
    with pytest.raises(ValueError, match="unsupported model_type"):
        hf.moe_config_from_hf(transformers.LlamaConfig())
    m = tiny_model("qwen3_moe")
    m.config.output_router_logits = True
    assert hf.swap_moe_blocks(m, **SWAP) == 2 and m.config.output_router_logits is False
    out = m(input_ids=torch.zeros(1, 4, dtype=torch.int64), labels=torch.zeros(1, 4, dtype=torch.int64))
    aux = hf.aux_loss(m)
    assert aux.shape == () and float(aux.detach()) > 0 and torch.isfinite(out.loss)
    assert isinstance(m.model.layers[0].mlp.moe, MoE)


def train_qwen3(rank: int, mesh) -> None:
    """6 AdamW steps of a tiny Qwen3-MoE with our layer (EP over the mesh) under FSDP2 on a fixed batch per rank."""
    from moe_ep.parallel import apply_fsdp, broadcast_params, clip_grad_norm_  # noqa: PLC0415

    model = tiny_model("qwen3_moe")
    assert hf.swap_moe_blocks(model, mesh=mesh, **SWAP) == 2
    broadcast_params(model, mesh)
    apply_fsdp(model, mesh, blocks=list(model.model.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 96, (2, 12), generator=gen)
    losses = []
    for _ in range(6):
        out = model(input_ids=ids, labels=ids)
        loss = out.loss + hf.aux_loss(model)
        loss.backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    assert losses[-1] < 0.9 * losses[0], losses  # 6 AdamW steps on a fixed batch: the loss falls well below start


def _two_ranks(rank: int, world: int) -> None:
    mesh = init_ep(ep_size=world)
    for family in hf.FAMILIES:
        check_family(family, rank, world, mesh)
    train_qwen3(rank, mesh)


def test_two_ranks_swap_matches_hf_and_fsdp2_training_reduces_loss():
    """One spawn for every 2-rank check (each process imports torch + transformers: ~8 s of CPU)."""
    run_distributed(_two_ranks, 2)


def test_train_script_hf_deepseek_v3(tmp_path):
    """launch/train.py --model hf:deepseek_v3 under torchrun (1 CPU rank: the CLI path; EP + FSDP2 of an HF model are
    tested above): the preset's log, the loss falls."""
    from tests.test_train import run_train  # noqa: PLC0415

    log = run_train(tmp_path, 1, "--model", "hf:deepseek_v3", "--steps", "4", "--log-every", "2")
    assert log["model"] == "hf:deepseek_v3" and log["variant"] == "reference_deepseek_v3" and log["ep"] == 1
    assert len(log["loss"]) == 4 and log["summary"]["finite"]
    assert log["summary"]["final_loss"] < log["summary"]["first_loss"], log["loss"]


@pytest.mark.parametrize(
    "argv", [["--model", "hf:llama"], ["--model", "qwen3_moe"], ["--model", "hf:mixtral", "--compile"]]
)
def test_train_script_bad_model_fails_in_parsing(argv, capsys):
    from tests.test_train import TRAIN, _script  # noqa: PLC0415

    with pytest.raises(SystemExit):
        _script(TRAIN).parse_args(argv)
    assert "--model" in capsys.readouterr().err


def test_readme_hf_swap_runs_as_written():
    """The README's Hugging Face section (issue 37's three-line swap), executed exactly as printed there."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "## Hugging Face models" in readme, "the README lost issue 37's Hugging Face section: re-apply it"
    code = readme.split("## Hugging Face models", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # in this process: no second import of torch + transformers
    assert out.getvalue().strip() == "2 (8, 64, 64)"


def test_logits_oracle_counts_routing_flips():
    """tests/multigpu/hf_cuda.py's logits oracle on the CPU: our reference backend with bf16 experts against HF's fp32
    DeepSeek-V3 (the setup of the GPU case). On these tokens one token's router scores are a near-tie that the bf16
    roundings of layer 0 decide the other way in layer 1: the oracle must name exactly that token, and the gap over
    the other tokens must be the bf16 roundings' (< 2^-6), while the gap over all tokens is not."""
    import os  # noqa: PLC0415

    env = dict(os.environ)
    import tests.multigpu.hf_cuda as hc  # noqa: PLC0415  (its helpers module sets GPU-run environment variables)

    os.environ.clear()
    os.environ.update(env)

    cfg = hf.tiny_config("deepseek_v3", dim=256, n_layers=2, n_heads=4, ffn_hidden=128, num_experts=8, top_k=2,
                         vocab_size=256, seq_len=128)  # fmt: skip
    torch.manual_seed(0)
    ref_model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = copy.deepcopy(ref_model)
    hf.swap_moe_blocks(model, mesh=None, recipe="bf16", backend="reference", max_tokens_per_rank=256)
    for b in model.modules():
        if isinstance(b, hf.HFMoEBlock):
            b.moe.experts.to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    got, want, flipped = hc._routed_sets(model, ref_model, "deepseek_v3", ids)
    v = want.shape[-1]
    keep = ~flipped
    assert int(flipped.sum()) == 1
    assert hc._rel(got.reshape(-1, v)[keep], want.reshape(-1, v)[keep]) < 2**-6
    assert hc._rel(got, want) > 2**-6
