"""The experts: SwiGLU MLPs over expert-sorted rows, grouped by local expert.

:mod:`.reference` (pure PyTorch, the specification: ``expert_mlp`` and its MXFP8 recipe), :mod:`.gemm` (launchers of
the MXFP8 grouped GEMMs), :mod:`.operands` (weight and activation operands, their references), :mod:`.weight_cache`
(the weights' operands once per weight version) and :mod:`.cuda` (``expert_mlp_cuda``, the expert MLP on the
kernels). GPU packages are imported lazily.
"""
