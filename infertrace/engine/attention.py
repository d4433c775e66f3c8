"""Paged attention over the KV cache, and the backends that compute it.

Every step is one varlen batch: request i contributes query tokens [query_start_loc[i], query_start_loc[i+1])
at the end of a context of seq_lens[i] tokens whose KV lives in the slots its block table names. The torch
backend is the reference: plain matmul and softmax, on any device. `batched` computes the whole batch in one
call over padded tensors; `looped` computes one request at a time, as engines written from scratch first do.
The Triton backend runs this engine's own kernels; the flash backend runs FlashAttention-4 (`FlashAttention`).
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
    # a step captured per token-count bucket: (tile_seq, tile_index, block_m) of `attention_tiles`, the Triton
    # kernel's grid; max_query_len and the host lists then describe the bucket, not the step
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None
    # a decode step's rows, longest context first: the Triton kernel launches their programs in this order
    decode_order: torch.Tensor | None = None
    # (cu_seqlens_q, seqused_k, page_table) as int32, for the flash backend (`FlashAttention.begin_forward`)
    int32_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x, rounded to the cache's dtype. An 8-bit cache saturates at its largest finite value, as the
    GPU kernels' conversion does (torch's own cast gives NaN past it on CUDA), and is written through a byte view
    (index_copy_ has no float8 kernel on every device)."""
    if cache.dtype == x.dtype:
        cache.index_copy_(0, slots, x)
    else:
        top = torch.finfo(cache.dtype).max
        cache.view(torch.uint8).index_copy_(0, slots, x.clamp(-top, top).to(cache.dtype).view(torch.uint8))


