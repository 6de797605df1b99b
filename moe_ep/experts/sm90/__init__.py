"""Hopper (sm_90a) GEMM implementations."""
