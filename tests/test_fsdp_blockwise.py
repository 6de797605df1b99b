"""The blockwise FP8 all-gather of expert weights (moe_ep.experts.fsdp_blockwise): the packed format, the gathered
weight's operands against quantizing the whole weight, the shard's version tracking, the consumers (HopperBlockwise's
prepare, the reference's quantize_operand), and FSDP2 training on gloo with recipe "blockwise" bitwise equal to the
plain gather (CPU, fp32 master weights: the FP8 gather quantizes exactly what the reference quantizes)."""

from __future__ import annotations

import pytest
import torch

from moe_ep.blockwise.reference import quantize_weight_torch
from moe_ep.experts.fsdp_blockwise import (
    BlockwiseExpertShard,
    BlockwiseExpertWeight,
    _packed_parts,
    packed_bytes,
    quantize_packed,
    use_blockwise_all_gather,
)
from moe_ep.experts.fsdp_mxfp8 import MXFP8ExpertShard, MXFP8ExpertWeight
from moe_ep.experts.fsdp_mxfp8 import quantize_packed as mxfp8_packed
from moe_ep.experts.reference import quantize_operand
from moe_ep.mxfp8.reference import fake_quantize_blocks_torch
from moe_ep.recipe import BLOCKWISE, MXFP8
from tests._dist import run_distributed
from tests._fsdp_steps import cuda_stand_in, train_steps

U8 = torch.uint8


class _Mesh:
    def __init__(self, n: int = 1) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _weight(g: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, n, k, generator=gen) * torch.exp(2 * torch.randn(g, n, 1, generator=gen))
    w[0, 3, 5] = float("nan")  # a NaN block (expert 0, block (0, 0))
    w[-1, 128:, :128] = 0.0  # an all-zero block (last expert, block (1, 0))
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (NaN compares equal to itself bit for bit)."""
    return t.contiguous().view(U8)


def _gather(shards: list[BlockwiseExpertShard], shape, dtype=torch.float32) -> BlockwiseExpertWeight:
    """What FSDP2 does with the shards' all-gather inputs: each input concatenated rank-major, then post-all-gather."""
    mesh = _Mesh(len(shards))
    inputs = [s.fsdp_pre_all_gather(mesh, shape, None, None, None) for s in shards]
    outs = tuple(torch.cat([inp[0][i] for inp in inputs]) for i in range(len(inputs[0][0])))
    w, inner = shards[0].fsdp_post_all_gather(outs, inputs[0][1], dtype)
    assert inner == outs
    return w


def test_packed_layout_worked_example() -> None:
    assert _packed_parts(2, 128, 256) == [(0, 65536), (65536, 4)]
    assert packed_bytes(2, 128, 256) == 65540 == 2 * packed_bytes(1, 128, 256)
    # expert 0: rows 0-127 = 1 (amax 1: 2**-8 >= 1/448 > 2**-9, scale 127 - 8 = 119, 1 * 2**8 = 256 = e4m3 0x78),
    # rows 128-255 = 0 (scale 2**-127: byte 0, data 0); expert 1: rows 0-127 = -2 (scale 2**-7: 120, -256 = 0xF8),
    # rows 128-255 = 3 with one NaN (the block is NaN: data 0x7F, scale 255)
    w = torch.zeros(2, 256, 128)
    w[0, :128] = 1.0
    w[1, :128] = -2.0
    w[1, 128:] = 3.0
    w[1, 200, 5] = float("nan")
    buf = quantize_packed(w)
    assert buf.dtype == U8 and buf.shape == (65540,)
    want = torch.cat([torch.full((16384,), v, dtype=U8) for v in (0x78, 0x00, 0xF8, 0x7F)])
    assert torch.equal(buf[:65536], want)
    assert buf[65536:].tolist() == [119, 0, 120, 255]
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_packed(torch.zeros(1, 128, 96))


