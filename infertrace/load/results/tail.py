"""Where the tail's time went, from the requests joined to the server's log (load/results/join.py): the p50 and p99
TTFT cohorts part by part, the slowest requests, and findings with their evidence."""

from __future__ import annotations

from collections import Counter

import numpy as np

from infertrace.load.observe.findings import Finding
from infertrace.load.records import RequestResult
from infertrace.load.results.join import TTFT_PARTS
from infertrace.load.results.render import plural

P50_BAND = (40.0, 60.0)  # the p50 cohort: requests whose TTFT lies between these percentiles
TAIL_PERCENTILE = 99.0  # the tail cohort: TTFT (or the ITL gap) at or above this percentile
MIN_TAIL = 1
DOMINANT_SHARE = 0.5  # a part that holds this share of the tail's TTFT names the finding
SLOWEST = 20
PART_LABELS = {"network_and_frontend": "network and front end", "tokenize": "tokenizing", "queue": "queueing",
               "prefill_steps": "its prefill steps", "between_prefill_waits": "waits between its prefill steps",
               "first_token_send": "sending the first token",
               # vLLM's per-request metrics (load/results/response_metrics.py)
               "scheduled_to_first_token": "scheduled to first token (prefill)",
               "network_and_api_server": "the API server, network and client",
               # a vLLM span, an SGLang log (load/results/peer_logs.py)
               "frontend_and_handoff": "vLLM's front end and handoff to the engine",
               "prefill_and_first_token_send": "prefill and sending the first token"}


def explained(results: list[RequestResult]) -> list[RequestResult]:
    """The successful requests whose TTFT the join split, of the source that split the most (a run whose spans
    missed a few requests keeps those requests' in-response parts, which are other parts)."""
    done = [r for r in results if r.success and r.server is not None and r.server.get("ttft_parts") is not None]
    if not done:
        return done
    source = Counter(r.server.get("source") for r in done).most_common(1)[0][0]
    return [r for r in done if r.server.get("source") == source]


def part_names(group: list[RequestResult]) -> tuple[str, ...]:
    """The TTFT parts the join gave, in its order: infertrace serve's request log splits TTFT in six, a vLLM
    span in five, vLLM's per-request metrics and SGLang's log in three."""
    return tuple(group[0].server["ttft_parts"]) if group else TTFT_PARTS


def cohorts(results: list[RequestResult]) -> dict[str, dict]:
    """The p50 cohort (TTFT between the 40th and 60th percentiles) and the p99 cohort (at or above the 99th):
    how many, their TTFT, the mean of each part in ms and its share, and what they queued behind."""
    done = explained(results)
    if not done:
        return {}
    ttft = np.array([r.ttft for r in done])
    lo, hi, tail = np.percentile(ttft, [*P50_BAND, TAIL_PERCENTILE])
    groups = {"p50": [r for r in done if lo <= r.ttft <= hi], "p99": [r for r in done if r.ttft >= tail]}
    return {name: _cohort(group) for name, group in groups.items() if group}


def _cohort(group: list[RequestResult]) -> dict:
    parts = {p: float(np.mean([r.server["ttft_parts"][p] for r in group])) for p in part_names(group)}
    ttft_ms = float(np.mean([r.ttft for r in group])) * 1e3
    out = {"requests": len(group), "ttft_ms": ttft_ms, "parts_ms": parts,
           "shares": {p: v / ttft_ms if ttft_ms > 0 else None for p, v in parts.items()}}
    if all("queue_behind" in r.server for r in group):  # what a request log tells and a response does not
        behind = [r.server["queue_behind"] or {} for r in group]
        out.update(queued_behind_prefills=float(np.median([b.get("prefill_rows", 0) for b in behind])),
                   queued_behind_prefill_tokens=float(np.median([b.get("prefill_tokens", 0) for b in behind])),
                   waiting_ahead=float(np.median([r.server.get("waiting_ahead") or 0 for r in group])))
    return out


def slowest(results: list[RequestResult], n: int = SLOWEST) -> list[RequestResult]:
    return sorted(explained(results), key=lambda r: r.ttft, reverse=True)[:n]


def itl_gaps(results: list[RequestResult]) -> list[dict]:
    return [g for r in results if r.success and r.server for g in r.server.get("itl_steps") or []]


