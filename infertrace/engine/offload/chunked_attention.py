"""Attention over one chunk of KV that also returns the log-sum-exp of its scores, and the merge of such partials.

Softmax attention over keys split into chunks equals the merge of each chunk's attention weighted by exp(lse):
out = sum_c exp(lse_c - lse) * out_c with lse = log sum_c exp(lse_c). The reference computes a chunk with plain
matmuls in float32 on any device. On CUDA, PyTorch's fused attention ops that return the log-sum-exp are used
instead, but only after a self-check against the reference on this device and dtype (they are private ops).
"""

from __future__ import annotations

import torch

Partial = tuple[torch.Tensor, torch.Tensor]  # out [T, Hq, D] float32, lse [T, Hq] float32


def attend_chunk_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Partial:
    """q [T, Hq, D] against k/v [S, Hkv, D] (query heads grouped over KV heads).

    causal: query row i sits at key position S - T + i and sees keys up to it; otherwise every key is seen.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qh = q.reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).float()  # [Hkv, G, T, D]
    kh = k.permute(1, 0, 2).unsqueeze(1).float()  # [Hkv, 1, S, D]
    vh = v.permute(1, 0, 2).unsqueeze(1).float()
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [Hkv, G, T, S]
    if causal:
        rows = torch.arange(num_tokens, device=q.device)[:, None] + (num_keys - num_tokens)
        scores = scores.masked_fill(torch.arange(num_keys, device=q.device)[None, :] > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, T]
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vh)  # [Hkv, G, T, D]
    out = out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)
    return out, lse.permute(2, 0, 1).reshape(num_tokens, num_heads)


def merge_partials(a: Partial | None, b: Partial) -> Partial:
    """The partial over the union of two disjoint key sets."""
    if a is None:
        return b
    out_a, lse_a = a
    out_b, lse_b = b
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def _fused_chunk(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Partial:
    """One of PyTorch's fused attention kernels over a chunk; GQA by folding the group into the query rows."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # the kernels need unit stride along head_dim
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if causal:
        # folding would break the causal alignment: repeat the (few) new keys per query head instead
        qb = q.transpose(0, 1).unsqueeze(0)
        kb = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        vb = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    else:
        qb = q.reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qb = qb.reshape(1, num_kv_heads, group * num_tokens, head_dim)
        kb = k.transpose(0, 1).unsqueeze(0)
        vb = v.transpose(0, 1).unsqueeze(0)
    if op == "flash":
        result = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, causal, False, scale=scale)
    elif op == "flash_cpu":
        result = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, causal, scale=scale)
    else:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(
            qb, kb, vb, None, True, 0.0, causal, scale=scale
        )
    out, lse = result[0], result[1]
    rows = qb.shape[2]
    out, lse = out[0].float(), lse[0, :, :rows].float()  # lse may be padded past the rows
    if causal:
        return out.transpose(0, 1), lse.transpose(0, 1)
    # reshape, not view: a kernel may hand back a transposed (non-contiguous) output
    out = out.reshape(num_kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3)
    out = out.reshape(num_tokens, num_heads, head_dim)
    return out, lse.reshape(num_kv_heads, group, num_tokens).permute(2, 0, 1).reshape(num_tokens, num_heads)


class ChunkAttention:
    """Chunk attention for one device and dtype: a fused kernel where it passed the self-check, else the reference."""

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
        self.op: str | None = None
        if device.type == "cuda":
            candidates = ("flash", "efficient") if dtype in (torch.float16, torch.bfloat16) else ("efficient",)
            for op in candidates:
                if _self_check(op, device, dtype, num_heads, num_kv_heads, head_dim):
                    self.op = op
                    break

    @property
    def name(self) -> str:
        return self.op or "reference"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Partial:
        if self.op is not None:
            return _fused_chunk(self.op, q, k, v, scale, causal)
        return attend_chunk_reference(q, k, v, scale, causal)


def _self_check(op: str, device, dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the fused op agrees with the reference on random data of this layout (any failure means no)."""
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        for tokens, keys, causal in ((5, 77, False), (37, 37, True), (1, 300, False)):
            q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(device, dtype)
            k = torch.randn(keys, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            v = torch.randn(keys, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            scale = head_dim**-0.5
            out, lse = _fused_chunk(op, q, k, v, scale, causal)
            ref_out, ref_lse = attend_chunk_reference(q, k, v, scale, causal)
            if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
                return False
            if not torch.allclose(out, ref_out, atol=tol, rtol=tol):
                return False
            if not torch.allclose(lse, ref_lse, atol=tol, rtol=tol):
                return False
        return True
    except Exception:  # noqa: BLE001 - an op missing or refusing this layout simply is not used
        return False