@pytest.mark.parametrize(
    "ranks, dtype", [(1, torch.float32), (2, torch.float32), (4, torch.float32), (2, torch.bfloat16)]
)
def test_gathered_operands_equal_quantizing_the_full_weight(ranks: int, dtype: torch.dtype) -> None:
    """Shards quantized separately and gathered as FSDP2 does (ranks = 1: the packed buffer; > 1: data and scale
    each rank-major) give bitwise the operands and fake quantization of the whole weight (NaN and zero blocks too)."""
    g, n, k = 4, 256, 128  # N != K: a transposition mistake changes shapes
    w = _weight(g, n, k).to(dtype)
    ls = g // ranks
    shards = [BlockwiseExpertShard(w[r * ls : (r + 1) * ls].clone()) for r in range(ranks)]
    gw = _gather(shards, (g, n, k))
    assert gw.shape == (g, n, k) and gw.dtype == torch.float32
    data, data_t, scale = quantize_weight_torch(w)
    got = gw.operands()
    assert torch.equal(_bits(got[0]), _bits(data)) and got[0].shape == (g, n, k) and got[0].is_contiguous()
    assert torch.equal(_bits(got[1]), _bits(data_t)) and got[1].dtype == torch.float8_e4m3fn
    assert torch.equal(got[2], scale) and got[2].shape == (g, n // 128, k // 128)
    assert int(scale[0, 0, 0]) == 255 and int(scale[-1, 1, 0]) == 0  # the NaN and the zero block
    fwd = gw.operands(dgrad=False)
    assert fwd[1] is None and fwd[0].data_ptr() == got[0].data_ptr()  # fprop: views of the gathered bytes
    # the reference consumer: fprop (blocks of W) and dgrad (blocks of W^T) read the stored values
    fq = fake_quantize_blocks_torch(w, (128, 128)).to(torch.float32)
    for transposed in (False, True):
        op = BLOCKWISE.gemm("dgrad1" if transposed else "fprop1").b
        plain = quantize_operand(w.to(torch.float32), op, [], transposed=transposed)
        mine = quantize_operand(gw, op, [], transposed=transposed)
        assert torch.equal(_bits(mine), _bits(plain)) and torch.equal(_bits(mine), _bits(fq)), transposed
    with pytest.raises(TypeError, match="128x128 quantizations only"):
        quantize_operand(gw, MXFP8.gemm("fprop1").b, [])


def test_hopper_blockwise_prepare_takes_the_gathered_bytes() -> None:
    from moe_ep.experts.sm90.blockwise import HOPPER_BLOCKWISE  # noqa: PLC0415
    from moe_ep.experts.sm90.mlp import GEMMS  # noqa: PLC0415

    w = _weight(2, 128, 256)
    gw = _gather([BlockwiseExpertShard(w[:1].clone()), BlockwiseExpertShard(w[1:].clone())], (2, 128, 256))
    data, data_t, scale = quantize_weight_torch(w)
    fwd = HOPPER_BLOCKWISE.prepare(gw, None, dgrad=False)
    assert fwd.data_t is None and torch.equal(_bits(fwd.data), _bits(data)) and torch.equal(fwd.scale, scale)
    bwd = HOPPER_BLOCKWISE.prepare(gw, None, fprop=False)
    assert torch.equal(_bits(bwd.data_t), _bits(data_t)) and torch.equal(bwd.scale, scale)
    mx = MXFP8ExpertWeight(mxfp8_packed(w), (2, 128, 256), torch.float32, 1)
    with pytest.raises(TypeError, match="fp8_expert_gather=True"):
        HOPPER_BLOCKWISE.prepare(mx, None)
    with pytest.raises(TypeError, match="not the MXFP8 recipe's"):
        GEMMS.prepare(gw, None)


def test_gathered_weight_ops() -> None:
    w = _weight(2, 128, 128)
    gw = _gather([BlockwiseExpertShard(w.clone())], (2, 128, 128), torch.bfloat16)
    p = torch.nn.Parameter(gw)  # detach: the same bytes
    assert isinstance(p, BlockwiseExpertWeight) and p._data_u8 is gw._data_u8 and p.requires_grad
    z = torch.zeros_like(gw)
    assert type(z) is torch.Tensor and z.shape == (2, 128, 128) and z.dtype == torch.bfloat16 and not z.any()
    assert gw.fake_quantize().dtype == torch.bfloat16
    with pytest.raises(NotImplementedError, match="blockwise-gathered expert weight"):
        gw + 1
    buf = quantize_packed(w)
    with pytest.raises(ValueError, match="expected 65536 and 4"):
        BlockwiseExpertWeight(buf[:-2], buf[-2:], (2, 128, 256), torch.float32)
    with pytest.raises(ValueError, match="multiples of 128"):
        BlockwiseExpertWeight(buf[:-2], buf[-2:], (2, 128, 64), torch.float32)


def test_shard_quantizes_once_per_version() -> None:
    w = _weight(2, 128, 128)
    p = torch.nn.Parameter(BlockwiseExpertShard(w.clone()))
    shard = p  # nn.Parameter keeps the subclass (detach preserves it)
    assert type(shard) is BlockwiseExpertShard
    (a,), meta = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    (b,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert a is b and shard.quantizations == 1 and meta == ((2, 128, 128), 1)
    assert torch.equal(a, quantize_packed(w))
    (d2, s2), meta2 = shard.fsdp_pre_all_gather(_Mesh(2), w.shape, w.stride(), None, None)  # dp > 1: two views
    assert shard.quantizations == 1 and meta2 == ((2, 128, 128), 2)
    assert d2.data_ptr() == a.data_ptr() and d2.numel() == 32768 and torch.equal(s2, a[32768:])
    p.grad = torch.randn_like(w)
    torch.optim.AdamW([p], lr=0.1).step()  # in-place updates below autograd still move the version
    (c,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert shard.quantizations == 2 and not torch.equal(c, a)
    assert torch.equal(c, quantize_packed(shard._data))
    with torch.no_grad():
        p.mul_(0.5)  # exact: only the scales move
    (d,), _ = shard.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), None, None)
    assert shard.quantizations == 3 and torch.equal(d, quantize_packed(shard._data))
    assert torch.equal(d[:32768], c[:32768]) and not torch.equal(d[32768:], c[32768:])
    # views FSDP2 takes stay shards of this kind; math gives plain tensors
    assert type(p.view(-1)) is BlockwiseExpertShard and type(torch.chunk(p.detach(), 2)[1]) is BlockwiseExpertShard
    assert type(p.detach() * 2) is torch.Tensor and type(torch.zeros_like(p)) is torch.Tensor
    out, inner = shard.fsdp_post_all_gather((d,), meta, torch.bfloat16)
    assert isinstance(out, BlockwiseExpertWeight) and inner == (d,) and out.shape == (2, 128, 128)
    assert shard.fsdp_post_all_gather((d,), meta, torch.bfloat16, out=out) is None
    with pytest.raises(RuntimeError, match="no longer views"):
        shard.fsdp_post_all_gather((d.clone(),), meta, torch.bfloat16, out=out)


def test_use_blockwise_all_gather_checks() -> None:
    m = torch.nn.Module()
    m.w13 = torch.nn.Parameter(torch.randn(3, 256, 128))
    m.bias = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="3 experts do not split evenly over 2 dp ranks"):
        use_blockwise_all_gather(m, 2)
    use_blockwise_all_gather(m, 3)
    assert type(m.w13) is BlockwiseExpertShard and m.w13.requires_grad  # (a Parameter of a subclass keeps it)
    assert type(m.bias) is torch.nn.Parameter
    use_blockwise_all_gather(m, 3)  # idempotent
    m.w2 = torch.nn.Parameter(torch.randn(2, 128, 96))
    with pytest.raises(ValueError, match="N and K must be multiples of 128"):
        use_blockwise_all_gather(m, 1)
    m.w2 = torch.nn.Parameter(MXFP8ExpertShard(torch.randn(2, 128, 128)))
    with pytest.raises(ValueError, match="already wrapped for the MXFP8"):
        use_blockwise_all_gather(m, 1)


