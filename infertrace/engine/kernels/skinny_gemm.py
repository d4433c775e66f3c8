"""y = x @ W^T for the few rows of a decode step: a weight-streaming GEMM.

At batch 8 a projection is a matrix-vector product in disguise: the time is the time to read W once. The kernel
gives each program a band of output columns (and, with split-K, a slice of the reduction), streams that band's
weights through shared memory with a deep pipeline and multiplies by all rows of x at once. With split-K each slice
of the reduction stores its float32 partial sums in its own plane of a workspace; the kernel after the GEMM (the
residual add + RMSNorm, or the fused q/k norm) adds the planes in a fixed order as it reads them (`load_planes`), so
no reduction pass runs, nothing needs zeroing, and the sum is the same bit for bit from run to run whatever the
split.

A second kernel computes the same product in Gluon (`early`): its pipeline written out, so the first tiles of
weights are copied into shared memory before it waits on the kernel before it (programmatic dependent launch).
Behind a kernel that keeps the GPU's memory idle for microseconds (the all-reduce waiting on the other ranks) it is
1-3 us faster a projection; with nothing to hide behind, up to 0.5 us slower, so the engine takes it with more than
one rank (`early_rule`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch, tuning
from infertrace.engine.kernels.allreduce_norm import push_to_ranks

try:  # Gluon (Triton's lower-level language, 3.5 and later): the GEMM that reads its first weights before the wait
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - older Triton: the Triton kernel only
    gluon = None


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                        buffers_ptr=None, epoch_ptr=None, call=0, calls_per_forward=1, PUSH: tl.constexpr = False,
                        RANK: tl.constexpr = 0, WORLD: tl.constexpr = 1, MAX_ROWS: tl.constexpr = 16,
                        HALF: tl.constexpr = False):
    if PDL:  # x comes from the kernel before, and the workspace planes are read by the kernel after it
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
            x_ok = row_ok[:, None]
            w_ok = col_ok[:, None]
        else:
            k_ok = (k_begin + k + ks) < K
            x_ok = row_ok[:, None] & k_ok[None, :]
            w_ok = col_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PUSH:  # this rank's part, straight into every rank's slot of the all-reduce + norm kernel's buffers
        push_part(acc, rows, cols, row_ok[:, None] & col_ok[None, :], N, buffers_ptr, epoch_ptr, call,
                  calls_per_forward, x_ptr.dtype.element_ty, RANK, WORLD, MAX_ROWS, HALF)
    else:
        y_ptrs = y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def silu_times(g, u, dtype: tl.constexpr):
    """silu(g) * u in `dtype` from float32 gate and up values, silu's result rounded to `dtype` first, as the
    unfused model rounds it."""
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def push_part(acc, rows, cols, mask, n_cols, buffers_ptr, epoch_ptr, call, calls_per_forward, dtype: tl.constexpr,
              RANK: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, HALF: tl.constexpr):
    """A row-parallel projection's tile of this rank's part (unsplit: the rank's whole sum) stored into slot k mod 3
    of every rank's all-reduce buffer at this rank's place, as the all-reduce + norm kernel would push it (rounded to
    `dtype` with HALF, -0.0 pushed as +0.0); that kernel then only pulls (kernels/allreduce_norm.py, PUSHED)."""
    k = tl.load(epoch_ptr) * calls_per_forward + call
    entry = (k % 3) * (WORLD * MAX_ROWS * n_cols) + (RANK * MAX_ROWS + rows)[:, None] * n_cols + cols[None, :]
    push_to_ranks(acc, entry, mask, buffers_ptr, dtype, WORLD, HALF)


if gluon is not None:
    @gluon.jit
    def _skinny_gemm_early_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                  SPLIT_K: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                                  SILU: gl.constexpr = False):
        """`_skinny_gemm_kernel`'s product with its pipeline written out (4 warps, tensor-core mma.sync on tiles
        copied into shared memory with cp.async), so that the copies of the first STAGES - 1 tiles of weights are
        issued before the programmatic-dependent-launch wait: nothing writes the weights, so they stream in while
        the kernel before still runs (at TP>1, the all-reduce waiting on the other ranks); x, which that kernel
        writes, is copied after the wait.

        SILU: w is a merged gate/up projection [N = 2I, K] and y gets silu(gate) * up [M, I]: program j multiplies
        gate rows [j * BLOCK_N / 2, (j + 1) * BLOCK_N / 2) and the same up rows (I further) as one band of BLOCK_N
        rows, and its epilogue rounds the two halves of its tile as the projection would store them and applies
        `fused.silu_mul`'s roundings (no SiLU kernel after it; unsplit). The kernel after it (the down projection's
        GEMM, not a small SiLU kernel) may launch only once this one's programs have multiplied their tiles: let at
        the wait, its programs took the SMs and the bandwidth from this kernel's later ones (one H200, qwen3-14b's
        TP=4 shard behind a 7 us hold, `gemm_bench.py --silu-epilogue`: 47.3 us a layer against 43.0)."""
        load: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte copies along K
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        smem: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        span = gl.cdiv(gl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = pid_k * span
        iters = gl.cdiv(gl.minimum(K - k_begin, span), BLOCK_K)
        HALF_N: gl.constexpr = BLOCK_N // 2
        band = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load))
        if SILU:  # the band's first half gate rows, its second half the same up rows
            act_cols = pid_n * HALF_N + band % HALF_N
            cols = act_cols + (band // HALF_N) * (N // 2)
            col_ok = act_cols < N // 2
        else:
            cols = pid_n * BLOCK_N + band
            col_ok = cols < N
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load))
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, load))
        w_ptrs = w_ptr + cols.to(gl.int64)[:, None] * stride_wn + (k_begin + ks)[None, :]
        x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_begin + ks)[None, :]
        k_left = gl.minimum(K - k_begin, span)  # a tile's columns past it are masked (and read as zeros)
        w_ok = col_ok[:, None] & (ks < k_left)[None, :]
        x_ok = (rows < M)[:, None] & (ks < k_left)[None, :]
        w_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, BLOCK_N, BLOCK_K], smem)
        x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_M, BLOCK_K], smem)
        for j in gl.static_range(STAGES - 1):  # the first tiles of weights, before the wait: one group each
            async_copy.async_copy_global_to_shared(w_smem.index(j), w_ptrs + j * BLOCK_K,
                                                   mask=w_ok & (ks < k_left - j * BLOCK_K)[None, :])
            async_copy.commit_group()
        if PDL:  # x comes from the kernel before, and the workspace planes are read by the kernel after it
            gdc_wait()
            if not SILU:
                gdc_launch_dependents()
        for j in gl.static_range(STAGES - 1):  # their x, one group each
            async_copy.async_copy_global_to_shared(x_smem.index(j), x_ptrs + j * BLOCK_K,
                                                   mask=x_ok & (ks < k_left - j * BLOCK_K)[None, :])
            async_copy.commit_group()
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        for i in range(iters):
            # tile i has landed: STAGES - 2 groups were committed after its last one (the x of the first tiles
            # after it, then the tiles copied in the loop), and every warp is done with tile i - 1, whose slot
            # takes tile i + STAGES - 1 now, copied while tile i is multiplied
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            ahead = i + STAGES - 1
            left = k_left - ahead * BLOCK_K  # <= 0 past the slice: nothing copied, the group empty
            async_copy.async_copy_global_to_shared(w_smem.index(ahead % STAGES), w_ptrs + ahead * BLOCK_K,
                                                   mask=w_ok & (ks < left)[None, :])
            async_copy.async_copy_global_to_shared(x_smem.index(ahead % STAGES), x_ptrs + ahead * BLOCK_K,
                                                   mask=x_ok & (ks < left)[None, :])
            async_copy.commit_group()
            cur = i % STAGES
            acc = mma_v2(x_smem.index(cur).load(a_layout), w_smem.index(cur).permute((1, 0)).load(b_layout), acc)
        async_copy.wait_group(0)
        if PDL and SILU:
            gdc_launch_dependents()
        if SILU:  # the tile's gate and up halves as the projection stores them, through shared memory
            tile = gl.allocate_shared_memory(y_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N],
                                             gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
            tile.store(acc.to(y_ptr.dtype.element_ty))
            gl.thread_barrier()
            halves: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
            g = tile.slice(0, HALF_N, dim=1).load(halves).to(gl.float32)
            u = tile.slice(HALF_N, HALF_N, dim=1).load(halves).to(gl.float32)
            act_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, halves))
            out_cols = pid_n * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, halves))
            gl.store(y_ptr + act_rows[:, None] * stride_ym + out_cols[None, :],
                     silu_times(g, u, y_ptr.dtype.element_ty),  # `silu_mul`'s roundings
                     mask=(act_rows < M)[:, None] & (out_cols < N // 2)[None, :])
            return
        out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        out_cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        y_ptrs = y_ptr + pid_k * stride_ys + out_rows[:, None] * stride_ym + out_cols[None, :]
        gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(out_rows < M)[:, None] & (out_cols < N)[None, :])


@triton.jit
def load_planes(ptrs, mask, plane_stride, PLANES: tl.constexpr, dtype: tl.constexpr):
    """For the kernel that reads a projection's output: float32 values at `ptrs`, as stored (PLANES == 0), or the
    split-K partial sums of PLANES planes added in order and rounded to `dtype`, as the projection unsplit would
    have stored them."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if PLANES > 0:
        for p in tl.static_range(1, PLANES):
            x += tl.load(ptrs + p * plane_stride, mask=mask, other=0.0)
        x = x.to(dtype)
    return x.to(tl.float32)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *, block_n: int = 32,
                block_k: int = 256, split_k: int = 1, num_warps: int = 4, num_stages: int = 4,
                early: bool | None = None, push: tuple | None = None) -> torch.Tensor | None:
    """x [M, K] (M <= 16) times weight [N, K] transposed.

    With split_k > 1 the result is the float32 partial sums [split_k, M, N], one plane a slice of K, to be added
    plane by plane (`.sum(0)`, or the kernel that reads them with `load_planes`); `out`, when given, is a float32
    workspace of at least split_k planes of [M, N], and its first split_k planes are returned. `early`: the Gluon
    kernel, whose first num_stages - 1 tiles of weights are copied before its programmatic-dependent-launch wait
    (4 warps; bf16 or fp16; `early_available`); None: as `set_early` set it for the process. Its copies are 16
    bytes, so it takes rows that start on 16-byte boundaries (K and x's row stride multiples of 16 elements, as
    Triton specializes them); other inputs take the Triton kernel.

    `push` (`PushBuffers.push_target`: a row-parallel projection at TP>1, unsplit): the product, this rank's part of
    the all-reduce, goes straight into every rank's slot of the all-reduce + norm kernel's buffers instead of `out`
    (the Triton kernel; returns None), and that kernel, told so, only pulls.
    """
    m, k = x.shape
    if push is not None:
        assert split_k == 1, "a pushed part is the rank's whole sum"
        addresses, epoch, call, calls, rank, world, max_rows, half = push
        n = weight.shape[0]
        assert m <= max_rows and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
        _skinny_gemm_kernel[(triton.cdiv(n, block_n), 1)](
            x, weight, x, m, n, k, x.stride(0), weight.stride(0), 0, 0, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=1, EVEN_K=k % block_k == 0, PDL=launch.enabled(), buffers_ptr=addresses, epoch_ptr=epoch,
            call=call, calls_per_forward=calls, PUSH=True, RANK=rank, WORLD=world, MAX_ROWS=max_rows, HALF=half,
            num_warps=num_warps, num_stages=num_stages, launch_pdl=launch.enabled())
        return None
    early = (_early if early is None else early) and _early_fits(x, weight)
    n = weight.shape[0]
    assert m <= 16 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    if split_k == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
        assert out.shape == (m, n) and out.stride(1) == 1
        plane_stride = 0
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if out is None else out[:split_k]
        assert out.dtype == torch.float32 and out.shape == (split_k, m, n) and out.stride(2) == 1
        plane_stride = out.stride(0)
    row_stride = out.stride(-2)
    grid = (triton.cdiv(n, block_n), split_k)
    if early:
        assert early_available() and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        assert block_n % 32 == 0 and block_k % 16 == 0 and num_stages >= 2
        num_stages = min(num_stages, early_max_stages(block_n, block_k))  # what shared memory holds
        _skinny_gemm_early_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), row_stride,
                                        plane_stride, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                        STAGES=num_stages, PDL=launch.enabled(), num_warps=4,
                                        launch_pdl=launch.enabled())
        return out
    _skinny_gemm_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), row_stride, plane_stride,
                              BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                              EVEN_K=k % (block_k * split_k) == 0, PDL=launch.enabled(),
                              num_warps=num_warps, num_stages=num_stages, launch_pdl=launch.enabled())
    return out


