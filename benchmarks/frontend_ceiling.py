"""How many tokens a second one `infertrace serve` front end streams to clients, and how evenly, when the engine
is never the limit: the real front end (app, ProcessEngine, framing) over the real engine-process loop
(EngineLoop), whose engine is a stand-in that gives every running request one token per step and takes
--step-ms per step (a GPU's step time). `infertrace bench` drives it from its own process.

    python benchmarks/frontend_ceiling.py --streams 256 --step-ms 7 --output-len 128 --num-prompts 1024
    python benchmarks/frontend_ceiling.py --api-servers 2 ...        # the same with two front ends
    python benchmarks/frontend_ceiling.py --profile front.prof ...   # cProfile of the (first) front end

Prints output tok/s, TPOT and ITL medians (an ITL median far under TPOT: tokens reach clients in bursts) and the
front end's CPU seconds per 1,000 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path


class StandInEngine:
    """What EngineLoop calls on an engine, with one token per running request per step and a fixed step time."""

    def __init__(self, step_s: float, max_num_seqs: int = 256) -> None:
        from infertrace.engine.outputs import RequestOutput

        self.Out = RequestOutput
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[str, list] = {}
        self.running: dict[str, list] = {}  # id -> [prompt_len, max_tokens, done]
        self.counters = {"steps": 0}
        self.last_step = None
        self.kv_blocks_used = 0
        self.kv_blocks_total = 1
        self.request_log = None  # the log's stamps are dropped: this engine has no log

    num_running = property(lambda self: len(self.running))
    num_waiting = property(lambda self: len(self.waiting))

    def add_request(self, request_id, prompt, params, label=None) -> None:
        self.waiting[request_id] = [len(prompt), params.max_tokens, 0]

    def abort(self, request_id):
        state = self.running.pop(request_id, None) or self.waiting.pop(request_id, None)
        if state is None:
            return None
        return self.Out(request_id, [], "", True, "abort", state[0], state[2], 0)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def plan_delay(self) -> float:
        return 0.0  # no step in flight: the next is planned at once

    def step(self):
        started = time.perf_counter()
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
        outs = []
        for rid, state in list(self.running.items()):
            state[2] += 1
            done = state[2] >= state[1]
            outs.append(self.Out(rid, [42], " tok", done, "length" if done else None, state[0], state[2], 0))
            if done:
                del self.running[rid]
        self.counters["steps"] += 1
        left = self.step_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return outs


class StandInServices:
    def __init__(self) -> None:
        from infertrace.server.frontend.metrics import ServerMetrics

        self.metrics = ServerMetrics()

    def on_step(self, stats) -> None:
        pass

    def command(self, name, args):
        if name == "metrics":
            return {"stats": {}, "server": self.metrics.snapshot()}
        return None


def engine_main(step_s: float, socks) -> None:
    from infertrace.server.engine_link.messages import FromEngine, frame
    from infertrace.server.engine_link.process import EngineLoop

    info = {"max_model_len": 32768, "kv_blocks_total": 1, "engine_config": {}, "decode_path": {},
            "versions": {}, "device": {"type": "stand-in"}, "engine_pid": os.getpid()}
    ready = frame(FromEngine("ready", value=info))  # the handshake each front end waits for before it listens
    for sock in socks:
        sock.sendall(ready)
    EngineLoop(StandInEngine(step_s), StandInServices(), socks).run()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=7.0)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--api-servers", type=int, default=1)
    ap.add_argument("--model", type=Path, help="tokenizer directory (default: the built-in tiny model)")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--profile", type=Path, help="write a cProfile of the first front end here")
    args = ap.parse_args()

    import multiprocessing
    import socket


    model = args.model
    if model is None:
        from infertrace.load.client.embedded_target import default_model_dir

        model = default_model_dir()
    pairs = [socket.socketpair() for _ in range(args.api_servers)]
    ctx = multiprocessing.get_context("spawn")
    engine = ctx.Process(target=engine_main, args=(args.step_ms / 1000, [b for _, b in pairs]), daemon=True)
    engine.start()
    for _, b in pairs:
        b.close()
    result = asyncio.run(_serve_and_load(args, model, [a for a, _ in pairs]))
    engine.kill()
    print(json.dumps(result))


def start_frontends(settings, socks, count: int) -> list:
    """Front ends 1..count-1 as `serve --api-servers` starts them (`frontend_main`, one process each, on the shared
    port); returns once each listens."""
    import multiprocessing

    from infertrace.server.engine_link.runner import frontend_main

    ctx = multiprocessing.get_context("spawn")
    started = []
    for index, sock in enumerate(socks, start=1):
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=frontend_main, args=(settings, sock, index, count, theirs), daemon=True)
        proc.start()
        theirs.close()
        started.append((proc, ours))
    for proc, conn in started:
        said = conn.recv() if conn.poll(60) else "no answer in 60 s"
        if said != "listening":
            for each, _ in started:
                each.kill()
            raise SystemExit(f"front end {proc.pid} did not start: {said}")
    return [proc for proc, _ in started]


async def _serve_and_load(args, model: Path, socks) -> dict:
    import cProfile
    import resource
    from dataclasses import replace

    from aiohttp import web

    from infertrace.server.engine_link.client import ProcessEngine
    from infertrace.server.frontend.app import build_app
    from infertrace.server.frontend.tokenizer import FrontendTokenizer
    from infertrace.server.settings import ServerSettings

    settings = ServerSettings(model_dir=str(model), served_model_name="stand-in", port=args.port,
                              max_queue=100000)
    engine = ProcessEngine(socks[0])
    await engine.connect()
    app = build_app(engine, FrontendTokenizer(model), settings, {"index": 0, "count": args.api_servers})
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port, reuse_port=args.api_servers > 1 or None).start()
    children = start_frontends(replace(settings, port=args.port), socks[1:], args.api_servers)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "infertrace", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
               "--tokenizer", str(model), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--ignore-eos", "--num-prompts", str(args.num_prompts), "--concurrency", str(args.streams),
               "--warmup", "0", "--scrape-interval", "0", "--result-json", str(out)]
        profiler = cProfile.Profile() if args.profile else None
        before = resource.getrusage(resource.RUSAGE_SELF)
        if profiler:
            profiler.enable()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
        after = resource.getrusage(resource.RUSAGE_SELF)
        if proc.returncode != 0:
            raise SystemExit(f"bench failed: {err.decode()[-2000:]}")
        r = json.loads(out.read_text())
    for child in children:
        child.kill()
    await runner.cleanup()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"streams": args.streams, "step_ms": args.step_ms, "api_servers": args.api_servers,
            "output_tok_s": round(r["output_throughput"]), "median_tpot_ms": round(r["median_tpot_ms"], 2),
            "median_itl_ms": round(r["median_itl_ms"], 2), "p99_itl_ms": round(r["p99_itl_ms"], 1),
            "frontend0_cpu_s_per_1k_tokens": round(1000 * cpu / r["total_output_tokens"], 4)}


if __name__ == "__main__":
    main()