# ------------------------------------------------------------------------------------------- FSDP2 on gloo
def _train(rank, world, ep, fp8: bool, reshard: bool, backend="reference", recipe="blockwise", mx: bool = False):
    from launch.model import ModelConfig, MoETransformer  # noqa: PLC0415
    from moe_ep import init_ep  # noqa: PLC0415
    from moe_ep.layer import MoE  # noqa: PLC0415
    from moe_ep.parallel import apply_fsdp, broadcast_params  # noqa: PLC0415

    mesh = init_ep(ep)
    cfg = ModelConfig(
        dim=128, n_layers=1, n_heads=4, seq_len=16, ffn_hidden=128, num_experts=4, top_k=2,
        max_tokens_per_rank=32, backend=backend, recipe=recipe,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MoETransformer(cfg, mesh)
    assert all(m.cfg.recipe == recipe for m in model.modules() if isinstance(m, MoE))
    broadcast_params(model, mesh)
    apply_fsdp(model, mesh, reshard_after_forward=reshard, fp8_expert_gather=fp8, mxfp8_expert_gather=mx)
    return train_steps(model, rank, world)


def _fsdp_training(rank: int, world: int) -> None:
    from moe_ep import layer_cuda  # noqa: PLC0415

    for ep, reshard in ((1, True), (2, True)):  # dp = 2 (two all-gather inputs), dp = 1 (the packed buffer)
        plain, _ = _train(rank, world, ep, False, reshard)
        fp8, shards = _train(rank, world, ep, True, reshard)
        assert fp8 == plain, (ep, reshard, fp8, plain)
        assert all(type(s) is BlockwiseExpertShard for s in shards)
        # quantized once per optimizer step, not again for the backward's re-gather
        assert [s.quantizations for s in shards] == [3] * 2, [s.quantizations for s in shards]

    # The cuda backend's path (MoE.forward through the experts' FSDP forward method) with a CPU stand-in for the
    # kernels: it receives the gathered blockwise weights and computes with their stored quantizations.
    seen = []

    layer_cuda.resolve_backend = lambda cfg, x: "reference" if cfg.backend == "reference" else "cuda"
    layer_cuda.routed_experts_cuda = cuda_stand_in(BlockwiseExpertWeight, seen)
    plain, _ = _train(rank, world, 1, False, False, "auto")  # the same stand-in with the plain gather
    fp8, _ = _train(rank, world, 1, True, False, "auto")  # (and no reshard after forward: one gather per step)
    assert seen == [False] * 3 + [True] * 3, seen  # 3 steps of the one layer
    assert fp8 == plain, (fp8, plain)
    for recipe, mx, msg in (("bf16", False, "an FP8 recipe"), ("blockwise", True, "recipe 'mxfp8', got 'blockwise'")):
        try:
            _train(rank, world, 1, not mx, True, recipe=recipe, mx=mx)
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(f"recipe {recipe} (mxfp8_expert_gather={mx}) must raise")


def test_fsdp_training_with_blockwise_gather_equals_plain_gather() -> None:
    run_distributed(_fsdp_training, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_packed_bytes_equal_the_reference(dtype: torch.dtype) -> None:
    """On the GPU the shard is quantized by the one-pass kernel (its transposed copy into a scratch buffer): the packed
    bytes equal the reference's, and the gathered operands (the transpose made on the GPU) equal quantize_weight's."""
    from moe_ep.blockwise import cuda as bw  # noqa: PLC0415

    w = _weight(4, 256, 384).to(dtype)
    wc = w.cuda()
    assert torch.equal(quantize_packed(wc).cpu(), quantize_packed(w))
    gw = _gather([BlockwiseExpertShard(wc[:2].clone()), BlockwiseExpertShard(wc[2:].clone())], (4, 256, 384))
    for got, want in zip(gw.operands(), bw.quantize_weight(wc), strict=True):
        assert got.is_cuda and torch.equal(_bits(got), _bits(want))
