"""What the engine's request log costs per step and per request, and what a read costs, on this host's CPU.

    python benchmarks/request_log_cost.py [--batch-sizes 1,64,256] [--steps 20000]

Drives `RequestLog` the way the engine does (arrival, one record per step with every scheduled row, finish) over
a steady batch of decodes, timing each hook with perf_counter_ns (median of 5 repeats), then times a read of the
whole log as GET /v1/request_log does. No model runs: this is the log's own cost, to set beside a step's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from infertrace.engine.request_log import RequestLog


class _Row:
    __slots__ = ("seq", "num_new_tokens", "is_prefill")

    def __init__(self, request_id: str) -> None:
        self.seq = type("Seq", (), {"request_id": request_id})
        self.num_new_tokens, self.is_prefill = 1, False


class _Plan:
    kind = type("Kind", (), {"value": "decode"})

    def __init__(self, rows) -> None:
        self.scheduled, self.preempted = rows, []


def measure(batch: int, steps: int) -> dict:
    log = RequestLog(100_000)
    ids = [f"req-{i}" for i in range(batch)]
    for request_id in ids:
        log.arrived(request_id, 0.0, 512, 0, 0)
    plan, sampled = _Plan([_Row(i) for i in ids]), [7] * batch
    t = time.perf_counter_ns()
    for n in range(steps):
        log.step(n, plan, 0.01 * (n + 1), 0.01, sampled)
    per_step_us = (time.perf_counter_ns() - t) / steps / 1e3
    t = time.perf_counter_ns()
    for n in range(10_000):
        log.arrived(f"x{n}", 0.0, 512, 0, 0)
        log.finished(f"x{n}", 0.0, "length", 128, 0, n)
    per_request_us = (time.perf_counter_ns() - t) / 10_000 / 1e3
    t = time.perf_counter()
    answer = log.read(since=0, limit=batch)
    read_s = time.perf_counter() - t
    return {"batch_size": batch, "step_us": per_step_us, "request_us": per_request_us,
            "read_ms": read_s * 1e3, "read_rows": sum(len(r["steps"]) for r in answer["requests"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20_000)
    args = parser.parse_args()
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = [measure(batch, args.steps) for _ in range(5)]
        print(json.dumps({k: statistics.median(r[k] for r in runs) for k in runs[0]}))


if __name__ == "__main__":
    main()
