"""Pure-PyTorch converters from plain tensors to the Hopper GEMM kernels' operand formats, and host-side readers of
the NVSHMEM transport's device state: test and benchmark helpers (host group sizes, host syncs), not the library.
The references of the library's fast paths with the same signatures stay beside them (``*_torch``)."""

from __future__ import annotations

import torch

from moe_ep import mxfp8
from moe_ep.experts.reference import swiglu, swiglu_bwd
from moe_ep.experts.sm90.operands import (  # noqa: F401
    _cdiv,
    _host_sizes,
    colwise_scale_rows,
    prepare_weight_bf16_torch,
    weight_operand_ref,
    weight_t_operand_ref,
)
from moe_ep.mxfp8 import reference as mxfp8_reference  # noqa: F401
from moe_ep.mxfp8.format import colwise_prep_rows  # noqa: F401
from moe_ep.transport.nvshmem import layout
from moe_ep.transport.nvshmem.layout import CudaEPHandle
from moe_ep.transport.reference import RecvBuffers, payload_recipe


def colwise_prep_rows_used(group_sizes) -> int:
    """Rows of a prepared wgrad operand that its groups own (host sizes): ``sum_g 64 ceil(n_g / 64)``; the rest of
    the ``colwise_prep_rows`` bound is never written by the kernels.

    Example: sizes [40, 0, 8] -> 128 (rows 0-63 for group 0, 64-127 for group 2).
    """
    return sum(64 * _cdiv(max(int(n), 0), 64) for n in _host_sizes(group_sizes))


def prepare_colwise_bf16_torch(data: torch.Tensor, scale: torch.Tensor, group_sizes) -> torch.Tensor:
    """A wgrad operand in the grouped column-wise MXFP8 format (data e4m3 [M, C], scale u8 [>= ceil(M/32) + G, C]:
    ``colwise_operand_ref``) as exact bf16 with every group on a 64-row boundary -> bf16 [64 (ceil(M/64) + G), C]
    where group g is rows 64 poff_g .. (poff_g = sum_{h<g} ceil(n_h/64)), zero padded to a multiple of 64 rows: the
    reference of the prepared column operand ``mxfp8_cuda.quantize_grouped_dual`` writes (host group sizes; rows
    past the groups are zero here, the kernels leave them unwritten and nothing reads them).

    Example: sizes [40, 0, 8] -> group 0 at rows 0-39 (rows 40-63 zero), group 2 at rows 64-71 (72-127 zero).
    """
    sizes = _host_sizes(group_sizes)
    m, c = data.shape
    out = torch.zeros(colwise_prep_rows(m, len(sizes)), c, dtype=torch.bfloat16, device=data.device)
    deq = colwise_dequantize_ref(data, scale, sizes)
    start = poff = 0
    for rows in sizes:
        out[poff : poff + rows] = deq[start : start + rows].to(torch.bfloat16)
        start += rows
        poff += 64 * _cdiv(rows, 64)
    return out


def rowwise_operand_ref(x: torch.Tensor, group_sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] -> (e4m3 [M, K], u8 per-group blocked scales along M) for fprop/dgrad's ``a``."""
    q = mxfp8.quantize_torch(x, -1)
    sizes = torch.tensor(_host_sizes(group_sizes), dtype=torch.int64)
    return q.data, mxfp8.to_blocked_grouped(q.scale, sizes, "m")


