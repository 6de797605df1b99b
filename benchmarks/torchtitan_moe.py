"""torchtitan's MoE layer with expert parallelism, re-implemented in plain PyTorch: the ``torchtitan_bf16`` baseline of
``bench_layer.py``, built on the same weights as an ``moe_ep.MoE`` so both compute the same function.

Followed step by step from pytorch/torchtitan at b5bcd76 (2026-08-21), read for the facts, code written here:
``torchtitan/models/common/moe.py`` (``TokenChoiceTopKRouter``, ``GroupedExperts``, ``MoE``),
``torchtitan/models/common/token_dispatcher.py`` (``AllToAllTokenDispatcher``) and ``torchtitan/ops/scatter_add.py``.
One forward, per rank, with T tokens, E experts (E_l = E / W local), top-k K:

  router    gate in fp32 (torchtitan: ``Linear`` under fp32 autocast), softmax scores [T, E], ``topk(scores +
            expert_bias, K, sorted=False)`` (expert_bias: the aux-loss-free balancing buffer, zeros here), the top-k
            scores gathered from the unbiased scores and renormalized (``route_norm``: / (sum + 1e-20));
            a one-hot routing map [T, E] summed into per-expert counts, added to the ``tokens_per_expert`` buffer
  layout    ``argsort(ids.view(-1), stable=True)`` (slots sorted by expert), the sorted scores, the row gather
            ``x[order // K]`` [T*K, H]; counts exchanged with ``all_to_all_single`` (functional collective); input
            splits copied to the host non-blocking, output splits blocking, both ``.tolist()``: THE HOST SYNC
  dispatch  ``all_to_all_single_autograd`` of the bf16 rows (its backward is the reverse all-to-all), then
            ``_permute``: one index gather from rank-major (rank, local expert) segments to expert-major order
  experts   ``GroupedExperts``: offsets = int32 cumsum of the per-expert counts; ``silu(x @ w1^T) * (x @ w3^T)`` and
            ``@ w2^T``, three ``torch._grouped_mm`` calls (w1, w3 separate, as torchtitan keeps them)
  combine   ``_unpermute`` (``new_empty`` + index put), the reverse ``all_to_all_single_autograd``, rows scaled by their
            top-k scores in fp32 and cast back to bf16, then a deterministic ``scatter_add`` into zeros [T, H]
            (torchtitan's custom op: ``torch.use_deterministic_algorithms(True)`` around ``Tensor.scatter_add``;
            backward: the gradient passes through to ``out`` and is gathered for ``src``)

Group padding: torchtitan padded every expert's group to TOKEN_GROUP_ALIGN_SIZE_M rows (8 for bf16) with a
triton index kernel until fe80b63 (2026-04-02), which removed it from the bf16 path "as it is not required by default
bf16 grouped mm" (it survives only in ``TorchAOTokenDispatcher`` for FP8 / MXFP8 GEMMs). ``align=1`` (default) is
torchtitan today; ``align=8`` (or 16, 32) is the earlier behaviour: a zero row appended to the received rows,
``max_len = round_up(rows + E_l * align, align)`` permuted indices with the padding slots pointing at the zero row,
group sizes ``round_up(max(n_e, align), align)``, and the unpermute writing into ``rows + 1`` rows and dropping the
last. The indices here come from torch ops (repeat_interleave with a host-known output size), not the triton kernel;
neither syncs the host.

FP8 rowwise experts (``gemm="fp8_rowwise"``): torchtitan's ``Float8GroupedExpertsConverter``
(``torchtitan/components/quantization/float8.py`` at b5bcd76, after 42353da "use stateless grouped MM", the Hopper
recipe of ``--model.converters quantize.grouped_mm.float8``) keeps the expert parameters plain and routes each of the
three grouped GEMMs through torchao's ``torchao.prototype.moe_training.utils._quantize_then_scaled_grouped_mm(A, B_t,
config=Float8TrainingOpConfig(), offs=offs)``, which (torchao 0.18) calls
``torchao.prototype.moe_training.fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm``: an autograd function that
quantizes per call, every forward and backward, nothing cached across calls:
  forward   A [M, K] rowwise (one scale per row) and B_t [E, K, N] per (expert, output column), E4M3 with
            power-of-2 scales (fused triton kernels), ``torch._scaled_grouped_mm(..., use_fast_accum=True)`` -> bf16
  backward  dA: dY rowwise and the bf16 B re-quantized along the new reduction axis (per (expert, K) over N); dB: dY
            and the saved bf16 A quantized per (group, column) over each expert's rows (one fused triton kernel), a
            2D x 2D scaled grouped GEMM; out in bf16
so x is quantized twice per direction (w1 and w3 are separate GEMMs, as in torchtitan) and the weights every call.
``Float8TrainingOpConfig``'s default ``pad_token_groups_for_grouped_mm=False`` leaves the groups' alignment to the
dispatcher (torchao: "group sizes must be divisible by 16"; torchtitan: "16 byte alignment / 1 byte per elem"): the
converter swaps in ``TorchAOTokenDispatcher`` with ``pad_multiple=16``, whose permute is torchao's
``torchao.prototype.moe_training.ep.permute.permute_and_pad`` (a triton index kernel; the same layout as ``align``
above: a zero row appended, ``round_up(max(n_e, 16), 16)`` rows per group, padding slots at the zero row). Here too:
``gemm="fp8_rowwise"`` uses ``align=16`` (a multiple of 16 if given) and ``permute_and_pad``; router, layout,
all-to-all, unpermute and combine are the bf16 layer's. torchao is imported when such a layer is built (ImportError
naming the missing package otherwise); :func:`torchao_fp8_rowwise_info` says which version and functions ran. Not
reproduced: torch.compile, which torchtitan recommends for this recipe (it fuses the SwiGLU's elementwise ops; the
quantization kernels are triton kernels in eager mode too).

Not reproduced: DTensor / local_map wrapping, SPMD type checks, TP / SP, shared experts, compile. The layer takes
plain tensors on the EP process group, as the torchtitan dispatcher does after ``to_local()``.

Phase timing, with moe_ep.profiling's convention (``mark(name)`` ENDS phase ``name``, which began at the previous
mark): set ``layer.phases`` to a :class:`PhaseRecorder` for one step. The forward marks router, layout (the slot
sort, the row gather, the count exchange and the host sync), dispatch (all-to-all + permute), experts_fwd and
combine (fp8_rowwise: experts_fwd / experts_bwd include torchao's quantization, which runs inside its GEMM
function); tensor hooks mark the backward's combine_bwd (up to the experts' output gradient), experts_bwd (up to their
input gradient) and dispatch_bwd (the permute's and the all-to-all's backward, up to the gradient of the gathered
rows); the caller marks what is left of the backward (the row gather's and the router's backward) after it returns.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

GEMMS = ("bf16", "fp8_rowwise")  # TorchtitanMoE(gemm=...)
FP8_GROUP_ALIGN = 16  # torchtitan's pad_multiple for FP8 grouped GEMMs


def load_torchao_fp8_rowwise() -> dict:
    """torchao's FP8 rowwise MoE training path, imported now: {"grouped_mm": the differentiable grouped GEMM,
    "config": its ``Float8TrainingOpConfig()``, "permute_and_pad": the padded permute, "version": torchao's}.

    Raises ImportError naming what is missing (torchao itself, a torchao without ``Float8TrainingOpConfig`` (< 0.18),
    or triton, which torchao's kernels import).
    """
    try:
        import torchao  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "gemm='fp8_rowwise' needs the torchao package (torchao==0.18.0: pip install torchao==0.18.0)"
        ) from exc
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: PLC0415
        from torchao.prototype.moe_training.ep.permute import permute_and_pad  # noqa: PLC0415
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            f"gemm='fp8_rowwise': torchao {getattr(torchao, '__version__', '?')} lacks the FP8 rowwise MoE training "
            f"path of torchao 0.18 (torchao.prototype.moe_training: Float8TrainingOpConfig, "
            f"_quantize_then_scaled_grouped_mm, ep.permute.permute_and_pad), or a package it imports is missing "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return {
        "grouped_mm": _quantize_then_scaled_grouped_mm,
        "config": Float8TrainingOpConfig(),
        "permute_and_pad": permute_and_pad,
        "version": getattr(torchao, "__version__", "unknown"),
    }


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def torchao_fp8_rowwise_info(ao: dict | None = None) -> dict:
    """What ``gemm="fp8_rowwise"`` runs, for the results: torchao's version, the functions and the config fields (or
    {"error": ...} when torchao cannot be imported)."""
    if ao is None:
        try:
            ao = load_torchao_fp8_rowwise()
        except ImportError as exc:
            return {"error": str(exc)}
    cfg = ao["config"]
    return {
        "torchao": ao["version"],
        "grouped_mm": _qualname(ao["grouped_mm"]),
        "dispatches_to": "torchao.prototype.moe_training.fp8_grouped_mm._to_fp8_rowwise_then_scaled_grouped_mm",
        "config": {
            "type": type(cfg).__name__,
            **{
                k: str(getattr(cfg, k))
                for k in ("float8_dtype", "out_dtype", "pad_token_groups_for_grouped_mm")
                if hasattr(cfg, k)
            },
        },
        "permute": _qualname(ao["permute_and_pad"]),
        "group_align": FP8_GROUP_ALIGN,
        "quantized": "per call: activations rowwise, weights per (expert, column), dy rowwise and per group column; "
        "power-of-2 scales, E4M3, torch._scaled_grouped_mm use_fast_accum=True",
    }


class PhaseRecorder:
    """Marks along one step on the current stream: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

    As ``moe_ep.profiling.PhaseTimer``: created with a "start" mark; ``mark(name)`` ends phase ``name`` (from the
    previous mark); ``summary()`` (after a device synchronize) gives {name: ms} summed over repeats, in the order first
    seen.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, t0), (name, t1) in zip(self.marks, self.marks[1:], strict=False):
            ms = t0.elapsed_time(t1) if self.cuda else (t1 - t0) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out


