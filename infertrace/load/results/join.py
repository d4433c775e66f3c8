"""bench's request records joined to the server's request log by request id, on the client's clock.

The offset between the two clocks is bounded NTP-style by every request: the server received it after the client
sent it (offset <= received - t0) and had its first output before the client read it (offset >= first_output -
first token seen). The tightest bounds over all requests give the offset (their midpoint) and its error (half
their width). With that, each request's TTFT is split into parts that add up to it exactly:

    network_and_frontend   client send -> the front end's handler has it
    tokenize               the handler: body read, validation, tokenizing, admission
    queue                  handed to the engine -> the first step that carried it began
    prefill_steps          the steps that computed its prompt, to the one that sampled its first token
    between_prefill_waits  within that span, time in steps it did not ride (chunked prefill, preemption)
    first_token_send       that step's end -> the client read the first token (engine -> front end -> network)

Each inter-token gap is attributed to the step that produced the token which ended it: a decode step, a mixed step
carrying other requests' prefill of N tokens, a preemption, or steps it sat out.

The log is evidence beside the run, never a condition of it: a record of the wrong shape is skipped and counted,
and crossed clock bounds leave the TTFT parts out. This module only computes: the target reads the log.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from infertrace.load.records import RequestResult
from infertrace.load.server_log import RECORD_KINDS, checked_rows

TTFT_PARTS = ("network_and_frontend", "tokenize", "queue", "prefill_steps", "between_prefill_waits",
              "first_token_send")


def checked_log(log: Any) -> tuple[dict, list[str]]:
    """The log with only the requests and steps that have the shape the join reads, and a warning for what was
    skipped (how many, and the first reason). A log read over HTTP is checked already, page by page: its
    `malformed` holds the counts."""
    if not isinstance(log, dict):
        return {"requests": [], "steps": []}, ["the server's request log is not a JSON object; not joined"]
    out, malformed = {**log}, dict(log.get("malformed") or {})
    for key in RECORD_KINDS:
        if key not in malformed:
            out[key], *malformed[key] = checked_rows(log.get(key), key)
    warnings = []
    for key, (bad, first) in malformed.items():
        if bad:
            noun = "request" if key == "requests" else "step"
            warnings.append(f"the server's request log had {bad} malformed {noun} record{'s' if bad > 1 else ''}, "
                            f"skipped (the first: {first})")
    return out, warnings


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """server clock = client clock + offset_s, within +-error_s; `consistent` False when the bounds crossed
    (clocks that drifted, or workers on hosts whose clocks differ), where the midpoint is still given."""

    offset_s: float
    error_s: float
    pairs: int
    consistent: bool


def estimate_offset(pairs: list[tuple[float, float, float, float]]) -> ClockOffset | None:
    """From (client send, server received, server first output, client first token) per request."""
    upper = min((received - t0 for t0, received, _, _ in pairs), default=None)
    lower = max((first_output - seen for _, _, first_output, seen in pairs), default=None)
    if upper is None or lower is None:
        return None
    return ClockOffset((upper + lower) / 2, abs(upper - lower) / 2, len(pairs), lower <= upper)


def join(results: list[RequestResult], log: dict, warmup: list[RequestResult] = (),
         source: str = "infertrace") -> dict:
    """Give every result (measured and `warmup`) whose id the log holds its `server` view; returns the join's
    summary for the result file (how many measured requests matched and were explained, the clock offset and its
    error). Records of the wrong shape are skipped, and said so in the summary's `warnings`."""
    log, warnings = checked_log(log)
    warnings = [*(log.get("fetch_warnings") or []), *warnings]
    by_id: dict[str, dict] = {}
    for rec in log["requests"]:
        by_id[rec["request_id"]] = rec  # a reused id: the later record
    steps = {s["step"]: s for s in log["steps"]}
    index = StepIndex(log["steps"])
    matched = [(r, by_id[r.request_id]) for r in [*warmup, *results]
               if r.request_id is not None and r.request_id in by_id]
    pairs = []
    for r, rec in matched:
        if r.ttft is not None and rec.get("received") is not None and rec.get("first_output") is not None:
            pairs.append((r.t0, rec["received"], rec["first_output"], r.t0 + r.ttft))
    offset = estimate_offset(pairs)
    usable = offset is not None and offset.consistent
    if offset is not None and not offset.consistent:
        # no single offset agrees with every request: times moved onto the client's clock would be guesses
        warnings.append(f"the client's and the server's clocks disagree (their bounds cross by "
                        f"{2 * offset.error_s * 1e3:.3g} ms over {offset.pairs} requests: clocks that drift, or "
                        "hosts whose clocks differ); no request's TTFT is split into parts")
    for r, rec in matched:
        r.server = explain(r, rec, steps, offset.offset_s if usable else None, index)
    explained = sum(r.server is not None and r.server.get("ttft_parts") is not None for r in results)
    matched_measured = [by_id[r.request_id] for r in results if r.request_id is not None and r.request_id in by_id]
    partial = sum(rec.get("steps_complete") is False for rec in matched_measured)
    if partial:
        # otherwise a short count of explained requests would not say why
        warnings.append(f"{partial:,} of {len(matched_measured):,} matched requests have "
                        "steps the server's request log no longer held (its step ring had moved past them) or did "
                        "not send whole; their TTFT is not split into parts")
    summary = {"source": source, "requests": len(results), "matched": len(matched_measured),
               "explained": explained, "warnings": warnings,
               "offset_ms": None, "offset_error_ms": None, "offset_pairs": 0, "offset_consistent": None}
    if offset is not None:
        summary.update(offset_ms=offset.offset_s * 1e3, offset_error_ms=offset.error_s * 1e3,
                       offset_pairs=offset.pairs, offset_consistent=offset.consistent)
    return summary


