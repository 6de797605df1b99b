"""Process groups for expert parallelism."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_ep(ep_size: int, dp_size: int | None = None, backend: str | None = None) -> DeviceMesh:
    """Create the ("dp", "ep") DeviceMesh; rank r of an EP group owns experts [r*E/ep, (r+1)*E/ep).

    Initializes torch.distributed from the torchrun environment when needed: nccl with a GPU (and sets the
    CUDA device from LOCAL_RANK), gloo otherwise. ``dp_size`` defaults to world_size // ep_size.
    Ranks are laid out EP-innermost: global rank = dp_index * ep_size + ep_index.
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    if ep_size <= 0 or world % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the world size {world}")
    if dp_size is None:
        dp_size = world // ep_size
    if dp_size * ep_size != world:
        raise ValueError(f"dp_size * ep_size = {dp_size * ep_size} != world size {world}")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dp_size, ep_size), mesh_dim_names=("dp", "ep"))


_finish_calls = 0  # finish() calls in this process (the store key of each rendezvous)


def finish(mesh: DeviceMesh | None = None, timeout_s: float = 120.0) -> None:
    """Leave torch.distributed without racing a peer: call once at the end of a run, on every rank.

    1. a barrier on each group of ``mesh`` (its "dp" and "ep" groups; FSDP2 and the dispatch run their
       collectives there) and on the default group: every rank has finished every collective it issued;
    2. a rendezvous through the default store (no gloo/nccl traffic): every rank knows that every peer got there,
       so nobody is still inside a collective when a peer closes its connections; rank 0 (the store's host
       under env://) then waits until every peer has made its last store call;
    3. ``destroy_process_group``.
    Why: with only step 3 (or step 1 + 3), a rank that tears its gloo connections down while a slower peer is
    still receiving the last collective's messages can abort that peer at exit ("terminate called without an
    active exception"; seen once in CI on the 4-rank CPU training test). A no-op when not initialized.
    """
    if not dist.is_initialized():
        return
    if mesh is not None:
        for name in mesh.mesh_dim_names or ():
            dist.barrier(group=mesh.get_group(name))
    dist.barrier()
    # NOTE: host sync (teardown only). The default store is private API, present since torch 1.x and in 2.13.
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    global _finish_calls
    _finish_calls += 1  # every rank calls finish equally often: the key is fresh even if the store outlives a group
    key = f"moe_ep/finish/{_finish_calls}"
    deadline = time.monotonic() + timeout_s

    def wait_all(k: str, what: str) -> None:
        while store.add(k, 0) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"finish(): not every rank of {world} {what} within {timeout_s} s")
            time.sleep(0.002)

    store.add(key, 1)
    wait_all(key, "arrived")
    # A second count: a rank adds to it after its last store call. Rank 0 hosts the store under the env://
    # rendezvous (torchrun's agent hosts it otherwise), so it leaves only once every peer is done polling;
    # without this a peer's last poll could reach a store whose process had exited
    # (tests/test_parallel_finish.py forces that with a slow poller).
    store.add(f"{key}/left", 1)
    if dist.get_rank() == 0:
        wait_all(f"{key}/left", "left the rendezvous")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# FSDP2 on the ("dp", "ep") mesh
# ---------------------------------------------------------------------------------------------------------


