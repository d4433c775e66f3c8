"""The result file (`--result-json`, vLLM's key names at the top level) and the per-request JSONL."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from infertrace.config_fields import jsonable
from infertrace.load.observe.server_counters import run_speculative_decoding, vllm_spec_keys
from infertrace.load.results.metrics import from_scheduled, vllm_keys
from infertrace.load.results.point import PointRecord
from infertrace.load.stats import Stats
from infertrace.output import write_text

SCHEMA_VERSION = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def provenance(target, seed: int) -> dict:
    """What ran, where, with what: the target (and the server's own info), seed, versions, host, GPU if known."""
    gpu = None
    if "torch" in sys.modules:  # only when already loaded (the embedded engine): importing torch is slow
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    from infertrace import __version__

    return {
        "target": target.describe(),
        "seed": seed,
        "versions": {"infertrace": __version__, "python": platform.python_version(),
                     "aiohttp": _version("aiohttp"), "transformers": _version("transformers"),
                     "torch": _version("torch") if "torch" in sys.modules else None},
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "hostname": platform.node()},
        "gpu": gpu,
    }


def point_result(record: PointRecord) -> dict:
    """One run's result: vLLM's keys first, then ours."""
    cfg, m = record.config, record.metrics
    out = {"schema_version": SCHEMA_VERSION, **vllm_keys(m)}
    out.update({  # as vLLM writes them: a closed loop is an infinite rate capped by max_concurrency
        "num_prompts": cfg.num_prompts,
        "max_concurrency": cfg.effective_concurrency,
        "request_rate": jsonable(cfg.request_rate) if cfg.request_rate is not None else "inf",
        "burstiness": cfg.burstiness,
        "good_requests": m.good_requests, "slo": cfg.slo,
    })
    if cfg.ramp_up_strategy is not None:  # as vLLM adds them; its request_rate stays "inf"
        out.update(ramp_up_strategy=cfg.ramp_up_strategy, ramp_up_start_rps=cfg.ramp_up_start_rps,
                   ramp_up_end_rps=cfg.ramp_up_end_rps)
    steady, origin = record.steady, min((r.t0 for r in record.results), default=0.0)
    out.update({  # docs/bench.md, "Steady state"
        "steady_output_throughput": steady.output_throughput if steady else None,
        "steady_state_window_s": [steady.start - origin, steady.end - origin] if steady else None,
        "steady_state_in_flight": steady.in_flight if steady else None,
        "stopped_early": record.stopped_early,
    })
    for stat in ("mean", "median", "std", "p90", "p95", "p99"):
        out[f"{stat}_itl_per_token_ms"] = getattr(m.itl_per_token, stat)
    out["itl_per_token_requests"] = m.itl_per_token_requests  # those whose every chunk's token count is known
    for name, stats in zip(("ttft", "e2el"), from_scheduled(record.results)):  # from when each request was due
        for stat in ("mean", "median", "p99"):
            out[f"{stat}_{name}_from_scheduled_ms"] = getattr(stats, stat)
    out.update({
        "schedule_lag_p50_ms": m.schedule_lag.median, "schedule_lag_p99_ms": m.schedule_lag.p99,
        "slot_wait_p50_ms": m.slot_wait.median, "slot_wait_p99_ms": m.slot_wait.p99,
        "client_lag_p99_ms": record.client_lag.p99,
        "client_cpu_percent": None if record.client_cpu is None else 100.0 * record.client_cpu,
        "process_cpu_percent": None if record.process_cpu is None else 100.0 * record.process_cpu,
        "headroom_warnings": record.headroom_warnings,
        "token_count_warnings": record.token_count_warnings,
        "failures": m.failures,
        "output_token_sources": m.output_token_sources,
        **record.token_checks,
        "warmup_requests": len(record.warmup_results),
        # where total_input_tokens came from: our tokenizer's count of each prompt, or the server's usage alone
        "input_len_source": _input_len_source(record.results),
        "interrupted": record.interrupted,
        "profile": record.profile,
        **(record.workload or {}),  # trace replay: prefix reuse implied and measured; sessions: per-turn figures
    })
    out.update(_measured_extras(record))
    if (spec := run_speculative_decoding(record)) is not None:  # docs/bench.md, "Speculative decoding"
        out["speculative_decoding"] = spec
        out.update(vllm_spec_keys(spec))
    if record.observed is not None:  # the server's metrics and GPU telemetry on the run's time axis (docs/report.md)
        from infertrace.load.observe.observer import run_findings

        findings = run_findings(record)  # first: with --report it reads the traces, whose span the window takes
        # deltas over every scrape: the first is taken before the measured window opens, the last after it closes
        out.update(record.observed.to_json())
        out["findings"] = [f.to_json() for f in findings]
    if record.request_log is not None:  # each request's life on the server, joined by request id (docs/bench.md)
        from infertrace.load.results.tail import tail_findings, tail_summary

        out["request_log"] = tail_summary(record.results, record.request_log)
        out["findings"] = [*out.get("findings", []), *(f.to_json() for f in tail_findings(record.results))]
    return out