def store_paged(k, v, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                kv_stored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as [pages, block_size, kv_heads, head_dim] views, with the step's K/V written into them by the
    Triton kernel unless `kv_stored` (already written by the fused q/k-norm + RoPE kernel). CUDA only."""
    from infertrace.engine.kernels import paged_attention as kernels

    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    paged_k = k_cache.view(-1, block_size, num_kv_heads, head_dim)
    paged_v = v_cache.view(-1, block_size, num_kv_heads, head_dim)
    if not kv_stored:
        kernels.store_kvcache(k, v, paged_k, paged_v, slot_mapping)
    return paged_k, paged_v


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
        store(k_cache, meta.slot_mapping, k)
        store(v_cache, meta.slot_mapping, v)
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
        keys = k_cache[meta.context_slots].to(q.dtype).permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, D]
        values = v_cache[meta.context_slots].to(q.dtype).permute(0, 2, 1, 3).unsqueeze(2)
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
            keys = k_cache[slots].to(q.dtype).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
            values = v_cache[slots].to(q.dtype).permute(1, 0, 2).unsqueeze(1)
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


class TritonAttention:
    """CUDA attention through our Triton kernels: one kernel writes the new K/V into the paged cache, one computes
    attention over it for the whole varlen batch (`batched`) or launches once per request (`looped`).

    It reads only device tensors and host integers fixed by the step's shape, so decode steps can be captured in
    CUDA graphs.
    """

    name = "triton"
    MAX_SPLITS = 8
    fuses_kv_store = True  # the model's fused q/k-norm + RoPE kernel may write K/V into the cache for it

    def __init__(self, mode: str = "batched", block_size: int = 16, batch_buckets: tuple[int, ...] = (),
                 max_num_seqs: int = 256):
        from infertrace.engine.kernels import paged_attention as kernels

        assert mode in ("batched", "looped")
        self.mode = mode
        self.block_size = block_size
        self._kernels = kernels
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.max_num_seqs = max_num_seqs
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode_splits(self, batch_size: int, num_kv_heads: int) -> int:
        """KV splits for a decode batch: enough programs to cover the GPU twice. Chosen from the batch's CUDA-graph
        bucket, so a step computes the same sums whether it replays a graph or runs eagerly."""
        bucket = next((b for b in self.batch_buckets if b >= batch_size), batch_size)
        return max(1, min(self.MAX_SPLITS, -(-2 * self.num_sms // (bucket * num_kv_heads))))

    def _split_workspace(self, q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._workspace is None:  # once: graphs and eager decode steps all use views of it
            _, heads, dim = q.shape
            self._workspace = (
                torch.empty((self.MAX_SPLITS, self.max_num_seqs, heads, dim), dtype=torch.float32, device=q.device),
                torch.empty((self.MAX_SPLITS, self.max_num_seqs, heads), dtype=torch.float32, device=q.device),
            )
        parts, lse = self._workspace
        return parts[:splits, : q.shape[0]], lse[:splits, : q.shape[0]]

    def describe(self) -> str:
        return self.name

    def uses_tiles(self, num_tokens: int) -> bool:
        """Whether a token-count graph of `num_tokens` tokens runs this backend over a tile list (see TokenGraphs)."""
        return True

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the step's K/V are already in the cache (written by the fused q/k-norm + RoPE kernel)."""
        num_heads_kv = k_cache.shape[1]
        paged_k, paged_v = store_paged(k, v, k_cache, v_cache, meta.slot_mapping, self.block_size, kv_stored)
        out = torch.empty_like(q)
        if meta.tiles is not None:
            # rows of padding tokens stay unwritten: every other kernel of the step works row by row, so they reach
            # no real token
            return self._kernels.paged_attention(
                q, paged_k, paged_v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_query_len, scale, out=out, tiles=meta.tiles,
            )
        if self.mode == "batched":
            splits, workspace = 1, None
            if meta.max_query_len == 1 and q.shape[0] <= self.max_num_seqs:
                splits = self.decode_splits(q.shape[0], num_heads_kv)
                workspace = self._split_workspace(q, splits) if splits > 1 else None
            return self._kernels.paged_attention(
                q, paged_k, paged_v, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_query_len, scale, out=out, num_splits=splits, workspace=workspace,
                seq_order=meta.decode_order,  # set for decode steps only
            )
        for b, qlen in enumerate(meta.query_lens_list):
            # the kernel indexes q through query_start_loc, so a request is a one-row view of the batch tensors
            self._kernels.paged_attention(
                q, paged_k, paged_v, meta.query_start_loc[b : b + 2], meta.seq_lens[b : b + 1],
                meta.block_tables[b : b + 1], qlen, scale, out=out,
            )
        return out


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
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reason = flash_blocker(device.type, capability, str(dtype).split(".")[-1], config.kv_cache_dtype, config.attention)
    if reason is not None:
        raise ValueError(reason)


def flash_blocker(device_type: str, capability: tuple[int, int] | None, dtype: str | None, kv_cache_dtype: str,
                  attention: str) -> str | None:
    """The first thing that keeps the flash backend from running under these settings, in a sentence; None when
    nothing does (whether flash-attn-4 is installed is asked elsewhere). `dtype`: the model's, None when not known
    yet. Used where an engine starts (`check_flash_supported`) and where `ablate` says what `auto` resolves to."""
    if device_type != "cuda":
        return f"attention_backend='flash' needs a CUDA device; this engine runs on {device_type}"
    if capability is not None and capability[0] < 9:
        return (f"attention_backend='flash' needs a Hopper or later GPU (compute capability 9.0+); "
                f"this one is {capability[0]}.{capability[1]}: use 'triton'")
    if dtype is not None and dtype not in ("bfloat16", "float16"):
        return (f"attention_backend='flash' runs in bfloat16 or float16, not {dtype}: use dtype=bfloat16 or "
                f"attention_backend='triton'")
    if kv_cache_dtype != "auto":
        return (f"attention_backend='flash' reads a cache of the model's dtype; kv_cache_dtype={kv_cache_dtype!r} "
                f"needs attention_backend='triton'")
    if attention != "batched":
        return ("attention_backend='flash' computes the whole batch in one call: attention='looped' needs "
                "attention_backend='triton' or 'torch'")
    return None


class FlashAttention:
    """The step's attention in one FlashAttention-4 varlen call over the paged cache (the `flash` backend).

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

    name = "flash"
    mode = "batched"
    fuses_kv_store = True  # the model's fused q/k-norm + RoPE kernel may write K/V into the cache for it

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        check_flash_supported(config, device, dtype)
        self._varlen = load_flash_attn()
        self.block_size = config.block_size

    def describe(self) -> str:
        return self.name

    def uses_tiles(self, num_tokens: int) -> bool:
        return False

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """The int32 copies of the step's index tensors every layer reads (see the module's docstring)."""
        meta.int32_index = (meta.query_start_loc.to(torch.int32), meta.seq_lens.to(torch.int32),
                            meta.block_tables.to(torch.int32))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the step's K/V are already in the cache (written by the fused q/k-norm + RoPE kernel)."""
        paged_k, paged_v = store_paged(k, v, k_cache, v_cache, meta.slot_mapping, self.block_size, kv_stored)
        if meta.int32_index is None:  # a forward that did not go through the model's begin_forward
            self.begin_forward(meta)
        cu_seqlens_q, seqused_k, page_table = meta.int32_index
        # one KV split, decode included: FA4's split path builds its scheduler metadata on every call, and one
        # split is what the measured figures used (docs/benchmarks.md)
        out, _ = self._varlen(
            q, paged_k, paged_v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, page_table=page_table,
            max_seqlen_q=meta.max_query_len, softmax_scale=scale, causal=True, num_splits=1,
        )
        return out


