"""Triton kernels for the CUDA path: writing K/V into the paged cache and attention over it."""
