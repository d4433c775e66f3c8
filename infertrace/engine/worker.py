"""The tensor-parallel ranks after rank 0: one spawned process each, running the steps rank 0 plans.

Rank 0 (the engine's own process) schedules and samples; it sends every step's host inputs down one pipe per rank,
pickled once, and each rank runs the same forward, meeting rank 0 in the layers' collectives (NCCL on CUDA, gloo on
CPU). The same pipes carry calls (profiler start/stop) and their replies. Start-up is a handshake per rank with the
process watched, so a rank that fails to start is an error naming it rather than a hang.

Every way out ends every rank. Rank 0's `OtherRanks` owns the others: `shutdown()` (called by the engine's finalizer
too, so a script that returns or raises without calling it still stops them at interpreter exit) tells each rank to
exit (a rank leaves by os._exit, without NCCL's teardown), kills what is left after EXIT_WAIT_S, then aborts rank 0's
side of an NCCL group (a destroy with the peers gone waits for ever), bounded by TEARDOWN_WAIT_S. A watcher thread sees a rank
that dies on its own: it records why, kills the other ranks (they would wait for ever in a collective with the dead
one) and aborts rank 0's NCCL communicator, so a step waiting on the dead rank ends and raises RankFailedError; the
step's wait polls for that instead of blocking in the driver, since a peer-memory all-reduce spinning on a dead
peer never ends by itself. A rank ignores SIGINT (Ctrl-C reaches the whole process group; rank 0 decides) and
exits with `os._exit` when told to, when its pipe closes, when a step fails, or when rank 0's process is gone.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from infertrace.engine.config import EngineConfig

START_TIMEOUT_S = 300.0  # a rank's start: torch import, weight load, CUDA-graph capture
CALL_TIMEOUT_S = 120.0  # a call's reply (a profiler stop writes a trace)
EXIT_WAIT_S = 3.0  # how long shutdown() lets the ranks exit by themselves before it kills them
TEARDOWN_WAIT_S = 3.0  # how long shutdown() waits for rank 0's side of the process group to be torn down
# one collective may wait this long for a peer: a first step compiles Triton kernels on every rank, unevenly
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class RankFailedError(RuntimeError):
    """A tensor-parallel rank exited or failed; the engine cannot run more steps."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(config: EngineConfig) -> str:
    from infertrace.engine.model_runner import resolve_device

    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


