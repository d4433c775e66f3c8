"""The server's prefix-cache counters read before and after a run, so the run's own hit rate can be told apart from
everything the server served since it started.

vLLM 0.33 and infertrace count prompt tokens looked up (`prefix_cache_queries_total`) and found
(`prefix_cache_hits_total`): the run's hit rate is the growth of hits over the growth of queries. SGLang 0.5.23
exposes only a gauge, `sglang:cache_hit_rate`, over its recent requests: it is reported as read after the run, and
marked so. The bundled engine in-process is read from its own counters, which are the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from infertrace.load.observe.scrape import NotPrometheus, parse_exposition, server_kind


@dataclass(frozen=True, slots=True)
class PrefixCacheReading:
    queries: float | None = None  # cumulative prompt tokens looked up
    hits: float | None = None  # cumulative prompt tokens found
    hit_rate_gauge: float | None = None  # SGLang: the server's own rate, not a counter


def prefix_cache_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) from a Prometheus text body of vLLM or infertrace serve; None when it has neither."""
    reading = parse_reading(text)
    if reading is None or reading.queries is None or reading.hits is None:
        return None
    return reading.queries, reading.hits


def parse_reading(text: str) -> PrefixCacheReading | None:
    """The prefix-cache figures of one /metrics body (names as scrape.py maps them); None when not Prometheus."""
    try:
        gauges, counters = parse_exposition(text)
    except NotPrometheus:
        return None
    gauge = gauges.get("prefix_cache_hit_rate") if server_kind(text) == "sglang" else None
    return PrefixCacheReading(counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits"), gauge)


async def read_prefix_cache(target) -> PrefixCacheReading | None:
    """The target's counters now: the embedded engine's own, or the server's /metrics; None when unavailable."""
    if target.kind == "embedded":
        counters = getattr(target.engine, "counters", None) or {}
        return PrefixCacheReading(counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits"))
    try:
        status, body = await target.transport.request_json("GET", "/metrics")
    except Exception:  # noqa: BLE001 - a server without metrics costs the figure, never the run
        return None
    return parse_reading(body) if status == 200 and isinstance(body, str) else None


def run_hit_rate(before: PrefixCacheReading | None, after: PrefixCacheReading | None) -> dict:
    """`server_prefix_cache_hit_rate` over the run and how it was obtained (`server_prefix_cache_source`)."""
    if before is not None and after is not None and None not in (before.queries, before.hits, after.queries,
                                                                  after.hits):
        queries, hits = after.queries - before.queries, after.hits - before.hits
        if queries > 0 and hits >= 0:
            return {"server_prefix_cache_hit_rate": hits / queries, "server_prefix_cache_source": "counters",
                    "server_prefix_cache_queries": queries, "server_prefix_cache_hits": hits}
    if after is not None and after.hit_rate_gauge is not None:
        return {"server_prefix_cache_hit_rate": after.hit_rate_gauge,
                "server_prefix_cache_source": "gauge after the run (sglang:cache_hit_rate; not limited to the run)"}
    return {"server_prefix_cache_hit_rate": None, "server_prefix_cache_source": None}