def _measured_extras(record: PointRecord) -> dict:
    """The first message of each kind of failure; the server's prefix-cache hit rate for every dataset beside the
    rate the workload implies (and a warning when it is well above it); TTFCT, the time to the first answer token
    with a reasoning model's thinking before it left out (AIPerf's time to first output token); the GPUs' energy
    per output token."""
    ttfct = Stats.of([r.ttfct for r in record.results if r.success and r.ttfct is not None])
    energy = record.energy or {}
    return {
        "failure_examples": record.failure_examples,
        **record.prefix_cache,
        **{f"{stat}_ttfct_ms": getattr(ttfct, stat) for stat in ("mean", "median", "std", "p90", "p95", "p99")},
        "energy_joules": energy.get("joules"), "energy_per_output_token_j": energy.get("joules_per_output_token"),
        "energy_method": energy.get("method"),
    }


def _input_len_source(results) -> str | None:
    if any(r.expected_prompt_tokens is not None for r in results):
        return "tokenizer"
    return "usage" if any(r.prompt_tokens is not None for r in results) else None


BACKENDS = {"completions": "openai", "chat": "openai-chat", "embeddings": "openai-embeddings"}  # vLLM's --backend names


def run_keys(config: dict, target, now: dt.datetime) -> dict:
    """The run-level keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py, 0.33), same meaning."""
    description = target.describe()
    if description["kind"] == "http":
        backend = BACKENDS[config["endpoint"]]
        model_id = description.get("model") or config["model"]
    else:
        backend, model_id = "infertrace-embedded", config["model"] or description.get("model_dir")
    return {
        "date": now.astimezone().strftime("%Y%m%d-%H%M%S"),  # vLLM's format, local time
        "date_utc": now.astimezone(dt.timezone.utc).isoformat(timespec="seconds"),
        "endpoint_type": backend, "backend": backend, "model_id": model_id,
        "tokenizer_id": config["tokenizer"] or model_id,
    }


def result_document(records: list[PointRecord], config: dict, target) -> dict:
    """A single run: its result with config and provenance. A sweep: one entry per point under `runs`."""
    common = {**run_keys(config, target, dt.datetime.now(dt.timezone.utc)), "config": config,
              "provenance": provenance(target, config["seed"])}
    sweep = config.get("sweep_param")
    if sweep is None:
        return {**point_result(records[0]), **common}
    return {"schema_version": SCHEMA_VERSION, "sweep": {"param": sweep, "values": config["sweep_values"]},
            "runs": [point_result(r) for r in records],
            "interrupted": any(r.interrupted for r in records), **common}


def capacity_document(cap, config: dict, target) -> dict:
    """A --find-max search: the answer, then every load tried with its verdict, its bounds' estimates and
    intervals, and the full result of each of its runs."""
    def est(e) -> dict:
        return {"estimate_ms": jsonable(e.value_ms), "low_ms": jsonable(e.low_ms), "high_ms": jsonable(e.high_ms),
                "samples": e.samples}

    return {
        "schema_version": SCHEMA_VERSION,
        "find_max": {
            "param": cap.param, "slo": cap.slo, "max_load": cap.max_load,
            "first_failing_load": cap.first_failing_load, "stopped": cap.stopped,
            "points": [{"load": t.load, "passed": t.passed, "decided_by": t.decided_by, "runs": len(t.records),
                        "bounds": {k: est(e) for k, e in t.estimates.items()},
                        "results": [point_result(r) for r in t.records]} for t in cap.trials],
        },
        "interrupted": cap.stopped == "interrupted",
        **run_keys(config, target, dt.datetime.now(dt.timezone.utc)), "config": config,
        "provenance": provenance(target, config["seed"]),
    }


def write_requests_jsonl(path: str | Path, records: list[PointRecord]) -> Path:
    """Every request of every point, warmup included (marked), with its timings and failure reason.

    Times are seconds after the point's first measured send (warmup requests have negative times)."""
    lines = []
    for point, record in enumerate(records):
        origin = min((r.t0 for r in record.results or record.warmup_results), default=0.0)
        for phase, results in (("warmup", record.warmup_results), ("measured", record.results)):
            for r in sorted(results, key=lambda r: r.t0):
                lines.append(json.dumps({"point": point, "phase": phase, **r.to_json(origin)}) + "\n")
    return write_text(path, "".join(lines))
