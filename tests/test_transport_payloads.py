"""The transport's payloads by recipe: every pass takes a recipe (a :class:`moe_ep.recipe.Recipe`, its name, or None
for raw rows), MXFP8 ships 1x32 blocks and blockwise 1x128 blocks.

CPU: the reference transport (the specification) with a recipe: its blockwise bytes are
``moe_ep.blockwise.reference.quantize_rowwise_torch`` of the token rows (torch.equal on e4m3 and scale bytes), the
combine backward's dy rows are those bytes dequantized, the public ``dispatch`` / ``combine`` keep ``quantize=True /
False``, and a hidden size the blocks do not tile raises naming the block.

GPU (one device, EP = 1, group None: the NVSHMEM transport's region is ordinary memory): the fused quantized dispatch
and the dy dispatch of the NVSHMEM kernels against the reference transport, byte for byte, on awkward inputs (NaN /
Inf / subnormal rows, experts with no tokens, every token on one expert, H a multiple of 128 but not of 512); the
multi-GPU runs are tests/multigpu/ep_nvshmem.py. ``dw`` of the combine backward is a dot product over H summed in
another order than torch's: |mine - ref| <= 1e-5 sum_h |v_h y_h| + 1e-6 (as there).
"""

from __future__ import annotations

import pytest
import torch

