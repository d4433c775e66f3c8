"""Long-context offload: a request whose KV cannot fit the device pool keeps all of its KV in host memory.

Its KV sits in a run of host blocks laid out layer-major ([layers, 2, tokens, kv_heads, head_dim]), so that the
keys (or values) of one layer over a token range are one contiguous copy. In each of its steps, every layer
- queues a store of the step's new K/V to the host (store stream, after the compute that produced them);
- attends over the KV before the step chunk by chunk: chunks of `offload_chunk_tokens` stream to the device
  through a ring of `offload_ring_slots` slots, loads running ahead of compute (across layer boundaries too), a
  slot reloaded only after an event says compute finished with it;
- attends the step's own tokens causally among themselves;
and merges the partial results by log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from infertrace.engine.annotate import annotate
from infertrace.engine.attention import AttentionMetadata
from infertrace.engine.config import EngineConfig
from infertrace.engine.offload.chunked_attention import ChunkAttention, merge_partials
from infertrace.engine.offload.host_pool import HostKVPool
from infertrace.engine.offload.transfers import D2H, H2D, Transfer, Transfers
from infertrace.engine.scheduler import StepPlan
from infertrace.engine.sequence import Sequence


def ring_budget_tokens(config: EngineConfig, num_layers: int) -> int:
    """Tokens of the device KV budget the ring takes: its slots hold one layer each, a KV token holds every layer."""
    per_layer_tokens = config.offload_ring_slots * config.offload_chunk_tokens
    blocks = -(-per_layer_tokens // (num_layers * config.block_size))
    return blocks * config.block_size


class LongSequenceKV:
    __slots__ = ("first_block", "num_blocks", "region")

    def __init__(self, first_block: int, num_blocks: int, region: torch.Tensor):
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.region = region  # [layers, 2, tokens, kv_heads, head_dim] in the host pool


class LongContext:
    def __init__(
        self,
        config: EngineConfig,
        runner,
        pool: HostKVPool,
        transfers: Transfers,
        device_tokens: int,
        max_model_len: int,
    ):
        spec = runner.spec
        self.pool = pool
        self.transfers = transfers
        self.device_tokens = device_tokens  # a request that may grow past this runs here
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.num_layers = spec.num_hidden_layers
        self.chunk_tokens = config.offload_chunk_tokens
        self.num_slots = config.offload_ring_slots
        shape = (self.num_slots, 2, self.chunk_tokens, spec.num_key_value_heads, spec.head_dim)
        try:
            self.ring = torch.empty(shape, dtype=runner.dtype, device=runner.device)
        except torch.OutOfMemoryError:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=runner.dtype).element_size()
            raise ValueError(
                f"offload=long needs {nbytes / 1024**2:.0f} MiB of device memory for its ring of {self.num_slots} "
                f"slots x {self.chunk_tokens} tokens; lower offload_chunk_tokens, offload_ring_slots or "
                "gpu_memory_utilization"
            ) from None
        self.attention = ChunkAttention(
            runner.device, runner.dtype, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        )
        self.seqs: dict[Sequence, LongSequenceKV] = {}
        self._slot_free: list[torch.cuda.Event | None] = [None] * self.num_slots
        self.num_steps = 0
        self.num_sequences = 0
        # per step: the (layer, chunk) loads in order, how many were issued and consumed, each slot's load
        self._kv: LongSequenceKV | None = None
        self._past = 0
        self._tasks: list[tuple[int, int]] = []
        self._issued = self._consumed = 0
        self._ready: list[Transfer | None] = [None] * self.num_slots

    @property
    def ring_nbytes(self) -> int:
        return self.ring.numel() * self.ring.element_size()

    # ----- the scheduler's questions -----
    def max_len(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)

    def wants(self, seq: Sequence) -> bool:
        """Whether `seq` may grow past what the device pool holds, so its KV must live in host memory."""
        return seq in self.seqs or self.max_len(seq) > self.device_tokens

    def blocks_for(self, seq: Sequence) -> int:
        return -(-self.max_len(seq) // self.block_size)

    def can_admit(self, seq: Sequence) -> bool:
        return self.pool.find_run(self.blocks_for(seq)) is not None

    def admit(self, seq: Sequence) -> None:
        num_blocks = self.blocks_for(seq)
        first = self.pool.allocate_run(num_blocks)
        assert first is not None, "admitted a long request without host room"
        self.seqs[seq] = LongSequenceKV(first, num_blocks, self.pool.region(first, num_blocks))
        self.num_sequences += 1

    def release(self, seq: Sequence) -> None:
        """Give the request's host blocks back once every copy touching them finished."""
        kv = self.seqs.pop(seq, None)
        if kv is not None:
            self.transfers.fence(lambda: self.pool.free_run(kv.first_block, kv.num_blocks))

    # ----- a step -----
    @torch.inference_mode()
    def run(self, runner, plan: StepPlan) -> list[int | None]:
        """Forward the long request's planned tokens; returns its sampled token (None mid-prefill)."""
        [s] = plan.scheduled
        seq, start, end = s.seq, s.start, s.start + s.num_new_tokens
        kv = self.seqs[seq]
        device = runner.device
        with annotate("prepare_inputs"):
            input_ids = torch.tensor(seq.token_ids[start:end], dtype=torch.long).to(device, non_blocking=True)
            positions = torch.arange(start, end, dtype=torch.long).to(device, non_blocking=True)
            meta = _single_sequence_metadata(start, end, self.block_size, device)
            backend = _LongAttention(self)
        with annotate("forward"):
            self._begin(kv, start)
            with _attention_backend(runner.model, backend):
                hidden = runner.model(input_ids, positions, meta)
            assert backend.layer == self.num_layers and self._consumed == len(self._tasks)
            logits = runner.model.compute_logits(hidden[-1:]).float() if s.samples else None
        with annotate("sample"):
            tokens = runner.sampler(logits, [seq.params], [seq.generator]) if s.samples else []
        self.num_steps += 1
        return [int(tokens[0]) if s.samples else None]

    def _begin(self, kv: LongSequenceKV, past: int) -> None:
        self.transfers.stores_before_loads()  # the KV before this step was written by earlier steps' stores
        self._kv, self._past = kv, past
        chunks = -(-past // self.chunk_tokens)
        self._tasks = [(layer, c) for layer in range(self.num_layers) for c in range(chunks)]
        self._issued = self._consumed = 0
        self._prefetch()

    def _chunk_range(self, chunk: int) -> tuple[int, int]:
        lo = chunk * self.chunk_tokens
        return lo, min(lo + self.chunk_tokens, self._past)

    def _prefetch(self) -> None:
        """Issue loads until every slot holds or awaits a chunk not yet consumed."""
        while self._issued < len(self._tasks) and self._issued < self._consumed + self.num_slots:
            slot = self._issued % self.num_slots
            layer, chunk = self._tasks[self._issued]
            lo, hi = self._chunk_range(chunk)
            region = self._kv.region
            pairs = [(self.ring[slot, i, : hi - lo], region[layer, i, lo:hi]) for i in (0, 1)]  # keys, values
            self._ready[slot] = self.transfers.copy(H2D, pairs, after_compute=False, after=[self._slot_free[slot]])
            self._issued += 1

    def _take(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's keys and values in their ring slot, once its load finished (for the compute stream)."""
        assert self._tasks[self._consumed] == (layer, chunk)
        self._prefetch()
        slot = self._consumed % self.num_slots
        self.transfers.wait(self._ready[slot])
        lo, hi = self._chunk_range(chunk)
        return self.ring[slot, 0, : hi - lo], self.ring[slot, 1, : hi - lo]

    def _release(self) -> None:
        """Compute has queued its last use of the current slot: the slot may be reloaded after that."""
        slot = self._consumed % self.num_slots
        if self.transfers.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.ring.device))
            self._slot_free[slot] = event
        self._consumed += 1
        self._prefetch()

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        k, v = k.contiguous(), v.contiguous()
        end = start + k.shape[0]
        region = self._kv.region
        pairs = [(region[layer, 0, start:end], k), (region[layer, 1, start:end], v)]
        self.transfers.copy(D2H, pairs, keep_alive=[k, v])


