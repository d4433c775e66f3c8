"""How many streamed events per second a load generator takes in: infertrace (one and N load processes) beside
vLLM's `vllm bench serve`, guidellm and AIPerf, in one run against the same instant server.

The server (aiohttp, SO_REUSEPORT over one process per physical core it is given) streams every response at once
from pre-built SSE events, one token each, written in batches. Every client is measured the same way, whatever
it reports itself: in a closed loop a request arrives only after the client has read a whole response, so past
the first `concurrency` arrivals the arrival rate is the client's completion rate, and

    events/s    = (arrivals counted - 1) x tokens per response / (last arrival - first counted arrival)
    requests/s  = (arrivals counted - 1) / the same span
    CPU us/event = CPU seconds of the client's whole process tree over that span / the events in it

(the end of the server's writes would overstate it: loopback socket buffers hold megabytes the client has not
read). The client's CPU comes from /proc, sampled every few milliseconds, so start-up and tear-down are not charged.
With --pace-ms the server pauses between a response's writes, as a real server does between tokens; the rate is
then the server's, the window's events are those the server wrote inside it (requests: those over the tokens of
a response), and CPU us/event is the figure to compare.

    python benchmarks/client_ceiling.py                         # infertrace on one core
    python benchmarks/client_ceiling.py --repeats 3 --vllm /tmp/venvs/vllm/bin/vllm \
        --guidellm /tmp/venvs/guidellm/bin/guidellm --aiperf /tmp/venvs/aiperf/bin/aiperf
    python benchmarks/client_ceiling.py --workers 1,2,4,8 --repeats 3   # scale-out, on a many-core machine
    python benchmarks/client_ceiling.py --events-per-write 1 --pace-ms 8 --concurrency 256 --tokens 128 \
        --requests 1024 --vllm /tmp/venvs/vllm/bin/vllm      # a real server's shape: one token a write, 8 ms apart

With --otlp the server also exports an `llm_request` span per request, as vLLM does (the attributes of vLLM 0.33's
vllm/tracing/utils.py, a batch every second over HTTP/protobuf, under the request's traceparent), and a row
`infertrace --otlp` runs bench with --otlp-receiver on that port and --otlp-traces-endpoint at the same receiver:
its CPU us/event beside the plain row's is what receiving the spans and exporting bench's own cost per event.

Placement reads the CPU topology (/sys/devices/system/cpu/cpu*/topology/thread_siblings_list): every client runs
on whole physical cores of its own, one logical CPU of each (a hyperthread sibling is left idle), and the server
takes the physical cores that the largest --workers count leaves. With --workers W, infertrace also runs
`--workers W` on W physical cores for --duration seconds (every worker stops at the same moment, so a faster one
does not leave a tail of fewer workers), with the concurrency scaled by W. A row that cannot have cores of its own
(too few cores for it and the server) is still run and marked as sharing cores: not a scaling figure.

Peers are not dependencies of infertrace: install each in its own venv and pass its executable (`pip install
guidellm`, `pip install aiperf`; for vLLM on a CPU machine `pip install --no-deps vllm==0.33.0`, CPU torch 2.13.0,
and what `vllm bench serve` imports: packaging regex pyyaml "huggingface_hub>=1.31.0" "pydantic>=2.12.0" numpy
cbor2 psutil pyzmq urllib3 "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" requests openai_harmony
"openai>=2.25.0" msgspec cloudpickle pillow pybase64 cachetools uvloop py-cpuinfo "fastapi>=0.133.0,<0.137.0"
prometheus_client partial_json_parser uvicorn xgrammar llguidance watchfiles orjson einops). They need a
tokenizer directory for their synthetic prompts (--tokenizer; by default the built-in tiny model, made under
$INFERTRACE_CACHE on first use).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_S = 0.01  # the CPU sampler's period (the kernel counts CPU time in ticks of 10 ms)
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVER_BUSY_WARN = 0.9  # past this share of its processes' time the server, not the client, may set the pace


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ----- the instant server -----
class InstantServer:
    """Streams `max_tokens` one-token events per request with no delay; keeps every arrival time."""

    def __init__(self, events_per_write: int, pace_s: float = 0.0, otlp_port: int | None = None) -> None:
        self.events_per_write = events_per_write
        self.pace_s = pace_s  # between one write of a response and the next: a real server's pace, not instant
        self._bodies: dict[tuple[bool, int], list[tuple[bytes, int]]] = {}
        self.otlp_port = otlp_port  # where each request's llm_request span goes (--otlp), else None
        self.finished: list[tuple[str, str | None, int, int]] = []  # (request id, traceparent, start, end ns)
        self.reset()

    def reset(self) -> None:
        self.events = 0
        self.arrivals: list[float] = []
        self.written: list[tuple[float, int]] = []  # paced: (time, token events) of every write

    def _writes(self, chat: bool, n: int) -> list[tuple[bytes, int]]:
        """A response's writes, each with the token events it holds."""
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
            self._bodies[key] = [(b"".join(events[i:i + step]), max(0, min(n, i + step) - i))
                                 for i in range(0, len(events), step)]
        return self._bodies[key]

    async def generate(self, request):
        import asyncio

        from aiohttp import web

        self.arrivals.append(time.perf_counter())  # CLOCK_MONOTONIC: the same clock in every process
        started_ns = time.time_ns()
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 1024)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk, tokens in self._writes("messages" in body, n):
            await resp.write(chunk)
            if self.pace_s:
                self.written.append((time.perf_counter(), tokens))
                await asyncio.sleep(self.pace_s)
        await resp.write_eof()
        self.events += n
        if self.otlp_port is not None:
            self.finished.append((request.headers.get("X-Request-Id", ""), request.headers.get("traceparent"),
                                  started_ns, time.time_ns()))
        return resp

    async def export_spans(self) -> None:
        """Every second, the finished requests' spans to the OTLP receiver, as vLLM's BatchSpanProcessor sends
        them; a receiver that is not there costs the batch."""
        import asyncio

        import aiohttp
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

        def attr(key, **value):
            return KeyValue(key=key, value=AnyValue(**value))

        url = f"http://127.0.0.1:{self.otlp_port}/v1/traces"
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(1.0)
                done, self.finished = self.finished, []
                if not done:
                    continue
                spans = []
                for rid, traceparent, start, end in done:
                    _, trace_id, parent, _ = (traceparent or f"00-{'0' * 31}1-{'0' * 16}-01").split("-")
                    latency = (end - start) / 1e9
                    spans.append(Span(
                        trace_id=bytes.fromhex(trace_id), span_id=os.urandom(8), parent_span_id=bytes.fromhex(parent),
                        name="llm_request", kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=start,
                        end_time_unix_nano=end, attributes=[
                            attr("gen_ai.request.id", string_value=f"cmpl-{rid}-0"),
                            attr("gen_ai.response.model", string_value="ceiling"),
                            attr("gen_ai.request.max_tokens", int_value=1024),
                            attr("gen_ai.usage.prompt_tokens", int_value=8),
                            attr("gen_ai.usage.completion_tokens", int_value=1024),
                            attr("gen_ai.latency.time_in_queue", double_value=0.0),
                            attr("gen_ai.latency.time_to_first_token", double_value=0.0),
                            attr("gen_ai.latency.time_in_model_prefill", double_value=0.0),
                            attr("gen_ai.latency.time_in_model_decode", double_value=latency),
                            attr("gen_ai.latency.time_in_model_inference", double_value=latency),
                            attr("gen_ai.latency.e2e", double_value=latency)]))
                body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[
                    ScopeSpans(spans=spans)])]).SerializeToString()
                try:
                    async with session.post(url, data=body, headers={"Content-Type": "application/x-protobuf"}):
                        pass
                except (aiohttp.ClientError, OSError):
                    pass

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "ceiling", "object": "model"}]})

    async def health(self, request):
        from aiohttp import web

        return web.Response(text="ok")

    async def stats(self, request):
        """Arrival times and events since the last reset (POST resets)."""
        from aiohttp import web

        out = {"events": self.events, "arrivals": self.arrivals, "written": self.written}
        if request.method == "POST":
            self.reset()
        return web.json_response(out)


