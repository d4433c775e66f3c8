"""Join bench's --requests-jsonl to a vLLM or SGLang server's own per-request timings, by request id.

    python benchmarks/join_peer_log.py requests.jsonl PEER_LOG [--out joined.jsonl]

PEER_LOG is vLLM's `llm_request` spans as OTLP JSON (`vllm serve --otlp-traces-endpoint ...` into an OpenTelemetry
collector whose `file` exporter writes them) or SGLang's server log (`--enable-request-time-stats-logging`).
Each joined line gains `server` (the peer's figures, in ms after the client's send) and `ttft_parts` (ms, adding up
to `ttft_ms`); the summary (matches, the clock offset and its error, what was skipped) goes to stdout as JSON.
A span, log line or requests line that cannot be read is skipped and counted, never the whole file; numbers that are
not finite are written as null.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from infertrace import input_files
from infertrace.exits import BAD_INPUT
from infertrace.load.results.peer_logs import MAX_PEER_LOG_BYTES, join_peer, read_peer_log
from infertrace.output import OutputError, check_writable, write_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests_jsonl", type=Path)
    parser.add_argument("peer_log", type=Path)
    parser.add_argument("--out", type=Path, help="the joined lines (default: REQUESTS_JSONL with .joined.jsonl)")
    args = parser.parse_args(argv)
    out = args.out or args.requests_jsonl.with_suffix(".joined.jsonl")
    try:
        check_writable(out, "--out")
        lines, bad_lines = read_requests(args.requests_jsonl)
        peer = read_peer_log(args.peer_log)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    records = [r for _, r in lines if r is not UNREADABLE]
    summary = join_peer([r for r in records if isinstance(r, dict) and r.get("phase") == "measured"], peer.records,
                        peer.source)
    summary.update(unreadable_request_lines=bad_lines, skipped_peer_entries=peer.skipped)
    if peer.skipped:
        summary["warnings"].append(f"{peer.skipped} malformed {peer.source} entr{'ies' if peer.skipped > 1 else 'y'} "
                                   f"skipped (the first: {peer.first_problem})")
    try:
        write_text(out, "".join(joined_line(raw, r) + "\n" for raw, r in lines))
    except (OSError, OutputError) as e:
        print(f"error: cannot write {out}: {e}", file=sys.stderr)
        return BAD_INPUT
    print(json.dumps(finite({**summary, "out": str(out)})))
    return 0


UNREADABLE = object()  # a line that is not JSON: written out as it came


def read_requests(path: Path) -> tuple[list[tuple[str, object]], int]:
    """(line, its JSON, or UNREADABLE) for each line of a --requests-jsonl file, and how many were not JSON."""
    try:
        text = input_files.read_text(path, MAX_PEER_LOG_BYTES)
    except input_files.InputFileError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    lines, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            lines.append((line, json.loads(line)))
        except (ValueError, RecursionError):
            lines.append((line, UNREADABLE))
            bad += 1
    return lines, bad


def joined_line(raw: str, record) -> str:
    """The record as JSON without NaN; the line as it came where it is not JSON or nested too deeply to write
    again."""
    if record is UNREADABLE:
        return raw
    try:
        return json.dumps(finite(record))
    except RecursionError:
        return raw


def finite(obj):
    """`obj` with every NaN or infinity as None: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
