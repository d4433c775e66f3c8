"""What the engine's request log costs per step and per request, and what a read costs, on this host's CPU.

    python benchmarks/request_log_cost.py [--batch-sizes 1,64,256] [--steps 20000]
    python benchmarks/request_log_cost.py --engine MODEL_DIR [--rounds 6] [--prompts 64] [--output-len 32]

Drives `RequestLog` the way the engine does (arrival, one record per step with every scheduled row, finish) over
a steady batch of decodes, timing each hook with perf_counter_ns (median of 5 repeats), then times a read of the
whole log as GET /v1/request_log does. No model runs: this is the log's own cost, to set beside a step's time.
With --engine, the same prompts run through the engine with the log on and off in alternating rounds (one warm-up
round each first), on one torch thread; each round's output tokens per second (wall clock) and CPU time per output
token (process time, which a busy shared host disturbs far less than the wall clock) are printed, then the medians
and their ratios.
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


def engine_rounds(model_dir: str, rounds: int, prompts: int, input_len: int, output_len: int) -> dict:
    """Output tokens per second of the engine with the log on (default size) and off, alternating."""
    import random

    import torch

    from infertrace.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(1)
    rng = random.Random(0)
    engines = {mode: Engine(model_dir, EngineConfig(request_log_size=size))
               for mode, size in (("on", EngineConfig().request_log_size), ("off", 0))}
    vocab = engines["on"].vocab_size
    batch = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(prompts)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    tokens = prompts * output_len
    for r in range(rounds + 1):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            engine = engines[mode]
            for i, prompt in enumerate(batch):
                engine.add_request(f"{mode}-{r}-{i}", prompt, params)
            t, c = time.perf_counter(), time.process_time()
            while engine.has_unfinished():
                engine.step()
            elapsed, used = time.perf_counter() - t, time.process_time() - c
            if r:  # round 0 warms both up
                rates[mode].append(tokens / elapsed)
                cpu[mode].append(used / tokens * 1e3)
                print(json.dumps({"round": r, "log": mode, "output_tok_s": tokens / elapsed,
                                  "cpu_ms_per_token": used / tokens * 1e3}))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    return {"on_tok_s": on, "off_tok_s": off, "on_over_off": on / off, "cpu_ms_per_token_on": cpu_on,
            "cpu_ms_per_token_off": cpu_off, "cpu_on_over_off": cpu_on / cpu_off, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--engine", metavar="MODEL_DIR")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(engine_rounds(args.engine, args.rounds, args.prompts, args.input_len, args.output_len)))
        return
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = [measure(batch, args.steps) for _ in range(5)]
        print(json.dumps({k: statistics.median(r[k] for r in runs) for k in runs[0]}))


if __name__ == "__main__":
    main()
