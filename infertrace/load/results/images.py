"""The image tokens a server counted for bench's chat requests with images (--random-mm-base-items-per-request), and
how the run reports them; the images themselves are made in infertrace/load/workloads/images.py.

A server counts image tokens inside `usage.prompt_tokens`. After the run one text-only request (request 0's messages
without their images, max_tokens 1) gives what the server counts for that text wrapped in its chat template; a
request's image tokens are its prompt tokens less that count, moved by the difference between its text's tokens and
request 0's by our tokenizer. Without our tokenizer's counts or the server's usage they are unknown, and the result
says why. The probe itself is infertrace/load/client/images.py.
"""

from __future__ import annotations

import math

import numpy as np
from rich.table import Table

from infertrace.load.records import RequestResult
from infertrace.load.workloads.images import ImagePlan


def count_image_tokens(results: list[RequestResult], per_request: int, overhead: int | None) -> int:
    """Set each result's `images`, and its `image_tokens` where its usage and our tokenizer's count of its text
    are known and `overhead` (the chat template's tokens around the text, from the probe) is; returns how many
    successful requests stay unknown."""
    unknown = 0
    for r in results:
        r.images = per_request
        if overhead is not None and r.success and r.prompt_tokens is not None \
                and r.expected_prompt_tokens is not None:
            r.image_tokens = r.prompt_tokens - r.expected_prompt_tokens - overhead
        elif r.success:
            unknown += 1
    return unknown


def image_measurement(plan: ImagePlan, results: list[RequestResult], first_spec, probe: int | None,
                      why: str | None) -> dict:
    """After the run, from the text-only probe's prompt tokens (or why there are none): each request's image tokens,
    and the figures."""
    overhead = None
    if first_spec is None:
        why = "no request was built"
    elif first_spec.prompt_len is None:
        why = "no tokenizer counted the requests' text (pass --tokenizer)"
    elif probe is not None:
        overhead = probe - first_spec.prompt_len
    unknown = count_image_tokens(results, plan.per_request, overhead)
    if why is None and unknown:
        why = f"{unknown} successful requests had no usage.prompt_tokens"
    return image_figures(plan, results, why)


def image_figures(plan: ImagePlan, results: list[RequestResult], unknown_why: str | None) -> dict:
    """The result's `images` block, and its figures as top-level keys for the gate."""
    counted = [r.image_tokens for r in results if r.image_tokens is not None]
    refused = [r.error for r in results if r.error is not None and r.error.startswith("HTTP 4")]
    if not counted and unknown_why is None:
        unknown_why = "no request succeeded"
    tokens = np.asarray(counted, dtype=np.float64)
    figures = {
        "source": plan.source, "images_per_request": plan.per_request, "distinct_images": len(plan.urls),
        "images_sent": plan.per_request * len(results), "requests_counted": len(counted),
        "mean_image_tokens": float(tokens.mean()) if counted else None,
        "median_image_tokens": float(np.median(tokens)) if counted else None,
        "max_image_tokens": int(tokens.max()) if counted else None,
        "mean_tokens_per_image": float(tokens.mean()) / plan.per_request if counted else None,
        "image_tokens_unknown": unknown_why,
        "refused": len(refused), "refused_example": refused[0] if refused else None,
        # no server says it over HTTP: vLLM 0.32's per-request metrics (PerRequestMetrics,
        # vllm/entrypoints/generate/base/protocol.py) have no such figure, and its processor timings
        # (ObservabilityConfig.enable_mm_processor_stats, "not exposed as a CLI argument") are read in-process by
        # `vllm bench mm-processor` only; the time lies inside TTFT's network_and_api_server part
        "preprocessing_ms": None,
    }
    gate = {"images_per_request": plan.per_request, "mean_image_tokens": figures["mean_image_tokens"],
            "median_image_tokens": figures["median_image_tokens"],
            "mean_tokens_per_image": figures["mean_tokens_per_image"]}
    return {"images": figures, **gate}


def refusal_line(figures: dict) -> str | None:
    """One line when the server refused requests with images, in its own words."""
    if not figures["refused"]:
        return None
    return (f"the server refused {figures['refused']} of {figures['images_sent'] // figures['images_per_request']} "
            f"requests with images: {figures['refused_example']}")


def image_table(figures: dict) -> Table:
    t = Table(title=f"images ({figures['source']})", title_justify="left")
    for column in ("per request", "distinct", "sent", "image tokens mean / median / max", "tokens per image"):
        t.add_column(column, justify="right")

    def num(v) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.1f}"

    tokens = (f"{num(figures['mean_image_tokens'])} / {num(figures['median_image_tokens'])} / "
              f"{num(figures['max_image_tokens'])}") if figures["requests_counted"] else \
        f"unknown: {figures['image_tokens_unknown']}"
    t.add_row(str(figures["images_per_request"]), str(figures["distinct_images"]), str(figures["images_sent"]),
              tokens, num(figures["mean_tokens_per_image"]))
    return t