class _DeterministicScatterAdd(torch.autograd.Function):
    """torchtitan's ``deterministic_scatter_add``: ``out.scatter_add(0, index, src)`` with deterministic algorithms on.

    ``index`` is [N, H] (an expanded [N, 1] view); backward: d_out = g, d_src = g.gather(0, index).
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:  # noqa: D102
        prev, prev_warn = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(True, warn_only=False)
        try:
            res = out.scatter_add(0, index, src)
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        ctx.save_for_backward(index)
        return res

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        (index,) = ctx.saved_tensors
        return g, None, torch.gather(g, 0, index)


def _hook_mark(t: torch.Tensor, rec: PhaseRecorder | None, name: str) -> None:
    """Mark phase ``name`` when the backward reaches ``t`` (its gradient has been computed)."""
    if rec is not None and t.requires_grad:
        t.register_hook(lambda g: rec.mark(name))


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts``: this rank's experts, w1 / w3 [E_l, F, H] (gate / up), w2 [E_l, H, F].

    A module of its own (as in torchtitan) so that FSDP2 can shard the expert weights on another mesh than the router
    (``fully_shard(layer.experts, mesh=dp)``) and all-gathers them in its forward pre-hook.
    forward(x [R, H] expert-major, sizes [E_l]) -> [R, H] x.dtype: three grouped GEMMs, ``torch._grouped_mm`` in
    bf16 (rows past the last offset, i.e. the padding tail, are left unspecified by ``_grouped_mm`` and discarded by
    the unpermute). ``gemm="fp8_rowwise"``: each through torchao's ``_quantize_then_scaled_grouped_mm`` with
    ``Float8TrainingOpConfig()`` (torchtitan's ``Float8GroupedExperts._grouped_mm``; every group's size a multiple of
    16, which the layer's padded permute gives).
    """

    def __init__(
        self,
        num_local: int,
        hidden: int,
        ffn_hidden: int,
        device=None,
        dtype=torch.bfloat16,
        *,
        gemm: str = "bf16",
        torchao_fns: dict | None = None,
    ) -> None:
        super().__init__()
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_local, ffn_hidden, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn_hidden, **kw))
        self.w3 = nn.Parameter(torch.empty(num_local, ffn_hidden, hidden, **kw))
        self.gemm = gemm
        self._ao = None
        if gemm == "fp8_rowwise":
            if hidden % 16 or ffn_hidden % 16:
                raise ValueError(f"fp8_rowwise needs hidden and ffn_hidden divisible by 16, got {hidden}, {ffn_hidden}")
            self._ao = torchao_fns if torchao_fns is not None else load_torchao_fp8_rowwise()

    def _grouped_mm(self, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self._ao is None:
            return torch._grouped_mm(a, b_t, offs=offs)
        return self._ao["grouped_mm"](a, b_t, config=self._ao["config"], offs=offs)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(sizes, dim=0, dtype=torch.int32)
        xb = x.bfloat16()
        h = F.silu(self._grouped_mm(xb, self.w1.bfloat16().transpose(-2, -1), offs))
        h = h * self._grouped_mm(xb, self.w3.bfloat16().transpose(-2, -1), offs)
        return self._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs).type_as(x)


