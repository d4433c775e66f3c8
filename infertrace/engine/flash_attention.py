"""FlashAttention-4 over the paged KV cache (the `flash` attention backend).

FlashAttention-4 (the `flash-attn-4` package, imported as `flash_attn.cute`: kernels written in the CuTe DSL for
Hopper and later) computes a step's attention in one call of its varlen interface: the queries packed by
`cu_seqlens_q`, the keys and values read from the cache's pages through a page table, each request's context length
from `seqused_k`, causal from the bottom right (a request's query rows are the last rows of its context), which is
this engine's step layout. The cache's [slots, kv_heads, head_dim] tensors are [pages, block_size, kv_heads,
head_dim] pages as they are.

The call's launch shape depends only on host integers (the batch's size, `max_seqlen_q`, the page table's width), so
it is captured in the decode and token-count CUDA graphs; every eager call costs about 125 us of host time in the
DSL's argument handling, which the graphs remove. Its index arguments must be int32 while the step buffers hold
int64: `begin_forward` converts them once per forward, inside the graph when one is captured, and every layer reads
the converted copies.
"""

from __future__ import annotations

import torch

from infertrace.engine.attention import AttentionMetadata
from infertrace.engine.config import EngineConfig

INSTALL_HINT = "pip install 'infertrace[flash]' (flash-attn-4, FlashAttention for Hopper and later GPUs)"


def load_flash_attn():
    """FlashAttention-4's varlen function; ImportError with the reason and how to install it when it is missing."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # the DSL raises more than ImportError when its CUDA libraries are missing
        raise ImportError(f"attention_backend='flash' needs flash-attn-4, which does not import here "
                          f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc
    return flash_attn_varlen_func


def check_flash_supported(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError naming the first thing that keeps the flash backend from running on `device`."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend='flash' needs a CUDA device; this engine runs on {device.type}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"attention_backend='flash' needs a Hopper or later GPU (compute capability 9.0+); "
                         f"this one is {major}.{minor}: use 'triton'")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention_backend='flash' runs in bfloat16 or float16, not {str(dtype).split('.')[-1]}: "
                         f"use dtype=bfloat16 or attention_backend='triton'")
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"attention_backend='flash' reads a cache of the model's dtype; "
                         f"kv_cache_dtype={config.kv_cache_dtype!r} needs attention_backend='triton'")
    if config.attention != "batched":
        raise ValueError("attention_backend='flash' computes the whole batch in one call: attention='looped' needs "
                         "attention_backend='triton' or 'torch'")


class FlashAttention:
    """The step's attention in one FlashAttention-4 varlen call over the paged cache."""

    name = "flash"
    mode = "batched"
    fuses_kv_store = True  # the model's fused q/k-norm + RoPE kernel may write K/V into the cache for it
    # KV splits for decode steps (flash-decoding). One: FA4's split path builds its scheduler metadata per call, and
    # a decode step's grid (batch x kv heads, query heads packed per KV head) is what the measured figures used.
    decode_splits = 1

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        check_flash_supported(config, device, dtype)
        from infertrace.engine.kernels import paged_attention as kernels

        self._varlen = load_flash_attn()
        self._kernels = kernels
        self.block_size = config.block_size

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """The int32 copies of the step's index tensors every layer reads (see the module's docstring)."""
        meta.int32_index = (meta.query_start_loc.to(torch.int32), meta.seq_lens.to(torch.int32),
                            meta.block_tables.to(torch.int32))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the step's K/V are already in the cache (written by the fused q/k-norm + RoPE kernel)."""
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        paged_k = k_cache.view(-1, self.block_size, num_kv_heads, head_dim)
        paged_v = v_cache.view(-1, self.block_size, num_kv_heads, head_dim)
        if not kv_stored:
            self._kernels.store_kvcache(k, v, paged_k, paged_v, meta.slot_mapping)
        if meta.int32_index is None:  # a forward that did not go through the model's begin_forward
            self.begin_forward(meta)
        cu_seqlens_q, seqused_k, page_table = meta.int32_index
        splits = self.decode_splits if meta.max_query_len == 1 else 1
        out, _ = self._varlen(
            q, paged_k, paged_v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, page_table=page_table,
            max_seqlen_q=meta.max_query_len, softmax_scale=scale, causal=True, num_splits=splits,
        )
        return out
