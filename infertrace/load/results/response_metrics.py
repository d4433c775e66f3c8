"""The result file's summary of vLLM's per-request metrics (infertrace/load/server_metrics.py reads them from
each response into the request's `server` view)."""

from __future__ import annotations

from infertrace.load.records import RequestResult
from infertrace.load.server_metrics import FIGURES, SOURCE, TTFT_PARTS, server_view  # noqa: F401  (the results' names)


def summary(results: list[RequestResult], required: bool) -> dict | None:
    """The result file's join summary for the metrics the responses carried; None when none did and they were not
    required (--server-metrics on): a server that has none is no finding."""
    # a server started with --per-request-spec-decode-metrics alone sends `metrics` holding only
    # speculative_decoding: no timing figure, so no match
    matched = sum(r.server is not None and r.server.get("source") == SOURCE
                  and any(r.server.get(k) is not None for k in FIGURES) for r in results)
    if not matched and not required:
        return None
    explained = sum(r.server is not None and r.server.get("source") == SOURCE
                    and r.server.get("ttft_parts") is not None for r in results)
    done = sum(r.success for r in results)
    warnings = []
    if not matched:
        warnings.append("no response carried vLLM's per-request metrics: start vLLM with "
                        "--enable-per-request-metrics (and keep engine stats on: no --disable-log-stats)")
    elif explained < done:
        warnings.append(f"{done - explained} of {done} successful requests carried no queue time and TTFT in "
                        "vLLM's per-request metrics; their TTFT is not split into parts")
    return {"source": SOURCE, "requests": len(results), "matched": matched, "explained": explained,
            "warnings": warnings}
