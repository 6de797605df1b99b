"""The MXFP8 all-gather of expert weights (moe_ep.experts.fsdp_mxfp8): the packed format, the gathered weight's
operands against the plain weight's, the shard's version tracking, and FSDP2 training on gloo bitwise equal to the
plain gather (CPU, fp32 master weights: the MXFP8 gather quantizes exactly what the reference quantizes)."""

from __future__ import annotations

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.experts.fsdp_mxfp8 import (
    MXFP8ExpertShard,
    MXFP8ExpertWeight,
    _packed_parts,
    packed_bytes,
    quantize_packed,
    use_mxfp8_all_gather,
)
from moe_ep.experts.sm90.operands import weight_operands
from tests._dist import run_distributed
from tests._fsdp_steps import cuda_stand_in, train_steps


def _weight(g: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, n, k, generator=gen) * torch.exp(2 * torch.randn(g, n, 1, generator=gen))
    w[0, 3, 5] = float("nan")  # a NaN block in each quantization
    w[-1, :, 7] = 0.0  # an all-zero column (zero blocks along N)
    return w


@pytest.mark.parametrize("rows, cols", [(1, 1), (130, 5), (128, 4), (96, 7), (257, 64)])
def test_from_blocked_inverts_to_blocked(rows: int, cols: int) -> None:
    s = torch.randint(0, 255, (3, rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(mxfp8.from_blocked(mxfp8.to_blocked(s), rows, cols), s)
    r, c = rows - 1, cols - 1
    assert int(mxfp8.to_blocked(s[0])[mxfp8.blocked_offset(r, c, cols)]) == int(s[0, r, c])
    with pytest.raises(ValueError, match="blocked scales"):
        mxfp8.from_blocked(mxfp8.to_blocked(s), rows + 128, cols)


def test_packed_layout_worked_example() -> None:
    assert _packed_parts(2, 64, 32) == [(0, 4096), (4096, 1024), (5120, 4096), (9216, 1024)]
    assert packed_bytes(2, 64, 32) == 10240 == 2 * packed_bytes(1, 64, 32)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_weight_equals_plain_operands(ranks: int, dtype: torch.dtype) -> None:
    """Shards quantized separately and concatenated rank-major (what the all-gather does) give bitwise the operands
    and fake-quantized weights of the whole weight (per-expert quantization: shards of whole experts are exact)."""
    g, n, k = 4, 160, 96  # not multiples of 128: padded scale tiles
    w = _weight(g, n, k).to(dtype)
    ls = g // ranks
    buf = torch.cat([quantize_packed(w[r * ls : (r + 1) * ls]) for r in range(ranks)])
    gw = MXFP8ExpertWeight(buf, (g, n, k), torch.bfloat16, ranks)
    want = weight_operands(w)
    got = gw.operands()
    assert torch.equal(got.w_prepared.view(torch.int16), want.w_prepared.view(torch.int16))
    assert torch.equal(got.wt_prepared.view(torch.int16), want.wt_prepared.view(torch.int16))
    only = gw.operands(fprop=False)
    assert only.w_prepared is None
    assert torch.equal(only.wt_prepared.view(torch.int16), want.wt_prepared.view(torch.int16))
    for axis in (-1, -2):
        fq = mxfp8.fake_quantize(w.to(torch.bfloat16) if dtype == torch.bfloat16 else w, axis).to(torch.bfloat16)
        assert torch.equal(gw.fake_quantize(axis).view(torch.int16), fq.view(torch.int16)), axis
    with pytest.raises(ValueError, match="axis 0"):
        gw.fake_quantize(0)


def test_gathered_weight_ops() -> None:
    w = _weight(2, 64, 32)
    gw = MXFP8ExpertWeight(quantize_packed(w), (2, 64, 32), torch.bfloat16, 1)
    p = torch.nn.Parameter(gw)  # detach: the same bytes
    assert isinstance(p, MXFP8ExpertWeight) and p._buf is gw._buf and p.requires_grad
    z = torch.zeros_like(gw)
    assert type(z) is torch.Tensor and z.shape == (2, 64, 32) and z.dtype == torch.bfloat16 and not z.any()
    with pytest.raises(NotImplementedError, match="MXFP8-gathered expert weight"):
        gw + 1
    with pytest.raises(ValueError, match="over 3 shards"):
        MXFP8ExpertWeight(quantize_packed(w), (2, 64, 32), torch.bfloat16, 3)  # 2 experts do not split in 3
    with pytest.raises(ValueError, match="over 1 shards"):
        MXFP8ExpertWeight(quantize_packed(w)[:-16], (2, 64, 32), torch.bfloat16, 1)


class _Mesh:
    def size(self) -> int:
        return 1


def test_shard_quantizes_once_per_version() -> None:
    w = _weight(2, 64, 32)
    p = torch.nn.Parameter(MXFP8ExpertShard(w.clone()))
    shard = p  # nn.Parameter keeps the subclass (detach preserves it)
    assert isinstance(shard, MXFP8ExpertShard)
    (a,), meta = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    (b,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert a is b and shard.quantizations == 1 and meta == ((2, 64, 32), 1)
    assert torch.equal(a, quantize_packed(w))
    p.grad = torch.randn_like(w)
    torch.optim.AdamW([p], lr=0.1).step()  # in-place updates below autograd still move the version
    (c,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert shard.quantizations == 2 and not torch.equal(c, a)
    assert torch.equal(c, quantize_packed(shard._data))
    with torch.no_grad():
        p.mul_(0.5)  # exact: only the scales move
    (d,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert shard.quantizations == 3 and torch.equal(d, quantize_packed(shard._data))
    # views FSDP2 takes stay shards; math gives plain tensors
    assert isinstance(p.view(-1), MXFP8ExpertShard) and isinstance(torch.chunk(p.detach(), 2)[1], MXFP8ExpertShard)
    assert type(p.detach() * 2) is torch.Tensor and type(torch.zeros_like(p)) is torch.Tensor
    out, inner = shard.fsdp_post_all_gather((d,), meta, torch.bfloat16)
    assert isinstance(out, MXFP8ExpertWeight) and inner == (d,) and out.shape == (2, 64, 32)
    assert shard.fsdp_post_all_gather((d,), meta, torch.bfloat16, out=out) is None


def test_use_mxfp8_all_gather_checks() -> None:
    m = torch.nn.Module()
    m.w13 = torch.nn.Parameter(torch.randn(3, 64, 32))
    m.bias = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="3 experts do not split evenly over 2 dp ranks"):
        use_mxfp8_all_gather(m, 2)
    use_mxfp8_all_gather(m, 3)
    assert isinstance(m.w13, MXFP8ExpertShard) and type(m.bias) is torch.nn.Parameter


# ------------------------------------------------------------------------------------------- FSDP2 on gloo
def _train(rank: int, world: int, ep: int, mx: bool, reshard: bool, backend: str, quantize: bool = True):
    from launch.model import ModelConfig, MoETransformer  # noqa: PLC0415
    from moe_ep import init_ep  # noqa: PLC0415
    from moe_ep.parallel import apply_fsdp, broadcast_params  # noqa: PLC0415

    mesh = init_ep(ep)
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=64, num_experts=4, top_k=2,
        max_tokens_per_rank=32, quantize=quantize, backend=backend,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MoETransformer(cfg, mesh)
    broadcast_params(model, mesh)
    apply_fsdp(model, mesh, reshard_after_forward=reshard, mxfp8_expert_gather=mx)
    return train_steps(model, rank, world)


def _fsdp_training(rank: int, world: int) -> None:
    from moe_ep import layer_cuda  # noqa: PLC0415

    for ep, reshard in ((1, True), (2, True), (1, False)):
        plain, _ = _train(rank, world, ep, False, reshard, "reference")
        mx, shards = _train(rank, world, ep, True, reshard, "reference")
        assert mx == plain, (ep, reshard, mx, plain)
        # quantized once per optimizer step, not again for the backward's re-gather
        assert [s.quantizations for s in shards] == [3] * 4, [s.quantizations for s in shards]

    # The cuda backend's path (MoE.forward through the experts' FSDP forward method) with a CPU stand-in for the
    # kernels: it receives the gathered MXFP8 weights and computes with their stored quantizations.
    seen = []

    layer_cuda.resolve_backend = lambda cfg, x: "reference" if cfg.backend == "reference" else "cuda"
    layer_cuda.routed_experts_cuda = cuda_stand_in(MXFP8ExpertWeight, seen)
    plain, _ = _train(rank, world, 1, False, True, "auto")  # the same stand-in with the plain gather (x in bf16)
    mx, _ = _train(rank, world, 1, True, True, "auto")
    assert seen == [False] * 6 + [True] * 6, seen  # 3 steps x 2 layers each
    assert mx == plain, (mx, plain)
    try:
        _train(rank, world, 1, True, True, "reference", quantize=False)
    except ValueError as e:
        assert "quantize=True" in str(e)
    else:
        raise AssertionError("mxfp8_expert_gather with quantize=False must raise")


def test_fsdp_training_with_mxfp8_gather_equals_plain_gather() -> None:
    run_distributed(_fsdp_training, 2)
