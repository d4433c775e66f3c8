"""Prometheus text exposition (format 0.0.4) of the engine and server state, without a client library.

Names follow vLLM's (`vllm:num_requests_running` -> `infertrace:num_requests_running`) so dashboards carry over.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from typing import Any

PREFIX = "infertrace:"
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
    """Cumulative-bucket histogram; observed from the engine thread, read from the event loop."""

    def __init__(self, buckets: tuple[float, ...] = STEP_TIME_BUCKETS_S) -> None:
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._lock = threading.Lock()

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
        # by the collector's generation, 0-2: per-bucket counts and the sum, written only by the collector's callback
        self._gc_counts = {str(g): [0] * len(STEP_BOUNDS) for g in range(3)}
        self._gc_sums = {str(g): 0.0 for g in range(3)}
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

    def observe_gc(self, generation: int, duration_s: float) -> None:
        """Takes no lock: the collector calls back at any allocation, also while this very thread holds one of these
        locks (a lock here hung `count()` for ever in a test run). Collections never overlap, so the callback is the
        only writer; a reader may see a collection counted a moment before its time is added."""
        counts = self._gc_counts[str(generation)]
        for i, bound in enumerate(STEP_BOUNDS):
            if duration_s <= bound:
                counts[i] += 1
                break
        self._gc_sums[str(generation)] += duration_s

    def forget_gc(self) -> None:
        for generation, counts in self._gc_counts.items():
            counts[:] = [0] * len(counts)
            self._gc_sums[generation] = 0.0

    def snapshot(self) -> dict[str, Any]:
        """Plain data for /metrics: {"counts": {...}, "step_times": {kind: [cumulative counts, sum, count]},
        "gc_pauses": {generation: [cumulative counts, sum, count]}}."""
        with self._lock:
            counts, histograms = dict(self.counts), dict(self._step_times)
        pauses = {}
        for generation, per_bucket in self._gc_counts.items():
            cumulative = list(itertools.accumulate(per_bucket))
            if cumulative[-1]:
                pauses[generation] = [cumulative, self._gc_sums[generation], cumulative[-1]]
        return {"counts": counts, "step_times": {kind: list(h.snapshot()) for kind, h in histograms.items()},
                "gc_pauses": pauses}

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
                return  # not removed here: the collector is walking its list of callbacks
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                metrics.observe_gc(info["generation"], time.perf_counter() - started.pop())

        gc.callbacks.append(on_gc)


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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = key if key.endswith("_total") else f"{key}_total"
            out.metric(name, "counter", _COUNTER_HELP.get(key, f"Engine counter {key}."), value)

    out.header("request_success_total", "counter", "Requests finished, by finish reason.")
    for reason, n in sorted(_labelled(counts, "finished").items()):
        out.sample("request_success_total", n, finished_reason=reason)
    out.header("requests_rejected_total", "counter", "Requests refused before reaching the engine, by reason.")
    for reason, n in sorted(_labelled(counts, "rejected").items()):
        out.sample("requests_rejected_total", n, reason=reason)
    out.metric("client_disconnects_total", "counter", "Requests aborted because their client went away.",
               counts.get("client_disconnects", 0))

    out.header("step_duration_seconds", "histogram", "Engine step wall time, by step kind.")
    for kind, (cumulative, total_s, count) in sorted(server.get("step_times", {}).items()):
        for bound, n in zip(STEP_BOUNDS, cumulative):
            out.sample("step_duration_seconds_bucket", n, kind=kind, le=_number(bound))
        out.sample("step_duration_seconds_sum", total_s, kind=kind)
        out.sample("step_duration_seconds_count", count, kind=kind)
    out.header("gc_pause_seconds", "histogram", "Garbage collections of the engine's process, by generation: each "
               "pauses the engine loop.")
    for generation, (cumulative, total_s, count) in sorted(server.get("gc_pauses", {}).items()):
        for bound, n in zip(STEP_BOUNDS, cumulative):
            out.sample("gc_pause_seconds_bucket", n, generation=generation, le=_number(bound))
        out.sample("gc_pause_seconds_sum", total_s, generation=generation)
        out.sample("gc_pause_seconds_count", count, generation=generation)
    return out.text()


class _Writer:
    def __init__(self, common_labels: dict[str, str]) -> None:
        self.common = common_labels
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {PREFIX}{name} {help_text}")
        self.lines.append(f"# TYPE {PREFIX}{name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        pairs = ",".join(f'{k}="{_escape(str(v))}"' for k, v in {**self.common, **labels}.items())
        self.lines.append(f"{PREFIX}{name}{{{pairs}}} {_number(value)}")

    def metric(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.header(name, kind, help_text)
        self.sample(name, value)

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
