"""The server's prefix-cache counters read before and after a run, so the run's own hit rate can be told apart from
everything the server served since it started.

vLLM (0.33 read from its source, 0.32 checked running) and infertrace count prompt tokens looked up
(`prefix_cache_queries_total`) and found (`prefix_cache_hits_total`): the run's hit rate is the growth of hits over
the growth of queries. SGLang 0.5.23
exposes only a gauge, `sglang:cache_hit_rate`, over its recent requests: it is reported as read after the run, and
marked so. The bundled engine in-process is read from its own counters, which are the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from infertrace.load.client.target import Target
from infertrace.load.observe.scrape import NotPrometheus, labelled, parse_exposition, server_kind
from infertrace.load.server_metrics import speculative_summary


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


async def read_prefix_cache(target: Target) -> PrefixCacheReading | None:
    """The target's counters now: the in-process engine's own, or the server's /metrics; None when unavailable."""
    if (counters := target.engine_counters()) is not None:
        return PrefixCacheReading(counters.get("prefix_cache_queries"), counters.get("prefix_cache_hits"))
    body = await target.read_metrics()
    return parse_reading(body) if body is not None else None


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


CACHE_EXCESS_WARN = 0.10  # measured hit rate above what the workload implies by this much: a cache warmed before


def implied_hit_rate(cfg, workload: dict | None, requests: int, block_size: int | None = None) -> float | None:
    """The share of prompt tokens the run itself could find cached, from how its prompts were made: a trace's
    reuse servable in whole blocks (none without block hashes: each request gets random tokens of its own); for
    random and shared-prefix prompts, the prompts sent again (--duration cycles --num-prompts of them), every use
    of a shared prefix after its first, and --prompt-salt's line, which starts every prompt of the run
    (`prompt_salt_tokens` in `workload`) and which alone is found only in whole blocks (`prompt_salt_cached_tokens`:
    none where the salt is shorter than a block). A server finds prompts in whole KV blocks and
    recomputes at least a prompt's last token (vLLM's kv_cache_manager: at most prompt length - 1 is a hit): with
    the server's `block_size` known the rate counts only that much, else it can be above the server's by about a
    block a prompt. None where the files decide (ShareGPT, JSONL) or the history does (sessions)."""
    if cfg is None:
        return None
    if cfg.dataset == "trace":  # a trace without block hashes (Azure, BurstGPT) gets a random prompt a request
        servable = (workload or {}).get("trace_servable_prefix_reuse")
        return 0.0 if servable is None and workload and "trace" in workload else servable
    if cfg.dataset not in ("random", "shared-prefix") or requests < 1:
        return None
    shared = cfg.prefix_len if cfg.dataset == "shared-prefix" else 0
    salt = int((workload or {}).get("prompt_salt_tokens") or 0)
    salt_cached = int((workload or {}).get("prompt_salt_cached_tokens") or 0)
    length = salt + shared + cfg.input_len
    unique = min(requests, cfg.num_prompts)
    firsts = min(unique, cfg.num_prefixes) if shared else unique
    # a prompt sent again: all of it; a shared prefix used again: it and the salt before it; a prompt with a prefix
    # of its own, after the run's first prompt: the salt
    again, prefix, salt_only = length, salt + shared, salt_cached
    if block_size:  # the server's own block, read from its metrics, decides over the one the salt was cut to
        again, prefix, salt_only = (min(n, length - 1) // block_size * block_size for n in (again, prefix, salt))
    return ((requests - unique) * again + (unique - firsts) * prefix + (firsts - 1) * salt_only) \
        / (requests * length)


def measured_hit_rate(workload: dict | None, scrape) -> tuple[float | None, str | None]:
    """The server's prefix-cache hit rate over the measured window and where it comes from: the counters read
    around the run (trace replay, sessions), else the growth of hits over queries between the first and last
    scrape of /metrics, else SGLang's own gauge at the last scrape (its recent requests, not only the run's)."""
    if workload and workload.get("server_prefix_cache_hit_rate") is not None:
        return workload["server_prefix_cache_hit_rate"], workload.get("server_prefix_cache_source")
    if scrape is None:
        return None, None
    rate = scrape.deltas().get("prefix_cache_hit_rate")
    if rate is not None:
        return rate, "counters"
    gauge = [v for v in scrape.gauges.get("prefix_cache_hit_rate", []) if v is not None]
    if gauge:
        return gauge[-1], "gauge at the last scrape (sglang:cache_hit_rate; not limited to the run)"
    return None, None


def prefix_cache_figures(cfg, workload: dict | None, scrape, requests: int) -> dict:
    """`server_prefix_cache_hit_rate` (and its source) for every dataset, the rate the workload implies, and a
    warning when the server found much more cached than the run's own prompts can explain."""
    rate, source = measured_hit_rate(workload, scrape)
    blocks = [v for v in (scrape.gauges.get("kv_block_size", []) if scrape is not None else []) if v is not None]
    implied = implied_hit_rate(cfg, workload, requests, int(blocks[-1]) if blocks else None)
    warnings = []
    if rate is not None and implied is not None and rate > implied + CACHE_EXCESS_WARN:
        warnings.append(
            f"the server's prefix-cache hit rate was {rate:.1%} where this workload implies {implied:.1%}: prompts "
            "were found in a cache warmed before the run (an earlier run with the same --seed?), so TTFT is "
            "understated and runs do not compare; use --prompt-salt random or --reset-prefix-cache")
    return {"server_prefix_cache_hit_rate": rate, "server_prefix_cache_source": source,
            "implied_prefix_cache_hit_rate": implied, "prefix_cache_warnings": warnings}


SPEC_FIGURES = ("source", "drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                "per_position_acceptance_rate")  # from the counters; `requests` from the responses
SGLANG_SPEC_SOURCE = ("sglang:spec_accept_rate and sglang:spec_accept_length at the last scrape (its last "
                      "decode-log interval, not limited to the run); drafts from sglang:spec_verify_calls_total")


def speculative_decoding(scrape, results) -> dict | None:
    """The run's speculative decoding: drafts, draft tokens and accepted tokens as the growth of the server's
    counters between the first and last scrape, the acceptance rate (accepted / draft tokens), the mean acceptance
    length (1 + accepted / drafts, the bonus token included) and each draft position's acceptance rate (accepted at
    it / drafts), as vLLM 0.33.0 defines them (vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log and
    SpecDecodingProm; `vllm bench serve` takes the same deltas, vllm/benchmarks/serve.py). SGLang 0.5.23 counts only
    its verify steps: its rate and length are its own gauges, marked so. `requests` summarises what the responses
    carried (server_metrics.speculative_summary). None when the server has no such counters and no response
    carried such figures: a server that does not draft."""
    per_request = speculative_summary(results)
    counters = _spec_counters(scrape) if scrape is not None else None
    if counters is None and per_request is None:
        return None
    return {**(counters or dict.fromkeys(SPEC_FIGURES)), "requests": per_request}


def run_speculative_decoding(record) -> dict | None:
    """speculative_decoding of a measured run (a PointRecord): its scrapes and its requests, or the bundled
    engine's own counters when it ran in-process."""
    scrape = record.observed.scrape if record.observed is not None else None
    engine = (record.workload or {}).get("engine_spec_decode")
    if scrape is None and engine is not None:
        return {**_spec_figures(engine["drafts"], engine["draft_tokens"], engine["accepted_tokens"],
                                engine["accepted_per_position"], "engine counters"),
                "requests": speculative_summary(record.results)}
    return speculative_decoding(scrape, record.results)


ENGINE_SPEC = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def engine_spec_growth(before: dict, after: dict | None) -> dict | None:
    """The in-process engine's drafting over the run: drafts, draft and accepted tokens, accepted by position
    (the growth of its counters); None where it did not draft."""
    if after is None or not after.get(ENGINE_SPEC[0]):
        return None
    drafts, drafted, accepted = (after.get(k, 0) - before.get(k, 0) for k in ENGINE_SPEC)
    positions = sorted((k for k in after if k.startswith("spec_decode_num_accepted_tokens_per_pos[")),
                       key=lambda k: int(k[k.index("[") + 1:-1]))
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "accepted_per_position": [after[k] - before.get(k, 0) for k in positions]}


def _spec_figures(drafts: int, drafted: int, accepted: int, per_position: list | None, source: str) -> dict:
    """The figures of the run's drafting as vLLM defines them, from its counts."""
    return {"source": source, "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "per_position_acceptance_rate": [None if a is None else a / drafts for a in per_position]
            if drafts and per_position else None}


def _spec_counters(scrape) -> dict | None:
    drafts = _whole(scrape.increase("spec_decode_drafts"))
    if scrape.server == "sglang":
        rate, length = (_last(scrape.gauges.get(k, [])) for k in ("spec_accept_rate", "spec_accept_length"))
        if not drafts and not length:  # the gauges are 0 while SGLang does not draft
            return None
        return {"source": SGLANG_SPEC_SOURCE, "drafts": drafts, "draft_tokens": None, "accepted_tokens": None,
                "acceptance_rate": rate, "mean_acceptance_length": length, "per_position_acceptance_rate": None}
    drafted, accepted = (_whole(scrape.increase(k)) for k in ("spec_decode_draft_tokens", "spec_decode_accepted_tokens"))
    if drafts is None or drafted is None or accepted is None:
        return None
    positions = sorted(labelled(scrape.counters, "spec_decode_accepted_per_pos"), key=_position)
    per_position = [scrape.increase(f"spec_decode_accepted_per_pos[{p}]") for p in positions]
    return _spec_figures(drafts, drafted, accepted, per_position, "counters")


def _whole(count: float | None) -> int | None:
    """A counter's growth as the count it is (Prometheus writes every value as a float)."""
    return None if count is None else round(count)


def _position(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (1 << 30, label)


def _last(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return present[-1] if present else None


def vllm_spec_keys(block: dict | None) -> dict:
    """The `spec_decode_*` keys `vllm bench serve` 0.33 writes into its result (vllm/benchmarks/serve.py), same
    names and units (the acceptance rate in percent), and like it only where draft tokens were counted."""
    if not block or not block.get("draft_tokens"):
        return {}
    return {"spec_decode_acceptance_rate": 100.0 * block["acceptance_rate"],
            "spec_decode_acceptance_length": block["mean_acceptance_length"] or 0.0,
            "spec_decode_num_drafts": block["drafts"], "spec_decode_draft_tokens": block["draft_tokens"],
            "spec_decode_accepted_tokens": block["accepted_tokens"],
            "spec_decode_per_position_acceptance_rates": list(block["per_position_acceptance_rate"] or [])}
