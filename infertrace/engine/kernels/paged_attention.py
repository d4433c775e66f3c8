"""Triton kernels over a paged KV cache laid out as [num_blocks, block_size, num_kv_heads, head_dim].

`store_kvcache` writes the step's new K/V at their slots. `paged_attention` is one kernel for prefill, prefill
after a cached prefix, chunked prefill and decode: each program takes a tile of (query token, head of a GQA group)
rows of one sequence and one KV head, walks that sequence's block table and keeps an online softmax. Folding
the group's heads into the rows lets decode (one query token) still fill a tensor-core tile, and reads each K/V
block once per group. An optional split of the KV range (flash-decoding) spreads small decode batches over
more programs; a second kernel merges the splits by log-sum-exp. A decode step may launch its sequences in a
given order (`seq_order`, longest context first): the GPU starts programs in launch order, so a long context
launched last would otherwise run on alone while the rest of the GPU idles.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from infertrace.engine.kernels import launch
from infertrace.engine.kernels.tiles import prefill_block_m


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride, value_stride, ROW: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot < 0:  # padding rows of a captured graph
        return
    offs = tl.arange(0, ROW)
    kv_type = k_cache_ptr.dtype.element_ty  # the model's dtype, or float8 e4m3 (rounded, saturated)
    tl.store(k_cache_ptr + slot * ROW + offs, tl.load(key_ptr + i * key_stride + offs).to(kv_type))
    tl.store(v_cache_ptr + slot * ROW + offs, tl.load(value_ptr + i * value_stride + offs).to(kv_type))


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int32/int64, -1 skips."""
    n, heads, dim = key.shape
    row = heads * dim
    assert key.stride(-1) == 1 and key.stride(1) == dim and value.stride(1) == dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and triton.next_power_of_2(row) == row
    _store_kvcache_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), row,
                                PDL=launch.enabled(), launch_pdl=launch.enabled())


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, tile_seq_ptr, tile_index_ptr, seq_order_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_cb, stride_cs, stride_ch,
    stride_ls, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    TILE_LIST: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr, F16_DOTS: tl.constexpr,
    WIDEN: tl.constexpr, EARLY: tl.constexpr,
):
    if PDL and not EARLY:  # the kernel before has finished and its writes are visible past this point
        gdc_wait()
        gdc_launch_dependents()
    if TILE_LIST:  # program i takes the (sequence, tile) of entry i; -1 pads a grid fixed by a graph's bucket
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        if seq < 0:
            return
        tile = tl.load(tile_index_ptr + tl.program_id(0))
        pid2 = tl.program_id(2)
    elif ORDERED:  # the grid's fastest axis is (KV head, split), so a sequence's programs launch together
        pid2 = tl.program_id(0)
        seq = tl.load(seq_order_ptr + tl.program_id(1))
        tile = tl.program_id(2)
    else:
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        pid2 = tl.program_id(2)
    kv_head = pid2 // NUM_SPLITS
    split = pid2 % NUM_SPLITS

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    if tile * BLOCK_M >= q_len * GROUP:
        return
    ctx = tl.load(context_lens_ptr + seq)
    # a query token sees every key up to its own position (the cached prefix sits before the new tokens)
    q_pos = ctx - q_len + tok

    d = tl.arange(0, HEAD_DIM)
    kv_end = tl.minimum(ctx, ctx - q_len + (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    per_split = _split_tokens(kv_end, NUM_SPLITS, BLOCK_N)
    if NUM_SPLITS > 1 and split > 0 and kv_end <= per_split:
        return  # a context that one split covers: split 0 writes the output itself and the merge skips the row
    lo = split * per_split
    hi = tl.minimum(kv_end, lo + per_split)
    if PDL and EARLY:  # the program's place (sequence, context, split range) came from step inputs, read while the
        gdc_wait()  # kernel before drained; q and this step's K/V come from the kernels before
        gdc_launch_dependents()
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F16_DOTS:  # an 8-bit cache widens to float16 exactly, in one instruction; q and p are rounded to meet it
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634  # work in base 2
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        kv_off = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        v = _widen_f16(v) if WIDEN == 1 else v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1 or kv_end <= per_split:
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partial results in float32; lse in base 2, -inf for an empty split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        base = split * stride_ls + (q_start + tok) * stride_lt + head * stride_lh
        tl.store(lse_ptr + base, lse, mask=row_ok)
        tl.store(part_ptr + (base * HEAD_DIM)[:, None] + d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _widen_f16(x):
    """float8 e4m3 -> float16 (exact), two values an instruction. Written as an opaque instruction so the compiler
    keeps it where it stands: it otherwise moves the widening past the tile's trip through shared memory for the dot,
    and V, whose rows run along the dot's output, then comes back one byte per load (the cast's code on Hopper)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def _split_tokens(kv_end, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV tokens per split: an even share in whole tiles (so a context of at most one tile takes one split)."""
    return tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, context_lens_ptr, num_heads, stride_ot, stride_oh, stride_ls,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                         PDL: tl.constexpr):
    t = tl.program_id(0)  # a decode step: token t is sequence t's only query token
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + t)  # a host input of the step: read before the wait
    if PDL:  # the kernel before has finished and its writes are visible past this point
        # every program waits, even one with nothing to merge: a kernel ends only after the one before it has, so
        # the next kernel's wait on this one covers the attention too (were every context within one split, a merge
        # whose programs all returned first could end while the attention still writes the output)
        gdc_wait()
        gdc_launch_dependents()
    if ctx <= _split_tokens(ctx, NUM_SPLITS, BLOCK_N):
        return  # one split covered the context and wrote the output
    d = tl.arange(0, HEAD_DIM)
    row = t * num_heads + h
    m = float("-inf")
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_ptr + s * stride_ls + row))
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.math.exp2(tl.load(lse_ptr + s * stride_ls + row) - m)
        total += w
        acc += w * tl.load(part_ptr + (s * stride_ls + row) * HEAD_DIM + d)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty))


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    """The GPU's compute capability: 8.9 and later have the float8 conversion instructions, 9.0 is Hopper."""
    return torch.cuda.get_device_capability(device_index)


