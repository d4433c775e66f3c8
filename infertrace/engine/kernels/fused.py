"""Small fusions of the decode path: q/k RMSNorm with RoPE (optionally writing K and V into the paged cache as
well), and SiLU-and-multiply, one kernel each.

Each intermediate is rounded to the model dtype where the unfused model rounds it, so the fused path computes
the same function as the eager one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch
from infertrace.engine.kernels.skinny_gemm import load_planes


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr,
                         k_cache_ptr, v_cache_ptr, slot_ptr,
                         qkv_stride, plane_stride, num_q_heads, num_kv_heads, eps, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, PLANES: tl.constexpr, STORE_KV: tl.constexpr, PDL: tl.constexpr):
    # a token's q and k heads, BLOCK_H at a time: each load is issued once for a whole tile of heads, so a program
    # waits on memory a few times rather than a one-head program each time for every head
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_q_heads + num_kv_heads
    is_q = h < num_q_heads
    dtype = q_out_ptr.dtype.element_ty
    i = tl.arange(0, HALF)
    # the weights, the position (a host input of the step) and its RoPE row need nothing from the kernel before: read
    # while it drains
    w1 = tl.where(is_q[:, None], tl.load(q_w_ptr + i)[None, :], tl.load(k_w_ptr + i)[None, :]).to(tl.float32)
    w2 = tl.where(is_q[:, None], tl.load(q_w_ptr + HALF + i)[None, :],
                  tl.load(k_w_ptr + HALF + i)[None, :]).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    c1 = tl.load(cos_ptr + pos * 2 * HALF + i).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + i).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * 2 * HALF + i).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + i).to(dtype).to(tl.float32)[None, :]
    if PDL:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    base = qkv_ptr + t * qkv_stride + h[:, None] * 2 * HALF + i[None, :]
    x1 = load_planes(base, h_ok[:, None], plane_stride, PLANES, dtype)
    x2 = load_planes(base + HALF, h_ok[:, None], plane_stride, PLANES, dtype)
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    r = tl.math.rsqrt(var + eps)[:, None]
    y1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (y1 * c1).to(dtype).to(tl.float32) + (-y2 * s1).to(dtype).to(tl.float32)
    o2 = (y2 * c2).to(dtype).to(tl.float32) + (y1 * s2).to(dtype).to(tl.float32)
    r1 = o1.to(dtype)
    r2 = o2.to(dtype)
    q_rows = is_q & h_ok
    k_rows = (h >= num_q_heads) & h_ok
    kv_head = h - num_q_heads  # negative on q rows, which every k-side access masks off
    q_out = q_out_ptr + ((t * num_q_heads + h) * 2 * HALF)[:, None] + i[None, :]
    k_out = k_out_ptr + ((t * num_kv_heads + kv_head) * 2 * HALF)[:, None] + i[None, :]
    tl.store(q_out, r1, mask=q_rows[:, None])
    tl.store(q_out + HALF, r2, mask=q_rows[:, None])
    tl.store(k_out, r1, mask=k_rows[:, None])
    tl.store(k_out + HALF, r2, mask=k_rows[:, None])
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_rows = (k_rows & (slot >= 0))[:, None]  # slot -1: a padding row of a captured graph
        dst = ((slot * num_kv_heads + kv_head) * 2 * HALF)[:, None] + i[None, :]
        kv_type = k_cache_ptr.dtype.element_ty  # the model's dtype, or float8 e4m3 (rounded, saturated)
        tl.store(k_cache_ptr + dst, r1.to(kv_type), mask=kv_rows)
        tl.store(k_cache_ptr + dst + HALF, r2.to(kv_type), mask=kv_rows)
        v_src = qkv_ptr + t * qkv_stride + ((h + num_kv_heads) * 2 * HALF)[:, None] + i[None, :]
        v1 = load_planes(v_src, kv_rows, plane_stride, PLANES, dtype)
        v2 = load_planes(v_src + HALF, kv_rows, plane_stride, PLANES, dtype)
        tl.store(v_cache_ptr + dst, v1.to(dtype).to(kv_type), mask=kv_rows)
        tl.store(v_cache_ptr + dst + HALF, v2.to(dtype).to(kv_type), mask=kv_rows)


QK_HEADS_PER_PROGRAM = 8


def qk_norm_rope(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D], each RMS-normalised per head and rotated.

    With `kv_cache` = (k_cache, v_cache, slot_mapping), caches [num_slots, Hkv, D], the rotated K and the V of
    every token are also written at its slot (slot -1 writes nothing), so no separate store kernel runs.

    A float32 `qkv` of shape [planes, T, width] is a split-K projection's partial sums (`skinny_gemm`): they are
    added in order and rounded to the weights' dtype, the dtype of q and k. It needs `kv_cache` (V is read from
    it nowhere else).
    """
    planes = qkv.shape[0] if qkv.dim() == 3 else 0
    assert planes == 0 or (kv_cache is not None and qkv.dtype == torch.float32 and qkv.is_contiguous())
    t = qkv.shape[-2]
    dtype = q_weight.dtype if planes else qkv.dtype
    q = torch.empty((t, num_q_heads, head_dim), dtype=dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=dtype, device=qkv.device)
    if t:
        if kv_cache is not None:
            k_cache, v_cache, slots = kv_cache
            assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (num_kv_heads, head_dim)
        else:
            k_cache = v_cache = slots = k  # unused
        _qk_norm_rope_kernel[(t, triton.cdiv(num_q_heads + num_kv_heads, QK_HEADS_PER_PROGRAM))](
            qkv, q, k, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, slots, qkv.stride(-2),
            qkv.stride(0) if planes else 0, num_q_heads, num_kv_heads, eps, HALF=head_dim // 2,
            BLOCK_H=QK_HEADS_PER_PROGRAM, PLANES=planes, STORE_KV=kv_cache is not None, PDL=launch.enabled(),
            num_warps=4, launch_pdl=launch.enabled(),
        )
    return q, k


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * u).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, PDL=launch.enabled(),
                                                             num_warps=4, launch_pdl=launch.enabled())
    return out
