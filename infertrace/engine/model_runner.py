"""Runs the model for a planned step: weights and KV cache on the device, input preparation, forward, sampling.

With tensor parallelism every rank has a runner over its shard of the model; rank 0's turns each plan into host
inputs (`StepInputs`), hands them to the other ranks, and runs the same forward with them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from infertrace.engine.annotate import annotate, step_range_name
from infertrace.engine.attention import AttentionMetadata, make_attention_backend
from infertrace.engine.config import EngineConfig
from infertrace.engine.decode_path import DecodePath
from infertrace.engine.kernels import tuning
from infertrace.engine.kernels.tiles import attention_tile_array, decode_order
from infertrace.engine.models.loader import load_weights
from infertrace.engine.models.qwen3 import Qwen3ForCausalLM, Qwen3Spec
from infertrace.engine.parallel import SINGLE, TensorParallel
from infertrace.engine.rejection_sampler import verify
from infertrace.engine.sampler import Sampler, greedy_tokens
from infertrace.engine.scheduler import ScheduledSeq, StepKind, StepPlan
from infertrace.engine.step_buffers import StepBuffers
from infertrace.engine.structured import mask_logits

_CPU_FLOAT16_FALLBACK = torch.float32  # float16 matmuls are slow or missing on CPUs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unsupported dtype {name!r}")
    if dtype == torch.float16 and device.type == "cpu":
        return _CPU_FLOAT16_FALLBACK
    return dtype


@dataclass(slots=True)
class StepInputs:
    """A step's inputs as host values (int64 arrays, and lists for the per-request lengths): what every rank needs
    to run the step's forward."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: list[int]
    query_lens: list[int]
    logits_indices: np.ndarray  # the last token of each request that samples
    block_tables: np.ndarray  # [B, most blocks of a request] padded with 0
    decode: bool  # a decode step (one new token per request): may replay a CUDA graph
    name: str = ""  # the step's profiler range, which the other ranks open around it
    # async scheduling with more ranks: input `feed_rows[i]` is token `feed_sources[i]` sampled by the step before
    # (see ModelRunner.launch), which rank 0 broadcasts to the others on the device when `share_tokens`
    feed_rows: list[int] | None = None
    feed_sources: list[int] | None = None
    share_tokens: bool = False
    # every request that samples is greedy: the other ranks take the same argmax of the gathered logits themselves
    # instead of receiving rank 0's tokens (a broadcast held rank 0's host about 1.8 ms a step on two H200s)
    greedy: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


def _input_tokens(s: ScheduledSeq) -> list[int]:
    """The tokens a scheduled request feeds the step: its next ones, then the drafts it verifies (those past the
    end of its tokens)."""
    tokens = s.seq.token_ids[s.start : s.start + s.num_new_tokens]
    if len(tokens) < s.num_new_tokens:
        return tokens + s.seq.spec_token_ids[: s.num_new_tokens - len(tokens)]
    return tokens


