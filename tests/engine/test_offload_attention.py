"""Attention over KV chunks merged by log-sum-exp equals attention over the whole context."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine.offload import ChunkAttention, attend_chunk_reference, merge_partials
from infertrace.engine.offload.chunked_attention import _fused_chunk


def full_attention(q, k, v, scale):
    """Plain causal attention of the last len(q) positions over all of k/v, in float64."""
    tokens, heads, _ = q.shape
    keys, kv_heads, _ = k.shape
    group = heads // kv_heads
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    pos = torch.arange(tokens)[:, None] + keys - tokens
    scores = scores.masked_fill(torch.arange(keys)[None, :] > pos, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


def chunked(q, k, v, scale, chunk, attend=attend_chunk_reference):
    """Past keys in chunks (no mask), the query's own keys causally, merged."""
    past = k.shape[0] - q.shape[0]
    partial = None
    for lo in range(0, past, chunk):
        hi = min(lo + chunk, past)
        partial = merge_partials(partial, attend(q, k[lo:hi], v[lo:hi], scale, causal=False))
    partial = merge_partials(partial, attend(q, k[past:], v[past:], scale, causal=True))
    return partial


@pytest.mark.parametrize(("tokens", "context", "chunk"), [(1, 300, 64), (37, 200, 50), (16, 16, 8), (5, 133, 200)])
def test_merged_chunks_equal_full_attention(tokens, context, chunk):
    gen = torch.Generator().manual_seed(tokens + context)
    q = torch.randn(tokens, 8, 32, generator=gen)
    k = torch.randn(context, 2, 32, generator=gen)
    v = torch.randn(context, 2, 32, generator=gen)
    out, lse = chunked(q, k, v, 32**-0.5, chunk)
    assert out.dtype == torch.float32 and lse.shape == (tokens, 8)
    torch.testing.assert_close(out.double(), full_attention(q, k, v, 32**-0.5), atol=1e-5, rtol=1e-5)


def test_merge_is_exact_for_the_log_sum_exp():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=gen)
    k, v = torch.randn(40, 4, 16, generator=gen), torch.randn(40, 4, 16, generator=gen)
    _, whole = attend_chunk_reference(q, k, v, 0.25, causal=False)
    _, merged = merge_partials(attend_chunk_reference(q, k[:17], v[:17], 0.25, False),
                               attend_chunk_reference(q, k[17:], v[17:], 0.25, False))
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-6)


def test_fused_kernel_layout_matches_the_reference():
    # the GQA folding and head layout used with the fused CUDA kernels, checked through PyTorch's CPU kernel
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 8, 64, generator=gen)
    k = torch.randn(70, 2, 64, generator=gen)
    v = torch.randn(70, 2, 64, generator=gen)
    for causal, keys in ((False, slice(0, 70)), (True, slice(61, 70))):
        got = _fused_chunk("flash_cpu", q, k[keys], v[keys], 0.125, causal)
        want = attend_chunk_reference(q, k[keys], v[keys], 0.125, causal)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def test_cpu_uses_the_reference():
    attention = ChunkAttention(torch.device("cpu"), torch.float32, 8, 2, 64)
    assert attention.name == "reference"