class _LongAttention:
    """Stands in for the attention backend during a long request's forward; layers call it in order."""

    name = "long-context"

    def __init__(self, ctx: LongContext):
        self.ctx = ctx
        self.layer = 0

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ctx, layer = self.ctx, self.layer
        self.layer += 1
        with annotate("offload.store"):
            ctx._store(layer, k, v, ctx._past)
        partial = None
        for chunk in range(-(-ctx._past // ctx.chunk_tokens)):
            with annotate("offload.load"):
                keys, values = ctx._take(layer, chunk)
            partial = merge_partials(partial, ctx.attention(q, keys, values, scale, causal=False))
            ctx._release()
        partial = merge_partials(partial, ctx.attention(q, k, v, scale, causal=True))
        return partial[0].to(q.dtype)


@contextmanager
def _attention_backend(model, backend) -> Iterator[None]:
    """Run the model's layers with `backend` as their attention, for one forward."""
    previous = model.attn
    model.attn = backend
    try:
        yield
    finally:
        model.attn = previous


def _single_sequence_metadata(start: int, end: int, block_size: int, device: torch.device) -> AttentionMetadata:
    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        query_start_loc=tensor([0, end - start]),
        seq_lens=tensor([end]),
        block_tables=torch.zeros((1, 0), dtype=torch.long, device=device),
        query_lens_list=[end - start],
        seq_lens_list=[end],
        max_query_len=end - start,
        max_seq_len=end,
        block_size=block_size,
    )
