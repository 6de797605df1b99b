"""Hopper (sm_90a) implementation of the expert GEMMs: MXFP8 grouped GEMMs (:mod:`.gemm`, operands in
:mod:`.operands`, the expert MLP on them in :mod:`.mlp`) and the blockwise FP8 GEMMs. Kernels:
``kernels/experts/sm90/``."""
