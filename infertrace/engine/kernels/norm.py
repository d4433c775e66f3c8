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
from infertrace.engine.kernels.skinny_gemm import load_planes


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, plane_stride, eps,
                        HAS_RESIDUAL: tl.constexpr, PLANES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a constant: read while the kernel before drains
    if PDL:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    x = load_planes(x_ptr + row * n_cols + cols, mask, plane_stride, PLANES, dtype)  # a split-K GEMM: its planes added
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * n_cols + cols, x, mask=mask)  # the new residual stream
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(dtype)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Returns rmsnorm(x + residual) * weight; when `residual` is given it is updated in place to x + residual.

    A float32 `x` of shape [planes, rows, cols] beside a lower-precision `residual` is a split-K GEMM's partial
    sums (`skinny_gemm`): the planes are added in order and the sum rounded to the residual's dtype first.
    """
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    planes = x.shape[0] if x.dim() == 3 else 0
    assert planes == 0 or (residual is not None and x.dtype == torch.float32 and x.shape[1:] == residual.shape)
    n_rows, n_cols = x.shape[-2:]
    out = torch.empty_like(x if residual is None else residual)
    _add_rmsnorm_kernel[(n_rows,)](x, residual if residual is not None else x, weight, out, n_cols,
                                   n_rows * n_cols, eps, HAS_RESIDUAL=residual is not None, PLANES=planes,
                                   BLOCK=triton.next_power_of_2(n_cols),
                                   PDL=launch.enabled(), num_warps=4 if n_cols <= 2048 else 8,
                                   launch_pdl=launch.enabled())
    return out


@triton.jit
def _embed_rmsnorm_kernel(ids_ptr, table_ptr, weight_ptr, residual_ptr, out_ptr, vocab, n_cols, eps,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a constant: read while the kernel before drains
    if PDL:  # past this point the op before has finished (the ids may be the step before's samples, copied in)
        gdc_wait()
        gdc_launch_dependents()
    token = tl.load(ids_ptr + row)
    ok = mask & (token >= 0) & (token < vocab)
    x = tl.load(table_ptr + token.to(tl.int64) * n_cols + cols, mask=ok, other=0.0)
    tl.store(residual_ptr + row * n_cols + cols, x, mask=mask)  # the residual stream starts as the embedding
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(dtype)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


def embed_rmsnorm(input_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(table[input_ids]) * weight, table[input_ids]): the embedding lookup and the first layer's norm in
    one kernel; the second is the residual stream the later `add_rmsnorm`s update. Ids outside the table embed as
    zeros (the engine checks ids before they reach the model)."""
    assert input_ids.dim() == 1 and input_ids.is_contiguous() and table.is_contiguous()
    n_rows, (vocab, n_cols) = input_ids.shape[0], table.shape
    residual = torch.empty((n_rows, n_cols), dtype=table.dtype, device=table.device)
    out = torch.empty_like(residual)
    if n_rows:
        _embed_rmsnorm_kernel[(n_rows,)](input_ids, table, weight, residual, out, vocab, n_cols, eps,
                                         BLOCK=triton.next_power_of_2(n_cols), PDL=launch.enabled(),
                                         num_warps=4 if n_cols <= 2048 else 8, launch_pdl=launch.enabled())
    return out, residual


@triton.jit
def _embed_shard_kernel(ids_ptr, table_ptr, plane_ptr, residual_ptr, vocab_start, shard_rows, n_cols,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # past this point the op before has finished (the ids may be the step before's samples, copied in)
        gdc_wait()
        gdc_launch_dependents()
    token = tl.load(ids_ptr + row) - vocab_start
    ok = mask & (token >= 0) & (token < shard_rows)
    x = tl.load(table_ptr + token.to(tl.int64) * n_cols + cols, mask=ok, other=0.0)
    tl.store(plane_ptr + row * n_cols + cols, x.to(tl.float32), mask=mask)
    tl.store(residual_ptr + row * n_cols + cols, tl.zeros_like(x), mask=mask)


def embed_shard(input_ids: torch.Tensor, table: torch.Tensor, vocab_start: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A vocabulary-parallel embedding's lookup on one rank, for the all-reduce + norm kernel: (this rank's rows of
    the lookup as one float32 plane [1, T, H], zeros where a token's row lies in another rank's shard; a residual
    stream of zeros [T, H] in the table's dtype). Summed over the ranks and added to the zeros, the plane is the
    embedding exactly (one rank holds each token's row), and the kernel's norm is then `embed_rmsnorm`'s."""
    assert input_ids.dim() == 1 and input_ids.is_contiguous() and table.is_contiguous()
    n_rows, (shard_rows, n_cols) = input_ids.shape[0], table.shape
    plane = torch.empty((1, n_rows, n_cols), dtype=torch.float32, device=table.device)
    residual = torch.empty((n_rows, n_cols), dtype=table.dtype, device=table.device)
    if n_rows:
        _embed_shard_kernel[(n_rows,)](input_ids, table, plane, residual, vocab_start, shard_rows, n_cols,
                                       BLOCK=triton.next_power_of_2(n_cols), PDL=launch.enabled(),
                                       num_warps=4 if n_cols <= 2048 else 8, launch_pdl=launch.enabled())
    return plane, residual
