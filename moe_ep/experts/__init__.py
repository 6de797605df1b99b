"""The experts: SwiGLU MLPs over expert-sorted rows, grouped by local expert.

:mod:`.reference` (pure PyTorch, the specification: ``expert_mlp``, quantizing generically from the recipe table),
:mod:`.base` (``ExpertGemms``, the seam the layer calls, and ``gemms_for(device, recipe)``), :mod:`.bf16` (the bf16
baseline on ``torch._grouped_mm``), :mod:`.weight_cache` (weight operands once per weight version),
:mod:`.fsdp_mxfp8` / :mod:`.fsdp_blockwise` (FSDP2 all-gathers of the expert weights in FP8) and one folder per
architecture: :mod:`.sm90` (Hopper: the MXFP8 GEMMs and expert MLP in ``gemm`` / ``operands`` / ``mlp``, the blockwise
ones in ``blockwise_gemm`` / ``blockwise``). GPU packages are imported lazily.
"""
