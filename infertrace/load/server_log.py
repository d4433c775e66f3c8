"""The server's request log as bench reads it: the shape of one request's and one step's record, and the check
that keeps only records of that shape. The fetch checks each page with it as it arrives, the join each record."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# Times are the server's clock in seconds: a bound far beyond any clock (32,000 years) keeps NaN, infinities and
# integers too large for a float out of the arithmetic.
_Time = Annotated[float, msgspec.Meta(ge=-1e12, le=1e12)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
_Flag = int | bool


class LoggedRequest(msgspec.Struct):
    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    seq: _Count | None = None
    received: _Time | None = None
    tokenized: _Time | None = None
    arrival: _Time | None = None
    first_output: _Time | None = None
    finished: _Time | None = None
    sent: _Time | None = None
    prompt_tokens: _Count | None = None
    cached_tokens: _Count | None = None
    output_tokens: _Count | None = None
    waiting_ahead: _Count | None = None
    running_at_arrival: _Count | None = None
    finish_reason: Annotated[str, msgspec.Meta(max_length=200)] | None = None
    preempted: list[_Count] | None = None
    steps_complete: bool = True
    steps: list[tuple[_Count, _Count, _Flag, _Flag]] | None = None  # (step, tokens, prefill, sampled a token)


class LoggedStep(msgspec.Struct):
    step: _Count
    start: _Time
    duration: Annotated[float, msgspec.Meta(ge=0, le=1e12)]
    kind: Annotated[str, msgspec.Meta(max_length=200)] = "unknown"
    batch_size: _Count = 0
    num_tokens: _Count = 0
    prefill_tokens: _Count = 0
    prefill_rows: _Count = 0
    preempted: _Count = 0


RECORD_KINDS = {"requests": LoggedRequest, "steps": LoggedStep}


def checked_rows(rows: Any, key: str) -> tuple[list[dict], int, str | None]:
    """The rows of the log's `key` ("requests" or "steps") that have the shape the join reads, as plain dicts;
    how many did not, and the first reason."""
    if rows is None:
        return [], 0, None
    if not isinstance(rows, list):
        return [], 1, f"`{key}` is not a list"
    kept, bad, first = [], 0, None
    for row in rows:
        try:
            kept.append(msgspec.structs.asdict(msgspec.convert(row, RECORD_KINDS[key])))
        except msgspec.ValidationError as e:
            bad += 1
            first = first or str(e)
    return kept, bad, first
