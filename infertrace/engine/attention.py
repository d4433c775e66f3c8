"""Paged attention over the KV cache, and the backends that compute it.

Every step is one varlen batch: request i contributes query tokens [query_start_loc[i], query_start_loc[i+1])
at the end of a context of seq_lens[i] tokens whose KV lives in the slots its block table names. The torch
backend is the reference: plain matmul and softmax, on any device. `batched` computes the whole batch in one
call over padded tensors; `looped` computes one request at a time, as engines written from scratch first do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infertrace.engine.config import EngineConfig


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B+1] cu_seqlens of the queries
    seq_lens: torch.Tensor  # [B] context length of each request, this step's tokens included
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # derived once per step and shared by all layers (filled by the backend's prepare())
    context_slots: torch.Tensor | None = None  # [B, max_seq_len] slot of each context position
    token_batch: torch.Tensor | None = None  # [T] request of each query token
    token_row: torch.Tensor | None = None  # [T] row of each query token within its request
    causal_mask: torch.Tensor | None = None  # [B, 1, 1, max_query_len, max_seq_len] True where attended

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)


class TorchAttention:
    """Reference attention in plain torch (any device)."""

    name = "torch"

    def __init__(self, mode: str = "batched"):
        assert mode in ("batched", "looped")
        self.mode = mode

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step tensors every layer reuses: context slots, query padding maps, the causal mask."""
        device = meta.slot_mapping.device
        bs = meta.block_size
        num_blocks = -(-meta.max_seq_len // bs)
        offsets = torch.arange(bs, device=device)
        slots = meta.block_tables[:, :num_blocks, None] * bs + offsets
        meta.context_slots = slots.reshape(meta.batch_size, -1)[:, : meta.max_seq_len]
        if self.mode == "looped":
            return
        qlens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        meta.token_batch = torch.repeat_interleave(torch.arange(meta.batch_size, device=device), qlens)
        meta.token_row = torch.arange(meta.slot_mapping.numel(), device=device) - meta.query_start_loc[meta.token_batch]
        # query row r of request b sits at position seq_len - query_len + r and sees keys 0..that position
        rows = torch.arange(meta.max_query_len, device=device)
        query_pos = (meta.seq_lens - qlens)[:, None] + rows[None, :]
        keys = torch.arange(meta.max_seq_len, device=device)
        meta.causal_mask = (keys[None, None, :] <= query_pos[:, :, None])[:, None, None]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_slots, Hkv, D]. Writes k/v to the cache, returns [T, Hq, D]."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if self.mode == "looped":
            return self._looped(q, k_cache, v_cache, meta, scale)
        return self._batched(q, k_cache, v_cache, meta, scale)

    def _batched(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        batch, max_q = meta.batch_size, meta.max_query_len
        q_pad = q.new_zeros(batch, max_q, num_heads, head_dim)
        q_pad[meta.token_batch, meta.token_row] = q
        q_pad = q_pad.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        keys = k_cache[meta.context_slots].permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, D]
        values = v_cache[meta.context_slots].permute(0, 2, 1, 3).unsqueeze(2)
        scores = torch.matmul(q_pad, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, Lq, L]
        scores = scores.masked_fill(~meta.causal_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values)  # [B, Hkv, G, Lq, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_q, num_heads, head_dim)
        return out[meta.token_batch, meta.token_row]

    def _looped(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for b, (qlen, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            qb = q[start : start + qlen].view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            slots = meta.context_slots[b, :seq_len]
            keys = k_cache[slots].permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
            values = v_cache[slots].permute(1, 0, 2).unsqueeze(1)
            scores = torch.matmul(qb, keys.transpose(-1, -2)) * scale  # [Hkv, G, qlen, L]
            if qlen > 1:
                query_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            ob = torch.matmul(probs, values)  # [Hkv, G, qlen, D]
            out[start : start + qlen] = ob.permute(2, 0, 1, 3).reshape(qlen, num_heads, head_dim)
            start += qlen
        return out


def make_attention_backend(config: EngineConfig, device: torch.device) -> TorchAttention:
    """The attention backend `config` asks for on `device`; the torch reference is the only one on CPU."""
    backend = config.attention_backend
    if backend in ("triton", "flash_attn") and device.type != "cuda":
        raise ValueError(f"attention_backend={backend!r} needs a CUDA device; this engine runs on {device.type}")
    if backend in ("triton", "flash_attn"):
        raise ValueError(f"attention_backend={backend!r} is not available in this build; use 'torch' or 'auto'")
    return TorchAttention(config.attention)
