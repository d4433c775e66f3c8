"""Everything one measured run produced, and what it says about the client's own headroom."""

from __future__ import annotations

from dataclasses import dataclass

from infertrace.load.config import BenchConfig
from infertrace.load.observe.findings import CLIENT_CPU_WARN, CLIENT_LAG_WARN_S, coalesced_events
from infertrace.load.observe.observer import Observed
from infertrace.load.observe.server_counters import prefix_cache_figures
from infertrace.load.observe.telemetry import energy_per_token, url_is_local
from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import (
    INTENDED_START_WARN,
    Metrics,
    from_scheduled,
    token_count_warnings,
)
from infertrace.load.results.steady import SteadyState
from infertrace.load.stats import Stats


@dataclass(slots=True)
class PointRecord:
    """Everything one measured run produced."""

    config: BenchConfig
    results: list[RequestResult]
    warmup_results: list[RequestResult]
    metrics: Metrics
    token_checks: dict[str, int]
    client_cpu: float | None  # CPU seconds of the load generator's thread (--workers: the busiest worker) / duration
    process_cpu: float | None  # CPU seconds of the whole process (an embedded engine included; --workers: every
    # worker's) / duration
    client_lag: Stats  # schedule lag minus slot wait: lateness that is the client's own
    interrupted: bool = False
    profile: dict | None = None
    workload: dict | None = None  # trace replay and sessions: their own figures (prefix reuse, per turn, ...)
    stopped_early: bool = False  # a --find-max point ended once its queue was seen growing without bound
    steady: SteadyState | None = None
    observed: Observed | None = None  # the server's metrics and GPU telemetry over the measured window
    request_log: dict | None = None  # the server's request log joined to the requests (results/join.py)

    @property
    def warnings(self) -> list[str]:
        return (self.headroom_warnings + self.token_count_warnings + self.prefix_cache["prefix_cache_warnings"]
                + self.request_log_warnings)

    @property
    def request_log_warnings(self) -> list[str]:
        """What of the server's request log could not be read or joined (results/join.py)."""
        return list((self.request_log or {}).get("warnings") or [])

    @property
    def energy(self) -> dict | None:
        """The GPUs' energy over the measured window and per output token, from NVML on this host; None without
        telemetry, or when the server is on another host (this host's GPUs did not serve it)."""
        if self.observed is None or self.config is None or not url_is_local(self.config.base_url):
            return None
        return energy_per_token(self.observed.telemetry, self.metrics.total_output_tokens)

    @property
    def failure_examples(self) -> dict[str, str]:
        """The first message of each kind of failure, as the server said it."""
        out: dict[str, str] = {}
        for r in sorted(self.results, key=lambda r: r.t0):
            if r.error is not None:
                kind, _, message = r.error.partition(":")
                out.setdefault(kind, message.strip() or kind)
        return out

    @property
    def prefix_cache(self) -> dict:
        """The server's prefix-cache hit rate over the run (any dataset), the rate the workload implies, and a
        warning when the first is well above the second (server_counters.prefix_cache_figures)."""
        scrape = self.observed.scrape if self.observed is not None else None
        return prefix_cache_figures(self.config, self.workload, scrape, len(self.results))

    @property
    def headroom_warnings(self) -> list[str]:
        """Signs that the client, not the server, may have set the pace."""
        out = []
        if self.client_cpu is not None and self.client_cpu > CLIENT_CPU_WARN:
            out.append(f"the load generator used {self.client_cpu:.0%} of a CPU core: it may be the bottleneck")
        if (coalesced := coalesced_events(self.results, self.client_cpu)) is not None:
            out.append(f"{coalesced.what} ({coalesced.evidence})")
        if self.client_lag.p99 is not None and self.client_lag.p99 > CLIENT_LAG_WARN_S * 1000:
            out.append(f"requests left {self.client_lag.p99:.1f} ms late at p99: the client is falling behind "
                       "its schedule")
        if self.config is not None and self.config.open_loop:
            measured, intended = self.metrics.ttft.median, from_scheduled(self.results)[0].median
            if measured and intended and intended > measured * (1 + INTENDED_START_WARN):
                out.append(f"median TTFT is {intended:.1f} ms counted from each request's scheduled time against "
                           f"{measured:.1f} ms from its send: requests waited for a free slot (see "
                           "*_from_scheduled_ms)")
        return out

    @property
    def token_count_warnings(self) -> list[str]:
        """Where token counts are estimated or disagree between the server and our tokenizer."""
        return token_count_warnings(self.token_checks, bool(self.metrics.output_token_sources.get("chunks")))
