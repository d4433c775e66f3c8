"""vLLM's per-request metrics, read from each response itself, as the request's `server` view with its TTFT parts.

vLLM 0.32.0 started with `--enable-per-request-metrics` puts a `metrics` object (PerRequestMetrics,
vllm/entrypoints/generate/base/protocol.py) on a stream's final usage chunk, the one with `choices: []` that
`stream_options.include_usage` asks for (vllm/entrypoints/openai/completion/serving.py and chat_completion/serving.py,
"In streaming, metrics ride on this final usage chunk"); without the server flag the key is absent. The figures come
from the engine's own timestamps (vllm/entrypoints/generate/base/serving.py `build_per_request_timing_metrics`):
`queue_time_ms` is queued to first scheduled, `time_to_first_token_ms` first scheduled to the first token (its
prefill steps and the waits between), so what is left of the client's TTFT is the API server (tokenizing, handing
over, detokenizing), the network and the client's read.
"""

from __future__ import annotations

import math

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
