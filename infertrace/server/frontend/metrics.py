"""Prometheus text exposition (format 0.0.4) of the engine and server state, without a client library.

Names follow vLLM's (`vllm:num_requests_running` -> `infertrace:num_requests_running`) so dashboards carry over.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from typing import Any

PREFIX = "infertrace:"
VLLM_PREFIX = "vllm:"  # speculative decoding's counters keep vLLM's own names, which dashboards and bench read
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_TIME_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BOUNDS = (*STEP_TIME_BUCKETS_S, math.inf)  # the `le` labels of the step-time histograms

_COUNTER_HELP = {
    "prompt_tokens": "Prompt tokens prefilled (prefix-cache hits excluded when the engine counts them apart).",
    "generation_tokens": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "preemptions": "Requests preempted (recomputed later) because KV blocks ran out.",
    "cpu_prefix_cache_hits": "Prompt tokens found in the host (CPU) tier of the prefix cache.",
    "recomputed_tokens": "Prompt tokens computed again after their KV was dropped (preemption or eviction).",
    "overlapped_steps": "Engine steps queued on the device before the previous step's tokens reached the host.",
    "offload_blocks_stored": "KV blocks copied to the host tier.",
    "offload_blocks_loaded": "KV blocks copied back from the host tier.",
    "offload_host_evictions": "Host-tier KV blocks evicted (least recently used first).",
    "offload_bytes_h2d": "Bytes of KV copied host to device.",
    "offload_bytes_d2h": "Bytes of KV copied device to host.",
    "offload_transfer_seconds": "Time spent in KV copies between host and device.",
    "long_context_requests": "Requests whose KV lives in host memory and streams through GPU slots.",
    "long_context_steps": "Engine steps run for long-context requests.",
}


class Histogram:
    """Cumulative-bucket histogram; observed from the engine thread, read from the event loop. `locked=False` for
    one observer that may run while its own thread holds any lock (the garbage collector's callback): no lock is
    taken, and a reader may see an observation counted a moment before its value is added to the sum."""

    def __init__(self, buckets: tuple[float, ...] = STEP_TIME_BUCKETS_S, locked: bool = True) -> None:
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._lock = threading.Lock() if locked else contextlib.nullcontext()

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative counts per bucket, sum, count)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, total, running


class ServerMetrics:
    """What the server counts, kept where the engine runs so that every front end reports into one place: requests
    by finish reason, rejections by reason, client disconnects, requests in flight (counter deltas sent by the
    front ends), and per-kind step-time histograms fed by the engine's step callback."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()  # "finished:stop", "rejected:queue_full", ...
        self._step_times: dict[str, Histogram] = {}
        self._gc_pauses = self._fresh_gc_pauses()  # by the collector's generation, 0-2
        self._lock = threading.Lock()

    def count(self, deltas: dict[str, int]) -> None:
        with self._lock:
            self.counts.update(deltas)

    def observe_step(self, kind: str, duration_s: float) -> None:
        with self._lock:
            histogram = self._step_times.get(kind)
            if histogram is None:
                histogram = self._step_times[kind] = Histogram()
        histogram.observe(duration_s)

    @staticmethod
    def _fresh_gc_pauses() -> dict[str, Histogram]:
        # unlocked: the collector calls back at any allocation, also while this very thread holds a lock of
        # ServerMetrics (taking one there hung `count()` for ever in a test run); collections never overlap
        return {str(g): Histogram(locked=False) for g in range(3)}

    def observe_gc(self, generation: int, duration_s: float) -> None:
        self._gc_pauses[str(generation)].observe(duration_s)

    def forget_gc(self) -> None:
        self._gc_pauses = self._fresh_gc_pauses()

    def snapshot(self) -> dict[str, Any]:
        """Plain data for /metrics: {"counts": {...}, "step_times": {kind: [cumulative counts, sum, count]},
        "gc_pauses": {generation: [cumulative counts, sum, count]}}."""
        with self._lock:
            counts, histograms = dict(self.counts), dict(self._step_times)
        pauses = {generation: list(h.snapshot()) for generation, h in self._gc_pauses.items()}
        return {"counts": counts, "step_times": {kind: list(h.snapshot()) for kind, h in histograms.items()},
                "gc_pauses": {generation: p for generation, p in pauses.items() if p[2]}}

    def time_gc(self) -> None:
        """Observe every garbage collection of this process (its pause of the engine loop) from now on, until this
        object is gone; `forget_gc()` drops what was observed so far."""
        import gc
        import time
        import weakref

        ref = weakref.ref(self)
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            metrics = ref()
            if metrics is None:
                return  # removed by the next time_gc(): the collector is walking its list of callbacks now
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                metrics.observe_gc(info["generation"], time.perf_counter() - started.pop())

        on_gc.server_metrics = ref
        gc.callbacks[:] = [cb for cb in gc.callbacks if not _timed_gone(cb)]
        gc.callbacks.append(on_gc)


def _timed_gone(callback) -> bool:
    """Whether `callback` is a `time_gc` callback whose ServerMetrics is gone."""
    ref = getattr(callback, "server_metrics", None)
    return ref is not None and ref() is None


def _labelled(counts: dict[str, int], family: str) -> dict[str, int]:
    prefix = family + ":"
    return {key[len(prefix):]: n for key, n in counts.items() if key.startswith(prefix)}


def render(model_name: str, engine_stats: dict[str, Any], server: dict[str, Any]) -> str:
    """The /metrics body from the engine's stats and a `ServerMetrics.snapshot()`."""
    counts = server.get("counts", {})
    out = _Writer({"model_name": model_name})
    out.metric("num_requests_running", "gauge", "Requests in the engine's running batch.",
               engine_stats.get("running", 0))
    out.metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", engine_stats.get("waiting", 0))
    out.metric("num_requests_in_flight", "gauge", "HTTP generation requests accepted and not yet answered.",
               counts.get("in_flight", 0))
    used, total = engine_stats.get("kv_blocks_used", 0), engine_stats.get("kv_blocks_total", 0)
    out.metric("kv_blocks_used", "gauge", "KV cache blocks in use.", used)
    out.metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.", total)
    out.metric("kv_cache_usage_perc", "gauge", "KV cache usage, 1 means full.", used / total if total else 0.0)

    engine_counters = dict(engine_stats.get("counters") or {})
    queries, hits = engine_counters.get("prefix_cache_queries", 0), engine_counters.get("prefix_cache_hits", 0)
    out.metric("prefix_cache_hit_rate", "gauge", "Prefix-cache hits over queries, in tokens, since start.",
               hits / queries if queries else 0.0)
    for key, value in sorted(engine_counters.items()):
        if key.startswith("spec_decode_"):
            continue  # under vLLM's names below
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = key if key.endswith("_total") else f"{key}_total"
            out.metric(name, "counter", _COUNTER_HELP.get(key, f"Engine counter {key}."), value)

    per_pos = engine_stats.get("spec_accepted_per_pos")
    if per_pos is not None:
        _spec_decode(out, engine_counters, per_pos)

    out.header("request_success_total", "counter", "Requests finished, by finish reason.")
    for reason, n in sorted(_labelled(counts, "finished").items()):
        out.sample("request_success_total", n, finished_reason=reason)
    out.header("requests_rejected_total", "counter", "Requests refused before reaching the engine, by reason.")
    for reason, n in sorted(_labelled(counts, "rejected").items()):
        out.sample("requests_rejected_total", n, reason=reason)
    out.metric("client_disconnects_total", "counter", "Requests aborted because their client went away.",
               counts.get("client_disconnects", 0))

    out.histograms("step_duration_seconds", "Engine step wall time, by step kind.", "kind",
                   server.get("step_times", {}))
    out.histograms("gc_pause_seconds", "Garbage collections of the engine's process, by generation: each pauses the "
                   "engine loop.", "generation", server.get("gc_pauses", {}))
    return out.text()


def _spec_decode(out: _Writer, counters: dict[str, Any], per_pos: list[int]) -> None:
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py in 0.33.0): acceptance rate is
    accepted / draft tokens, mean acceptance length 1 + accepted / drafts."""
    for key, help_text in (("num_drafts", "Number of spec decoding drafts: requests' verify steps with drafts."),
                           ("num_draft_tokens", "Number of draft tokens."),
                           ("num_accepted_tokens", "Number of accepted tokens.")):
        out.metric(f"spec_decode_{key}_total", "counter", help_text, counters.get(f"spec_decode_{key}", 0),
                   prefix=VLLM_PREFIX)
    name = "spec_decode_num_accepted_tokens_per_pos_total"
    out.header(name, "counter", "Accepted tokens per draft position.", prefix=VLLM_PREFIX)
    for position, n in enumerate(per_pos):
        out.sample(name, n, prefix=VLLM_PREFIX, position=str(position))


class _Writer:
    def __init__(self, common_labels: dict[str, str]) -> None:
        self.common = common_labels
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_text: str, prefix: str = PREFIX) -> None:
        self.lines.append(f"# HELP {prefix}{name} {help_text}")
        self.lines.append(f"# TYPE {prefix}{name} {kind}")

    def sample(self, name: str, value: float, prefix: str = PREFIX, **labels: str) -> None:
        pairs = ",".join(f'{k}="{_escape(str(v))}"' for k, v in {**self.common, **labels}.items())
        self.lines.append(f"{prefix}{name}{{{pairs}}} {_number(value)}")

    def metric(self, name: str, kind: str, help_text: str, value: float, prefix: str = PREFIX) -> None:
        self.header(name, kind, help_text, prefix)
        self.sample(name, value, prefix)

    def histograms(self, name: str, help_text: str, label: str, snapshots: dict[str, list]) -> None:
        """One histogram family, a series per `label` value: {value: [cumulative counts, sum, count]}."""
        self.header(name, "histogram", help_text)
        for value, (cumulative, total, count) in sorted(snapshots.items()):
            for bound, n in zip(STEP_BOUNDS, cumulative):
                self.sample(f"{name}_bucket", n, **{label: value, "le": _number(bound)})
            self.sample(f"{name}_sum", total, **{label: value})
            self.sample(f"{name}_count", count, **{label: value})

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)