def serve(port: int, control_port: int, events_per_write: int, pace_s: float = 0.0,
          otlp_port: int | None = None) -> None:
    """One server process: the shared port (SO_REUSEPORT) for clients, a port of its own for /stats."""
    import asyncio

    from aiohttp import web

    server = InstantServer(events_per_write, pace_s, otlp_port)
    app = web.Application()
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, server.generate)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_route("*", "/stats", server.stats)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_port=True).start()
        await web.TCPSite(runner, "127.0.0.1", control_port).start()
        if otlp_port is not None:
            await server.export_spans()
        await asyncio.Event().wait()

    asyncio.run(main())


def _stats(control_url: str, reset: bool) -> dict:
    import urllib.request

    req = urllib.request.Request(f"{control_url}/stats", method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _wait_ready(control_urls: list[str]) -> None:
    """Until every server process answers its /stats (20 s at most)."""
    deadline = time.monotonic() + 20
    for url in control_urls:
        while True:
            try:
                _stats(url, reset=True)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the instant server at {url} did not start") from None
                time.sleep(0.1)


def server_window(control_urls: list[str], skip: int) -> dict:
    """Every server process's arrivals merged; the counted window past the first `skip` (and reset).

    A paced server's closed loop arrives in waves (every response takes as long as every other), so there the
    window holds the token events the server wrote between its ends instead (with the client keeping up, a
    paced write is read as it goes out), and requests are those events over the tokens of a response."""
    arrivals, events, written = [], 0, []
    for url in control_urls:
        seen = _stats(url, reset=True)
        arrivals += seen["arrivals"]
        events += seen["events"]
        written += seen["written"]
    arrivals.sort()
    counted = arrivals[skip:]
    if len(counted) < 2:
        return {"requests": len(arrivals), "events": events, "span_s": None}
    tokens = events / len(arrivals)
    span = counted[-1] - counted[0]
    window = {"requests": len(arrivals), "events": events, "start": counted[0], "end": counted[-1], "span_s": span,
              "window_events": (len(counted) - 1) * tokens, "window_requests": len(counted) - 1}
    if written:
        window["window_events"] = sum(n for t, n in written if counted[0] <= t <= counted[-1])
        window["window_requests"] = window["window_events"] / tokens
    return window


# ----- CPU of a process tree, from /proc -----
HAS_CHILDREN_FILES = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()  # CONFIG_PROC_CHILDREN


def _tree_pids(root: int) -> list[int]:
    parents = None if HAS_CHILDREN_FILES else _children_by_parent()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        if parents is None:
            todo += [int(c) for f in glob.glob(f"/proc/{pid}/task/*/children") for c in _read(f).split()]
        else:
            todo += parents.get(pid, [])
    return pids


def _children_by_parent() -> dict[int, list[int]]:
    """Without /proc/PID/task/TID/children: every process's parent, from its stat line."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        if fields := _read(stat).rsplit(")", 1)[-1].split():
            parents.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    return parents


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:  # the process ended meanwhile
        return ""


def _tree_cpu_s(root: int) -> tuple[float, float]:
    """CPU seconds of the tree (utime + stime of every live process, plus what its reaped children had: cutime,
    cstime) and of the root process alone (utime + stime)."""
    total = own = 0
    for pid in _tree_pids(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:15])
        if pid == root:
            own = int(fields[11]) + int(fields[12])
    return total / CLK_TCK, own / CLK_TCK


class CpuSampler:
    """(monotonic time, tree CPU seconds, root CPU seconds) every SAMPLE_S in a thread, while the client runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), *_tree_cpu_s(self.pid)))
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float, column: int = 1) -> float | None:
        """The tree's CPU seconds at `t` (column 2: the root's), between the samples either side."""
        for a, b in zip(self.samples, self.samples[1:]):
            if a[0] <= t <= b[0]:
                return a[column] + (b[column] - a[column]) * (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else a[column]
        return None

    def over(self, start: float, end: float, column: int = 1) -> float | None:
        """CPU seconds from `start` to `end`."""
        a, b = self.at(start, column), self.at(end, column)
        return None if a is None or b is None else b - a


# ----- placement -----
def physical_cores() -> list[list[int]]:
    """Logical CPUs grouped by physical core (hyperthread siblings together), in CPU order; only the CPUs this
    process may use."""
    allowed = os.sched_getaffinity(0)
    cores: dict[tuple[int, ...], None] = {}
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list"),
                       key=lambda p: int(p.split("/cpu")[-1].split("/")[0])):
        siblings = tuple(c for c in _cpu_list(Path(path).read_text()) if c in allowed)
        if siblings:
            cores[siblings] = None
    return [list(c) for c in cores] or [[c] for c in sorted(allowed)]