WIDEN_MODES = {"cast": 0, "asm_v": 1}  # how an 8-bit cache is widened to float16 for the dots


def _default_tiling(eight_bit_decode: bool, widen: str, prefill_sm90: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) when the caller gives none: decode over an 8-bit cache takes the fastest measured
    for its widening at batch 256 and 128 (`benchmarks/kernels_bench.py --only fp8,widen`); steps with longer
    queries over a 16-bit cache on Hopper and later (`prefill_sm90`) take a third stage (on two H100s, 2-13% faster
    than two over the token-count graphs' tile lists of a 512-token prefill, alone or with decodes, for qwen3-0.6b's
    and 4b's heads; over an 8-bit cache it was 0.5-5% slower: `benchmarks/kernels_bench.py --only prefill_tiling`);
    the rest (64, 4, 2)."""
    if prefill_sm90:
        return 64, 4, 3
    if not eight_bit_decode:
        return 64, 4, 2
    return (128, 4, 4) if widen == "cast" else (64, 4, 3)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiling: tuple[int, int, int] | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    widen: str = "auto",
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new query tokens over a paged cache that already holds their K/V.

    q: [total_q_tokens, num_heads, head_dim]; cu_seqlens_q: [num_seqs + 1] int32; context_lens: [num_seqs] int32
    (cached + new tokens); block_tables: [num_seqs, max_blocks] int32. `max_q_len` bounds the grid (1 for decode),
    so the launch shape depends only on host integers, which keeps it capturable in a CUDA graph.
    `workspace` (partials, lse) may be passed in to avoid allocating when num_splits > 1. `tiling` is
    (BLOCK_N, num_warps, num_stages), `_default_tiling` when not given.

    `tiles` = (tile_seq, tile_index, block_m) replaces the grid over (tiles of max_q_len, sequences) by a list
    (`infertrace.engine.kernels.tiles.attention_tiles`): program i computes tile tile_index[i] of sequence tile_seq[i], and entries of sequence -1
    exit at once. The grid is then the list's length, which a CUDA graph fixes per token-count bucket while the
    sequences and their lengths change from replay to replay.

    `seq_order` ([num_seqs], a permutation of the sequences; decode only) launches sequence seq_order[0]'s programs
    first, then seq_order[1]'s, and so on (`decode_order` gives longest context first).

    An 8-bit (float8 e4m3) cache is widened where it is read. Under a 16-bit q the dots then run in float16 (the
    cache's values are exact in it, q and the probabilities are rounded to it; sums stay float32). `widen` says how:
    "asm_v" (the default where the GPU has the instruction) widens V by the conversion instruction and K by a cast,
    "cast" both by casts (`_widen_f16` says why it matters).
    """
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty_like(q)
    eight_bit = k_cache.element_size() == 1
    f16_dots = eight_bit and q.dtype != torch.float32
    if widen == "auto":
        widen = "asm_v" if f16_dots and _capability(q.device.index) >= (8, 9) else "cast"
    assert widen == "cast" or f16_dots, "the widening instruction is for an 8-bit cache under float16 dots"
    block_n, num_warps, num_stages = tiling or _default_tiling(
        eight_bit and max_q_len == 1, widen,
        max_q_len > 1 and k_cache.element_size() == 2 and _capability(q.device.index) >= (9, 0))
    if tiles is None:
        block_m = prefill_block_m(max_q_len, group)
        tile_seq = tile_index = cu_seqlens_q  # unused
        grid = (triton.cdiv(max_q_len * group, block_m), num_seqs, num_kv_heads * num_splits)
        if seq_order is not None:
            assert max_q_len == 1, "a launch order is for decode steps"
            grid = grid[::-1]
    else:
        tile_seq, tile_index, block_m = tiles
        assert num_splits == 1 and seq_order is None
        grid = (tile_seq.shape[0], 1, num_kv_heads)
    if num_splits == 1:
        parts, lse = out, out  # unused
        lse_strides = (0, 0, 0)
    else:
        assert max_q_len == 1, "KV splits are for decode steps"
        if workspace is None:
            parts = torch.empty((num_splits, total, num_heads, head_dim), dtype=torch.float32, device=q.device)
            lse = torch.empty((num_splits, total, num_heads), dtype=torch.float32, device=q.device)
        else:
            parts, lse = workspace
        lse_strides = (lse.stride(0), lse.stride(1), lse.stride(2))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, parts, lse, cu_seqlens_q, context_lens, block_tables, tile_seq, tile_index,
        cu_seqlens_q if seq_order is None else seq_order, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *lse_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TILE_LIST=tiles is not None,
        ORDERED=seq_order is not None, PDL=launch.enabled(), F16_DOTS=f16_dots, WIDEN=WIDEN_MODES[widen],
        EARLY=launch.enabled() and max_q_len == 1 and tiles is None,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=launch.enabled(),
    )
    if num_splits > 1:
        _merge_splits_kernel[(total, num_heads)](
            parts, lse, out, context_lens, num_heads, out.stride(0), out.stride(1), lse.stride(0),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_N=block_n, PDL=launch.enabled(),
            launch_pdl=launch.enabled(),
        )
    return out