# Where FlashAttention-4's prefill overtakes the Triton kernel, by the GPU's compute capability major: `auto` runs a
# prefill or mixed step of at least this many tokens with FlashAttention-4 (when it is installed and the step can use
# it) and every other step with the Triton kernels. Measured on an H100 (docs/benchmarks.md, "Attention backends"):
# FA4 is slower at 512 tokens (2.04 against 0.90 ms of attention a qwen3-4b step) and in decode (457 against 404 us a
# batch-8 step), faster from 2,048 tokens on (4.82 against 6.79 ms), 2.2x at 32,768.
FLASH_PREFILL_FROM = {9: 1536}


def flash_prefill_rule(capability: tuple[int, int]) -> int | None:
    """The fewest tokens of a prefill or mixed step that `auto` gives to FlashAttention-4 on a GPU of `capability`
    (None: never; overridden by kernels/tuning.py's "flash_prefill_from")."""
    return FLASH_PREFILL_FROM.get(capability[0])


class PhasedAttention:
    """`auto` on a GPU where both backends run: each step's attention from the backend measured faster for its phase
    and size (`flash_prefill_rule`). Decode steps, and prefill or mixed steps below `flash_from` tokens, run the Triton
    kernels; larger prefill and mixed steps run FlashAttention-4. Both read and write the same paged cache, so steps of
    either kind follow each other freely.

    The choice depends only on the step's token count and longest query, host integers a CUDA graph fixes, so each
    decode and token-count graph captures one backend: a token-count bucket of `flash_from` tokens or more holds FA4's
    call, a smaller one the Triton kernel over its tile list (`uses_tiles`)."""

    name = "auto"
    mode = "batched"
    fuses_kv_store = True

    def __init__(self, triton: TritonAttention, flash: FlashAttention, flash_from: int):
        self.triton = triton
        self.flash = flash
        self.flash_from = flash_from

    def describe(self) -> str:
        return f"triton, flash for prefill and mixed steps of {self.flash_from}+ tokens"

    def uses_tiles(self, num_tokens: int) -> bool:
        return num_tokens < self.flash_from

    def backend_for(self, meta: AttentionMetadata):
        """The backend of a step: by its token count (a graph's bucket) and whether any query is longer than one."""
        if meta.max_query_len > 1 and meta.slot_mapping.shape[0] >= self.flash_from:
            return self.flash
        return self.triton

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def begin_forward(self, meta: AttentionMetadata) -> None:
        backend = self.backend_for(meta)
        if backend is self.flash:
            backend.begin_forward(meta)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_stored: bool = False) -> torch.Tensor:
        return self.backend_for(meta).forward(q, k, v, k_cache, v_cache, meta, scale, kv_stored=kv_stored)


def make_attention_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                           overrides: dict | None = None):
    """The attention backend `config` asks for on `device`: on CUDA, `auto` is the Triton kernels, with
    FlashAttention-4 for the prefill sizes where it was measured faster (`PhasedAttention`) when it is installed and
    the engine's settings let it run; `flash` is FlashAttention-4 alone; elsewhere the torch reference.
    `overrides`: an experiment's rule values (kernels/tuning.py)."""
    backend = config.attention_backend
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"attention_backend={backend!r} needs a CUDA device; this engine runs on {device.type}")
    if backend == "flash":
        return FlashAttention(config, device, dtype)
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        triton = TritonAttention(config.attention, config.block_size, config.cuda_graph_batch_sizes,
                                 config.max_num_seqs)
        if backend == "triton":
            return triton
        chosen = (overrides or {}).get("flash_prefill_from")
        flash_from = (None if chosen == "off" else chosen) if chosen is not None else \
            flash_prefill_rule(torch.cuda.get_device_capability(device))
        flash = _flash_if_usable(config, device, dtype) if flash_from is not None else None
        return triton if flash is None else PhasedAttention(triton, flash, flash_from)
    return TorchAttention(config.attention)


def _flash_if_usable(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> FlashAttention | None:
    """FlashAttention-4 for `auto`, or None where it is not installed or the engine's settings keep it out."""
    try:
        return FlashAttention(config, device, dtype)
    except (ValueError, ImportError):
        return None