def explain(r: RequestResult, rec: dict, steps: dict[int, dict], offset: float | None,
            index: StepIndex | None = None) -> dict:
    """The server's view of one request, in milliseconds after its client send (`*_ms`), with its TTFT parts and
    its inter-token gaps' steps where the log and the clocks allow."""
    rows = rec.get("steps") or []
    out: dict[str, Any] = {
        "waiting_ahead": rec.get("waiting_ahead"), "running_at_arrival": rec.get("running_at_arrival"),
        "prompt_tokens": rec.get("prompt_tokens"), "cached_tokens": rec.get("cached_tokens"),
        "output_tokens": rec.get("output_tokens"), "finish_reason": rec.get("finish_reason"),
        "preempted_at_steps": rec.get("preempted") or [], "steps_ridden": len(rows),
        # the first step it rode again after each preemption (None: it never came back)
        "resumed_at_steps": [next((row[0] for row in rows if row[0] > p), None) for p in rec.get("preempted") or []],
    }
    first_step = steps.get(rows[0][0]) if rows else None
    first_token_row = next((row for row in rows if row[3]), None)
    first_token_step = steps.get(first_token_row[0]) if first_token_row else None
    if first_step is not None:
        out["first_step"] = first_step["step"]
    if first_token_step is not None:
        out["first_token_step"] = first_token_step["step"]

    def ms(t: float | None) -> float | None:
        return None if t is None or offset is None else (t - offset - r.t0) * 1e3

    first_start = first_step["start"] if first_step else None
    first_end = first_token_step["start"] + first_token_step["duration"] if first_token_step else None
    for name, t in (("received", rec.get("received")), ("tokenized", rec.get("tokenized")),
                    ("arrival", rec.get("arrival")), ("first_step", first_start), ("first_token", first_end),
                    ("first_output", rec.get("first_output")), ("finished", rec.get("finished")),
                    ("sent", rec.get("sent"))):
        out[f"{name}_ms"] = ms(t)
    tokenized = rec.get("tokenized")
    if tokenized is not None and first_start is not None:
        out["queue_ms"] = (first_start - tokenized) * 1e3
        out["queue_behind"] = (index or StepIndex(list(steps.values()))).between(tokenized, first_start)
    complete = rec.get("steps_complete", True)
    if (complete and offset is not None and r.ttft is not None and first_step is not None
            and first_token_step is not None and rec.get("received") is not None and tokenized is not None):
        ttft_rows = [row for row in rows if row[0] <= first_token_row[0]]
        ridden = _union([(steps[row[0]]["start"], steps[row[0]]["start"] + steps[row[0]]["duration"])
                         for row in ttft_rows if row[0] in steps], first_start, first_end)
        received = rec["received"]
        out["ttft_parts"] = {
            "network_and_frontend": (received - offset - r.t0) * 1e3,
            "tokenize": (tokenized - received) * 1e3,
            "queue": (first_start - tokenized) * 1e3,
            "prefill_steps": ridden * 1e3,
            "between_prefill_waits": (first_end - first_start - ridden) * 1e3,
            "first_token_send": (r.t0 + r.ttft - (first_end - offset)) * 1e3,
        }
        out["ttft_steps"] = [_step_view(steps.get(row[0]), row) for row in ttft_rows]
    if complete:
        itl = itl_steps(r, rows, steps, rec.get("preempted") or [])
        if itl is not None:
            out["itl_steps"] = itl
    return out


