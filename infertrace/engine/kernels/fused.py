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

from infertrace.engine.kernels import launch, tuning
from infertrace.engine.kernels.skinny_gemm import load_planes, silu_times


@triton.jit
def _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, HALF: tl.constexpr, dtype: tl.constexpr):
    """Heads given as their two halves (a row each of x1, x2, float32): RMSNorm with the weight halves w1, w2, then
    RoPE with the cos/sin halves, each intermediate rounded to `dtype` where the unfused model rounds it; returns
    the rotated halves in `dtype`."""
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    r = tl.math.rsqrt(var + eps)[:, None]
    y1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (y1 * c1).to(dtype).to(tl.float32) + (-y2 * s1).to(dtype).to(tl.float32)
    o2 = (y2 * c2).to(dtype).to(tl.float32) + (y1 * s2).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


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
    r1, r2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, HALF, dtype)
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
def _qkv_norm_rope_kernel(x_ptr, w_ptr, q_out_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr,
                          k_cache_ptr, v_cache_ptr, slot_ptr, M, K, stride_xm, stride_wn, num_q_heads, num_kv_heads,
                          eps, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # program h: head h of the qkv projection (its 2 * HALF output columns, as two halves for RoPE), every row;
    # the head's weights stream as in the skinny GEMM, then the q/k norm, RoPE and the K/V cache write run on the sums
    h = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    i = tl.arange(0, HALF)
    ks = tl.arange(0, BLOCK_K)
    dtype = q_out_ptr.dtype.element_ty
    is_q = h < num_q_heads
    kv_head = h - num_q_heads  # K heads, then V heads at kv_head - num_kv_heads
    # norm weights, positions, RoPE rows and slots are the step's inputs and constants: read before the wait
    w1 = tl.where(is_q, tl.load(q_w_ptr + i), tl.load(k_w_ptr + i)).to(tl.float32)[None, :]
    w2 = tl.where(is_q, tl.load(q_w_ptr + HALF + i), tl.load(k_w_ptr + HALF + i)).to(tl.float32)[None, :]
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)[:, None] * 2 * HALF
    c1 = tl.load(cos_ptr + pos + i[None, :]).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + pos + HALF + i[None, :]).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + pos + i[None, :]).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + pos + HALF + i[None, :]).to(dtype).to(tl.float32)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    if PDL:  # x comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    acc1 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w1_ptrs = w_ptr + (h * 2 * HALF + i).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    w2_ptrs = w1_ptrs + HALF * stride_wn
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wa = tl.load(w1_ptrs)
            wb = tl.load(w2_ptrs)
        else:
            k_ok = (k + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wa = tl.load(w1_ptrs, mask=k_ok[None, :], other=0.0)
            wb = tl.load(w2_ptrs, mask=k_ok[None, :], other=0.0)
        acc1 += tl.dot(x, tl.trans(wa))
        acc2 += tl.dot(x, tl.trans(wb))
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w2_ptrs += BLOCK_K
    x1 = acc1.to(dtype).to(tl.float32)  # the projection's output as stored in the model dtype
    x2 = acc2.to(dtype).to(tl.float32)
    kv_type = k_cache_ptr.dtype.element_ty  # the model's dtype, or float8 e4m3 (rounded, saturated)
    kv_rows = (slot >= 0)[:, None]  # slot -1: a padding row of a captured graph
    if kv_head < num_kv_heads:  # a q or a K head: RMSNorm, then RoPE
        r1, r2 = _norm_rope(x1, x2, w1, w2, c1, c2, s1, s2, eps, HALF, dtype)
        if is_q:
            q_out = q_out_ptr + (rows * num_q_heads + h).to(tl.int64)[:, None] * 2 * HALF + i[None, :]
            tl.store(q_out, r1, mask=row_ok[:, None])
            tl.store(q_out + HALF, r2, mask=row_ok[:, None])
        else:
            dst = k_cache_ptr + (slot * num_kv_heads + kv_head)[:, None] * 2 * HALF + i[None, :]
            tl.store(dst, r1.to(kv_type), mask=kv_rows)
            tl.store(dst + HALF, r2.to(kv_type), mask=kv_rows)
    else:  # a V head: into the cache as it is
        dst = v_cache_ptr + (slot * num_kv_heads + kv_head - num_kv_heads)[:, None] * 2 * HALF + i[None, :]
        tl.store(dst, x1.to(dtype).to(kv_type), mask=kv_rows)
        tl.store(dst + HALF, x2.to(dtype).to(kv_type), mask=kv_rows)


def qkv_norm_rope(x: torch.Tensor, weight: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
                  block_k: int = 128, num_stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """The qkv projection of a few rows (x [T <= 16, hidden] @ weight.T) and `qk_norm_rope` after it, one kernel:
    a program a head streams that head's weights, then normalises and rotates its q or K head, or takes its V
    head, and writes K and V into the cache at `kv_cache`'s slots. Returns q [T, Hq, D]. Against the skinny GEMM
    unsplit (same block_k) followed by `qk_norm_rope`: V the same bit for bit, q and K through the same roundings,
    the norm's sums perhaps added in another order."""
    t, hidden = x.shape
    assert t <= 16 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == hidden
    assert weight.shape[0] == (num_q_heads + 2 * num_kv_heads) * head_dim
    k_cache, v_cache, slots = kv_cache
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (num_kv_heads, head_dim)
    q = torch.empty((t, num_q_heads, head_dim), dtype=weight.dtype, device=x.device)
    if t:
        _qkv_norm_rope_kernel[(num_q_heads + 2 * num_kv_heads,)](
            x, weight, q, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, slots, t, hidden, x.stride(0),
            weight.stride(0), num_q_heads, num_kv_heads, eps, HALF=head_dim // 2, BLOCK_M=16, BLOCK_K=block_k,
            EVEN_K=hidden % block_k == 0, PDL=launch.enabled(), num_warps=num_warps, num_stages=num_stages,
            launch_pdl=launch.enabled(),
        )
    return q


# (N, K) of a qkv projection -> (block_k, num_stages, num_warps) of `qkv_norm_rope` ahead of the shapes measured
QKV_TUNED: dict[tuple[int, int], tuple[int, int, int] | None] = tuning.table("qkv_norm_rope")


def qkv_fused_config(n: int, k: int) -> tuple[int, int, int] | None:
    """The tiling of `qkv_norm_rope` where it runs instead of the skinny GEMM then `qk_norm_rope`, None where the two
    kernels stay. Measured on the H100 in the batch-8 decode graph (`step_graphs_bench.py --only variants`):
    qwen3-4b's qkv (6144 x 2560) at (128, 5, 4) replays the step in 3.654 against 3.732 ms (context 385). Only
    measured shapes fuse: at qwen3-0.6b's (4096 x 1024) the pair alone was faster (7.2 against 8.1 us a layer) and
    the decode graph was not measured."""
    if (n, k) in QKV_TUNED:
        return QKV_TUNED[(n, k)]
    return (128, 5, 4) if (n, k) == (6144, 2560) else None


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, K, inter, stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         PDL: tl.constexpr):
    # program j: columns [j * BLOCK_N, (j + 1) * BLOCK_N) of the activation, from the same band of gate rows and of
    # up rows of the merged weight, streamed together
    if PDL:  # x comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    g_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + inter.to(tl.int64) * stride_wn
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(g_ptrs, mask=col_ok[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g += tl.dot(x, tl.trans(wg))
        acc_u += tl.dot(x, tl.trans(wu))
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)  # gate and up as the projection stores them, then `silu_mul`'s roundings
    u = acc_u.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], silu_times(g, u, dtype),
             mask=row_ok[:, None] & col_ok[None, :])


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = 64, block_k: int = 128,
                 num_stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """silu(gate) * up of a few rows, gate and up from the merged projection (x [T <= 16, hidden] @ weight.T,
    weight [2I, hidden]) in one kernel: the same values as the skinny GEMM then `silu_mul`."""
    t, hidden = x.shape
    inter = weight.shape[0] // 2
    assert t <= 16 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape == (2 * inter, hidden)
    out = torch.empty((t, inter), dtype=weight.dtype, device=x.device)
    if t:
        _gate_up_silu_kernel[(triton.cdiv(inter, block_n),)](
            x, weight, out, t, hidden, inter, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=16,
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0, PDL=launch.enabled(),
            num_warps=num_warps, num_stages=num_stages, launch_pdl=launch.enabled(),
        )
    return out


# (2I, hidden) of a merged gate/up projection -> (block_n, block_k, num_stages, num_warps) of `gate_up_silu`
GATE_UP_TUNED: dict[tuple[int, int], tuple[int, int, int, int] | None] = tuning.table("gate_up_silu")


def gate_up_silu_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """The tiling of `gate_up_silu` where it runs instead of the skinny GEMM then `silu_mul`, None where the two
    kernels stay. Measured on the H100 in the batch-8 decode graph (`step_graphs_bench.py --only variants`, with
    `qkv_norm_rope`): qwen3-4b's gate/up (19456 x 2560) at (32, 128, 3, 4) replays the step in 3.623 against 3.658
    ms (context 385); (64, 128, 3, 4) 3.638, and at 4 stages (32, 64 or 128 columns) 3.78-3.82. Only measured
    shapes fuse."""
    if (n, k) in GATE_UP_TUNED:
        return GATE_UP_TUNED[(n, k)]
    return (32, 128, 3, 4) if (n, k) == (19456, 2560) else None


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
    tl.store(out_ptr + t * inter + cols, silu_times(g, u, dtype), mask=mask)


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
