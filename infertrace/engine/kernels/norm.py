"""Residual add fused with RMSNorm: one pass over the hidden state instead of four or five kernels.

Rounding follows the unfused model exactly: the sum is rounded to the model dtype before it is normalised, the
normalised value is rounded before the weight multiplies it, so tokens match the eager path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, X_IS_ACC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if X_IS_ACC:
        x = x.to(dtype)  # a split-K GEMM's float32 sums, rounded as its output would have been
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * n_cols + cols, x, mask=mask)  # the new residual stream
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)
    if X_IS_ACC:
        tl.store(x_ptr + row * n_cols + cols, tl.zeros([BLOCK], tl.float32), mask=mask)  # ready for the next GEMM


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Returns rmsnorm(x + residual) * weight; when `residual` is given it is updated in place to x + residual.

    A float32 `x` beside a lower-precision `residual` is a split-K accumulator: it is rounded to the residual's
    dtype first, and left zeroed.
    """
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    n_rows, n_cols = x.shape
    is_acc = residual is not None and x.dtype == torch.float32 and residual.dtype != torch.float32
    out = torch.empty_like(x if residual is None else residual)
    _add_rmsnorm_kernel[(n_rows,)](x, residual if residual is not None else x, weight, out, n_cols, eps,
                                   HAS_RESIDUAL=residual is not None, X_IS_ACC=is_acc,
                                   BLOCK=triton.next_power_of_2(n_cols),
                                   PDL=launch.enabled(), num_warps=4 if n_cols <= 2048 else 8,
                                   launch_pdl=launch.enabled())
    return out
