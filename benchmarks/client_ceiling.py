"""How many streamed events per second a load generator can take in on one CPU core.

A local aiohttp server streams every response instantly (pre-built SSE events, one token each, written in
batches) on its own core; the client under test runs pinned to another core in a closed loop. The server
measures every client the same way, whatever the client reports itself: in a closed loop a request arrives only
after the client has read a whole response, so past the first `concurrency` arrivals the arrival rate is the
client's completion rate, and events/s = (arrivals counted) x tokens per response / their time span. (The end
of the server's writes would overstate it: loopback socket buffers hold megabytes the client has not read.)

    python benchmarks/client_ceiling.py                       # infertrace bench, and guidellm if on PATH
    python benchmarks/client_ceiling.py --guidellm /path/to/guidellm --repeats 3
    python benchmarks/client_ceiling.py --workers 1,4,8,15 --server-procs 0   # scale-out, on a many-core machine

With --workers W1,W2,..., infertrace also runs with `--workers W` (W load processes, the requests scaled by W),
pinned to W cores of their own; the server then runs as --server-procs processes on one port (SO_REUSEPORT, 0:
one per remaining core) so that it does not become the limit, and the figure is the client's own count (its
output tokens over its duration: requests/s and CPU microseconds per event come from the same result).

guidellm is not a dependency of infertrace: install it apart (`pip install guidellm`, e.g. in a venv) and pass
its executable with --guidellm. It needs a tokenizer directory for its synthetic prompts (--tokenizer; by
default the built-in tiny model is made under $INFERTRACE_CACHE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class InstantServer:
    """Streams `max_tokens` one-token events per request with no delay; counts what it sent."""

    def __init__(self, events_per_write: int) -> None:
        self.events_per_write = events_per_write
        self._bodies: dict[tuple[bool, int], list[bytes]] = {}
        self.reset()

    def reset(self) -> None:
        self.events = 0
        self.arrivals: list[float] = []

    def _writes(self, chat: bool, n: int) -> list[bytes]:
        key = (chat, n)
        if key not in self._bodies:
            obj = "chat.completion.chunk" if chat else "text_completion"
            events = []
            for k in range(n):
                piece = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
                events.append(_sse({"id": "x", "object": obj, "created": 0, "model": "ceiling",
                                    "choices": [{**piece, "finish_reason": "length" if k == n - 1 else None}],
                                    "usage": None}))
            events.append(_sse({"id": "x", "object": obj, "created": 0, "model": "ceiling", "choices": [],
                                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}}))
            events.append(b"data: [DONE]\n\n")
            step = self.events_per_write
            self._bodies[key] = [b"".join(events[i:i + step]) for i in range(0, len(events), step)]
        return self._bodies[key]

    async def generate(self, request):
        from aiohttp import web

        self.arrivals.append(time.perf_counter())
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 1024)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in self._writes("messages" in body, n):
            await resp.write(chunk)
        await resp.write_eof()
        self.events += n
        return resp

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "ceiling", "object": "model"}]})

    async def health(self, request):
        from aiohttp import web

        return web.Response(text="ok")

    async def stats(self, request):
        from aiohttp import web

        skip = int(request.query.get("concurrency", 0))
        counted = self.arrivals[skip:]
        span = counted[-1] - counted[0] if len(counted) > 1 else None
        tokens = self.events / len(self.arrivals) if self.arrivals else 0
        out = {"events": self.events, "requests": len(self.arrivals), "span_s": span,
               "events_per_s": (len(counted) - 1) * tokens / span if span else None}
        if request.method == "POST":
            self.reset()
        return web.json_response(out)


def serve(port: int, events_per_write: int, reuse_port: bool = False) -> None:
    from aiohttp import web

    server = InstantServer(events_per_write)
    app = web.Application()
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, server.generate)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_route("*", "/stats", server.stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, reuse_port=reuse_port)


def _stats(url: str, reset: bool, concurrency: int = 0) -> dict:
    import urllib.request

    req = urllib.request.Request(f"{url}/stats?concurrency={concurrency}", method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_ready(url: str) -> None:
    """Until the server answers its /stats (10 s at most)."""
    for _ in range(100):
        try:
            _stats(url, reset=True)
            return
        except OSError:
            time.sleep(0.1)


def _pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def run_infertrace(url: str, core: int, args, workdir: Path) -> dict:
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a short prompt", "max_tokens": args.tokens}) + "\n")
    result = workdir / "infertrace.json"
    cmd = _pinned(core) + [sys.executable, "-m", "infertrace", "bench", "--base-url", url, "--dataset", "jsonl",
                           "--dataset-path", str(prompts), "--num-prompts", str(args.requests),
                           "--concurrency", str(args.concurrency), "--warmup", "0", "--result-json", str(result)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = json.loads(result.read_text())
    return {"self_reported_events_per_s": doc["total_output_tokens"] / doc["duration"],
            "client_cpu_percent": doc["client_cpu_percent"], "command": " ".join(cmd)}


def run_workers(url: str, workers: int, first_core: int, args, workdir: Path) -> dict:
    """infertrace bench with `workers` load processes pinned to cores first_core.. (the client's own count)."""
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a short prompt", "max_tokens": args.tokens}) + "\n")
    result = workdir / f"workers{workers}.json"
    cores = f"{first_core}-{first_core + workers - 1}"
    pin = ["taskset", "-c", cores] if shutil.which("taskset") else []
    cmd = pin + [sys.executable, "-m", "infertrace", "bench", "--base-url", url, "--dataset", "jsonl",
                 "--dataset-path", str(prompts),
                 "--num-prompts", str(args.requests * workers), "--concurrency", str(args.concurrency * workers),
                 "--warmup", "0", "--workers", str(workers), "--scrape-interval", "0", "--result-json", str(result)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = json.loads(result.read_text())
    events, duration = doc["total_output_tokens"], doc["duration"]
    cpu_s = (doc["process_cpu_percent"] or 0) / 100 * duration
    return {"workers": workers, "events_per_s": events / duration, "requests_per_s": doc["completed"] / duration,
            "cpu_us_per_event": 1e6 * cpu_s / events if events else None, "command": " ".join(cmd)}


def run_guidellm(url: str, core: int, args, workdir: Path) -> dict:
    out = workdir / "guidellm.json"
    cmd = _pinned(core) + [
        args.guidellm, "run", "--backend", f"kind=openai_http,target={url}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens=8,output_tokens={args.tokens}",
        "--tokenizer", f"kind=hf_auto,model={args.tokenizer}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}", "--disable-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench = json.loads(out.read_text())["benchmarks"][0]
    tokens = bench["metrics"]["text"]["tokens"]["output"]["successful"]["total_sum"]
    return {"self_reported_events_per_s": tokens / bench["duration"], "command": " ".join(cmd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="streamed tokens (events) per response")
    parser.add_argument("--requests", type=int, default=512, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per client; the median is reported")
    parser.add_argument("--events-per-write", type=int, default=16, help="SSE events per server write")
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--guidellm", default=shutil.which("guidellm"), help="guidellm executable (optional)")
    parser.add_argument("--tokenizer", help="tokenizer directory for guidellm's synthetic prompts")
    parser.add_argument("--workers", help="also run infertrace with these --workers counts, e.g. 1,4,8,15")
    parser.add_argument("--server-procs", type=int, default=0,
                        help="with --workers: server processes on one port (0: one per core the workers leave)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.events_per_write, args.reuse_port)
        return
    if args.workers:
        scale_out(args)
        return

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(_pinned(args.server_core) + [sys.executable, __file__, "--serve", "--port",
                                                             str(args.port), "--events-per-write",
                                                             str(args.events_per_write)])
    try:
        _wait_ready(url)
        clients = {"infertrace": run_infertrace}
        if args.guidellm:
            if args.tokenizer is None:
                from infertrace.load.embedded_target import default_model_dir

                args.tokenizer = str(default_model_dir())
            clients["guidellm"] = run_guidellm
        report = {"setup": {k: v for k, v in vars(args).items() if k != "serve"},
                  "load_average_before": os.getloadavg(), "clients": {name: {"runs": []} for name in clients}}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):  # interleaved, so that a change in machine load hits every client
                for name, run in clients.items():
                    _stats(url, reset=True)
                    own = run(url, args.client_core, args, Path(tmp))
                    seen = _stats(url, reset=True, concurrency=args.concurrency)
                    report["clients"][name]["runs"].append(
                        {**own, "server_events_per_s": seen["events_per_s"], "events": seen["events"]})
        report["load_average_after"] = os.getloadavg()
        for name, entry in report["clients"].items():
            entry["server_events_per_s_median"] = statistics.median(r["server_events_per_s"] for r in entry["runs"])
            print(f"{name:>10}: {entry['server_events_per_s_median']:,.0f} events/s "
                  f"(server-side, median of {args.repeats})", flush=True)
        if "guidellm" in report["clients"]:
            ours = report["clients"]["infertrace"]["server_events_per_s_median"]
            theirs = report["clients"]["guidellm"]["server_events_per_s_median"]
            report["ratio"] = ours / theirs
            print(f"     ratio: {report['ratio']:.2f}x")
        print(json.dumps(report, indent=2))
    finally:
        server.terminate()
        server.wait(10)


def scale_out(args) -> None:
    """infertrace with each --workers count against a many-process instant server; one table."""
    counts = [int(w) for w in args.workers.split(",")]
    cores = os.cpu_count() or 2
    url = f"http://127.0.0.1:{args.port}"
    procs = args.server_procs or max(1, cores - max(counts))
    servers = [subprocess.Popen([sys.executable, __file__, "--serve", "--reuse-port", "--port", str(args.port),
                                 "--events-per-write", str(args.events_per_write)]) for _ in range(procs)]
    rows = []
    try:
        _wait_ready(url)
        with tempfile.TemporaryDirectory() as tmp:
            for w in counts:
                runs = [run_workers(url, w, 0, args, Path(tmp)) for _ in range(args.repeats)]
                best = sorted(runs, key=lambda r: r["events_per_s"])[len(runs) // 2]  # the median run
                rows.append(best)
        base = rows[0]["events_per_s"]
        print(f"{'workers':>8} {'events/s':>12} {'requests/s':>11} {'CPU us/event':>13} {'x first':>8}")
        for r in rows:
            print(f"{r['workers']:>8} {r['events_per_s']:>12,.0f} {r['requests_per_s']:>11,.1f} "
                  f"{r['cpu_us_per_event'] or 0:>13.3f} {r['events_per_s'] / base:>8.2f}")
        print(json.dumps({"cores": cores, "server_procs": procs, "setup": vars(args), "rows": rows}, indent=2))
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