class TorchtitanMoE(nn.Module):
    """torchtitan's token-choice top-k MoE over all-to-all expert parallelism (see the module docstring).

    Parameters: ``gate`` [E, H] (router), ``experts.w1`` / ``experts.w3`` [E_l, F, H], ``experts.w2`` [E_l, H, F]
    (also readable as ``w1`` / ``w2`` / ``w3``); buffers ``expert_bias`` [E] and ``tokens_per_expert`` [E] (fp32).
    ``ep_group``: the EP process group (None: one rank owns every expert). ``gemm``: "bf16" (``torch._grouped_mm``)
    or "fp8_rowwise" (torchao's FP8 rowwise grouped GEMM, with torchao's padded permute; see the module docstring).
    ``align``: rows per group multiple (default 1 for bf16, 16 for fp8_rowwise, which needs a multiple of 16).
    ``torchao_fns``: what :func:`load_torchao_fp8_rowwise` returns (default: imported now), for stand-ins in tests.
    forward(x [..., H]) -> y, x's shape and dtype.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        ep_group=None,
        *,
        route_norm: bool = True,
        route_scale: float = 1.0,
        align: int | None = None,
        device=None,
        dtype=torch.bfloat16,
        gemm: str = "bf16",
        torchao_fns: dict | None = None,
    ) -> None:
        super().__init__()
        import torch.distributed as dist  # noqa: PLC0415

        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by the EP size {self.ep_size}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if align is None:
            align = FP8_GROUP_ALIGN if gemm == "fp8_rowwise" else 1
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        if gemm == "fp8_rowwise" and align % FP8_GROUP_ALIGN:
            raise ValueError(f"gemm='fp8_rowwise' needs groups padded to a multiple of {FP8_GROUP_ALIGN}, got {align}")
        if gemm == "fp8_rowwise" and torchao_fns is None:
            torchao_fns = load_torchao_fp8_rowwise()
        self.hidden, self.ffn_hidden, self.num_experts, self.top_k = hidden, ffn_hidden, num_experts, top_k
        self.num_local = num_experts // self.ep_size
        self.route_norm, self.route_scale, self.align = route_norm, route_scale, align
        kw = dict(device=device, dtype=dtype)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, **kw))
        self.experts = GroupedExperts(self.num_local, hidden, ffn_hidden, **kw, gemm=gemm, torchao_fns=torchao_fns)
        self.gemm = gemm
        # fp8_rowwise: torchtitan's TorchAOTokenDispatcher permutes (and pads) with torchao's permute_and_pad
        self._permute_and_pad = None if torchao_fns is None else torchao_fns["permute_and_pad"]
        self.gemm_info = {"gemm": "bf16"} if torchao_fns is None else torchao_fp8_rowwise_info(torchao_fns)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.phases: PhaseRecorder | None = None
        self.scatter_mode = "deterministic"  # "atomic" if this torch build has no deterministic scatter_add here

    # the expert weights under their pre-GroupedExperts names (read-only views of the submodule's parameters)
    w1 = property(lambda self: self.experts.w1)
    w2 = property(lambda self: self.experts.w2)
    w3 = property(lambda self: self.experts.w3)

    # ---- weights shared with an moe_ep.MoE
    @torch.no_grad()
    def load_from_moe_ep(self, layer: nn.Module) -> None:
        """Copy ``layer``'s router and expert weights (moe_ep layout: w13 = [gate rows | up rows]) into this layer."""
        f = self.ffn_hidden
        w13 = layer.experts.w13
        self.gate.copy_(layer.router.weight)
        self.w1.copy_(w13[:, :f])
        self.w3.copy_(w13[:, f:])
        self.w2.copy_(layer.experts.w2)

    def grads_moe_ep_layout(self) -> dict[str, torch.Tensor | None]:
        """This layer's parameter gradients in moe_ep's layout: dw13 [E_l, 2F, H], dw2, drouter."""
        g13 = None if self.w1.grad is None else torch.cat([self.w1.grad, self.w3.grad], dim=1)
        return {"dw13": g13, "dw2": self.w2.grad, "drouter": self.gate.grad}

    # ---- the layer
    def _mark(self, name: str) -> None:
        if self.phases is not None:
            self.phases.mark(name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (top-k scores [T, K] fp32, expert ids [T, K] int64, per-expert counts [E] int64)."""
        top, ids, counts, _ = self._route(x)
        return top, ids, counts

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`route` plus the softmax scores [T, E] fp32 (for a load-balancing loss)."""
        scores = torch.softmax(F.linear(x.float(), self.gate.float()), dim=-1)
        _, ids = torch.topk(scores + self.expert_bias, k=self.top_k, dim=-1, sorted=False)
        top = scores.gather(-1, ids)
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * self.route_scale
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        return top, ids, counts, scores

    def _permute_indices(self, recv_counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Rank-major (rank, local expert) segments -> expert-major order (padded per group when align > 1).

        recv_counts [W * E_l] (rank-major), rows = their sum (known on the host from the splits) -> (indices into the
        received rows (``rows`` = the appended zero row when padding), group sizes [E_l], length of the permuted rows).
        """
        w, el, a, dev = self.ep_size, self.num_local, self.align, recv_counts.device
        t_mat = recv_counts.view(w, el)
        in_starts = (recv_counts.cumsum(0) - recv_counts).view(w, el)
        if a == 1:
            lens, starts = t_mat.t().reshape(-1), in_starts.t().reshape(-1)
            total, sizes, pad = rows, t_mat.sum(0), None
        else:
            n_e = t_mat.sum(0)
            sizes = (torch.clamp_min(n_e, a) + a - 1) // a * a
            total = -(-(rows + el * a) // a) * a
            lens = torch.cat(
                [torch.cat([t_mat.t(), (sizes - n_e)[:, None]], 1).reshape(-1), (total - sizes.sum())[None]]
            )
            starts = torch.cat([in_starts.t(), torch.full((el, 1), rows, device=dev, dtype=in_starts.dtype)], 1)
            starts = torch.cat([starts.reshape(-1), torch.full((1,), rows, device=dev, dtype=in_starts.dtype)])
            pad = torch.zeros(el, w + 1, dtype=torch.bool, device=dev)
            pad[:, w] = True
            pad = torch.cat([pad.reshape(-1), torch.ones(1, dtype=torch.bool, device=dev)])
        seg = torch.arange(lens.shape[0], device=dev).repeat_interleave(lens, output_size=total)
        out_starts = lens.cumsum(0) - lens
        idx = starts[seg] + torch.arange(total, device=dev) - out_starts[seg]
        if pad is not None:
            idx = torch.where(pad[seg], torch.full_like(idx, rows), idx)
        return idx, sizes, total

    def _scatter_add(self, out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if self.scatter_mode == "deterministic":
            try:
                return _DeterministicScatterAdd.apply(out, index, src)
            except RuntimeError as exc:  # no deterministic scatter_add in this build: say so in the results
                if "determinis" not in str(exc):
                    raise
                self.scatter_mode = "atomic"
        return out.scatter_add(0, index, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)[0]

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> (y: x's shape and dtype, softmax scores [T, E] fp32, per-expert counts [E] int64)."""
        from torch.distributed._functional_collectives import (  # noqa: PLC0415
            all_to_all_single,
            all_to_all_single_autograd,
        )

        rec = self.phases
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        k, w = self.top_k, self.ep_size
        top, ids, counts, scores = self._route(x)
        self._mark("router")

        # dispatch: slots sorted by expert, rows gathered, split sizes exchanged and read on the host
        order = torch.argsort(ids.view(-1), stable=True)
        top_sorted = top.view(-1)[order]
        tok = order // k
        routed = x[tok]
        _hook_mark(routed, rec, "dispatch_bwd")
        if w > 1:
            with torch.no_grad():
                recv = all_to_all_single(counts.view(w, -1), None, None, group=self.ep_group)
                recv = torch.ops._c10d_functional.wait_tensor(recv).reshape(-1)
                in_splits = counts.view(w, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=True)
                out_splits = recv.view(w, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=False)  # NOTE: host sync
                in_splits, out_splits = in_splits.tolist(), out_splits.tolist()
            self._mark("layout")
            routed = all_to_all_single_autograd(routed, out_splits, in_splits, self.ep_group)
            rows = sum(out_splits)
        else:
            recv, rows = counts, routed.shape[0]
            self._mark("layout")
        if self._permute_and_pad is not None:  # torchao's: a zero row appended, padding slots at -1 (that row)
            in_shape, routed, perm, sizes, _ = self._permute_and_pad(routed, recv, w, self.num_local, self.align)
        else:
            with torch.no_grad():
                perm, sizes, _ = self._permute_indices(recv, rows)
            if self.align > 1:
                routed = torch.vstack((routed, routed.new_zeros(routed.shape[-1])))
            in_shape = routed.shape
            routed = routed[perm, :]
        self._mark("dispatch")

        _hook_mark(routed, rec, "experts_bwd")
        out = self.experts(routed, sizes)
        _hook_mark(out, rec, "combine_bwd")
        self._mark("experts_fwd")

        # combine: unpermute, all-to-all back, scale by the top-k scores, deterministic scatter-add per token
        unperm = out.new_empty(in_shape)
        unperm[perm, :] = out
        if self.align > 1:
            unperm = unperm[:-1]
        if w > 1:
            unperm = all_to_all_single_autograd(unperm, in_splits, out_splits, self.ep_group)
        scaled = (unperm.to(torch.float32) * top_sorted.reshape(-1, 1)).to(unperm.dtype)
        y = self._scatter_add(torch.zeros_like(x), tok.reshape(-1, 1).expand(-1, self.hidden), scaled)
        self._mark("combine")
        return y.reshape(shape), scores, counts


class TorchtitanMoELayer(TorchtitanMoE):
    """:class:`TorchtitanMoE` as a drop-in MoE of ``launch.model.MoETransformer`` (``launch/train.py --baseline
    torchtitan``): built from the same :class:`moe_ep.MoEConfig` and ("dp", "ep") mesh as ``moe_ep.MoE``, fp32 master
    parameters (FSDP2's mixed precision casts them, as for ``moe_ep.MoE``), and the same training objective.

    forward(x [..., H]) -> (y: x's shape and dtype, aux_loss: fp32 scalar, already weighted by ``cfg.aux_loss_coef``).
    The aux loss is moe_ep's (``moe_ep.router.route``): E * sum_e f_e * P_e with f_e the fraction of this rank's T * K
    assignments that go to expert e and P_e the mean softmax score of e (torchtitan itself balances with the
    ``expert_bias`` buffer instead; here it stays zero). Routing is moe_ep's too: fp32 softmax, top-k, renormalized.
    Dropless only (``cfg.capacity_factor`` must be None). The model's initialization protocol: ``router_weight`` (the
    [E, H] gate) and ``set_expert_weights_(i, w13, w2)`` (local expert i from moe_ep's layout), so that a model of
    either layer starts from the same weights.
    """

    def __init__(self, cfg, mesh=None) -> None:
        if cfg.capacity_factor is not None:
            raise ValueError("the torchtitan baseline is dropless: capacity_factor must be None")
        if not cfg.renormalize:
            raise ValueError("the torchtitan baseline renormalizes the top-k scores (cfg.renormalize must be True)")
        group = None
        if mesh is not None:
            ep_mesh = mesh["ep"]
            group = ep_mesh.get_group() if ep_mesh.size() > 1 else None
        super().__init__(cfg.hidden, cfg.ffn_hidden, cfg.num_experts, cfg.top_k, group, dtype=torch.float32)
        self.aux_loss_coef = cfg.aux_loss_coef

    @property
    def router_weight(self) -> nn.Parameter:
        return self.gate

    @torch.no_grad()
    def set_expert_weights_(self, i: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Local expert ``i`` from moe_ep's layout: w13 [2F, H] = [gate rows | up rows], w2 [H, F]."""
        f = self.ffn_hidden
        self.experts.w1[i].copy_(w13[:f])
        self.experts.w3[i].copy_(w13[f:])
        self.experts.w2[i].copy_(w2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y, scores, counts = self._forward(x)
        t = scores.shape[0]
        frac = counts.to(torch.float32) / max(t * self.top_k, 1)
        mean_p = scores.mean(0) if t else scores.new_zeros(self.num_experts)
        aux = self.num_experts * (frac * mean_p).sum()
        return y, aux * self.aux_loss_coef
