"""The engine in-process (no server) under an open-loop load: requests of INPUT_LEN random token ids and OUTPUT_LEN
tokens (ignore_eos) arriving at RATE/s (Poisson, seeded), `engine.step()` in a loop. Prints the step spacing, TTFT
and ITL as the engine's caller sees them (arrival to the first token out of `step()`, then between tokens), and the
host time per step by engine phase (`--phases`: the engine's own profiler ranges, read from torch.profiler, which
slows each step by its per-op cost, so the TTFT and ITL of such a run are not the engine's).

    python benchmarks/engine_host_load.py MODEL_DIR [--mode graphs|eager] [--num-requests 400] [--rate 60] [--phases]

`--mode eager` turns the token-count graphs off (decode graphs stay), as `--no-prefill-cuda-graphs` does on serve.
Phases nest: `step` includes everything. To compare two commits, run the script
once with each commit's `infertrace` first on PYTHONPATH (e.g. `git archive REV infertrace | tar -x -C /tmp/rev`).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import infertrace
from infertrace.engine import LLM, SamplingParams

# the engine's own profiler ranges (infertrace/engine/annotate.py); "step" is every `step[...]` range
PHASES = ("step", "schedule", "prepare_inputs", "forward", "sample")


def phase_seconds(events) -> dict[str, float]:
    """Seconds of CPU time in each of PHASES over a torch.profiler run's events (its ranges nest: `step` holds
    the rest)."""
    seconds = dict.fromkeys(PHASES, 0.0)
    for event in events:
        name = "step" if event.name.startswith("step[") else event.name
        if name in seconds:
            seconds[name] += event.cpu_time_total / 1e6
    return seconds


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=60.0)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--phases", action="store_true",
                        help="host time by engine phase, from torch.profiler (which slows every step)")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    print(f"infertrace from {Path(infertrace.__file__).parent}")
    eng = LLM(args.model, prefill_cuda_graphs=args.mode == "graphs", device=args.device).engine
    vocab = eng.runner.spec.vocab_size
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]

    for i in range(4):  # warm-up
        eng.add_request(f"warm{i}", prompt(), SamplingParams(max_tokens=16, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    arrivals, t = [], 0.0
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    prompts = [prompt() for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    itl: list[float] = []
    steps, admitted = 0, 0
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.phases else None
    if profiler is not None:
        profiler.start()
    t0 = time.perf_counter()
    while admitted < args.num_requests or eng.has_unfinished():
        now = time.perf_counter() - t0
        while admitted < args.num_requests and arrivals[admitted] <= now:
            eng.add_request(f"r{admitted}", prompts[admitted], params)
            admitted += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, arrivals[admitted] - now))
            continue
        outputs = eng.step()
        steps += 1
        now = time.perf_counter() - t0
        for out in outputs:
            i = int(out.request_id[1:])
            if i in first:
                itl.append(now - last[i])
            else:
                first[i] = now - arrivals[i]
            last[i] = now
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.stop()
    ttft, itl = sorted(first.values()), sorted(itl)
    print(f"{args.mode}: {args.num_requests} requests at {args.rate:g}/s, {steps} steps in {wall:.2f} s, "
          f"spacing {1e3 * wall / steps:.3f} ms a step")
    print(f"  TTFT p50 {1e3 * percentile(ttft, 0.5):.2f} p90 {1e3 * percentile(ttft, 0.9):.2f} "
          f"p99 {1e3 * percentile(ttft, 0.99):.2f} ms; ITL p50 {1e3 * percentile(itl, 0.5):.2f} "
          f"p99 {1e3 * percentile(itl, 0.99):.2f} ms")
    if profiler is not None:
        for name, seconds in phase_seconds(profiler.events()).items():
            print(f"  {name:>15}: {1e6 * seconds / steps:8.1f} us a step (profiled)")


if __name__ == "__main__":
    main()