def _cpu_list(text: str) -> list[int]:
    out = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def placement(cores: list[list[int]], worker_counts: list[int], server_procs: int) -> dict:
    """Clients from the first physical core on; the server on the cores that the largest client still leaving one
    free leaves (a larger client then shares the server's cores, and is marked so)."""
    fits = [w for w in [1, *worker_counts] if w < len(cores)]
    server_cores = cores[max(fits, default=len(cores) - 1):] or cores[-1:]
    if server_procs:
        server_cores = server_cores[:server_procs]
    return {"client_cpus": [c[0] for c in cores], "server_cores": server_cores,
            "server_cpus": sorted(c for core in server_cores for c in core)}


def _pin(cpus: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus))] if shutil.which("taskset") else []


# ----- the clients: each returns its command -----
def infertrace_cmd(url: str, args, workdir: Path, workers: int | None = None) -> list[str]:
    """`infertrace bench` over --requests requests, or with `workers` load processes for --duration seconds."""
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a short prompt", "max_tokens": args.tokens}) + "\n")
    cmd = [sys.executable, "-m", "infertrace", "bench", "--base-url", url, "--dataset", "jsonl",
           "--dataset-path", str(prompts), "--concurrency", str(args.concurrency * (workers or 1)), "--warmup", "0",
           "--ignore-eos", "--scrape-interval", "0", "--result-json", str(workdir / "infertrace.json")]
    if args.otlp_on:  # the spans the server sends, received; bench's own, sent to the same receiver
        receiver = f"http://127.0.0.1:{args.otlp_port}"
        cmd += ["--otlp-receiver", receiver, "--otlp-traces-endpoint", f"{receiver}/v1/traces"]
    if workers is None:
        return cmd + ["--num-prompts", str(args.requests)]
    return cmd + ["--workers", str(workers), "--duration", str(args.duration),
                  "--num-prompts", str(args.concurrency * workers)]


