"""Join bench's --requests-jsonl to a vLLM or SGLang server's own per-request timings, by request id.

    python benchmarks/join_peer_log.py requests.jsonl PEER_LOG [--out joined.jsonl]

PEER_LOG is vLLM's `llm_request` spans as OTLP JSON (`vllm serve --otlp-traces-endpoint ...` into an OpenTelemetry
collector whose `file` exporter writes them) or SGLang's server log (`--enable-request-time-stats-logging`).
Each joined line gains `server` (the peer's figures, in ms after the client's send) and `ttft_parts` (ms, adding up
to `ttft_ms`); the summary (matches, the clock offset and its error) goes to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infertrace.load.results.peer_logs import join_peer, read_peer_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests_jsonl", type=Path)
    parser.add_argument("peer_log", type=Path)
    parser.add_argument("--out", type=Path, help="the joined lines (default: REQUESTS_JSONL with .joined.jsonl)")
    args = parser.parse_args(argv)
    try:
        records = [json.loads(line) for line in args.requests_jsonl.read_text().splitlines() if line.strip()]
        source, peer = read_peer_log(args.peer_log)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = join_peer([r for r in records if r.get("phase") == "measured"], peer, source)
    out = args.out or args.requests_jsonl.with_suffix(".joined.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(json.dumps({**summary, "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