def gate_up_silu_early(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = 32, block_k: int = 128,
                       num_stages: int = 5) -> torch.Tensor | None:
    """silu(gate) * up [M, I] of a merged gate/up projection (weight [2I, K]) by the early kernel, SiLU-and-multiply
    in its epilogue: `fused.silu_mul` of `skinny_gemm`'s product (early, same block_k) bit for bit, one kernel
    instead of two. Each program takes block_n / 2 gate rows and the same up rows. None where the early kernel
    cannot run these inputs (the caller runs the two kernels)."""
    m, k = x.shape
    n = weight.shape[0]
    if not (_early and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and n % 2 == 0
            and _early_fits(x, weight)):
        return None
    assert m <= 16 and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    assert block_n % 32 == 0 and block_k % 16 == 0 and num_stages >= 2
    out = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    if m:  # the epilogue's tile takes the pipeline's shared memory once the pipeline is done with it
        stages = min(num_stages, early_max_stages(block_n, block_k))
        _skinny_gemm_early_kernel[(triton.cdiv(n // 2, block_n // 2), 1)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), 0, BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=block_k, SPLIT_K=1, STAGES=stages, PDL=launch.enabled(), SILU=True, num_warps=4,
            launch_pdl=launch.enabled())
    return out


def _early_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the early kernel's 16-byte copies can take these rows: K and the row strides multiples of 16
    elements, both tensors 16-byte aligned (as Triton specializes them)."""
    return x.shape[1] % 16 == 0 and x.stride(0) % 16 == 0 and weight.stride(0) % 16 == 0 and not (
        x.data_ptr() % 16 or weight.data_ptr() % 16)


_early = False  # the process's choice (`early_rule`'s, set by the model runner)


def early_rule(ranks: int) -> bool:
    """Whether the decode GEMMs take the early kernel: with more than one rank, where the all-reduce before each
    row-parallel projection leaves the GPU's memory idle while it waits on the other ranks (overridden by
    kernels/tuning.py's "gemm_early_weights")."""
    return ranks > 1


def set_early(on: bool) -> bool:
    """Whether skinny GEMMs called without `early` take the Gluon kernel, where it can run; returns whether they do.
    A CUDA graph keeps the kernels as they were when it was captured."""
    global _early
    _early = bool(on) and early_available()
    return _early


GLUON_TRITON = "3.6."  # the Triton whose Gluon the early kernel is written for (Gluon is experimental, its API moves)


def early_available() -> bool:
    """Whether the Gluon kernel can run here: Triton 3.6 (GLUON_TRITON) with Gluon, and a CUDA GPU with tensor
    cores' mma.sync and cp.async (compute capability 8.0 and later). Elsewhere the Triton kernel runs."""
    return (gluon is not None and triton.__version__.startswith(GLUON_TRITON) and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 0))


# (N, K) -> (block_n, block_k, split_k, num_stages) ahead of decode_config's rules (benchmarks try tilings with it)
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = tuning.table("skinny_gemm")

# One rank's shard of qwen3-14b's projections at TP=2 and TP=4, where the rules below leave speed behind, by the GPU
# they were measured on (the start of its name). `gemm_bench.py --split-sweep` on an H200 (each GEMM with the kernel
# that reads it, 36 in a CUDA graph), us a pair, the rules' tiling -> this one; in the TP decode graph together: TP=2
# 4.995 -> 4.756 ms, TP=4 3.470 -> 3.284 ms. On an H100 the same pairs (`gemm_bench.py --shards`) came out mixed (the
# TP=2 output projection 12.14 -> 12.59 us, gate/up at TP=4 33.40 -> 33.83, down at TP=2 34.57 -> 34.15), so H100s
# keep the rules (docs/benchmarks.md, "qwen3-14b's tensor-parallel shards tiled").
SHARDS: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    "NVIDIA H200": {
        (5120, 8704): (32, 128, 2, 4),  # down, TP=2: 27.65 -> 26.05
        (5120, 4352): (32, 128, 2, 4),  # down, TP=4: 15.95 -> 15.34
        (5120, 2560): (32, 128, 2, 4),  # o, TP=2: 10.56 -> 10.53 alone; the TP=2 graph 4.825 ms without it, 4.756 with
        (3584, 5120): (64, 128, 4, 4),  # qkv, TP=2: 12.69 -> 12.26
        (1792, 5120): (64, 128, 4, 5),  # qkv, TP=4: 8.21 -> 8.05
        (8704, 5120): (32, 128, 1, 5),  # gate/up before SiLU-and-multiply, TP=4: 27.60 -> 25.45
    },
}