def _step_view(step: dict | None, row: list) -> dict:
    view = {"step": row[0], "tokens": row[1], "prefill": bool(row[2])}
    if step is not None:
        view.update(kind=step["kind"], batch_size=step["batch_size"], step_tokens=step["num_tokens"],
                    others_prefill_tokens=step["prefill_tokens"] - (row[1] if row[2] else 0),
                    step_ms=step["duration"] * 1e3)
    return view


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi] (steps overlap under async scheduling)."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


class StepIndex:
    """The log's steps in start order, with running sums, so the steps inside a window cost two bisections."""

    def __init__(self, steps: list[dict]) -> None:
        self.steps = sorted(steps, key=lambda s: s["start"])
        self.starts = [s["start"] for s in self.steps]
        self.ends = list(accumulate((s["start"] + s["duration"] for s in self.steps), max))  # non-decreasing
        self.rows = [0, *accumulate(s["prefill_rows"] for s in self.steps)]
        self.tokens = [0, *accumulate(s["prefill_tokens"] for s in self.steps)]

    def between(self, start: float, end: float) -> dict:
        """The steps that ran while a request waited (from `start` to `end`), and the prefills in them."""
        lo = bisect.bisect_right(self.ends, start)
        hi = bisect.bisect_left(self.starts, end)
        if hi <= lo:
            return {"steps": 0, "prefill_rows": 0, "prefill_tokens": 0}
        return {"steps": hi - lo, "prefill_rows": self.rows[hi] - self.rows[lo],
                "prefill_tokens": self.tokens[hi] - self.tokens[lo]}


def itl_steps(r: RequestResult, rows: list, steps: dict[int, dict], preempted: list[int]) -> list[dict] | None:
    """One entry per gap of `r.itl`: the step that produced the token ending the gap, and the cause; None when
    the client's chunks and the server's sampled rows do not line up."""
    sampled = [row for row in rows if row[3]]
    counts = [1 if n is None else n for n in r.chunk_tokens]
    if not r.itl or len(counts) != len(r.itl) + 1 or sum(counts) != len(sampled):
        return None
    rode = {row[0]: row for row in rows}
    out, seen = [], counts[0]
    for gap, n in zip(r.itl, counts[1:]):
        prev_row, row = sampled[seen - 1], sampled[seen + n - 1]
        seen += n
        step = steps.get(row[0])
        prev = steps.get(prev_row[0])
        between = range(prev_row[0] + 1, row[0] + 1)
        others = max((steps[k]["prefill_tokens"] - (rode[k][1] if rode[k][2] else 0)
                      for k in between if k in rode and k in steps), default=0)
        if any(prev_row[0] < p <= row[0] for p in preempted):
            cause = "preemption"
        elif others > 0:
            cause = "mixed"
        elif any(k not in rode for k in between):
            cause = "skipped_steps"
        else:
            cause = "decode"
        entry = {"step": row[0], "cause": cause, "others_prefill_tokens": others, "gap_ms": gap * 1e3}
        if step is not None:
            entry["step_ms"] = step["duration"] * 1e3
            if prev is not None:
                entry["server_gap_ms"] = (step["start"] + step["duration"] - prev["start"] - prev["duration"]) * 1e3
        out.append(entry)
    return out