def vllm_cmd(url: str, args, workdir: Path) -> list[str]:
    return [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "ceiling", "--tokenizer", args.tokenizer, "--dataset-name", "random",
            "--random-input-len", "8", "--random-output-len", str(args.tokens), "--random-range-ratio", "0",
            "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency), "--ignore-eos",
            "--disable-tqdm"]


def guidellm_cmd(url: str, args, workdir: Path) -> list[str]:
    return [args.guidellm, "run", "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=concurrent,streams={args.concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens=8,output_tokens={args.tokens}",
            "--tokenizer", f"kind=hf_auto,model={args.tokenizer}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--output", f"kind=json,path={workdir / 'guidellm.json'}", "--disable-progress"]


def aiperf_cmd(url: str, args, workdir: Path) -> list[str]:
    return [args.aiperf, "profile", "--model", "ceiling", "--url", url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", args.tokenizer, "--concurrency", str(args.concurrency),
            "--request-count", str(args.requests), "--prompt-input-tokens-mean", "8",
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.tokens),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--ui", "none", "--output-artifact-dir", str(workdir / "aiperf")]


def measure(name: str, cmd: list[str], cpus: list[int], concurrency: int, control_urls: list[str],
            servers: list[subprocess.Popen], workdir: Path) -> dict:
    """Run one client pinned to `cpus`; the server's window, and the client's and the server's CPU over it."""
    for url in control_urls:
        _stats(url, reset=True)
    log = workdir / f"{name.replace(' ', '_')}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_pin(cpus) + cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        sampler = CpuSampler(proc.pid)
        server_samplers = [CpuSampler(server.pid) for server in servers]
        code = proc.wait()
        for each in (sampler, *server_samplers):
            each.stop()
    seen = server_window(control_urls, skip=concurrency)
    row = {"client": name, "cpus": cpus, "exit_code": code, "command": " ".join(_pin(cpus) + cmd), **seen}
    if code != 0 or not seen["span_s"]:
        row["error"] = log.read_text(errors="replace")[-2000:]
        return row
    span, start, end = seen["span_s"], seen["start"], seen["end"]
    cpu, root_cpu = sampler.over(start, end), sampler.over(start, end, column=2)
    server_cpu = [s.over(start, end) for s in server_samplers]
    row.update(events_per_s=seen["window_events"] / span, requests_per_s=seen["window_requests"] / span,
               cpu_us_per_event=None if cpu is None else 1e6 * cpu / seen["window_events"],
               cpu_cores=None if cpu is None else cpu / span,
               root_process_cpu_cores=None if root_cpu is None else root_cpu / span)
    if None not in server_cpu:  # the share of the server processes' time they were busy
        row["server_busy"] = sum(server_cpu) / span / len(servers)
    if (own := workdir / "infertrace.json").exists() and name.startswith("infertrace"):
        doc = json.loads(own.read_text())  # the client's own figures, beside the server's count
        row.update(own_events_per_s=doc["total_output_tokens"] / doc["duration"],
                   own_process_cpu_percent=doc.get("process_cpu_percent"),
                   worker_start_skew_max_ms=doc.get("worker_start_skew_max_ms"))
        own.unlink()
    return row