@functools.cache
def device_shards(name: str | None = None) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """SHARDS' tilings for the GPU named `name` (this process's CUDA device by default); none for other GPUs."""
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((table for prefix, table in SHARDS.items() if name.startswith(prefix)), {})


def decode_config(n: int, k: int, planes: bool = False) -> tuple[int, int, int, int]:
    """(block_n, block_k, split_k, num_stages) for an [8-16, K] x [N, K]^T projection, from benchmarks/gemm_bench.py
    on an H100 (qwen3 shapes, 8 rows, weights cold in L2). `planes`: the kernel after it adds split-K partial sums
    (the residual add + RMSNorm after a projection back to the hidden size, the fused q/k norm after the qkv
    projection); otherwise split_k is 1."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    block_n, block_k, split_k, stages = device_shards().get((n, k)) or rules_config(n, k, planes)
    if _early and triton.cdiv(n, block_n) * split_k <= _sm_count():
        # the early kernel with one program an SM: more of each program's weights copied before the wait. One
        # H200, behind a kernel holding the GPU 7 us (the all-reduce's stand-in), qwen3-14b's TP=4 qkv shard with
        # the q/k norm after it: 15.40 us a layer at 5 stages, 14.07 at 6 (Triton's kernel 16.90; `gemm_bench.py
        # --early 4,6`); grids of more programs than SMs measured no better or worse at 6
        stages = max(stages, min(EARLY_ONE_WAVE_STAGES, early_max_stages(block_n, block_k)))
    return block_n, block_k, split_k, stages


EARLY_ONE_WAVE_STAGES = 6


def early_max_stages(block_n: int, block_k: int) -> int:
    """The most stages of the early kernel whose tiles (BLOCK_M = 16 rows of x and block_n of weights, block_k
    16-bit values each) fit in a program's shared memory: (64, 256) tiles take 40 KB a stage, so five on an
    H100 or H200 (227 KB), where six asked for 240 KB and failed to launch (qwen3-0.6b at TP=2)."""
    return _shared_memory_per_program() // ((16 + block_n) * block_k * 2)


@functools.cache
def _shared_memory_per_program() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin


@functools.cache
def _sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def rules_config(n: int, k: int, planes: bool = False) -> tuple[int, int, int, int]:
    """`decode_config`'s rules alone, without a tuning file or SHARDS."""
    if planes and n <= 4096 and k >= n and k % 512 == 0:
        # few output columns for a long reduction: split it 4 ways to fill the SMs (`--split-sweep`, with the norm:
        # qwen3-4b's down projection 22.48 -> 21.39 us; 0.6b's 8.26 -> 5.76 us at 5 stages, these 4 stages not among
        # the 8 best printed, over 5.93 us)
        return 32, 128, 4, 4
    if planes and n <= 4096 and k % 256 == 0:
        # qwen3-0.6b's qkv projection with the q/k norm that adds its planes: 7.02 -> 6.07 us split 2 ways; at
        # qwen3-4b's (6144 x 2560) splitting gains nothing (13.96 against 14.02 us)
        return 64, 128, 2, 4
    if n <= 4096:
        return (64, 256, 1, 4) if k % 512 == 0 else (64, 128, 1, 5)
    if n <= 8192:
        return 64, 128, 1, 5
    return (32, 128, 1, 3) if n < 65536 else (64, 256, 1, 4)
