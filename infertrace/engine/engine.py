"""The synchronous engine core: requests in, one scheduler step at a time, token deltas out.

A step is planned (a pure decision), then runs inside one profiler range named after it:
`step[PREFILL bs=.. toks=..]` / `step[DECODE bs=..]` / `step[MIXED bs=.. toks=..]`, holding `schedule` (the plan
applied: preemptions, admissions, KV slots), `prepare_inputs`, `forward` and `sample`; with KV offload also
`offload.load` (host-tier hits copied back before the forward) and `offload.store` (newly full blocks copied out).

With tensor_parallel_size > 1 this process is rank 0: it schedules and samples, and the other ranks (worker.py) run
each step's forward on their shards of the model.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from array import array
from pathlib import Path

import numpy as np

from infertrace.engine.annotate import annotate, step_range_name
from infertrace.engine.block_manager import BlockManager
from infertrace.engine.config import EngineConfig
from infertrace.engine.detokenizer import IncrementalDetokenizer
from infertrace.engine.draft_model import DraftModelProposer, check_same_vocabulary, draft_model_dir
from infertrace.engine.model_runner import (
    LaunchedStep,
    ModelRunner,
    resolve_device,
    resolve_dtype,
)
from infertrace.engine.models.loader import check_model_dir, read_json
from infertrace.engine.models.qwen3 import Qwen3Spec
from infertrace.engine.ngram_proposer import TokenMirror, propose_ngram
from infertrace.engine.offload.host_pool import check_host_budget
from infertrace.engine.offload.kv_offload import COUNTER_NAMES as OFFLOAD_COUNTER_NAMES
from infertrace.engine.offload.kv_offload import KVOffload
from infertrace.engine.offload.long_context import ring_budget_tokens
from infertrace.engine.outputs import RequestOutput, StepStats
from infertrace.engine.pace import StepPace
from infertrace.engine.parallel import SINGLE, TensorParallel, check_divisible
from infertrace.engine.request_log import RequestLog
from infertrace.engine.sampling_params import SamplingParams, SamplingParamsError
from infertrace.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from infertrace.engine.sequence import Sequence
from infertrace.engine.spec_config import SpeculativeConfig
from infertrace.engine.structured import advance

COUNTER_NAMES = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "steps",
    "requests_added",
    "requests_finished",
    "requests_aborted",
    "cpu_prefix_cache_hits",  # prompt tokens loaded from the host tier of the prefix cache
    "recomputed_tokens",  # prompt tokens computed again although their KV had been computed and dropped
    "overlapped_steps",  # steps planned and queued before the previous step's tokens reached the host
    # speculative decoding, as vLLM counts it: requests' verify rows with drafts, their draft tokens, and those kept
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    *OFFLOAD_COUNTER_NAMES,
)


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, step_label: str | None = None):
        """`step_label`: the kind its profiler step ranges name instead of the step's own (a draft model's engine
        names its steps `step[DRAFT ..]`, without the step numbers of the request log)."""
        from transformers import AutoTokenizer

        self.config = config = config or EngineConfig()
        self.model_dir = check_model_dir(model_dir)
        self._step_label = step_label
        hf_config = read_json(self.model_dir / "config.json")
        self.speculative = config.speculative
        # the draft model's engine starts first: on a GPU the target's KV cache is then sized from what it left
        self.drafter = _drafter(self.speculative, config, self.model_dir, hf_config)
        host_blocks, runner_config = _offload_budgets(config, hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.other_ranks = None
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            _check_tensor_parallel(Qwen3Spec.from_hf_config(hf_config), config.tensor_parallel_size)
            from infertrace.engine.worker import OtherRanks

            self.other_ranks = OtherRanks(config, self.model_dir, hf_config)
            # the ranks stop with the engine: on shutdown(), when it is collected, or when the interpreter exits
            self._finalizer = weakref.finalize(self, self.other_ranks.shutdown)
            tp = TensorParallel(0, config.tensor_parallel_size)
        try:
            self.runner = ModelRunner(runner_config, self.model_dir, hf_config, tp, self.other_ranks)
            if self.other_ranks is not None:
                self.other_ranks.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        spec = self.runner.spec

        if config.max_model_len is not None and config.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings "
                f"({spec.max_position_embeddings})"
            )
        kv_capacity = self.runner.num_blocks * config.block_size
        if config.offload_long:
            # a request too long for the device pool keeps its KV in the host pool, which caps the context instead
            host_capacity = host_blocks * config.block_size
            if config.max_model_len is not None and config.max_model_len > host_capacity:
                raise ValueError(
                    f"max_model_len={config.max_model_len} does not fit the host KV pool ({host_capacity} tokens); "
                    "raise offload_host_gb or lower max_model_len"
                )
            kv_capacity = host_capacity
        elif config.max_model_len is not None and config.max_model_len > kv_capacity:
            raise ValueError(
                f"max_model_len={config.max_model_len} does not fit the KV cache ({kv_capacity} tokens); "
                "raise kv_cache_tokens or lower max_model_len"
            )
        # one request must always fit in the KV cache on its own, so the context is capped by its size
        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings, kv_capacity)
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = _eos_token_ids(self.model_dir, hf_config, self.tokenizer)

        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.offload = None
        if config.offload != "off":
            self.offload = KVOffload(config, self.runner, self.block_manager, host_blocks, self.max_model_len)
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            prefix_tier=self.offload.prefix if self.offload else None,
            long_context=self.offload.long if self.offload else None,
        )
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.last_step: StepStats | None = None
        self._requests: dict[str, Sequence] = {}
        self._step_index = 0
        self._arrivals = 0
        # async scheduling: the step queued on the device whose tokens the host has not seen yet
        self._async = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda")
        self._async = self._async and config.offload == "off" and self.speculative is None
        # with more ranks, rank 0 broadcasts each step's tokens on the device: the next step may be fed from them
        self.runner.share_tokens = self._async and config.tensor_parallel_size > 1
        self._inflight: _Step | None = None
        self._pace = StepPace() if self._async else None  # when to plan the step after the one in flight
        self._grammars = None  # built by the first request with a grammar
        self._profiler = None
        # each request's life by id (arrival, the steps it rode, its end): always on, bounded, read by the server
        self.request_log = RequestLog(config.request_log_size, speculative=self.speculative is not None) \
            if config.request_log_size else None
        # accepted draft tokens by their position among a step's drafts (vLLM's per-position counter)
        self.spec_accepted_per_pos = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank); the engine cannot step afterwards."""
        if self.other_ranks is not None:
            self._finalizer()

    # ----- profiling -----
    def start_profile(self, out_dir: str | Path, activities: tuple[str, ...] = ("CPU", "GPU"),
                      record_shapes: bool = False, with_stack: bool = False, label: str = "infertrace",
                      stem: str | None = None) -> None:
        """Start torch.profiler on every rank; call from the thread that runs the steps (AsyncEngine.call)."""
        from infertrace.engine.rank_profiler import RankProfiler

        if self._profiler is not None:
            raise RuntimeError("a profile is already being captured")
        out_dir, stem, activities = str(out_dir), stem or f"{label}.{time.time_ns()}", tuple(activities)
        profiler = RankProfiler(out_dir, stem, 0, activities, record_shapes, with_stack)
        if self.other_ranks is not None:
            self.other_ranks.call("start_profile", out_dir, stem, activities, record_shapes, with_stack)
        profiler.start()
        self._profiler = profiler

    def stop_profile(self) -> list[Path]:
        """Stop every rank's profiler; the traces written, one per rank in rank order
        (`{label}.{ns}.rank{r}.pt.trace.json.gz`)."""
        if self._profiler is None:
            raise RuntimeError("no profile is being captured")
        profiler, self._profiler = self._profiler, None
        paths = [profiler.stop()]
        if self.other_ranks is not None:
            paths += self.other_ranks.call("stop_profile")
        return [Path(p) for p in paths]

    # ----- state -----
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_blocks_total(self) -> int:
        return self.block_manager.num_blocks

    @property
    def kv_blocks_used(self) -> int:
        return self.block_manager.num_used_blocks

    # ----- requests -----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    label: str | None = None) -> None:
        """`label`: the id the request log reports (its client's), where it differs from the engine's."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt, self.vocab_size)
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the maximum context is {self.max_model_len}")
        seq = Sequence(request_id, token_ids, params, arrival=self._arrivals)
        self._arrivals += 1
        if params.grammar is not None:
            seq.matcher = self._grammar_matcher(params.grammar)
        if params.seed is not None:
            seq.generator = self.runner.sampler.make_generator(params.seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        self._requests[request_id] = seq
        if self.request_log is not None:
            self.request_log.arrived(request_id, time.perf_counter(), len(token_ids), len(self.scheduler.waiting),
                                     len(self.scheduler.running), label)
        self.scheduler.add(seq)
        self.counters["requests_added"] += 1
        self.counters["prompt_tokens"] += len(token_ids)

    def _grammar_matcher(self, grammar: str):
        if self.speculative is not None:
            raise SamplingParamsError("grammar", "structured output is not supported with speculative decoding")
        if self.config.offload_long:
            raise SamplingParamsError("grammar", "structured output is not supported with offload of long contexts")
        if self._grammars is None:
            from infertrace.engine.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return self._grammars.matcher(grammar)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now and free its KV blocks; returns its final output (None for unknown or finished ids)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.token_ids[-1] == _PENDING:
            seq.token_ids.pop()  # its token was still being sampled
        self.scheduler.finish(seq, "abort")
        self.counters["requests_aborted"] += 1
        if self.request_log is not None:
            self.request_log.finished(request_id, time.perf_counter(), "abort", seq.num_output_tokens,
                                      seq.num_cached_tokens or 0)
        return self._output(seq, [], finished=True)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    # ----- stepping -----
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of the requests that produced tokens or finished in it.

        With async scheduling a step's tokens come out of the next call: that call first plans and queues the
        following step (its decode rows read the pending tokens on the device), then waits for the earlier one.
        """
        prev, self._inflight = self._inflight, None
        if prev is not None:
            entered = time.perf_counter()
            self._inflight = self._launch_overlapped(prev)
            if self._inflight is not None:
                self._pace.lead(self._inflight.launched_at - entered)
            return self._complete(prev)
        if not self.scheduler.has_unfinished():
            return []
        t0 = time.perf_counter()
        offload = self.offload
        before = None
        if offload is not None:
            offload.poll()
            before = offload.counters()
        if self.speculative is not None:
            self._propose()
        plan = self.scheduler.plan()
        if not plan.scheduled:
            self.scheduler.apply(plan)
            self.counters["preemptions"] += len(plan.preempted)
            if self.request_log is not None:
                self.request_log.preempted([s.request_id for s in plan.preempted], self._step_index)
            return []
        step = _Step(plan, t0, before, 0 if plan.long else sum(len(seq) for seq, _ in plan.admitted))
        # no step is in flight here, so this one takes the next number (_record counts them as they complete)
        with annotate(self._range_name(plan, self._step_index)):
            self._launch(step)
            if self._async and step.launched is not None and step.launched.tokens is not None:
                self._inflight = step
                return []
            return self._complete(step)  # inside the step's range: its offload stores belong to it

    def plan_delay(self) -> float:
        """Seconds the caller may go on taking new requests before its next step() call.

        With async scheduling, that call plans the step after the one in flight; planned as late as the host's lead
        allows before the device finishes the step in flight, it takes the requests that arrived meanwhile (pace.py).
        0 when the call should come now: no step in flight, a request already waiting, or no estimate yet.
        """
        step = self._inflight
        if step is None or step.launched is None or self.scheduler.waiting:
            return 0.0
        plan = step.plan
        at = self._pace.plan_at(StepPace.key(plan.kind, plan.num_tokens), step.launched_at)
        return 0.0 if at is None else max(0.0, at - time.perf_counter())

    def _launch(self, step: _Step, ahead: _Step | None = None, rows: dict[Sequence, int] | None = None) -> None:
        """Apply the step's plan and queue its forward (a long-context step runs to the end), inside the caller's
        step range.

        `rows` maps requests whose last token is a placeholder to their row among the tokens of `ahead`, the step
        still running.
        """
        plan = step.plan
        with annotate("schedule"):
            self.scheduler.apply(plan)
        if plan.loads:
            with annotate("offload.load"):
                self.offload.load(plan.loads)
        if plan.long:
            step.tokens = self.offload.long.run(self.runner, plan)
            return
        feed = None
        if rows:
            # a placeholder is the last token of its row: the row's last input position, fed on the device
            inputs, sources, end = [], [], 0
            for s in plan.scheduled:
                end += s.num_new_tokens
                if s.seq in rows and s.start + s.num_new_tokens == len(s.seq):
                    inputs.append(end - 1)
                    sources.append(rows[s.seq])
            feed = (ahead.launched.tokens, inputs, sources) if inputs else None
        try:
            step.launched = self.runner.launch(plan, feed)
            step.launched_at = time.perf_counter()
        except RuntimeError as exc:
            if self.other_ranks is not None:
                self.other_ranks.explain(exc)  # a rank that died mid-step: name it
            raise

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (device and host tier), so that the next requests compute their
        prompts afresh; False, and nothing forgotten, while requests are running or waiting (as vLLM's and
        SGLang's resets refuse while blocks are held)."""
        if self.has_unfinished():
            return False
        self.block_manager.reset_prefix_cache()
        if self.offload is not None and self.offload.prefix is not None:
            self.offload.pool.reset_prefix_cache()
        return True

    def decode_path(self) -> dict:
        """What the engine chose at start-up for its steps, for a run's provenance: the runner's DecodePath, with the
        CUDA graphs it captured and whether steps are scheduled ahead."""
        runner = self.runner
        return {**runner.decode_path.as_dict(),
                "cuda_graphs_captured": runner.graphs is not None,
                "prefill_cuda_graphs_captured": runner.token_graphs is not None,
                "cuda_graph_capture_s": round(runner.graph_capture_s, 3),
                "cuda_graph_memory_bytes": runner.graph_memory_bytes,
                "async_scheduling": self._async}

    def _launch_overlapped(self, prev: _Step) -> _Step | None:
        """Plan and queue the step after `prev` before `prev`'s tokens are on the host, or None when the next step
        has to see them first (a preemption or a long-context step)."""
        t0 = time.perf_counter()
        plan_prev = prev.plan
        prev.published = self.scheduler.update_computed(plan_prev)
        prev.computed = True
        # each sampled row gets a placeholder token, filled in when `prev` completes; a request the token is
        # certain to end (by length) gets none and is not scheduled again
        rows: dict[Sequence, int] = {}
        sampled = [s.seq for s, x in zip(plan_prev.scheduled, prev.launched.samples) if x]
        if any(seq.matcher is not None and not seq.is_finished for seq in sampled):
            return None  # its next mask needs the token still in flight
        for i, seq in enumerate(sampled):
            if seq.is_finished or self._ends_by_length(seq, pending=1):
                continue
            seq.append_token(_PENDING)
            rows[seq] = i
        plan = self.scheduler.plan()
        if not plan.scheduled or plan.preempted or plan.long:
            for seq in rows:
                seq.token_ids.pop()
            return None
        step = _Step(plan, t0, None, sum(len(seq) for seq, _ in plan.admitted))
        self.counters["overlapped_steps"] += 1
        # `prev` is still in flight: it completes (and is numbered) first
        with annotate(self._range_name(plan, self._step_index + 1)):
            self._launch(step, prev, rows)
        return step

    def _complete(self, step: _Step) -> list[RequestOutput]:
        """Wait for a step's tokens, hand them to their requests, and record the step."""
        plan = step.plan
        tokens = step.launched.results() if step.launched is not None else step.tokens
        if self._pace is not None and step.launched is not None:
            self._pace.completed(StepPace.key(plan.kind, plan.num_tokens), step.launched_at, time.perf_counter())
        if not step.computed:
            step.published = self.scheduler.update_computed(plan)
        if step.published and self.offload is not None and self.offload.prefix is not None:
            with annotate("offload.store"):
                self.offload.store(step.published)
        outputs = []
        for s, token in zip(plan.scheduled, tokens):
            seq = s.seq
            if token is None or seq.is_finished:
                continue
            if isinstance(token, list):  # a verify step's row: the drafts it kept and the token after them
                new, reason = self._commit_verified(s, token)
            else:
                position = s.start + s.num_new_tokens
                if position < len(seq):
                    seq.token_ids[position] = token  # the placeholder the next step was planned with
                else:
                    seq.append_token(token)
                self.counters["generation_tokens"] += 1
                new, reason = [token], self._stop_reason(seq, token)
            finished = reason is not None
            if finished:
                if seq.detokenizer.flush() and reason != "stop":
                    reason = "stop"
                self.scheduler.finish(seq, reason)
                del self._requests[seq.request_id]
                self.counters["requests_finished"] += 1
                if self.request_log is not None:
                    self.request_log.finished(seq.request_id, time.perf_counter(), reason, seq.num_output_tokens,
                                              seq.num_cached_tokens or 0, self._step_index)
            outputs.append(self._output(seq, new, finished))
        duration = time.perf_counter() - step.t0
        if self.request_log is not None:
            self.request_log.step(self._step_index, plan, step.t0, duration, tokens)
        self._record(step, duration)
        return outputs

    def _propose(self) -> None:
        """Draft tokens for every running request about to decode, as many as it can still take (its max_tokens
        and the context bound the tokens a verify step adds: its accepted drafts and one more)."""
        spec = self.speculative
        wanted, ks = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0:
                continue
            k = min(spec.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - len(seq) - 1)
            if k > 0:
                wanted.append(seq)
                ks.append(k)
        if not wanted:
            return
        with annotate("draft"):
            if self.drafter is not None:
                drafts = self.drafter.propose(wanted, ks)
            else:
                drafts = []
                for seq, k in zip(wanted, ks):
                    if seq.token_mirror is None:
                        seq.token_mirror = TokenMirror()
                    tokens = seq.token_mirror.of(seq.token_ids)
                    drafts.append(propose_ngram(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, k))
        for seq, draft in zip(wanted, drafts):
            seq.spec_token_ids = draft

    def _commit_verified(self, s: ScheduledSeq, tokens: list[int]) -> tuple[list[int], str | None]:
        """Hand a verify row's tokens to its request, up to a stop; the KV of its rejected drafts is given up (the
        sequence's computed length rolls back to its last accepted draft, and blocks left empty are freed)."""
        seq = s.seq
        accepted = len(tokens) - 1
        if s.num_draft_tokens:
            self.counters["spec_decode_num_drafts"] += 1
            self.counters["spec_decode_num_draft_tokens"] += s.num_draft_tokens
            self.counters["spec_decode_num_accepted_tokens"] += accepted
            for i in range(accepted):
                self.spec_accepted_per_pos[i] += 1
        seq.spec_token_ids = []
        seq.num_computed_tokens = s.start + 1 + accepted
        new, reason = [], None
        for token in tokens:
            seq.append_token(token)
            new.append(token)
            self.counters["generation_tokens"] += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                break
        if reason is None:
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.register_full_blocks(seq)  # blocks the accepted drafts filled
        return new, reason

    def _range_name(self, plan: StepPlan, number: int) -> str:
        if self._step_label is not None:
            return step_range_name(self._step_label, plan.batch_size, plan.num_tokens)
        return step_range_name(plan.kind.value, plan.batch_size, plan.num_tokens, number)

    def _record(self, step: _Step, duration: float) -> None:
        plan = step.plan
        self.counters["steps"] += 1
        self.counters["preemptions"] += len(plan.preempted)
        self.counters["prefix_cache_queries"] += step.queried
        self.counters["prefix_cache_hits"] += plan.num_cached_tokens
        self.counters["cpu_prefix_cache_hits"] += plan.num_cpu_cached_tokens
        self.counters["recomputed_tokens"] += plan.num_recomputed_tokens
        moved: dict[str, float] = {}
        if step.offload_before is not None:
            after = self.offload.counters()
            moved = {k: after[k] - step.offload_before[k] for k in after}
            self.counters |= after
        prefill_tokens = sum(s.num_new_tokens for s in plan.scheduled if s.is_prefill)
        self.last_step = StepStats(
            index=self._step_index,
            kind=plan.kind.value,
            batch_size=plan.batch_size,
            num_tokens=plan.num_tokens,
            duration_s=duration,
            prefix_cache_hits=plan.num_cached_tokens,
            preemptions=len(plan.preempted),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=plan.num_tokens - prefill_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_blocks_used=self.kv_blocks_used,
            cpu_prefix_cache_hits=plan.num_cpu_cached_tokens,
            recomputed_tokens=plan.num_recomputed_tokens,
            offload_bytes_h2d=int(moved.get("offload_bytes_h2d", 0)),
            offload_bytes_d2h=int(moved.get("offload_bytes_d2h", 0)),
            offload_transfer_s=float(moved.get("offload_transfer_seconds", 0.0)),
            long_context=plan.long,
        )
        self._step_index += 1

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            new_text=seq.detokenizer.take(finished),
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        complete = seq.matcher is not None and advance(seq.matcher, token)
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if seq.detokenizer.add(token) or complete:  # a complete grammar ends the output, even with ignore_eos
            return "stop"
        if self._ends_by_length(seq):
            return "length"
        return None

    def _ends_by_length(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether `seq` is at its length limit (output tokens or context) once `pending` more tokens arrive."""
        return (seq.num_output_tokens + pending >= seq.params.max_tokens
                or len(seq) + pending >= self.max_model_len)


_PENDING = -1  # token id of a placeholder: the step that samples it has not finished


@dataclasses.dataclass(slots=True)
class _Step:
    plan: StepPlan
    t0: float
    offload_before: dict | None
    queried: int  # prompt tokens of admitted requests looked up in the prefix cache
    launched: LaunchedStep | None = None
    launched_at: float = 0.0  # when its launch returned (perf_counter)
    tokens: list[int | None] | None = None  # a long-context step's tokens (it runs synchronously)
    computed: bool = False  # update_computed already applied (the next step was planned before this one ended)
    published: list = dataclasses.field(default_factory=list)


def _drafter(spec: SpeculativeConfig | None, config: EngineConfig, model_dir: Path, hf_config: dict) -> DraftModelProposer | None:
    """The draft model's engine (None for n-gram drafting or none), with KV for one request of the longest context
    (more requests at a time when shorter: its scheduler queues the rest)."""
    if spec is None or spec.method != "draft_model":
        return None
    try:
        draft_dir = check_model_dir(draft_model_dir(spec.model))
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config draft model: {exc}") from None
    check_same_vocabulary(model_dir, draft_dir)
    context = config.max_model_len or hf_config.get("max_position_embeddings") or 0
    draft_positions = read_json(draft_dir / "config.json").get("max_position_embeddings") or context
    tokens = -(-min(context, draft_positions) // config.block_size) * config.block_size
    draft_config = dataclasses.replace(config, speculative_config=None, request_log_size=0, prefix_caching=True,
                                       kv_cache_tokens=max(tokens, config.block_size))
    return DraftModelProposer(Engine(draft_dir, draft_config, step_label="draft"))


def _offload_budgets(config: EngineConfig, hf_config: dict) -> tuple[int, EngineConfig]:
    """Host pool blocks (checked against the host's memory before any weight is loaded), and the config the model
    runner sizes the device KV pool with: in long mode the ring's slots come out of an explicit KV budget."""
    if config.offload == "off":
        return 0, config
    spec = Qwen3Spec.from_hf_config(hf_config)
    dtype = resolve_dtype(config.dtype, hf_config, resolve_device(config.device))
    token_bytes = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * dtype.itemsize
    host_blocks = check_host_budget(config.offload_host_gb, token_bytes * config.block_size)
    if not config.offload_long or config.kv_cache_tokens is None:
        return host_blocks, config
    ring = ring_budget_tokens(config, spec.num_hidden_layers)
    left = config.kv_cache_tokens - ring
    if left < config.block_size:
        raise ValueError(
            f"offload=long streams KV through {config.offload_ring_slots} GPU slots of {config.offload_chunk_tokens} "
            f"tokens per layer, which take {ring} tokens of kv_cache_tokens={config.kv_cache_tokens} and leave less "
            "than one block for requests held on the GPU; raise kv_cache_tokens or lower offload_chunk_tokens or "
            "offload_ring_slots"
        )
    return host_blocks, dataclasses.replace(config, kv_cache_tokens=left)


def _check_tensor_parallel(spec: Qwen3Spec, size: int) -> None:
    """A ValueError, before any rank starts, when the model's heads or MLP features do not split over `size`."""
    check_divisible("attention heads", spec.num_attention_heads, size)
    check_divisible("KV heads", spec.num_key_value_heads, size)
    check_divisible("intermediate size", spec.intermediate_size, size)


def _eos_token_ids(model_dir: Path, hf_config: dict, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for value in (read_json(model_dir / "generation_config.json").get("eos_token_id"), hf_config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _token_ids(prompt: list[int], vocab_size: int) -> list[int]:
    """A prompt's token ids as Python ints, each checked to be an integer in [0, vocab_size): through a 64-bit array,
    which refuses anything that is not an integer, at a tenth of the cost of checking them one by one."""
    message = f"prompt token ids must be integers in [0, {vocab_size})"
    try:
        ids = array("q", prompt if isinstance(prompt, list) else list(prompt))  # bytes would be read as raw data
    except (TypeError, OverflowError):
        raise ValueError(message) from None
    if ids:
        values = np.frombuffer(ids, dtype=np.int64)
        if values.min() < 0 or values.max() >= vocab_size:
            raise ValueError(message)
    return ids.tolist()