from moe_ep import mxfp8
from moe_ep.blockwise.reference import dequantize_rowwise_torch, quantize_rowwise_torch
from moe_ep.recipe import BLOCKWISE, MXFP8
from moe_ep.transport import combine, dispatch
from moe_ep.transport import reference as ref
from moe_ep.transport.autograd import as_payload


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; float NaNs must sit at the same places (their payloads may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if a.is_floating_point():
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


def _inputs(t: int, h: int, e: int, k: int, routing: str, dtype=torch.float32, device="cpu", seed=0):
    """x [t, h] with awkward rows (a NaN block, an Inf block, a zero row, a subnormal-only block, magnitudes over 12
    decades), topk_idx [t, k] ("random", "one_expert": every token's only expert is 3, "sparse": experts 0 and 5
    only, so the others get no token), topk_w [t, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-6, 6, t)[:, None]
    if t >= 4:
        x[0, 5] = float("inf")
        x[1, 200 % h] = float("nan")
        x[2] = 0.0
        x[3, :128] = torch.linspace(-3e-39, 3e-39, 128)
    if routing == "one_expert":
        idx = torch.full((t, k), 3, dtype=torch.int64)
    elif routing == "sparse":
        idx = torch.stack([torch.randperm(2, generator=g)[:k] * 5 for _ in range(t)])
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return x.to(dtype).to(device), idx.to(device), w.to(device)


# ------------------------------------------------------------------------------------------------------------ CPU
def test_payload_recipe_names():
    """A recipe, its name or None / "bf16"; a bool only through the public functions (as_payload)."""
    assert ref.payload_recipe(BLOCKWISE) is BLOCKWISE and ref.payload_recipe("blockwise") is BLOCKWISE
    assert ref.payload_recipe("mxfp8") is MXFP8 and ref.payload_recipe(None) is None
    assert ref.payload_recipe("bf16") is None
    assert as_payload(True) is MXFP8 and as_payload(False) is None and as_payload("blockwise") is BLOCKWISE
    for bad, err in ((True, TypeError), (3, TypeError), ("fp4", ValueError)):
        with pytest.raises(err):
            ref.payload_recipe(bad)


@pytest.mark.parametrize("routing", ["random", "one_expert", "sparse"])
def test_reference_blockwise_bytes_are_the_rowwise_quantizer(routing):
    """Sent, received and expanded blockwise bytes == quantize_rowwise_torch of the token rows (H = 384: not a
    multiple of 512); a Recipe and its name give the same; MXFP8 still gives its blocked scales."""
    x, idx, w = _inputs(37, 384, 8, 2, routing)
    h = ref.build_layout(idx, 8)
    dq, sq = quantize_rowwise_torch(x)
    recv = ref.dispatch_send(x, w, h, BLOCKWISE)
    assert _same(recv.data, dq[h.send_token]) and _same(recv.scale, sq[h.send_token])
    tok = h.send_token[h.expand_row]
    for recipe in (BLOCKWISE, "blockwise"):
        data, scale, rw = ref.dispatch_fwd_quantized(x, w, h, recipe)
        assert scale.shape == (h.num_expanded, 3)
        assert _same(data, dq[tok]) and _same(scale, sq[tok])
        assert _same(rw, w[tok, h.expand_slot])
    rows, _ = ref.dispatch_fwd(x, w, h, BLOCKWISE)
    assert _same(rows, dequantize_rowwise_torch(dq, sq)[tok])
    data, scale, _ = ref.dispatch_fwd_quantized(x, w, h, MXFP8)
    q = mxfp8.quantize_torch(x, -1)
    assert _same(data, q.data[tok]) and _same(scale, mxfp8.to_blocked_grouped(q.scale[tok], h.group_sizes, "m"))
    with pytest.raises(ValueError, match="FP8 recipe"):
        ref.dispatch_fwd_quantized(x, w, h, None)


def test_reference_combine_backward_blockwise():
    """dy travels as its 1x128 bytes: d y = deq(q(dy)) * w and dw = sum_h deq(q(dy)) * y, in fp32."""
    x, idx, w = _inputs(29, 256, 8, 2, "random")
    h = ref.build_layout(idx, 8)
    g = torch.Generator().manual_seed(1)
    n = h.num_expanded
    dy = torch.randn(29, 256, generator=g).bfloat16()
    dy[:, 0] = 1e5  # a spike: 1x128 and 1x32 blocks give visibly different rows (test_public_dispatch_keeps...)
    y, wr = torch.randn(n, 256, generator=g).bfloat16(), torch.rand(n, generator=g)
    v = dequantize_rowwise_torch(*quantize_rowwise_torch(dy)).bfloat16()[h.send_token[h.expand_row]].float()
    dyr, dw = ref.combine_bwd(dy, y, wr, h, "blockwise")
    assert _same(dyr, (v * wr[:, None]).bfloat16()) and _same(dw, (v * y.float()).sum(-1))
    assert not _same(dyr, ref.combine_bwd(dy, y, wr, h, MXFP8)[0])  # the blocks matter


def test_public_dispatch_keeps_quantize_bool():
    """dispatch / combine(quantize=True) is MXFP8, False is raw rows; a recipe or a name works too, forward and
    backward."""
    x, idx, w = _inputs(21, 256, 8, 2, "random", seed=3)
    x[:4] = torch.randn(4, 256)  # finite rows: gradients comparable with torch.equal
    # a spike in column 0: its 1x128 block flushes columns 32-127 that MXFP8's 1x32 blocks keep (power-of-two
    # scales: without such a spread the two payloads differ only in the rare elements 2**-15 below their block's amax)
    x[:, 0] = 1e6

    def run(q):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        rows, rw, h = dispatch(xx, idx, ww, 8, None, q)
        out = combine(rows * 2.0, rw, h, q)
        out.sum().backward()
        return out, rows, xx.grad, ww.grad

    for a, b in (("mxfp8", True), (MXFP8, True), (None, False), ("blockwise", BLOCKWISE)):
        assert all(_same(s, t) for s, t in zip(run(a), run(b), strict=True)), (a, b)
    assert not _same(run(True)[1], run(BLOCKWISE)[1])


def test_blockwise_hidden_must_be_a_multiple_of_128():
    """H = 160 (a multiple of 32, not of 128): every entry names the block instead of failing in a reshape."""
    x, idx, w = _inputs(9, 160, 8, 2, "random")
    h = ref.build_layout(idx, 8)
    msg = "multiple of 128 for the blockwise payload"
    with pytest.raises(ValueError, match=msg):
        dispatch(x, idx, w, 8, None, "blockwise")
    with pytest.raises(ValueError, match=msg):
        ref.dispatch_fwd_quantized(x, w, h, "blockwise")
    with pytest.raises(ValueError, match=msg):
        ref.combine_bwd(x, x[h.send_token[h.expand_row]], w.reshape(-1)[: h.num_expanded], h, BLOCKWISE)
    ref.dispatch_fwd_quantized(x, w, h, "mxfp8")  # 160 = 5 MXFP8 blocks: fine


# ------------------------------------------------------------------------------------------------------------ GPU
def _runtime():
    from moe_ep.transport.nvshmem import buffer as ct  # noqa: PLC0415

    return ct, ct.init_runtime(None, 512, 1024, 8, 64, wire_bytes=4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "routing, t, h, k, dtype, capacity",
    [
        ("random", 100, 384, 2, torch.bfloat16, None),
        ("one_expert", 77, 640, 1, torch.float32, None),
        ("sparse", 64, 1024, 2, torch.bfloat16, None),
        ("random", 300, 128, 8, torch.bfloat16, None),
        ("random", 90, 640, 4, torch.bfloat16, 150),
    ],
)
def test_cuda_blockwise_payload_equals_reference(routing, t, h, k, dtype, capacity, monkeypatch):
    """The fused 1x128 dispatch: data and row-major scales == quantize_rowwise_torch of the token rows (rows past N:
    scales zero); the value dispatch and the dy dispatch == the reference transport's; MXFP8 unchanged."""
    monkeypatch.setenv("MOE_EP_FORCE_REFERENCE", "1")  # the reference transport's MXFP8 in pure torch (the spec)
    ct, rt = _runtime()
    dev = rt.device
    x, idx, w = _inputs(t, h, 8, k, routing, dtype, dev)
    opts = {} if capacity is None else {"capacity": capacity}
    rh = ref.build_layout(idx, 8, None, **opts)
    handle = ct.build_layout(idx, 8, None, **opts)
    n = rh.num_expanded
    tok = rh.send_token[rh.expand_row]
    dq, sq = quantize_rowwise_torch(x)
    data, scale, wb = ct.dispatch_fwd_quantized(x, w, handle, "blockwise")
    rt.check_errors()
    assert scale.shape == (handle.expand_capacity, h // 128) and scale.dtype == torch.uint8
    assert _same(data[:n], dq[tok]) and _same(scale[:n], sq[tok]), "fused blockwise bytes"
    assert not bool(scale[n:].any()), "scales past N"
    assert _same(wb[:n], w[tok, rh.expand_slot])
    rdata, rscale, _ = ref.dispatch_fwd_quantized(x, w, rh, BLOCKWISE)
    assert _same(data[:n], rdata) and _same(scale[:n], rscale), "fused blockwise vs the reference transport"

    md, ms, _ = ct.dispatch_fwd_quantized(x, w, handle, "mxfp8")
    q = ref.dispatch_send(x, w, rh, MXFP8)
    want = mxfp8.to_blocked_grouped(q.scale[rh.expand_row], rh.group_sizes, "m")
    assert _same(md[:n], q.data[rh.expand_row]) and _same(ms[: want.numel()], want), "fused MXFP8 bytes"

    rows, _ = ct.dispatch_fwd(x, w, handle, BLOCKWISE)
    assert _same(rows[:n], ref.dispatch_fwd(x, w, rh, BLOCKWISE)[0]) and not bool(rows[n:].any())

    g = torch.Generator().manual_seed(7)
    dy = (torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t)[:, None]).to(dtype).to(dev)
    dy[0, 130 % h] = float("nan")
    dy[1, 7] = float("-inf")
    y = torch.randn(n, h, generator=g).to(dtype).to(dev)
    wy = (torch.rand(n, generator=g) + 0.5).to(dev)
    pad = handle.expand_capacity - n
    yp = torch.cat([y, y.new_zeros(pad, h)])
    wp = torch.cat([wy, wy.new_zeros(pad)])
    for recipe in (BLOCKWISE, MXFP8, None):
        dyr, dw = ct.combine_bwd(dy, yp, wp, handle, recipe)
        rdyr, rdw = ref.combine_bwd(dy, y, wy, rh, recipe)
        assert _same(dyr[:n], rdyr) and not bool(dyr[n:].any()), recipe
        v = ref._rows(*ref.send_rows(dy, rh, recipe), dtype)[rh.expand_row].float()
        tol = 1e-5 * (v * y.float()).abs().sum(-1) + 1e-6
        bad = ((dw[:n] - rdw).abs() > tol) | (torch.isnan(dw[:n]) != torch.isnan(rdw))
        assert not bool(bad.any()), recipe
    rt.check_errors()


@pytest.mark.gpu
def test_cuda_blockwise_hidden_error():
    ct, rt = _runtime()
    x, idx, w = _inputs(9, 160, 8, 2, "random", torch.bfloat16, rt.device)
    handle = ct.build_layout(idx, 8, None)
    with pytest.raises(ValueError, match="multiple of 128 for the blockwise payload"):
        ct.dispatch_fwd_quantized(x, w, handle, "blockwise")
    with pytest.raises(ValueError, match="multiple of 128 for the blockwise payload"):
        ct.combine_bwd(
            x, x.new_zeros(handle.expand_capacity, 160), w.new_zeros(handle.expand_capacity), handle, BLOCKWISE
        )
    ct.dispatch_fwd_quantized(x, w, handle, "mxfp8")  # still in step: nothing was launched for the refused calls
    rt.check_errors()


@pytest.mark.gpu
def test_cuda_layer_blockwise_nvshmem_equals_nccl():
    """The cuda backend's blockwise layer at EP = 1 over both transports (the fused 1x128 dispatch and dy dispatch
    vs the reference transport around the same expert kernels): y, x.grad and the weight gradients bitwise equal;
    topk_w.grad within the dw bound (dot products over H in another order)."""
    from moe_ep.config import MoEConfig  # noqa: PLC0415
    from moe_ep.layer_cuda import routed_experts_cuda  # noqa: PLC0415

    _, rt = _runtime()
    dev = rt.device
    t, hd, f, e, k = 100, 384, 256, 8, 2
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, hd, generator=g).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    tw = torch.rand(t, k, generator=g).to(dev)
    w13 = (torch.randn(e, 2 * f, hd, generator=g) * hd**-0.5).bfloat16().to(dev)
    w2 = (torch.randn(e, hd, f, generator=g) * f**-0.5).bfloat16().to(dev)
    dy = torch.randn(t, hd, generator=g).bfloat16().to(dev)

    def run(transport):
        cfg = MoEConfig(hd, f, e, k, recipe="blockwise", transport=transport, max_tokens_per_rank=512)
        leaves = [v.clone().requires_grad_(True) for v in (x, tw, w13, w2)]
        y, _ = routed_experts_cuda(leaves[0], idx, leaves[1], leaves[2], leaves[3], None, cfg, None)
        (y.float() * dy.float()).sum().backward()
        return [y.detach()] + [v.grad for v in leaves]

    mine, want = run("nvshmem"), run("nccl")
    for i, name in ((0, "y"), (1, "x.grad"), (3, "w13.grad"), (4, "w2.grad")):
        assert _same(mine[i], want[i]), name
    # topk_w.grad: dw of the dy dispatch, a dot over H; 1e-4 of the largest entry covers the module docstring's
    # 1e-5 sum_h |v_h y_h| here (sum_h |v_h y_h| is a few times the largest |dw| for random rows)
    gap = (mine[2] - want[2]).abs().max()
    assert gap <= 1e-4 * want[2].abs().max() + 1e-6, f"topk_w.grad: {gap}"
