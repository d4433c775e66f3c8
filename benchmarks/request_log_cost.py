"""What the engine's request log costs per step and per request, and what a read costs, on this host's CPU.

    python benchmarks/request_log_cost.py [--batch-sizes 1,64,256] [--steps 20000]
    python benchmarks/request_log_cost.py --engine MODEL_DIR [--rounds 6] [--prompts 64] [--output-len 32]
    python benchmarks/request_log_cost.py --serve MODEL_DIR [--rounds 6] [--streams 256] [--requests 512]
    python benchmarks/request_log_cost.py --watch URL --watch-out FILE   (request_log_serve.sh's CPU sampler)

Drives `RequestLog` the way the engine does (arrival, one record per step with every scheduled row, finish) over
a steady batch of decodes, timing each hook with perf_counter_ns (median of 5 repeats), then times a read of the
whole log as GET /v1/request_log does. No model runs: this is the log's own cost, to set beside a step's time.
With --engine, the same prompts run through the engine with the log on and off in alternating rounds (one warm-up
round each first), on one torch thread; each round's output tokens per second (wall clock) and CPU time per output
token (process time, which a busy shared host disturbs far less than the wall clock) are printed, then the medians
and their ratios.
With --serve, two `infertrace serve` processes of the model, the log on and off, take closed-loop rounds in turn
(on off, off on, ...) of --requests streamed completions at --streams in flight, after one warm-up round each (the
tiny model keeps the model's share of a step small on a CPU; the servers run unchanged).
Each round prints the CPU seconds per request of the front end and of the engine process (utime + stime of
/proc/PID/stat, read just before the first request and after the last), then the medians with their range.
With --watch, a running server's CPU and finished requests are sampled into a file until SIGTERM (watch_server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/request_log_cost.py` too
from benchmarks.client_ceiling import _tree_cpu_s  # noqa: E402
from infertrace.engine.request_log import RequestLog  # noqa: E402


def measure(batch: int, steps: int) -> dict:
    # the scheduler's own records: the hook's cost depends on how fast their attributes are read
    from infertrace.engine.sampling_params import SamplingParams
    from infertrace.engine.scheduler import ScheduledSeq, StepPlan
    from infertrace.engine.sequence import Sequence

    log = RequestLog(100_000)
    ids = [f"0/cmpl-{i:032x}" for i in range(batch)]
    for request_id in ids:
        log.arrived(request_id, 0.0, 512, 0, 0)
    params = SamplingParams(max_tokens=128)
    plan = StepPlan(scheduled=[ScheduledSeq(Sequence(i, [1] * 512, params), 512, 1, False) for i in ids])
    sampled = [7] * batch
    t = time.perf_counter_ns()
    for n in range(steps):
        log.step(n, plan, 0.01 * (n + 1), 0.01, sampled)
    per_step_us = (time.perf_counter_ns() - t) / steps / 1e3
    t = time.perf_counter_ns()
    for n in range(10_000):
        log.arrived(f"x{n}", 0.0, 512, 0, 0)
        log.stamp(f"x{n}", {"received": 0.0, "tokenized": 0.0, "first_output": 0.0, "sent": 0.0})
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


def server_cpu_s(frontend_pid: int, engine_pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime, every thread) so far of a server's front end alone and of its engine process
    with the engine's own children (tensor-parallel ranks)."""
    return {"frontend": _tree_cpu_s(frontend_pid)[1], "engine": _tree_cpu_s(engine_pid)[0]}


async def _round(session, url: str, model: str, prompts: list[list[int]], output_len: int, streams: int,
                 tag: str, pids: dict[str, int]) -> dict:
    """`prompts` streamed through `streams` workers; wall time and each server process's CPU time over them."""
    queue = list(enumerate(prompts))
    body = {"model": model, "max_tokens": output_len, "ignore_eos": True, "stream": True, "temperature": 0}

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop()
            async with session.post(f"{url}/v1/completions", json={**body, "prompt": prompt},
                                    headers={"X-Request-Id": f"{tag}-{i}"}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                async for _ in resp.content.iter_any():
                    pass

    before = server_cpu_s(**pids)
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(streams, len(prompts)))))
    wall = time.perf_counter() - t
    used = {name: cpu - before[name] for name, cpu in server_cpu_s(**pids).items()}
    n = len(prompts)
    return {"req_s": n / wall, "output_tok_s": n * output_len / wall,
            **{f"{name}_ms_per_request": cpu / n * 1e3 for name, cpu in used.items()}}


