"""y = x @ W^T for the few rows of a decode step: a weight-streaming GEMM.

At batch 8 a projection is a matrix-vector product in disguise: the time is the time to read W once. The kernel
gives each program a band of output columns (and, with split-K, a slice of the reduction), streams that band's
weights through shared memory with a deep pipeline and multiplies by all rows of x at once; split-K programs add
their fp32 partial sums into a zeroed fp32 accumulator, so no separate reduction pass reads them back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # x and the zeroed accumulator come from the kernels before
        gdc_wait()
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * span
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_begin + ks)[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k_begin + ks)[None, :]
    for k in range(0, span, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k_begin + k + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *, block_n: int = 32,
                block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (M <= 16) times weight [N, K] transposed.

    With split_k > 1, `out` must be a zeroed float32 [M, N] tensor the partial sums are added to (and is returned
    as is); split_k = 2 stays deterministic (0 + a + b is the same sum in either order).
    """
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 16 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
        if split_k > 1:
            out.zero_()
    grid = (triton.cdiv(n, block_n), split_k)
    _skinny_gemm_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                              BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                              EVEN_K=k % (block_k * split_k) == 0, PDL=launch.enabled(),
                              num_warps=num_warps, num_stages=num_stages, launch_pdl=launch.enabled())
    return out


# (N, K) of a projection -> (block_n, block_k, split_k, num_stages), from benchmarks/gemm_bench.py on an H100
# (qwen3-4b shapes, 8 rows, weights cold in L2); split_k is at most 2 so the sums stay deterministic
def decode_config(n: int, k: int) -> tuple[int, int, int, int]:
    if n <= 4096:
        # few output columns: split the reduction to fill the SMs
        return (64, 256, 2, 4) if k % 512 == 0 else (64, 128, 1, 5)
    if n <= 8192:
        return 64, 128, 1, 5
    return (32, 128, 1, 3) if n < 65536 else (64, 256, 1, 4)