def tail_findings(results: list[RequestResult]) -> list[Finding]:
    found = [ttft_tail(results), itl_tail(results)]
    return [f for f in found if f is not None]


def ttft_tail(results: list[RequestResult]) -> Finding | None:
    """The part that holds the most of the p99 cohort's TTFT, with what stands behind it."""
    c = cohorts(results).get("p99")
    if c is None or c["requests"] < MIN_TAIL:
        return None
    names = tuple(c["parts_ms"])
    part = max(names, key=lambda p: c["parts_ms"][p])
    share = c["shares"][part] or 0.0
    behind = "queued_behind_prefills" in c
    if share < DOMINANT_SHARE:
        top = sorted(names, key=lambda p: -c["parts_ms"][p])[:3]
        what = "p99 TTFT has no single cause: " + ", ".join(
            f"{PART_LABELS[p]} {c['shares'][p]:.0%}" for p in top)
    elif part == "queue" and behind:
        what = (f"p99 TTFT is queueing: {share:.0%} of it waiting behind "
                f"{c['queued_behind_prefills']:.0f} prefills (median)")
    else:
        what = f"p99 TTFT is {PART_LABELS[part]}: {share:.0%} of it"
    parts = ", ".join(f"{p} {c['parts_ms'][p]:.1f}" for p in names)
    evidence = (f"{plural(c['requests'], 'request')} at or above TTFT p99, mean TTFT {c['ttft_ms']:.1f} ms; "
                f"mean parts (ms): {parts}")
    if behind:
        evidence += (f"; median {c['queued_behind_prefills']:.0f} prefills "
                     f"({c['queued_behind_prefill_tokens']:.0f} tokens) ran while each waited, "
                     f"{c['waiting_ahead']:.0f} requests waiting ahead at arrival")
    if "p50" in (cohorts_all := cohorts(results)):
        evidence += f"; the p50 cohort's TTFT {cohorts_all['p50']['ttft_ms']:.1f} ms"
    return Finding("ttft_tail", what, None, evidence)


def itl_tail(results: list[RequestResult]) -> Finding | None:
    """What the steps behind the gaps at or above ITL p99 were."""
    gaps = itl_gaps(results)
    if not gaps:
        return None
    cut = float(np.percentile([g["gap_ms"] for g in gaps], TAIL_PERCENTILE))
    tail = [g for g in gaps if g["gap_ms"] >= cut]
    causes = Counter(g["cause"] for g in tail)
    cause, count = causes.most_common(1)[0]
    share = count / len(tail)
    mixed = [g["others_prefill_tokens"] for g in tail if g["cause"] == "mixed"]
    if cause == "mixed":
        what = (f"ITL p99 gaps are mixed steps carrying prefills of >= {min(mixed):,} tokens: {share:.0%} of the "
                f"gaps at or above p99")
    elif cause == "preemption":
        what = f"ITL p99 gaps are preemptions: {share:.0%} of the gaps at or above p99"
    elif cause == "skipped_steps":
        what = f"ITL p99 gaps are steps the request sat out: {share:.0%} of the gaps at or above p99"
    else:
        what = f"ITL p99 gaps are plain decode steps: {share:.0%} of the gaps at or above p99"
    step_ms = [g["step_ms"] for g in tail if "step_ms" in g]
    server_gap = [g["server_gap_ms"] for g in tail if "server_gap_ms" in g]
    evidence = (f"{len(tail)} of {len(gaps)} gaps at or above ITL p99 ({cut:.1f} ms): "
                + ", ".join(f"{k} {v}" for k, v in causes.most_common())
                + (f"; median step {np.median(step_ms):.1f} ms" if step_ms else "")
                + (f", median server gap {np.median(server_gap):.1f} ms" if server_gap else "")
                + (f"; mixed steps carried {min(mixed):,}-{max(mixed):,} prefill tokens of other requests"
                   if mixed else ""))
    return Finding("itl_tail", what, None, evidence)


def tail_summary(results: list[RequestResult], join_summary: dict) -> dict:
    """The result file's `request_log` object: the join, the cohorts, and the slowest requests' parts."""
    return {**join_summary, "cohorts": cohorts(results),
            "slowest": [{"request_id": r.request_id, "index": r.index, "ttft_ms": r.ttft * 1e3,
                         "ttft_parts": r.server["ttft_parts"]} for r in slowest(results)]}