def _with_drafts(last: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Logits indices of the rows that sample, `last` their last positions: a row whose tokens run `drafts` past the
    end of its sequence (its drafts) takes logits at its last token and at each draft."""
    if not (drafts > 0).any():
        return last
    counts = drafts + 1
    first = np.repeat(last - drafts, counts)
    return first + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one [requests, longest table] int64 array, padded with 0."""
    widths = np.fromiter(map(len, tables), np.int64, len(tables))
    out = np.zeros((len(tables), int(widths.max())), dtype=np.int64)
    out[np.arange(out.shape[1]) < widths[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64,
                                                                 int(widths.sum()))
    return out


class OtherRanks(Protocol):
    """The tensor-parallel ranks after rank 0, which run every step rank 0 hands them."""

    def step(self, inputs: StepInputs) -> None: ...

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for `event`, raising as soon as a rank is seen dead."""

    def check(self) -> None:
        """Raise when a rank has died."""

    def mark(self, what: str) -> None:
        """A host timestamp of this step, while the ranks' timeline records."""


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued: its sampled tokens on the device and a host copy that lands when it ends."""

    plan: StepPlan
    samples: list[bool]  # per scheduled request: whether it samples (fixed at launch; the sequences grow later)
    tokens: torch.Tensor | None  # one per scheduled request that samples, in plan order, on the device
    host: torch.Tensor | None  # pinned copy of `tokens`, valid once `event` has completed (CUDA only)
    event: torch.cuda.Event | None
    other_ranks: OtherRanks | None = None  # waited through: a dead rank is an error, not a wait for ever
    # a verify step's outcome, per request that samples: its accepted drafts and the token after them
    verified: list[list[int]] | None = None

    def results(self) -> list[int | list[int] | None]:
        """Wait for the step; the sampled token of each scheduled request (None mid-prefill); in a verify step,
        the list of tokens each request gained."""
        if self.verified is not None:
            it = iter(self.verified)
            return [next(it) if sampled else None for sampled in self.samples]
        if self.tokens is None:
            values: list[int] = []
        elif self.event is not None:
            if self.other_ranks is not None:
                self.other_ranks.wait(self.event)
                self.other_ranks.mark("landed")
            else:
                self.event.synchronize()
            values = self.host[: self.tokens.numel()].tolist()
        else:
            values = self.tokens.tolist()
            if self.other_ranks is not None:
                self.other_ranks.check()
        it = iter(values)
        return [next(it) if sampled else None for sampled in self.samples]


def _describe(attention) -> str:
    describe = getattr(attention, "describe", None)
    return attention.name if describe is None else describe()


def _all_reduce_path(reduce, note: str | None) -> dict:
    """DecodePath's all-reduce fields: what `make_all_reduce` made (None with one rank)."""
    from infertrace.engine.allreduce import PeerMemoryAllReduce

    if reduce is None:
        return {}
    if not isinstance(reduce, PeerMemoryAllReduce):
        return {"all_reduce": reduce.name, "all_reduce_note": note, "logits_gather": "torch.distributed"}
    return {"all_reduce": reduce.name, "all_reduce_note": note, "all_reduce_fusion": reduce.fusion,
            "all_reduce_spread": reduce.spread, "all_reduce_pull": reduce.pull, "all_reduce_payload": reduce.payload,
            "all_reduce_push": reduce.push,
            "logits_gather": "torch.distributed" if reduce.gather is None else "peer memory"}


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config: dict, tp: TensorParallel = SINGLE,
                 other_ranks: OtherRanks | None = None):
        self.config = config
        self.other_ranks = other_ranks
        self.device = resolve_device(config.device)
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.spec = Qwen3Spec.from_hf_config(hf_config)
        on_cuda = self.device.type == "cuda"
        fused = config.fused_norm and on_cuda
        skinny = (fused and config.skinny_gemm and self.dtype in (torch.bfloat16, torch.float16)
                  and not self.spec.attention_bias)
        tuned = tuning.rules()  # an experiment's values for the rules beside the kernels, read once here
        reduce = None
        all_reduce_note = None
        if tp.size > 1:  # the ranks agree on it (a collective), before any graph is captured
            from infertrace.engine.allreduce import make_all_reduce

            reduce, all_reduce_note = make_all_reduce(config.all_reduce, self.device, self.dtype, tp.size,
                                                      skinny=skinny, hidden_size=hf_config["hidden_size"],
                                                      gather_cols=-(-hf_config["vocab_size"] // tp.size),
                                                      overrides=tuned)
            tp = dataclasses.replace(tp, reduce=reduce)
        self.tp = tp
        self.share_tokens = False  # set by the engine: async scheduling with more ranks (see StepInputs)
        self._shared_tokens: torch.Tensor | None = None  # the other ranks' copy of the last step's sampled tokens
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else self.dtype
        self.num_kv_heads = self.spec.num_key_value_heads // tp.size  # this rank's
        self.block_size = config.block_size
        self.attention = make_attention_backend(config, self.device, self.dtype, tuned)
        # decode attention launched longest context first (the Triton kernel's `seq_order`, which runs decode in
        # `auto` too)
        self._ordered_decode = config.decode_longest_first and self.attention.name in ("triton", "auto")

        pdl = early = False
        if on_cuda:  # both switches are process-wide; a CUDA graph keeps the kernels as they were at its capture
            from infertrace.engine.kernels import launch, skinny_gemm

            pdl = launch.set_enabled(config.pdl)
            wanted = {"on": True, "off": False}.get(tuned.get("gemm_early_weights"), skinny_gemm.early_rule(tp.size))
            early = skinny_gemm.set_early(wanted and skinny and pdl)
        self.decode_path = DecodePath(
            attention_backend=f"{_describe(self.attention)} ({self.attention.mode})", fused_norm=fused, skinny_gemm=skinny,
            fused_projections=skinny and config.fused_projections, pdl=pdl, gemm_early_weights=early,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."), **_all_reduce_path(reduce, all_reduce_note))

        with torch.device("meta"):
            model = Qwen3ForCausalLM(self.spec, self.dtype, tp)
        model = model.to_empty(device=self.device)
        load_weights(model, model_dir)
        model.eval()
        max_positions = min(self.spec.max_position_embeddings, config.max_model_len or self.spec.max_position_embeddings)
        model.setup(self.attention, max_positions, self.device, self.decode_path)
        self.model = model
        self.max_positions = max_positions
        self.peak_activation_bytes = self._measure_peak_activation() if on_cuda and config.kv_cache_tokens is None else 0

        self.num_blocks = self._num_kv_blocks()
        slots = self.num_blocks * self.block_size
        shape = (2, self.spec.num_hidden_layers, slots, self.num_kv_heads, self.spec.head_dim)
        # zeroed: padded positions of the batched path read slots nobody wrote, and must read finite values
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        model.bind_kv_cache(list(self.kv_cache[0]), list(self.kv_cache[1]))
        self.sampler = Sampler(config.seed, self.device)
        # two pinned landing buffers for sampled tokens, used in turn: a step's copy lands while the host still
        # reads the one before it
        self._landing = [
            (torch.zeros(config.max_num_seqs, dtype=torch.long, pin_memory=True), torch.cuda.Event())
            for _ in range(2)
        ] if on_cuda else []
        self._turn = 0

        # the backends whose calls are captured in CUDA graphs; the Triton one's token-count graphs run the batched
        # kernel over a tile list (`uses_tiles`), FlashAttention's over the step's padded cu_seqlens
        capturable = on_cuda and self.attention.name in ("triton", "flash", "auto")
        use_graphs = config.cuda_graphs and capturable
        use_token_graphs = config.prefill_cuda_graphs and capturable and self.attention.mode == "batched"
        tiled = [t for t in config.cuda_graph_token_sizes if self.attention.uses_tiles(t)] if use_token_graphs else []
        group = self.spec.num_attention_heads // self.spec.num_key_value_heads
        self.buffers = None
        if config.static_buffers or use_graphs or use_token_graphs:
            from infertrace.engine.cuda_graph import TokenGraphs

            max_tokens = max(config.max_num_batched_tokens, max_positions, config.max_num_seqs)
            max_tiles = TokenGraphs.max_tiles(tiled, config.max_num_batched_tokens, config.max_num_seqs,
                                              group) if tiled else 1
            self.buffers = StepBuffers(max_tokens, config.max_num_seqs, -(-max_positions // self.block_size),
                                       self.device, max_tiles)
        self.graphs = None
        self.token_graphs = None
        self.graph_capture_s = 0.0
        self.graph_memory_bytes = 0  # device memory the captured graphs hold (their pool)
        if use_graphs or use_token_graphs:
            self._capture_graphs(use_graphs, use_token_graphs, group)

    def _capture_graphs(self, decode: bool, tokens: bool, group: int) -> None:
        """Token-count graphs first (the largest activations), then decode graphs, into one memory pool."""
        from infertrace.engine.cuda_graph import DecodeGraphs, TokenGraphs

        config = self.config
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the free-memory difference below is the graphs' pool alone
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        if tokens:
            self.token_graphs = TokenGraphs(self.model, self.buffers, config.cuda_graph_token_sizes,
                                            config.max_num_batched_tokens, config.max_num_seqs, self.block_size, group,
                                            uses_tiles=self.attention.uses_tiles)
            pool = self.token_graphs.capture(pool)
        if decode:
            self.graphs = DecodeGraphs(self.model, self.buffers, config.cuda_graph_batch_sizes, config.max_num_seqs,
                                       self.block_size, ordered=self._ordered_decode)
            self.graphs.capture(pool)
        self.graph_capture_s = time.perf_counter() - t0
        torch.cuda.empty_cache()  # the warm-ups' eager activations
        self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.spec
        return 2 * s.num_hidden_layers * self.num_kv_heads * s.head_dim * self.kv_dtype.itemsize

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        block_bytes = self.kv_bytes_per_token * self.block_size
        if cfg.kv_cache_tokens is not None:
            return cfg.kv_cache_tokens // self.block_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # what the engine may still take, less the activations of the largest step (measured by a warm-up)
            budget = free - total * (1.0 - cfg.gpu_memory_utilization) - self.peak_activation_bytes
        else:
            budget = cfg.cpu_kv_cache_gb * 1024**3
        blocks = int(budget // block_bytes)
        if self.tp.size > 1:  # every rank holds the same blocks: as many as the fullest rank can
            import torch.distributed as dist

            fewest = torch.tensor([blocks], device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            blocks = int(fewest.item())
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache on {self.device} (one block needs {block_bytes} bytes); "
                "lower the model size or raise the memory budget"
            )
        return blocks

    @torch.inference_mode()
    def _measure_peak_activation(self) -> int:
        """Run the largest prefill step once, against a throwaway KV cache, and return its peak activation bytes."""
        n = min(self.config.max_num_batched_tokens, self.max_positions)
        blocks = -(-n // self.block_size)
        s = self.spec
        cache = torch.zeros((2, s.num_hidden_layers, blocks * self.block_size, self.num_kv_heads, s.head_dim),
                            dtype=self.kv_dtype, device=self.device)
        self.model.bind_kv_cache(list(cache[0]), list(cache[1]))
        long = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, **long), query_start_loc=torch.tensor([0, n], **long),
            seq_lens=torch.tensor([n], **long), block_tables=torch.arange(blocks, **long)[None],
            query_lens_list=[n], seq_lens_list=[n], max_query_len=n, max_seq_len=n, block_size=self.block_size,
        )
        self.attention.prepare(meta)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        hidden = self.model(torch.zeros(n, **long), torch.arange(n, **long), meta)
        self.model.compute_logits(hidden[-1:]).float()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del cache, hidden, meta
        torch.cuda.empty_cache()
        return peak

    def run(self, plan: StepPlan) -> list[int | None]:
        """Forward the planned tokens; returns the sampled token of each scheduled request (None mid-prefill)."""
        return self.launch(plan).results()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, feed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> LaunchedStep:
        """Queue the step's kernels and return without waiting for them.

        `feed` = (tokens, rows, sources): input token `rows[i]` of this step is `tokens[sources[i]]`, the device
        tensor of an earlier step that may still be running (its host copy of those tokens is a placeholder).
        """
        with annotate("prepare_inputs"):
            inputs = self.host_inputs(plan)
            if self.other_ranks is not None:
                inputs.name = step_range_name(plan.kind.value, plan.batch_size, plan.num_tokens)
                inputs.share_tokens = self.share_tokens
                # a masked row's token is rank 0's to choose: the other ranks' argmax would not see the grammar
                inputs.greedy = all(s.seq.params.greedy and s.seq.matcher is None for s in plan.scheduled if s.samples)
                if feed is not None:
                    inputs.feed_rows, inputs.feed_sources = feed[1], feed[2]
                self.other_ranks.step(inputs)
            input_ids, positions, meta, logits_indices = self.prepare_inputs(inputs, feed)
        logits = self.forward(inputs, input_ids, positions, meta, logits_indices)
        with annotate("sample"):
            samples = [s.samples for s in plan.scheduled]
            sampling = [s for s, sampled in zip(plan.scheduled, samples) if sampled]
            if not sampling:
                return LaunchedStep(plan, samples, None, None, None)
            if plan.verifies:  # waits for the step: the next one is planned from its outcome
                return LaunchedStep(plan, samples, None, None, None, verified=verify(self.sampler, logits, sampling))
            matchers = [s.seq.matcher for s in sampling]
            if any(m is not None for m in matchers):  # rows without a grammar pay nothing more
                mask_logits(logits, matchers)
            tokens = self.sampler(logits, [s.seq.params for s in sampling], [s.seq.generator for s in sampling])
            if self.other_ranks is not None and self.share_tokens and not inputs.greedy:
                self._broadcast_tokens(tokens)
            if not self._landing:
                return LaunchedStep(plan, samples, tokens, None, None, self.other_ranks)
            host, event = self._landing[self._turn]
            self._turn ^= 1
            host[: tokens.numel()].copy_(tokens, non_blocking=True)
            event.record()
            if self.other_ranks is not None:
                self.other_ranks.mark("launched")
            return LaunchedStep(plan, samples, tokens, host, event, self.other_ranks)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> None:
        """Run a step rank 0 planned (on the other ranks): inputs and forward, no sampling; with `share_tokens`,
        receive the tokens rank 0 sampled, which the next step's inputs may be fed from."""
        feed = None
        if inputs.feed_rows is not None:
            feed = (self._shared_tokens, inputs.feed_rows, inputs.feed_sources)
        with annotate("prepare_inputs"):
            prepared = self.prepare_inputs(inputs, feed)
        logits = self.forward(inputs, *prepared)
        if inputs.share_tokens and inputs.logits_indices.size:
            with annotate("sample"):
                if inputs.greedy:
                    self._shared_tokens = greedy_tokens(logits)
                else:
                    tokens = torch.empty(inputs.logits_indices.size, dtype=torch.long, device=self.device)
                    self._shared_tokens = self._broadcast_tokens(tokens)

    @staticmethod
    def _broadcast_tokens(tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled tokens to every rank, on the device (async scheduling feeds them to the next step)."""
        import torch.distributed as dist

        dist.broadcast(tokens, src=0)
        return tokens

    @torch.inference_mode()
    def time_decode_graph(self, batch_size: int, replays: int) -> float:
        """GPU milliseconds of one replay of the decode graph for `batch_size`, replayed `replays` times back to back
        over the inputs last put in the step buffers (run when no request is running: the replays write the KV of
        those inputs again). With more ranks every rank must call it at once: the graphs meet in their collectives."""
        from infertrace.engine.cuda_graph import replay_ms

        graph, _ = self.graphs.graphs[self.graphs.bucket_for(batch_size)]
        return replay_ms(graph, replays)

    def forward(self, inputs: StepInputs, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits [requests that sample, vocab] in the model's dtype (None when none samples); every rank runs this.
        They are not widened to float32 here: greedy rows take their argmax as they are (the same index: widening
        is exact), and a row that samples is widened by itself in the sampler."""
        with annotate("forward"):
            if self._graph_step(inputs):
                return self.graphs.replay(inputs.batch_size)
            bucket = self._token_bucket(inputs)
            if bucket is not None:
                hidden = self.token_graphs.replay(bucket, inputs.input_ids.size)
            else:
                hidden = self.model(input_ids, positions, meta)
            return self.model.compute_logits(hidden[logits_indices]) if logits_indices.numel() else None

    def host_inputs(self, plan: StepPlan) -> StepInputs:
        """The plan as host arrays, computed per step rather than per token (no Python loop over tokens)."""
        scheduled = plan.scheduled
        num_seqs = len(scheduled)
        query_lens = [s.num_new_tokens for s in scheduled]
        starts = np.fromiter((s.start for s in scheduled), np.int64, num_seqs)
        qlens = np.array(query_lens, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # only a verify or mixed step can hold drafts: decode steps, the hot path, keep the plain slices
        drafting = plan.kind in (StepKind.VERIFY, StepKind.MIXED)
        pieces = ([_input_tokens(s) for s in scheduled] if drafting
                  else [s.seq.token_ids[s.start : s.start + s.num_new_tokens] for s in scheduled])
        input_ids = np.fromiter(chain.from_iterable(pieces), np.int64, num_tokens)
        token_seq = np.repeat(np.arange(num_seqs), qlens)  # request of each token
        positions = np.arange(num_tokens) + (starts - query_start_loc[:-1])[token_seq]
        block_tables = _padded([s.seq.block_table for s in scheduled])
        bs = self.block_size
        slot_mapping = block_tables[token_seq, positions // bs] * bs + positions % bs
        samples = np.fromiter((s.samples for s in scheduled), bool, num_seqs)
        logits_indices = query_start_loc[1:][samples] - 1
        if drafting:
            lengths = np.fromiter((len(s.seq.token_ids) for s in scheduled), np.int64, num_seqs)
            logits_indices = _with_drafts(logits_indices, (starts + qlens - lengths)[samples])
        return StepInputs(input_ids, positions, slot_mapping, query_start_loc, (starts + qlens).tolist(), query_lens,
                          logits_indices, block_tables, plan.kind is StepKind.DECODE)

    def prepare_inputs(self, inputs: StepInputs, feed: tuple[torch.Tensor, list[int], list[int]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's device tensors and attention metadata, prepared for the attention backend (`feed`: see
        `launch`)."""
        if self.buffers is None:
            prepared = self._fresh_inputs(inputs)
            if feed is not None and feed[1] == feed[2] == list(range(len(feed[1]))):
                self._feed_tokens(prepared[0], feed[0][: len(feed[1])], None, None)
            elif feed is not None:
                tokens, rows, sources = feed
                index = torch.tensor([rows, sources], dtype=torch.long).to(self.device, non_blocking=True)
                self._feed_tokens(prepared[0], tokens, index[0], index[1])
        else:
            prepared = self._buffered_inputs(inputs, feed)
        self.attention.prepare(prepared[2])
        return prepared

    def _buffered_inputs(self, inputs: StepInputs, feed: tuple[torch.Tensor, list[int], list[int]] | None
                         ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Every input put into the step buffers, then copied to the device in one batch (see StepBuffers)."""
        buffers = self.buffers
        buffers.begin()
        num_tokens, num_seqs = inputs.input_ids.size, len(inputs.seq_lens)
        input_ids = buffers.put("input_ids", inputs.input_ids)
        positions = buffers.put("positions", inputs.positions)
        slot_mapping = buffers.put("slot_mapping", inputs.slot_mapping)
        seq_lens = buffers.put("seq_lens", np.asarray(inputs.seq_lens, dtype=np.int64))
        buffers.put("block_tables", inputs.block_tables)
        logits_indices = buffers.put("logits_indices", inputs.logits_indices)
        order = None
        if self._graph_step(inputs):
            query_start_loc = buffers.decode_query_start_loc[: num_seqs + 1]
            rows = self.graphs.bucket_for(num_seqs)
            buffers.put_decode_padding(num_seqs, rows)
            if (launch := self._launch_order(inputs, rows)) is not None:  # the graph reads it from the buffer
                buffers.put("decode_order", launch)
        else:
            query_start_loc = buffers.put("query_start_loc", inputs.query_start_loc)
            if (launch := self._launch_order(inputs, num_seqs)) is not None:
                order = buffers.put("decode_order", launch)
        bucket = self._token_bucket(inputs)
        if bucket is not None:
            # padding tokens write no KV; their ids and positions are whatever earlier steps left (valid values)
            buffers.put("slot_mapping", np.full(bucket - num_tokens, -1, dtype=np.int64), num_tokens)
            graphs = self.token_graphs
            if graphs.uses_tiles(bucket):
                tiles = attention_tile_array(np.asarray(inputs.query_lens, dtype=np.int64), graphs.group,
                                             graphs.block_m(bucket), graphs.num_tiles(bucket))
                buffers.put("attn_tile_seq", tiles[0])
                buffers.put("attn_tile_index", tiles[1])
            else:  # the graph's batch is the bucket's: the rows past the step's are empty requests
                rows = graphs.batch_rows(bucket)
                buffers.put("query_start_loc", np.full(rows - num_seqs, num_tokens, dtype=np.int64), num_seqs + 1)
                buffers.put("seq_lens", np.zeros(rows - num_seqs, dtype=np.int64), num_seqs)
        fed = None
        if feed is not None:
            tokens, rows, sources = feed
            if rows == sources == list(range(len(rows))):  # the first rows, in order: a plain copy
                fed = (tokens[: len(rows)], None, None)
            else:
                fed = (tokens, buffers.put("feed_rows", np.asarray(rows, dtype=np.int64)),
                       buffers.put("feed_sources", np.asarray(sources, dtype=np.int64)))
        buffers.commit()
        if fed is not None:
            self._feed_tokens(input_ids, *fed)
        meta = self._metadata(inputs, slot_mapping, query_start_loc, seq_lens, buffers.block_tables[:num_seqs], order)
        return input_ids, positions, meta, logits_indices

    def _fresh_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """New device tensors for every input (`static_buffers=False`)."""

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(self.device, non_blocking=True)

        launch = self._launch_order(inputs, len(inputs.seq_lens))
        order = None if launch is None else tensor(launch)
        meta = self._metadata(inputs, tensor(inputs.slot_mapping), tensor(inputs.query_start_loc),
                              tensor(np.asarray(inputs.seq_lens, dtype=np.int64)), tensor(inputs.block_tables), order)
        return tensor(inputs.input_ids), tensor(inputs.positions), meta, tensor(inputs.logits_indices)

    def _metadata(self, inputs: StepInputs, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, order: torch.Tensor | None = None
                  ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_lens_list=inputs.query_lens,
            seq_lens_list=inputs.seq_lens,
            max_query_len=max(inputs.query_lens),
            max_seq_len=max(inputs.seq_lens),
            block_size=self.block_size,
            decode_order=order,
        )

    def _launch_order(self, inputs: StepInputs, rows: int) -> np.ndarray | None:
        """The decode attention's launch order over `rows` rows (the step's, then padding), longest context first;
        None when the step has a longer query or the order is off."""
        if not self._ordered_decode or max(inputs.query_lens) > 1:
            return None
        return decode_order(inputs.seq_lens, rows)

    @staticmethod
    def _feed_tokens(input_ids: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None,
                     sources: torch.Tensor | None) -> None:
        """Input ids `rows` (a device index; None: the first ones) of this step are `tokens[sources]`, an earlier
        step's samples on the device."""
        if rows is None:
            input_ids[: tokens.numel()].copy_(tokens)
        else:
            input_ids.index_copy_(0, rows, tokens.index_select(0, sources))

    def _graph_step(self, inputs: StepInputs) -> bool:
        return self.graphs is not None and inputs.decode and self.graphs.bucket_for(inputs.batch_size) is not None

    def _token_bucket(self, inputs: StepInputs) -> int | None:
        """The token-count graph a prefill or mixed step replays (None: it runs eagerly).

        A step whose every request brings one token keeps the eager path's split-KV decode attention.
        """
        if self.token_graphs is None or inputs.decode or max(inputs.query_lens) == 1:
            return None
        return self.token_graphs.bucket_for(len(inputs.input_ids))