def _start_server(model_dir: str, port: int, log_on: bool, out_dir: str) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-c", "from infertrace.cli import main; main()", "serve", "--model", model_dir, "--port",
            str(port), "--served-model-name", "m", "--max-queue", "100000"]
    if not log_on:
        args += ["--request-log-size", "0"]
    log_path = os.path.join(out_dir, f"server-{'on' if log_on else 'off'}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def _wait_healthy(session, proc: subprocess.Popen, url: str, limit_s: float = 300.0) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {proc.returncode} (see its log)")
        try:
            async with session.get(f"{url}/server_info") as resp:
                if resp.status == 200:
                    return await resp.json()
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not up within {limit_s:g} s")


async def serve_rounds(model_dir: str, rounds: int, streams: int, requests: int, input_len: int, output_len: int,
                       port: int, out_dir: str) -> dict:
    """Rounds of the two servers in turn (on off, off on, ...); each round's figures, then the medians."""
    import aiohttp

    os.makedirs(out_dir, exist_ok=True)
    servers = {"on": _start_server(model_dir, port, True, out_dir),
               "off": _start_server(model_dir, port + 1, False, out_dir)}
    rng = random.Random(0)
    figures: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            pids = {}
            for mode, (proc, url) in servers.items():
                info = await _wait_healthy(session, proc, url)
                pids[mode] = {"frontend_pid": info["frontend"]["pid"], "engine_pid": info["engine_pid"]}
            vocab = 1000  # ids every model's vocabulary holds
            for r in range(rounds + 1):
                for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    n = streams if r == 0 else requests  # round 0 warms both up
                    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]
                    fig = await _round(session, servers[mode][1], "m", prompts, output_len, streams, f"{mode}{r}",
                                       pids[mode])
                    if r:
                        figures[mode].append(fig)
                        print(json.dumps({"round": r, "log": mode, **fig}), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = {"rounds": rounds, "streams": streams, "requests": requests}
    for key in figures["on"][0]:
        for mode in ("on", "off"):
            values = [f[key] for f in figures[mode]]
            summary[f"{key}_{mode}"] = [statistics.median(values), min(values), max(values)]
        summary[f"{key}_on_over_off"] = summary[f"{key}_on"][0] / summary[f"{key}_off"][0]
    return summary


def watch_server(url: str, out_path: str, period_s: float) -> None:
    """Until SIGTERM: every `period_s`, one JSON line with the time (perf_counter), the CPU seconds so far of the
    server's front end and engine process, and the requests it has finished (its /metrics). A run's CPU per request
    is then taken between two lines, away from its warm-up and from any read of the log after it."""
    import signal
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as resp:
        info = json.load(resp)
    pids = {"frontend_pid": info["frontend"]["pid"], "engine_pid": info["engine_pid"]}
    with open(out_path, "w") as out:
        while True:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            finished = sum(sample.value for family in text_string_to_metric_families(text)
                           if family.name == "infertrace:requests_finished" for sample in family.samples
                           if sample.name.endswith("_total"))
            out.write(json.dumps({"t": time.perf_counter(), **server_cpu_s(**pids), "finished": finished}) + "\n")
            out.flush()
            time.sleep(period_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--engine", metavar="MODEL_DIR")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--serve", metavar="MODEL_DIR")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--out-dir", default="/tmp/request_log_cost")
    parser.add_argument("--watch", metavar="URL", help="sample a running server's CPU into --watch-out until SIGTERM")
    parser.add_argument("--watch-out", default="server_cpu.jsonl")
    parser.add_argument("--watch-period", type=float, default=0.2)
    args = parser.parse_args()
    if args.watch:
        watch_server(args.watch, args.watch_out, args.watch_period)
        return
    if args.serve:
        print(json.dumps(asyncio.run(serve_rounds(args.serve, args.rounds, args.streams, args.requests,
                                                  args.input_len, args.output_len, args.port, args.out_dir))))
        return
    if args.engine:
        print(json.dumps(engine_rounds(args.engine, args.rounds, args.prompts, args.input_len, args.output_len)))
        return
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = [measure(batch, args.steps) for _ in range(5)]
        print(json.dumps({k: statistics.median(r[k] for r in runs) for k in runs[0]}))


if __name__ == "__main__":
    main()