def colwise_operand_ref(t: torch.Tensor, group_sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """t float [M, N] -> (e4m3 [M, N], u8 [ceil(M/32) + G, N]): wgrad's grouped column-wise format.

    Blocks of 32 rows restart at each group's first row (the last one zero padded), exactly as
    ``gemm.fake_quantize_grouped_cols``; block j of group g is scale row ``sum_{h<g} ceil(n_h/32) + j``.
    Unused scale rows are zero.
    """
    sizes = _host_sizes(group_sizes)
    m, n = t.shape
    data = torch.zeros(m, n, dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.zeros(colwise_scale_rows(m, len(sizes)), n, dtype=torch.uint8, device=t.device)
    start = boff = 0
    for rows in sizes:
        if rows:
            pad = (-rows) % 32
            seg = t[start : start + rows]
            if pad:
                seg = torch.cat([seg, seg.new_zeros(pad, n)])
            q = mxfp8.quantize_torch(seg, 0)
            data[start : start + rows] = q.data[:rows]
            scale[boff : boff + q.scale.shape[0]] = q.scale
        start += rows
        boff += _cdiv(rows, 32)
    return data, scale


def colwise_dequantize_ref(data: torch.Tensor, scale: torch.Tensor, group_sizes) -> torch.Tensor:
    """Inverse of :func:`colwise_operand_ref`: e4m3 [M, N] + u8 [>= ceil(M/32)+G, N] -> fp32 [M, N]."""
    sizes = _host_sizes(group_sizes)
    idx, boff = [], 0
    for rows in sizes:
        idx.append(boff + torch.arange(rows, device=data.device) // 32)
        boff += _cdiv(rows, 32)
    rows_scale = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64, device=data.device)
    s = scale[rows_scale].to(torch.int32)
    mult = torch.where(s == mxfp8.SCALE_NAN, float("nan"), mxfp8_reference._exp2_int((s - 127).clamp(-127, 127)))
    return data[: rows_scale.numel()].to(torch.float32) * mult


def quantize_grouped_dual_torch(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    apply_swiglu: bool = False,
    swiglu_dh: torch.Tensor | None = None,
    colwise: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`moe_ep.mxfp8.cuda.quantize_grouped_dual` (same signature, same bytes).

    x: [M, K] bf16 (or a: [M, 2K] bf16 with apply_swiglu, quantizing ``swiglu(a)`` [M, K] fp32; or a: [M, 2F]
    bf16 with swiglu_dh [M, F] bf16, quantizing ``swiglu_bwd(a, dh)`` [M, 2F] fp32); group_sizes: [G] int32 (read
    on the host: this is the specification, not the fast path), summing to M; colwise: "bf16" (the only layout).
    Returns (data [M, K] e4m3 row-wise, scale u8 ``to_blocked_grouped`` along M, the prepared wgrad operand bf16
    [64 (ceil(M/64) + G), K], None): the column operand is the values quantized in per-group 32-row column blocks
    (``colwise_operand_ref``), exactly dequantized into the prepared layout (``prepare_colwise_bf16_torch``; group
    g at row 64 * sum_{h<g} ceil(n_h/64); rows past the last group's 64-row block are zero here, the kernel leaves
    them unwritten).

    Example: sizes [40, 8] (M = 48): group 0's column blocks cover rows 0-31 and 32-39 (padded with 24 zero rows
    for its scale); its prepared rows are 0-39, group 1's are 64-71.
    """
    if colwise != "bf16":
        raise ValueError(f"colwise must be 'bf16' (the prepared wgrad operand), got {colwise!r}")

    h = swiglu_bwd(x, swiglu_dh) if swiglu_dh is not None else swiglu(x) if apply_swiglu else x
    sizes = group_sizes.to(device="cpu", dtype=torch.int32)
    if int(sizes.sum()) != h.shape[0]:
        raise ValueError(f"group sizes sum to {int(sizes.sum())}, expected M = {h.shape[0]}")
    q = mxfp8.quantize_torch(h, -1)
    scale = mxfp8.to_blocked_grouped(q.scale, sizes, "m")
    data_c, scale_c = colwise_operand_ref(h, [int(v) for v in sizes])
    return q.data, scale, prepare_colwise_bf16_torch(data_c, scale_c, [int(v) for v in sizes]), None


def grouped_wgrad_prepared_torch(a_prep, b_prep, group_sizes, num_rows: int, out_dtype=torch.float32):
    """Reference of :func:`moe_ep.experts.sm90.gemm.grouped_wgrad_prepared_out` (host group sizes; its arguments but
    ``out``).

    a_prep: bf16 [64 (ceil(M/64) + G), N], b_prep: bf16 [same rows, K] -> [G, N, K] out_dtype: group g is rows
    64 poff_g .. + n_g of both (poff_g = sum_{h<g} ceil(n_h/64)), reduced in fp32 (fp64 operands: in fp64);
    sizes sum to at most num_rows (M), as the kernel's contract.

    Example: sizes [40, 0, 8] -> out[0] from rows 0-39, out[1] = 0, out[2] from rows 64-71.
    """
    sizes = _host_sizes(group_sizes)
    if sum(sizes) > num_rows:
        raise ValueError(f"group sizes sum to {sum(sizes)}, more than M = {num_rows}")
    acc = torch.promote_types(a_prep.dtype, torch.float32)  # fp64 operands (tests' exact reference) stay fp64
    out = torch.zeros(len(sizes), a_prep.shape[1], b_prep.shape[1], dtype=acc, device=a_prep.device)
    poff = 0
    for gi, rows in enumerate(sizes):
        if rows:
            out[gi] = a_prep[poff : poff + rows].to(acc).t() @ b_prep[poff : poff + rows].to(acc)
        poff += 64 * _cdiv(rows, 64)
    return out.to(out_dtype)


def recv_buffers(handle: CudaEPHandle, recipe, hidden: int, dtype: torch.dtype = torch.bfloat16):
    """Views of what this rank received in the last :func:`dispatch_fwd` (valid until any rank starts the next
    dispatch use: once the expand signals DISP_FREE, a peer may overwrite them): the
    reference's RecvBuffers contract (data [R, H], scale [R, H // block] or None, local [R, K] int64, weight [R, K]
    fp32). recipe: the payload's (a Recipe, its name, or None for raw rows). Host sync (reads R): tests only."""
    rt = handle.runtime
    torch.cuda.current_stream(rt.device).synchronize()  # host sync: a test helper
    r = min(int(handle.info[layout._I_R].item()), handle.recv_capacity)
    rec = payload_recipe(recipe)
    return _views(rt, r, hidden, handle.top_k, rec.act_block if rec is not None else 0, dtype, RecvBuffers)


def _views(rt, r, hid, k, block, dtype, cls):
    sym = rt.sym
    o = rt.offsets
    meta = sym[o["disp_meta"] : o["disp_meta"] + r * 3 * k * 4].view(torch.int32).view(r, 3 * k)
    if block:
        data = sym[o["disp_data"] : o["disp_data"] + r * hid].view(torch.float8_e4m3fn).view(r, hid)
        scale = sym[o["disp_scale"] : o["disp_scale"] + r * (hid // block)].view(r, hid // block)
    else:
        es = torch.empty(0, dtype=dtype).element_size()
        data = sym[o["disp_data"] : o["disp_data"] + r * hid * es].view(dtype).view(r, hid)
        scale = None
    return cls(data, scale, meta[:, :k].long(), meta[:, k : 2 * k].contiguous().view(torch.float32))


def host_counts(handle) -> dict:
    """A :class:`~moe_ep.transport.nvshmem.layout.CudaEPHandle`'s device counts read on the host (a host sync)."""
    self = handle
    info = self.info.cpu().tolist()  # NOTE: host sync (tests and debugging only)
    w, lcl = self.ep_size, self.num_local_experts
    cnt = self.counts.cpu()
    me = self.runtime.rank
    return {
        "R": info[layout._I_R],
        "N": info[layout._I_N],
        "send_splits": cnt[me, :w].tolist(),
        "recv_splits": cnt[:, me].tolist(),
        "group_sizes": [int(v) for v in self.group_sizes.cpu()],
        "gstart": info[layout._I_GSTART : layout._I_GSTART + lcl + 1],
        "tile_off": info[layout._I_GSTART + lcl + 1 : layout._I_GSTART + 2 * lcl + 2],
        "dropped": info[layout._i_dropped(lcl)],
    }
