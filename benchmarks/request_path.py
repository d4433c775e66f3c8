"""Where a served request's TTFT goes, stage by stage, on one clock: the real HTTP front end (this process: the
aiohttp app, its tokenizer, `ProcessEngine`) and the real engine-process loop (`EngineLoop`, spawned), over the real
engine or a stand-in with a fixed step time (frontend_ceiling.py's), under `infertrace bench` at an open-loop rate.

    python benchmarks/request_path.py MODEL_DIR                       # stand-in engine, 1.5 ms steps
    python benchmarks/request_path.py MODEL_DIR --engine real [--mode graphs|eager]
    python benchmarks/request_path.py MODEL_DIR --inline-chars 0      # every prompt tokenized on a thread

Each request is stamped (wall-clock ns, wrappers installed by this script; no profiler) when its handler has the
body, when its prompt is tokenized, when the front end has sent it to the engine, when the engine loop takes it in
and adds it, when `step()` returns its first output, when that step's message is sent, when the front end has the
output and when it builds the first SSE chunk. Printed: the median (mean) of each stage over the requests, and the
client's TTFT beside the front end's share of it (the rest is the client's send and receive). The stage from the
front end's send to the engine loop taking the request in is the wait for the running step to end, which an
in-engine TTFT (engine_host_load.py) counts too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = ("body", "tokenized", "sent", "engine_read", "added", "first_out", "message_sent", "frontend_has",
          "chunk_built")


def _stamp_engine(engine, loop_cls, log_path: str) -> None:
    """Engine-side stamps (in the engine process): a JSON line per request once its first output is sent."""
    stamps: dict[str, dict[str, int]] = {}
    log = open(log_path, "w")  # open for the engine process's life (it is killed at the end)
    add, step = engine.add_request, engine.step

    def add_request(request_id, prompt, params):
        stamps[request_id] = {"added": time.time_ns()}
        return add(request_id, prompt, params)

    def timed_step():
        outputs = step()
        now = time.time_ns()
        for out in outputs:
            s = stamps.get(out.request_id)
            if s is not None and "first_out" not in s:
                s["first_out"] = now
        return outputs

    engine.add_request, engine.step = add_request, timed_step
    handle, deliver = loop_cls._handle, loop_cls._deliver

    @functools.wraps(handle)
    def _handle(self, peer, msg):
        read = time.time_ns()
        handle(self, peer, msg)
        if msg.kind == "add" and msg.request_id in stamps:
            stamps[msg.request_id]["engine_read"] = read

    @functools.wraps(deliver)
    def _deliver(self, outputs):
        deliver(self, outputs)
        now = time.time_ns()
        for out in outputs:
            s = stamps.get(out.request_id)
            if s is not None and "first_out" in s and "message_sent" not in s:
                s["message_sent"] = now
                log.write(json.dumps({"id": out.request_id, **s}) + "\n")
                log.flush()

    loop_cls._handle, loop_cls._deliver = _handle, _deliver


def engine_main(model_dir: str | None, step_s: float, mode: str, log_path: str, socks) -> None:
    """The engine process: EngineLoop over the real engine (model_dir) or the stand-in (None)."""
    from infertrace.server.engine_link.messages import FromEngine
    from infertrace.server.engine_link.process import EngineLoop, _tell_all

    if model_dir is None:
        import frontend_ceiling

        engine, services = frontend_ceiling.StandInEngine(step_s), frontend_ceiling.StandInServices()
        info = {"max_model_len": 32768, "kv_blocks_total": 1, "engine_config": {}, "decode_path": {},
                "versions": {}, "device": {"type": "stand-in"}, "engine_pid": os.getpid()}
    else:
        from infertrace.engine.config import EngineConfig
        from infertrace.engine.engine import Engine
        from infertrace.server.engine_link.services import EngineServices

        engine = Engine(model_dir, EngineConfig(prefill_cuda_graphs=mode == "graphs"))
        services = EngineServices(engine, None, {})
        info = services.info()
    _stamp_engine(engine, EngineLoop, log_path)
    _tell_all(socks, FromEngine("ready", value=info))
    EngineLoop(engine, services, socks).run()


def _stamp_frontend(stamps: dict[str, dict[str, int]]) -> None:
    """Front-end stamps (this process), keyed by the request id the handler draws."""
    from infertrace.server.engine_link import client as engine_client
    from infertrace.server.frontend import app, state

    current: dict[str, dict[str, int]] = {}  # the request whose handler runs now (set before its first await)
    json_body, prompt_ids, generate, send, chunk = (app._json_body, state.ServerState.prompt_ids,
                                                    engine_client.ProcessEngine.generate,
                                                    engine_client.ProcessEngine._send, app._chunk)

    async def _json_body(request, **kwargs):
        body = await json_body(request, **kwargs)
        current["s"] = {"body": time.time_ns()}
        return body

    async def _prompt_ids(self, req):
        s = current["s"]
        ids = await prompt_ids(self, req)
        s["tokenized"] = time.time_ns()
        current["s"] = s  # other handlers ran while it was on a thread
        return ids

    async def _generate(self, request_id, prompt, params):
        s = stamps[request_id] = current["s"]
        first = True
        async for item in generate(self, request_id, prompt, params):
            if first:
                s["frontend_has"], first = time.time_ns(), False
            yield item

    def _send(self, message):
        send(self, message)
        if message.kind == "add":
            stamps[message.request_id]["sent"] = time.time_ns()

    def _chunk(builder, out):
        data = chunk(builder, out)
        s = stamps.get(builder.request_id)
        if s is not None and "chunk_built" not in s:
            s["chunk_built"] = time.time_ns()
        return data

    app._json_body, app._chunk = _json_body, _chunk
    state.ServerState.prompt_ids = _prompt_ids
    engine_client.ProcessEngine.generate, engine_client.ProcessEngine._send = _generate, _send


async def _serve_and_load(args, sock) -> dict:
    from aiohttp import web

    from infertrace.server.engine_link.client import ProcessEngine
    from infertrace.server.frontend.app import build_app
    from infertrace.server.frontend.tokenizer import FrontendTokenizer
    from infertrace.server.settings import ServerSettings

    settings = ServerSettings(model_dir=str(args.model), served_model_name="request-path", port=args.port,
                              max_queue=100000)
    engine = ProcessEngine(sock)
    await engine.connect()
    runner = web.AppRunner(build_app(engine, FrontendTokenizer(args.model), settings, {"index": 0, "count": 1}),
                           access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "infertrace", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
               "--tokenizer", str(args.model), "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts), "--request-rate",
               str(args.rate), "--warmup", str(args.warmup), "--scrape-interval", "0", "--result-json", str(out)]
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        await runner.cleanup()
        if proc.returncode != 0:
            raise SystemExit(f"bench failed: {err.decode()[-2000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="model directory (its tokenizer; its weights with --engine real)")
    parser.add_argument("--engine", choices=("stand-in", "real"), default="stand-in")
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs", help="--engine real: token graphs")
    parser.add_argument("--step-ms", type=float, default=1.5, help="the stand-in's step time")
    parser.add_argument("--rate", type=float, default=60.0)
    parser.add_argument("--num-prompts", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--inline-chars", type=int, help="tokenize prompts of at most this many characters on the "
                                                         "event loop (default: the server's INLINE_TOKENIZE_CHARS)")
    parser.add_argument("--port", type=int, default=8331)
    args = parser.parse_args()

    from infertrace.server.frontend import state

    if args.inline_chars is not None:
        state.INLINE_TOKENIZE_CHARS = args.inline_chars
    frontend: dict[str, dict[str, int]] = {}
    _stamp_frontend(frontend)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = str(Path(tmp) / "engine.jsonl")
        ours, theirs = socket.socketpair()
        model_dir = str(args.model) if args.engine == "real" else None
        proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(model_dir, args.step_ms / 1000, args.mode, log_path, [theirs]), daemon=True)
        proc.start()
        theirs.close()
        result = asyncio.run(_serve_and_load(args, ours))
        proc.kill()
        engine_side = {d.pop("id"): d for d in map(json.loads, Path(log_path).read_text().splitlines())}
    rows = [{**s, **engine_side[rid]} for rid, s in frontend.items()
            if rid in engine_side and all(k in {**s, **engine_side[rid]} for k in STAGES)]
    if not rows:
        raise SystemExit("no request was stamped at every stage")
    label = f"{args.engine}" + (f" ({args.mode})" if args.engine == "real" else f" ({args.step_ms} ms steps)")
    print(f"{label}, inline tokenizing up to {state.INLINE_TOKENIZE_CHARS} chars: {len(rows)} requests, "
          f"client TTFT p50 {result['median_ttft_ms']:.3f} ms (mean {result['mean_ttft_ms']:.3f})")
    print("stage, ms: median (mean)")
    for start, end in zip(STAGES, STAGES[1:]):
        values = [(r[end] - r[start]) / 1e6 for r in rows]
        print(f"  {start:>12} -> {end:<12} {statistics.median(values):7.3f} ({statistics.mean(values):.3f})")
    total = [(r["chunk_built"] - r["body"]) / 1e6 for r in rows]
    print(f"  front end, body to first chunk: {statistics.median(total):.3f} ({statistics.mean(total):.3f}); "
          f"the client's TTFT beyond it: {result['median_ttft_ms'] - statistics.median(total):.3f} "
          f"({result['mean_ttft_ms'] - statistics.mean(total):.3f})")


if __name__ == "__main__":
    main()
