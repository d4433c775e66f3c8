"""vLLM's per-request metrics, read from each response itself, as the request's `server` view with its TTFT parts.

vLLM 0.32.0 started with `--enable-per-request-metrics` puts a `metrics` object (PerRequestMetrics,
vllm/entrypoints/generate/base/protocol.py) on a stream's final usage chunk, the one with `choices: []` that
`stream_options.include_usage` asks for (vllm/entrypoints/openai/completion/serving.py and chat_completion/serving.py,
"In streaming, metrics ride on this final usage chunk"); without the server flag the key is absent. The figures come
from the engine's own timestamps (vllm/entrypoints/generate/base/serving.py `build_per_request_timing_metrics`):
`queue_time_ms` is queued to first scheduled, `time_to_first_token_ms` first scheduled to the first token (its
prefill steps and the waits between), so what is left of the client's TTFT is the API server (tokenizing, handing
over, detokenizing), the network and the client's read.

With speculative decoding and `--per-request-spec-decode-metrics summary|detailed`, `metrics.speculative_decoding`
(SpeculativeDecodingMetrics, same file; filled by RequestSpecDecodeMetrics.to_dict, vllm/v1/metrics/stats.py) counts
the request's verify steps (`num_spec_steps`), the draft tokens proposed (`num_draft_tokens`) and accepted
(`num_accepted_draft_tokens`), and `acceptance_histogram[j]`, the steps that accepted exactly j drafts. It is sent
whether or not the timing figures are (vLLM 0.32.0 completion/serving.py), only for n == 1.
"""

from __future__ import annotations

import math

import numpy as np

SOURCE = "vllm_response"
FIGURES = ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second")
TTFT_PARTS = ("queue", "scheduled_to_first_token", "network_and_api_server")


def server_view(metrics: dict, ttft: float | None) -> dict:
    """The request's `server` view: the figures as vLLM names them (a figure that is no finite non-negative number
    is None), and `ttft_parts` (ms, adding up to the client's TTFT) where queue time and TTFT are both given."""
    view: dict = {"source": SOURCE, **{k: _figure(metrics.get(k)) for k in FIGURES}}
    spec = metrics.get("speculative_decoding")
    view["speculative_decoding"] = spec if isinstance(spec, dict) else None
    queue, scheduled = view["queue_time_ms"], view["time_to_first_token_ms"]
    if ttft is not None and queue is not None and scheduled is not None:
        view["ttft_parts"] = {"queue": queue, "scheduled_to_first_token": scheduled,
                              "network_and_api_server": ttft * 1e3 - queue - scheduled}
    return view


def _figure(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


SPEC_COUNTS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")
MAX_HISTOGRAM = 257  # buckets of accepted drafts per step kept (k + 1): drafters propose a few tokens, trees tens
SPEC_STATS = ("mean", "min", "p50", "p90", "p99", "max")


def spec_counts(spec) -> tuple[int, int, int, list[int] | None] | None:
    """(steps, draft tokens, accepted draft tokens, histogram) of a response's `speculative_decoding`; None where
    a count is no non-negative integer or more drafts were accepted than proposed (the histogram, when it does not
    add up to the steps or is longer than MAX_HISTOGRAM, is None)."""
    if not isinstance(spec, dict):
        return None
    counts = [spec.get(k) for k in SPEC_COUNTS]
    if not all(_count(c) for c in counts) or counts[2] > counts[1]:
        return None
    histogram = spec.get("acceptance_histogram")
    if not (isinstance(histogram, list) and len(histogram) <= MAX_HISTOGRAM and all(_count(h) for h in histogram)
            and sum(histogram) == counts[0]):
        histogram = None
    return counts[0], counts[1], counts[2], histogram


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def speculative_summary(results) -> dict | None:
    """The run's per-request speculative-decoding figures, as AIPerf 0.14 reports them (docs/tutorials/
    spec-decode-metrics.md): each request's draft acceptance rate (accepted / proposed draft tokens) and mean
    acceptance length (1 + accepted / verify steps, the bonus token included, as vLLM counts it) as distributions
    over the requests that drafted, and the same two pooled over the run's steps and draft tokens, with the pooled
    histogram of accepted drafts per step. None when no successful request carried them."""
    counted = [c for r in results if r.success and r.server
               and (c := spec_counts(r.server.get("speculative_decoding"))) is not None]
    if not counted:
        return None
    steps, drafted, accepted = (sum(c[i] for c in counted) for i in range(3))
    histograms = [c[3] for c in counted]
    pooled = None
    if all(h is not None for h in histograms):
        pooled = [sum(h[j] for h in histograms if j < len(h)) for j in range(max(map(len, histograms)))]
    rates = [c[2] / c[1] for c in counted if c[1]]
    lengths = [1 + c[2] / c[0] for c in counted if c[0]]
    return {
        "requests": len(counted), "requests_drafted": sum(1 for c in counted if c[0]),
        "spec_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
        "acceptance_histogram": pooled,
        "acceptance_rate_per_request": _distribution(rates),
        "acceptance_length_per_request": _distribution(lengths),
    }


def _distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(SPEC_STATS)
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(a, (50, 90, 99)))
    return {"mean": float(a.mean()), "min": float(a.min()), "p50": p50, "p90": p90, "p99": p99, "max": float(a.max())}