# ----- one run -----
def clients(args, place: dict) -> list[tuple[str, object, list[int], int]]:
    """(name, command maker, CPUs, requests in flight) of every client of this run, in the order they run."""
    one = place["client_cpus"][:1]
    out = [("infertrace", infertrace_cmd, one, args.concurrency)]
    if args.otlp:
        def with_otlp(url, a, d):
            return infertrace_cmd(url, argparse.Namespace(**{**vars(a), "otlp_on": True}), d)

        out.append(("infertrace --otlp", with_otlp, one, args.concurrency))
    for flag in ("vllm", "guidellm", "aiperf"):
        if getattr(args, flag):
            out.append((flag, globals()[f"{flag}_cmd"], one, args.concurrency))
    for w in args.worker_counts:
        out.append((f"infertrace --workers {w}", lambda url, a, d, w=w: infertrace_cmd(url, a, d, w),
                    place["client_cpus"][:w], args.concurrency * w))
    return out


def median_row(runs: list[dict]) -> dict:
    good = [r for r in runs if "events_per_s" in r]
    if not good:
        return runs[-1]
    return sorted(good, key=lambda r: r["events_per_s"])[(len(good) - 1) // 2]


def render(rows: list[dict], shared: set[str]) -> str:
    base = next((r["events_per_s"] for r in rows if r["client"] == "infertrace" and "events_per_s" in r), None)
    one = next((r["events_per_s"] for r in rows if r["client"] == "infertrace --workers 1" and "events_per_s" in r),
               base)
    lines = [f"{'client':<26} {'cores':>5} {'events/s':>11} {'requests/s':>11} {'CPU us/event':>13} "
             + f"{'x infertrace':>13} {'per worker':>11} {'server busy':>12}"]
    for r in rows:
        if "events_per_s" not in r:
            lines.append(f"{r['client']:<26} {len(r['cpus']):>5}  failed (exit {r['exit_code']}); see the JSON")
            continue
        workers = int(r["client"].rsplit(" ", 1)[1]) if "--workers" in r["client"] else None
        per = f"{r['events_per_s'] / one / workers:>11.2f}" if workers and one else f"{'':>11}"
        cpu = f"{r['cpu_us_per_event']:>13.2f}" if r["cpu_us_per_event"] is not None else f"{'-':>13}"
        ratio = f"{r['events_per_s'] / base:>13.2f}" if base else f"{'-':>13}"
        busy = f"{100 * r['server_busy']:>11.0f}%" if r.get("server_busy") is not None else f"{'-':>12}"
        note = "  (shares cores with the server)" if r["client"] in shared else ""
        if r.get("server_busy", 0) > SERVER_BUSY_WARN:
            note += "  (the server may be the limit)"
        lines.append(f"{r['client']:<26} {len(r['cpus']):>5} {r['events_per_s']:>11,.0f} "
                     f"{r['requests_per_s']:>11,.1f} {cpu} {ratio} {per} {busy}{note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="streamed tokens (events) per response")
    parser.add_argument("--requests", type=int, default=512, help="requests per measurement of a one-core client")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per client core")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved measurements per client; the median")
    parser.add_argument("--events-per-write", type=int, default=16, help="SSE events per server write")
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="pause between a response's writes (0: instant); with --events-per-write 1, a real "
                             "server's shape: each token its own write, so the rate is set and CPU us/event is "
                             "the figure to read")
    parser.add_argument("--port", type=int, default=18765, help="the server's port (its processes' own follow)")
    parser.add_argument("--vllm", help="`vllm` executable (runs `vllm bench serve`)")
    parser.add_argument("--guidellm", help="guidellm executable")
    parser.add_argument("--aiperf", help="aiperf executable")
    parser.add_argument("--tokenizer", help="tokenizer directory for the peers' synthetic prompts")
    parser.add_argument("--workers", help="also run infertrace with these --workers counts, e.g. 1,2,4,8")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of each --workers run")
    parser.add_argument("--server-procs", type=int, default=0,
                        help="server processes (0: one per physical core the clients leave)")
    parser.add_argument("--otlp", action="store_true", help="the server exports a span per request, and a row "
                        "`infertrace --otlp` receives them (--otlp-receiver) and exports its own")
    parser.add_argument("--otlp-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write every run to this file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.otlp_on = False
    if args.serve:
        serve(args.port, args.control_port, args.events_per_write, args.pace_ms / 1000, args.otlp_port or None)
        return
    if args.otlp:
        os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # bench's own spans, to the receiver
        args.otlp_port = args.otlp_port or args.port + 1000
    args.worker_counts = [int(w) for w in args.workers.split(",")] if args.workers else []
    if (args.vllm or args.guidellm or args.aiperf) and args.tokenizer is None:
        from infertrace.load.client.embedded_target import default_model_dir

        args.tokenizer = str(default_model_dir())

    cores = physical_cores()
    place = placement(cores, args.worker_counts, args.server_procs)
    runs = clients(args, place)
    shared = {name for name, _, cpus, _ in runs if set(cpus) & set(place["server_cpus"])}
    print(f"topology: {len(cores)} physical cores {cores}; clients on {place['client_cpus']} (one CPU per core), "
          f"server: {len(place['server_cores'])} processes on {place['server_cores']}", file=sys.stderr)
    if not shutil.which("taskset"):
        print("warning: no taskset here: nothing is pinned, so the placement above is not kept", file=sys.stderr)
    for name in sorted(shared):
        print(f"warning: {name} shares cores with the server (too few cores): not a scaling figure", file=sys.stderr)

    url = f"http://127.0.0.1:{args.port}"
    control_urls = [f"http://127.0.0.1:{args.port + 1 + k}" for k in range(len(place["server_cores"]))]
    servers = [subprocess.Popen(_pin(core) + [sys.executable, __file__, "--serve", "--port", str(args.port),
                                              "--control-port", str(args.port + 1 + k),
                                              "--events-per-write", str(args.events_per_write),
                                              "--pace-ms", str(args.pace_ms),
                                              *(["--otlp-port", str(args.otlp_port)] if args.otlp else [])])
               for k, core in enumerate(place["server_cores"])]
    results: dict[str, list[dict]] = {name: [] for name, *_ in runs}
    try:
        _wait_ready(control_urls)
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):  # interleaved, so that a change in machine load hits every client
                for name, make, cpus, concurrency in runs:
                    workdir = Path(tmp)
                    row = measure(name, make(url, args, workdir), cpus, concurrency, control_urls, servers,
                                  workdir)
                    results[name].append(row)
                    shown = f"{row['events_per_s']:,.0f} events/s" if "events_per_s" in row else "failed"
                    print(f"  [{repeat + 1}/{args.repeats}] {name}: {shown}", file=sys.stderr)
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(10)
    rows = [median_row(results[name]) for name, *_ in runs]
    print(f"median of {args.repeats} interleaved runs; events counted by the server; {args.tokens} events per "
          f"request, {args.concurrency} in flight per client core"
          + (f", one write each {args.pace_ms:g} ms per stream ({args.events_per_write} events a write)"
             if args.pace_ms else ""))
    print(render(rows, shared))
    doc = {"setup": {k: v for k, v in vars(args).items() if k not in ("serve", "control_port", "otlp_on")},
           "topology": cores, "placement": place, "load_average_before": load_before,
           "load_average_after": os.getloadavg(), "median": rows, "runs": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"runs: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