class OtherRanks:
    """Rank 0's handle on ranks 1..N-1: started together with the process group, stopped by `shutdown()`."""

    def __init__(self, config: EngineConfig, model_dir: Path, hf_config: dict):
        import torch
        import torch.distributed as dist

        size = config.tensor_parallel_size
        self.backend = backend_for(config)
        if self.backend == "nccl" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (another tensor-parallel "
                               "engine?); shut it down first")
        port = free_port()
        init = f"tcp://127.0.0.1:{port}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._closed = False
        self.failure: str | None = None  # why the ranks can run no more steps (set by the watcher)
        self._wake_r, self._wake_w = os.pipe()  # written by shutdown(): the watcher stops
        self._signal_main = False  # the watcher also raises RankFailedError in the main thread (a server's loop)
        self._watcher: threading.Thread | None = None
        # host timestamps of each step while `record_timeline` is on (benchmarks/tp_bench.py --timeline)
        self.timeline: list[tuple[str, int]] | None = None
        try:
            for rank in range(1, size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(config, model_dir, hf_config, rank, init, theirs),
                                   name=f"infertrace-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()  # only the rank holds its end now: its death closes the pipe for us
                self.procs.append(proc)
                self.conns.append(ours)
            self._wait_all("hello")
            dist.init_process_group(self.backend, init_method=init, rank=0, world_size=size,
                                    timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="infertrace-tp-watch", daemon=True)
        self._watcher.start()
        # before multiprocessing's own exit hook (registered earlier, so run later), which would SIGTERM the ranks
        atexit.register(self._shutdown_at_exit)

    def _watch(self) -> None:
        """Wait for a rank to exit; if that was not shutdown() asking, stop the rest and unblock rank 0."""
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        i = next(sentinels[s] for s in ready if s in sentinels)
        self.failure = self._death(i)
        print(f"infertrace: {self.failure}; stopping the other tensor-parallel ranks", file=sys.stderr, flush=True)
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        # the main thread hears first: NCCL's abort below did not return on two H100s, and a server waiting for
        # requests behind it never heard of the dead rank
        if self._signal_main:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        if self.backend == "nccl":
            _abort_process_group()  # rank 0's kernels waiting on the dead rank end; its step then raises

    def raise_in_main_thread_on_failure(self) -> None:
        """Make a rank's death raise RankFailedError in the main thread even while it waits on something else (a
        server's loop waiting for requests would otherwise never hear of it): the watcher sends it SIGUSR1, which
        interrupts a blocking wait. Call from the main thread."""

        def rank_failed(signum, frame):
            raise RankFailedError(self.failure or "a tensor-parallel rank failed")

        signal.signal(signal.SIGUSR1, rank_failed)
        self._signal_main = True

    def check(self) -> None:
        """RankFailedError when a rank has died (the step just waited for may hold garbage)."""
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def wait(self, event) -> None:
        """Wait for a CUDA event of a step (its sampled tokens landing), raising RankFailedError as soon as a rank
        is seen dead: a step waiting on a dead peer may never end."""
        while not event.query():
            if self.failure is not None:
                raise RankFailedError(self.failure)
            time.sleep(0)  # let the watcher run
        self.check()

    def wait_ready(self) -> None:
        """Block until every rank has its model and KV cache (built alongside rank 0's, through collectives)."""
        try:
            self._wait_all("ready")
        except BaseException:
            self.shutdown()
            raise

    def step(self, inputs) -> None:
        self.check()
        self._check_alive()
        self.mark("send")
        data = pickle.dumps(("step", inputs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError:
            self._check_alive()
            raise

    def mark(self, what: str) -> None:
        """A host timestamp of this step on rank 0 while the timeline records: "send" (its inputs go to the other
        ranks), "launched" (its kernels are queued), "landed" (its tokens are on the host). One list append."""
        if self.timeline is not None:
            self.timeline.append((what, time.perf_counter_ns()))

    def record_timeline(self, on: bool) -> tuple[list[tuple[str, int]], list[list[tuple[str, int]]]] | None:
        """Start (True) or stop (False) recording host timestamps on every rank: rank 1 and up mark "recv" (a step's
        inputs received) and "launched". Stopping returns (rank 0's marks, the other ranks' in rank order). The
        clock is time.perf_counter_ns, CLOCK_MONOTONIC on Linux, which every process of one host shares."""
        if on:
            self.timeline = []
            self.call("timeline", True)
            return None
        mine, self.timeline = self.timeline or [], None
        return mine, self.call("timeline", False)

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call `runner-side method(*args)` on every other rank (see `_Rank.call`); their results, rank order."""
        return self.call_together(method, args)[1]

    def call_together(self, method: str, args: tuple, local: Callable[[], Any] | None = None) -> tuple[Any, list[Any]]:
        """`call`, with `local()` run on rank 0 while the other ranks run theirs (a call whose work meets in
        collectives, such as replaying a graph); (local's result, the other ranks' results in rank order)."""
        self._check_alive()
        data = pickle.dumps(("call", method, args))
        for conn in self.conns:
            conn.send_bytes(data)
        mine = local() if local is not None else None
        return mine, self._wait_all("result", CALL_TIMEOUT_S)

    def _wait_all(self, expected: str, timeout: float = START_TIMEOUT_S) -> list[Any]:
        results: dict[int, Any] = {}
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = {self.procs[i].sentinel: i for i in pending}
            ready = multiprocessing.connection.wait([*pending.values(), *sentinels], timeout)
            if not ready:
                raise RankFailedError(f"tensor-parallel rank(s) {sorted(i + 1 for i in pending)} sent no "
                                      f"{expected!r} within {timeout:.0f} s")
            for i, conn in list(pending.items()):
                if conn not in ready and self.procs[i].sentinel not in ready:
                    continue
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self.procs[i].join(5)
                    raise RankFailedError(self._death(i)) from None
                if kind == "error":
                    raise RankFailedError(f"tensor-parallel rank {i + 1} failed:\n{value}")
                assert kind == expected, (kind, expected)
                results[i] = value
                del pending[i]
        return [results[i] for i in range(len(self.conns))]

    def _death(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(1)
        # another thread of this process (the watcher, or the main thread's check) may be reaping the same child:
        # its wait then fails here and the exit code appears once that thread has it
        deadline = time.monotonic() + 1
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = "" if proc.exitcode is None else f" with code {proc.exitcode}"  # None: reaped by someone else
        return f"tensor-parallel rank {i + 1} (pid {proc.pid}) exited{code}"

    def _check_alive(self, wait_s: float = 0.0) -> None:
        """RankFailedError when a rank has exited (within `wait_s`). The processes' sentinels tell, not waitpid,
        which fails once something else in the process (a SIGCHLD handler) has reaped the child."""
        if self._closed:
            raise RankFailedError(self.failure or "the tensor-parallel ranks were shut down")
        dead = multiprocessing.connection.wait([p.sentinel for p in self.procs], wait_s)
        if dead:
            i = next(i for i, p in enumerate(self.procs) if p.sentinel in dead)
            raise RankFailedError(self._death(i))

    def explain(self, exc: BaseException) -> None:
        """Raise RankFailedError from `exc` (a failed collective) when a rank has exited or is exiting."""
        self.check()
        self._check_alive(wait_s=5.0)

    def shutdown(self) -> bool | None:
        """Stop every rank (politely, then by force) and tear down rank 0's side of the process group, in at most
        EXIT_WAIT_S + TEARDOWN_WAIT_S. Idempotent. False when the teardown did not finish (see
        _teardown_process_group)."""
        if self._closed:
            return None
        self._closed = True
        atexit.unregister(self._shutdown_at_exit)
        os.write(self._wake_w, b"x")
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("exit",)))
            except OSError:
                pass
        running = {p.sentinel: p for p in self.procs}
        deadline = time.monotonic() + EXIT_WAIT_S
        while running and (left := deadline - time.monotonic()) > 0:
            for sentinel in multiprocessing.connection.wait(list(running), left):
                del running[sentinel]
        for proc in running.values():
            proc.kill()
        for proc in self.procs:
            proc.join(5)
        for conn in self.conns:
            conn.close()
        if self._watcher is not None:
            self._watcher.join(1)
        os.close(self._wake_r)
        os.close(self._wake_w)
        done = _teardown_process_group(self.backend)
        if done is False:  # its thread would make the interpreter's exit abort: end the process before that
            atexit.unregister(_end_if_teardown_running)  # once, however many engines left one running
            atexit.register(_end_if_teardown_running)
        return done

    def _shutdown_at_exit(self) -> None:
        """shutdown() from the interpreter's exit. A teardown still running in its thread when the interpreter
        finalises makes C++ end the process with SIGABRT ("terminate called without an active exception", seen on
        H200s with NCCL); so the process ends here instead, with the status the interpreter would have given (1
        after an uncaught exception, else 0; a sys.exit(n) code is not known here and becomes 0)."""
        if self.shutdown() is False:
            _end_process_now()


_STUCK_TEARDOWN: threading.Thread | None = None  # a teardown thread left running by shutdown()


def _end_if_teardown_running() -> None:
    """At the interpreter's exit, after a shutdown() whose teardown did not finish (a script that called it, as a
    multiprocessing child or pytest does): the same ending as _shutdown_at_exit's while that teardown still runs
    (on four H200s such processes ended with SIGABRT, "terminate called without an active exception")."""
    if _STUCK_TEARDOWN is not None and _STUCK_TEARDOWN.is_alive():
        _end_process_now()


def _end_process_now() -> None:
    import logging

    code = 1 if getattr(sys, "last_value", None) is not None else 0
    print(f"infertrace: ending the process now (exit status {code}) rather than let the interpreter's exit "
          "abort on the process group", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _abort_process_group() -> None:
    """Abort this process's process group (NCCL: in-flight collectives end without their peers)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group as abort

    if dist.is_initialized():
        try:
            abort()
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            print(f"infertrace: aborting the process group failed: {e}", file=sys.stderr, flush=True)


def _teardown_process_group(backend: str) -> bool:
    """Rank 0's side of the process group, once the other ranks are gone: gloo's is destroyed; NCCL's aborted (its
    destroy, called after the other ranks had gone, waited for ever: the hang at exit; called by every rank at once,
    it did not finish within 3 s on 4 H200s either, and left the next engine of the process unable to start). In a
    thread, so that a teardown that still blocks costs at most TEARDOWN_WAIT_S; False when it is still running."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    teardown = dist.destroy_process_group if backend != "nccl" else _abort_process_group
    thread = threading.Thread(target=teardown, name="infertrace-tp-teardown", daemon=True)
    thread.start()
    thread.join(TEARDOWN_WAIT_S)
    if thread.is_alive():
        global _STUCK_TEARDOWN
        _STUCK_TEARDOWN = thread
        print(f"infertrace: the {backend} process group did not tear down within {TEARDOWN_WAIT_S:.0f} s; leaving it",
              file=sys.stderr, flush=True)
        return False
    return True


def rank_main(config: EngineConfig, model_dir: Path, hf_config: dict, rank: int, init: str,
              conn: multiprocessing.connection.Connection) -> None:
    """A rank's process: join the group, build the model shard and KV cache, then run what rank 0 sends. It ends
    with os._exit: NCCL's teardown can wait on peers that have gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the group: rank 0 decides
    exit_with_parent()
    try:
        import torch
        import torch.distributed as dist

        from infertrace.engine.model_runner import ModelRunner
        from infertrace.engine.parallel import TensorParallel

        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
        conn.send_bytes(pickle.dumps(("hello", None)))
        size = config.tensor_parallel_size
        dist.init_process_group(backend_for(config), init_method=init, rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
        runner = ModelRunner(config, model_dir, hf_config, TensorParallel(rank, size))
        from infertrace.engine.heap import freeze_startup_heap

        freeze_startup_heap()  # every rank's step loop is paced by the slowest: none pauses for a full collection
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        _send_error(conn)
        os._exit(1)
    code = 0
    try:
        _Rank(runner, conn).loop()
    except BaseException:
        traceback.print_exc()  # a failed step (a peer gone mid-collective, say); rank 0 names the rank
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Rank:
    def __init__(self, runner, conn: multiprocessing.connection.Connection):
        self.runner = runner
        self.conn = conn
        self.profiler = None
        self.timeline: list[tuple[str, int]] | None = None  # see OtherRanks.record_timeline

    def mark(self, what: str) -> None:
        if self.timeline is not None:
            self.timeline.append((what, time.perf_counter_ns()))

    def loop(self) -> bool:
        """Run what rank 0 sends until it says exit (True) or is gone (False)."""
        from infertrace.engine.annotate import annotate

        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return False  # rank 0 is gone
            kind = message[0]
            if kind == "exit":
                return True
            if kind == "step":
                self.mark("recv")
                inputs = message[1]
                with annotate(inputs.name):
                    self.runner.execute(inputs)
                self.mark("launched")
                continue
            try:
                result = self.call(message[1], *message[2])
            except BaseException:
                _send_error(self.conn)
                continue
            self.conn.send_bytes(pickle.dumps(("result", result)))

    def call(self, method: str, *args: Any) -> Any:
        from infertrace.engine.rank_profiler import RankProfiler

        if method == "start_profile":
            out_dir, stem, *options = args
            self.profiler = RankProfiler(out_dir, stem, self.runner.tp.rank, *options)
            self.profiler.start()
            return None
        if method == "stop_profile":
            profiler, self.profiler = self.profiler, None
            return None if profiler is None else profiler.stop()
        if method == "timeline":  # True: start recording host marks; False: stop and return them
            marks, self.timeline = self.timeline, [] if args[0] else None
            return None if args[0] else marks or []
        if method == "time_decode_graph":
            return self.runner.time_decode_graph(*args)
        raise ValueError(f"unknown rank call {method!r}")


def _send_error(conn) -> None:
    try:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    except OSError:
        pass


def exit_with_parent() -> None:
    """End this process at once when the process that started it ends (rank 0's, for a rank), even inside a
    collective or a step that would otherwise wait for it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
