"""The front end's part of the request log: the client's request id (`X-Request-Id`), the front end's times of a
request (received, tokenized, first output, sent), and `GET /v1/request_log`, which reads the engine's log.

The front end's times go to the engine when the request ends, in front of the next message the front end sends
anyway (never a write of their own; none at all when the engine keeps no log), so the engine process holds each
request's whole life whichever front end served it. They are `time.perf_counter()` seconds, the clock the
engine's steps are timed with (one host, one CLOCK_MONOTONIC).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from infertrace.server.frontend.protocol import ApiError, bad_request, brief

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
# letters, digits and the punctuation of UUIDs, ULIDs and the ids load generators build (vLLM's "cmpl-..." too)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_REQUEST_ID_CHARS)
# One answer's bounds. The engine builds it between two steps, so a page must cost about what a step costs, however
# full the log: on a CPU core, a page of 1 MiB (an upper bound of its JSON) took 12 ms with 64 streams of 200
# tokens (128 whole requests, 0.55 MB) and 16 ms at 256 streams of 128 tokens (199 requests, 0.50 MB); one of 4 MiB
# 26 and 54 ms. A reader follows `next` for the rest.
MAX_PAGE_REQUESTS = 1_000
MAX_PAGE_BYTES = 1 << 20
MAX_SEQ = (1 << 63) - 1  # a cursor beyond any log (and beyond what crosses to the engine process)
READ_TIMEOUT_S = 30.0


def client_request_id(headers: Mapping[str, str], in_flight: set[str]) -> str | None:
    """The request id the client chose (`X-Request-Id`, as vLLM and SGLang take it), or None without one.
    400 for one that is empty, too long, holds other characters, or names a request still in flight."""
    value = headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not REQUEST_ID.fullmatch(value):
        raise bad_request(f"the {REQUEST_ID_HEADER} header must be 1-{MAX_REQUEST_ID_CHARS} characters of letters, "
                          f"digits and . _ : -; got {value[:40]!r}{'...' if len(value) > 40 else ''}",
                          REQUEST_ID_HEADER, code="invalid_request_id")
    if value in in_flight:
        raise bad_request(f"the request id {value!r} is already in use by a request in flight", REQUEST_ID_HEADER,
                          code="duplicate_request_id")
    return value


class RequestStamps:
    """One request's times in the front end: received when made, then `tokenized`, `first_output` (its first
    output reached the handler) and `sent` (the response written); `send` hands them to the engine's log."""

    __slots__ = ("times",)

    def __init__(self) -> None:
        self.times = {"received": time.perf_counter()}

    def mark(self, name: str) -> None:
        self.times.setdefault(name, time.perf_counter())

    def send(self, engine: Any, request_id: str) -> None:
        self.times.setdefault("sent", time.perf_counter())
        stamp = getattr(engine, "stamp", None)
        if stamp is not None:
            try:
                stamp(request_id, self.times)
            except Exception:  # a dead engine: there is no log left to write to
                pass


def read_args(query: Mapping[str, str]) -> dict[str, int]:
    """The engine's read of one page: `since` (the cursor: a request's sequence number, as `next` of an earlier
    read) and `limit` (at most MAX_PAGE_REQUESTS, its default), with the page's byte bound; 400 for a value that is
    not an integer in 0..2^63-1."""
    args = {}
    for name in ("since", "limit"):
        raw = query.get(name)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:  # a string of more than 4,300 digits too
            value = -1
        if not 0 <= value <= MAX_SEQ:
            raise bad_request(f"{name} must be an integer in 0..{MAX_SEQ}, got {brief(raw)}", name)
        args[name] = value
    args["limit"] = min(args.get("limit", MAX_PAGE_REQUESTS), MAX_PAGE_REQUESTS)
    args["max_bytes"] = MAX_PAGE_BYTES
    return args


def check_read(answer: Any) -> dict:
    if answer is None:
        raise ApiError(404, "the request log is off: the server runs with --request-log-size 0",
                       code="request_log_off")
    return answer
