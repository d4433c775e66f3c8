"""The W3C trace context bench sends with each request (`traceparent`), so that a server's span of the request
(vLLM's `llm_request`, infertrace serve's) is the child of bench's own span of it (load/results/spans_out.py).

A request's trace id (16 bytes) and span id (8 bytes) are a BLAKE2b hash of its request id, which is random per run
(a random prefix and a counter, load/client/http_target.py): the header, the --requests-jsonl record and the
exported span get the same ids from the id alone, in any load worker, with no table kept per request.
"""

from __future__ import annotations

from hashlib import blake2b

VERSION = "00"
SAMPLED = "01"  # trace-flags: the server's tracer (vLLM's, parent-based) then records its span under ours


def ids(request_id: str) -> tuple[str, str]:
    """(trace id, span id) of the request, as lowercase hex; never all zeros (W3C's invalid value)."""
    digest = blake2b(request_id.encode(), digest_size=24).digest()
    trace, span = digest[:16], digest[16:]
    if not any(trace):
        trace = trace[:-1] + b"\x01"
    if not any(span):
        span = span[:-1] + b"\x01"
    return trace.hex(), span.hex()


def traceparent(request_id: str) -> str:
    """`00-<trace id>-<span id>-01`."""
    trace, span = ids(request_id)
    return f"{VERSION}-{trace}-{span}-{SAMPLED}"
