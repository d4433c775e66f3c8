"""Reading a server's request log over HTTP (`GET /v1/request_log`): where it stands before a run, and every
request it logged since, page by page. The log is evidence beside the run, never a condition of it: the read is
bounded in bytes, rows, pages and time, each page is checked as it arrives, and a server that cannot answer
costs the join, not the run."""

from __future__ import annotations

import time
from typing import Any

from infertrace.load.server_log import RECORD_KINDS, checked_rows

LOG_PATH = "/v1/request_log"
PAGE = 5_000  # rows asked for at a time; the server may answer fewer, and its `next` says where it goes on
MAX_PAGE_BYTES = 16 << 20  # one answer (about 6 MB holds 5,000 requests with their steps); parsed, JSON can
# take 20 times its bytes, so this bounds what one page costs before it is checked
MAX_LOG_BYTES = 256 << 20  # all pages together (what is kept is checked: a few times its bytes in memory)
MAX_ROWS = 500_000
MAX_PAGES = 2_000
FETCH_TIMEOUT_S = 120.0  # the whole fetch, every page included


async def read_cursor(transport) -> int | None:
    """Where the server's request log stands now (its `next`), or None when it keeps none."""
    try:
        status, body = await transport.request_json("GET", f"{LOG_PATH}?limit=0")
    except Exception:  # noqa: BLE001 - a server without the route, or one that went away: no join, the run stands
        return None
    cursor = body.get("next") if status == 200 and isinstance(body, dict) else None
    return cursor if _is_seq(cursor) else None  # a cursor that is no sequence number: no join, the run stands


async def read_since(transport, since: int) -> dict | None:
    """Every request the server logged from `since` on (page by page, following each answer's `next`), with the
    steps they rode; None when the log cannot be read. The read stops, keeping what it has and saying why in
    `fetch_warnings`, at a page that is empty or does not move on, or at a bound (MAX_* and FETCH_TIMEOUT_S).
    Only checked records are kept: `malformed` holds, per kind, how many were not and the first reason."""
    requests, steps, warnings = [], {}, []
    malformed = {key: [0, None] for key in RECORD_KINDS}
    answer, size = None, 0
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    for _ in range(MAX_PAGES):
        left = deadline - time.monotonic()
        if left <= 0:
            warnings.append(f"the server's request log took over {FETCH_TIMEOUT_S:g} s to read; joined as far as "
                            f"read ({len(requests):,} requests)")
            break
        try:
            status, body, n = await transport.request_json_sized(
                "GET", f"{LOG_PATH}?since={since}&limit={PAGE}", left, min(MAX_PAGE_BYTES, MAX_LOG_BYTES - size))
        except Exception as e:  # noqa: BLE001 - a target that went away, a page too big: the run stands
            answer = answer or {}
            warnings.append(f"the server's request log could not be read past {len(requests):,} requests ({e}); "
                            "joined as far as read")
            break
        if status != 200 or not isinstance(body, dict):
            if answer is None:
                return None
            break
        answer, size = body, size + n
        got = body.get("requests")
        for key, rows in (("requests", got), ("steps", body.get("steps"))):
            kept, bad, first = checked_rows(rows, key)
            malformed[key][0] += bad
            malformed[key][1] = malformed[key][1] or first
            if key == "requests":
                requests += kept
            else:
                steps.update((s["step"], s) for s in kept)
        if len(requests) >= MAX_ROWS:
            warnings.append(f"the server's request log holds over {MAX_ROWS:,} requests since the run began; "
                            f"joined the first {MAX_ROWS:,}")
            del requests[MAX_ROWS:]
            break
        if not isinstance(got, list) or not got:
            break
        if (after := _next_cursor(since, got, body.get("next"))) is None:
            warnings.append(f"the server's request log answered a page that does not move on from {since}; joined "
                            "as far as read")
            break
        since = after
    else:
        warnings.append(f"the server's request log took over {MAX_PAGES:,} pages; joined as far as read")
    if answer is None:
        return None
    return {**answer, "requests": requests, "steps": sorted(steps.values(), key=lambda s: s["step"]),
            "malformed": {key: tuple(v) for key, v in malformed.items()}, "fetch_warnings": warnings}


def _next_cursor(since: int, got: list, nxt: Any) -> int | None:
    """Where the next page starts: just after this page's last row (a server whose `next` is the end of its whole
    log, as older ones answer, would skip the rows a short page left out), or the answer's `next` when the rows
    carry no `seq`; None when that does not move past `since` (a server that repeats itself)."""
    last = got[-1].get("seq") if got and isinstance(got[-1], dict) else None
    candidates = [c for c in (last + 1 if _is_seq(last) else None, nxt if _is_seq(nxt) else None) if c is not None]
    after = min(candidates, default=None)
    return after if after is not None and after > since else None


def _is_seq(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63