def world_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over all ranks of the 2-D ("dp", "ep") mesh, named "dp_ep".

    ``DeviceMesh._flatten`` (private but what torchtitan uses; present in torch 2.13) reuses the ranks of
    the 2-D mesh in row-major order, so its rank order is the global rank order and no new process group is
    created on a second call with the same name.
    """
    return mesh._flatten("dp_ep")


def _needs_sum_only(group_size: int) -> bool:
    """Whether an FSDP unit whose shard group has ``group_size`` ranks must reduce with plain SUM.

    gloo rejects the ReduceOp.PREMUL_SUM that FSDP2 uses to apply a custom gradient divide factor
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so on gloo we force SUM + a post-division. But with a
    shard group of ONE rank and a custom factor, torch 2.13's ``foreach_reduce`` divides by the factor in its
    single-rank copy AND again as the post-divide (grads come out ``factor`` times too small; seen on CPU with
    dp=1), so there we must leave the default path, which divides exactly once and needs no collective.
    NCCL supports PREMUL_SUM / AVG for fp32 and bf16 reductions: no forcing.
    """
    return dist.get_backend() == "gloo" and group_size > 1


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: list[torch.nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    mxfp8_expert_gather: bool = False,
    fp8_expert_gather: bool = False,
) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) on the ("dp", "ep") mesh, in place; returns ``model``.

    - The ``experts`` module of every :class:`moe_ep.MoE` becomes its own FSDP unit on the "dp" sub-mesh:
      each EP rank holds different experts, so they can only be sharded across the ranks that hold the SAME
      experts (same EP index). Its gradient divide factor is set to the WORLD size (dp * ep), not dp: the EP
      combine-backward already sums each expert's gradient over the tokens of all ``ep`` ranks of its group,
      so after FSDP's reduce-scatter over "dp" the sum covers every rank's tokens once, and dividing by the
      world size gives the same mean-over-ranks gradient as every other parameter gets.
    - Each of ``blocks`` (default ``model.blocks``) and then the root become units on the flattened 1-D mesh
      over all ranks (:func:`world_mesh`), so non-expert parameters are sharded over every rank.
    - ``param_dtype`` / ``reduce_dtype``: :class:`MixedPrecisionPolicy` (e.g. bf16 params with fp32 gradient
      reduction on GPU; leave ``param_dtype=None`` on CPU to train in fp32).
    - ``fp8_expert_gather``: the experts' all-gather moves FP8 bytes in each layer's own recipe (``cfg.recipe``),
      quantized from the master weights once per optimizer step: "mxfp8" (:mod:`moe_ep.experts.fsdp_mxfp8`, 2 + 1/16
      bytes per element: both quantizations), "blockwise" (:mod:`moe_ep.experts.fsdp_blockwise`, 1 + 1/16384: data
      and 128x128 scales). Every MoE must have an FP8 recipe (not "bf16") and its local experts must split evenly
      over "dp" (blockwise: N and K multiples of 128 too). ``mxfp8_expert_gather``: the same, requiring every MoE's
      recipe to be "mxfp8" (the earlier switch, kept).

    FSDP all-gathers a unit's weights in the pre-hook of its forward: the reference backend calls ``experts(...)``,
    the cuda backend runs the layer through ``experts.run`` (an FSDP forward method, see :meth:`moe_ep.MoE.forward`).
    Initial weights must already be identical where they are replicated before sharding (FSDP2 does not
    broadcast): non-expert parameters on every rank, experts on ranks of the same EP index; see
    :func:`broadcast_params`. Call before building the optimizer.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .experts.fsdp_blockwise import use_blockwise_all_gather
    from .experts.fsdp_mxfp8 import use_mxfp8_all_gather
    from .layer import MoE  # here, not at module level: moe_ep/__init__ imports layer before parallel

    fp8_gathers = {"mxfp8": use_mxfp8_all_gather, "blockwise": use_blockwise_all_gather}  # recipe -> installer

    world = world_mesh(mesh)
    dp = mesh["dp"]
    world_size = world.size()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for recipe in {moe.cfg.recipe for moe in moes}:  # every layer checked before any is sharded
        if mxfp8_expert_gather and recipe != "mxfp8":
            raise ValueError(
                f"mxfp8_expert_gather needs MoE layers with quantize=True and recipe 'mxfp8', got {recipe!r} "
                "(fp8_expert_gather=True gathers each layer in its own FP8 recipe)"
            )
        if fp8_expert_gather and recipe not in fp8_gathers:
            raise ValueError(
                f"fp8_expert_gather needs MoE layers with an FP8 recipe ({', '.join(fp8_gathers)}), got recipe "
                f"{recipe!r}: a bf16 layer's weights are gathered plainly (fp8_expert_gather=False)"
            )
    for moe in moes:
        if fp8_expert_gather or mxfp8_expert_gather:
            fp8_gathers[moe.cfg.recipe](moe.experts, dp.size())
        fully_shard(moe.experts, mesh=dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        moe.experts.set_gradient_divide_factor(float(world_size))
        moe.experts.set_force_sum_reduction_for_comms(_needs_sum_only(dp.size()))
    if blocks is None:
        blocks = list(getattr(model, "blocks", []))
    for blk in blocks:
        fully_shard(blk, mesh=world, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        blk.set_force_sum_reduction_for_comms(_needs_sum_only(world_size))
    # The root keeps its parameters unsharded after forward (backward needs them first: no re-gather).
    fully_shard(model, mesh=world, mp_policy=mp, reshard_after_forward=False)
    model.set_force_sum_reduction_for_comms(_needs_sum_only(world_size))
    return model


def _is_expert_param(name: str) -> bool:
    return ".experts." in f".{name}"


@torch.no_grad()
def broadcast_params(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Make replicated initial weights identical before :func:`apply_fsdp` (FSDP2 does not broadcast).

    Non-expert parameters and buffers are copied from global rank 0 to every rank; expert parameters (names
    containing ``.experts.``) from the first "dp" rank of each EP index to the other ranks of its "dp" group.
    A safety net for layers whose init draws random numbers differently per rank; one broadcast per tensor.
    """
    world = world_mesh(mesh).get_group()
    dp = mesh.get_group("dp")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        group = dp if _is_expert_param(name) else world
        if dist.get_world_size(group) > 1:
            dist.broadcast(t.data, group=group, group_src=0)


@torch.no_grad()
def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of an :func:`apply_fsdp` model; returns the norm before clipping (fp32).

    ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors of the two meshes (experts on "dp", the rest on
    "dp_ep"). The local shards tile the model exactly once over the world: non-expert parameters are split
    over all ranks, and each rank's expert shard covers different experts or a different slice of one. So
    one all-reduce of the local sums of squares gives the exact squared norm of the full model.
    (Works on plain tensors too, e.g. a 1-process run without FSDP.)
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()
    else:
        sq = torch.zeros((), dtype=torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1 and any(hasattr(g, "to_local") for g in grads):
        dist.all_reduce(sq)
    norm = sq.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local:
        g.mul_(scale.to(g.dtype))
    return norm
