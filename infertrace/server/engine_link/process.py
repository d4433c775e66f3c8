"""The engine in a process of its own: scheduler, model runner, sampling and detokenization, behind one stream
socket per HTTP front end.

The loop is plain: take what the front ends sent (requests, aborts, commands), run one step, send each front end
one message with the step's outputs for its requests. Detokenization stays here, beside the scheduler, because stop
strings end a request (and free its KV) in the step that produced them; measured on CPU it costs a few µs per
token (docs/benchmarks.md).

Sends never block: each front end's socket is non-blocking, and what it has not taken yet waits in a buffer of
its own, flushed when the socket is writable, so a front end that stops reading (stopped, hung, swamped) costs
only its own streams; the step loop and the other front ends go on. A front end whose backlog passes
MAX_BACKLOG_BYTES, or whose socket has taken nothing for MAX_STALL_S while outputs wait for it, is dropped: its
requests are aborted (their KV and batch slots freed), its backlog discarded after the frame in flight, and it is
told why (a "dropped" message); its socket is closed once it closes its end (having read why, it exits), and
past FAREWELL_S it is killed. So memory stays bounded, and a front end that stalls with few streams does not hold
them for ever. A front end that has said nothing (its heartbeat included: one every HEARTBEAT_S from its event
loop) for MAX_SILENCE_S is dropped too, streams or not: a stopped front end with nothing in flight has no outputs
waiting, yet its listener goes on taking its share of new connections.

Lifetime: the process ends when every front end has closed its socket or been dropped (requests still running are
aborted first; a dropped front end gets FAREWELL_S more to take why once no live one is left),
when its parent process dies (a watcher thread), or after telling the front ends why its loop failed. It ignores
SIGINT and SIGTERM: the front ends own shutdown (they drain, then close their sockets), so a signal sent to the
whole process group does not cut their in-flight requests short.

This module imports torch only inside `engine_main`, the spawned process's entry point.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from infertrace.engine.worker import exit_with_parent
from infertrace.server.engine_link.messages import (
    Delta,
    FrameReader,
    FromEngine,
    ToEngine,
    decode_to_engine,
    frame,
)

log = logging.getLogger("infertrace.server")
RECV_BYTES = 1 << 20
# Outputs a front end may leave unread before it is dropped: minutes of a busy batch's steps (a step message is
# tens of bytes per stream), far beyond any pause of a working front end, and bounded memory per front end.
MAX_BACKLOG_BYTES = 64 << 20
# Seconds a front end's socket may take nothing while outputs wait for it: far beyond any pause of a working front
# end (its event loop reads every few milliseconds), short enough that a hung one soon gives back its requests' KV.
MAX_STALL_S = 60.0
# Seconds a front end (after its "hello") may send nothing before it is dropped. Each one's event loop sends a
# heartbeat every HEARTBEAT_S (client.py) and never blocks for long (tokenizing runs on threads), so only a stopped
# or hung front end goes this long unheard; the engine reads before it judges, so a long step of its own never
# blames a front end. The first front end (the engine's parent, the server itself) is exempt: see _silent.
MAX_SILENCE_S = 15.0
MAX_SILENCE_ENV = "INFERTRACE_MAX_SILENCE_S"  # overrides MAX_SILENCE_S, read when the server starts
PROFILE_CALLS = ("start_profile", "stop_profile")
# How long front ends dropped before the last live one left still get to take why, before the engine process exits.
FAREWELL_S = 5.0
# The last part of a wait for new requests that polls the sockets instead of sleeping in epoll (whole milliseconds):
# a step is planned within microseconds of its deadline, at the cost of a core's busy wait as long as this at most.
SPIN_S = 1e-3
# What a model load raises for what it was given (a setting, a file, a value too large for a tensor's size), not
# for a failure of its own (out of memory, a device error).
BAD_INPUT_ERRORS = (ValueError, TypeError, OverflowError, OSError)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process needs to start: plain values, sent to the spawned process."""

    model_dir: str
    config: dict[str, Any]  # EngineConfig fields
    profile_dir: str | None = None
    max_silence_s: float = MAX_SILENCE_S


def max_silence_from_env() -> float:
    """MAX_SILENCE_S, or $INFERTRACE_MAX_SILENCE_S when set; ValueError (one line) when that is not a positive
    number of seconds."""
    raw = os.environ.get(MAX_SILENCE_ENV)
    if raw is None or not raw.strip():
        return MAX_SILENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"${MAX_SILENCE_ENV} must be a positive number of seconds, not {raw!r}")
    return value


def start_engine_process(spec: EngineSpec, frontends: int = 1) -> tuple[multiprocessing.Process, list[socket.socket]]:
    """Spawn the engine process; returns it and one connected socket per front end (the engine holds the others).
    Readiness comes as the first message on each socket ("ready", or "dead" with the reason)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA state or event loop
    pairs = [socket.socketpair() for _ in range(frontends)]
    proc = ctx.Process(target=engine_main, args=(spec, [theirs for _, theirs in pairs]), name="infertrace-engine")
    # Ignored from its first instruction, not only once engine_main runs: a Ctrl-C sent to the process group while
    # the new interpreter starts would otherwise kill it with "Fatal Python error". Only the main thread may.
    main = threading.current_thread() is threading.main_thread()
    previous = [signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)] if main else []
    try:
        proc.start()
    finally:
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), previous):
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    for _, theirs in pairs:
        theirs.close()  # only the engine holds these now: its exit is an EOF on ours
    return proc, [ours for ours, _ in pairs]


def engine_main(spec: EngineSpec, socks: list[socket.socket]) -> None:
    """The engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()  # a SIGKILLed server must not leave an engine holding the GPU; TP ranks follow
    try:
        from pathlib import Path

        from infertrace.engine.config import EngineConfig
        from infertrace.engine.engine import Engine
        from infertrace.engine.heap import freeze_startup_heap
        from infertrace.engine.threads import cpu_threads
        from infertrace.server.engine_link.services import EngineServices

        engine = Engine(spec.model_dir, EngineConfig(**spec.config))
        threads = cpu_threads() if engine.runner.device.type == "cpu" else None
        if engine.other_ranks is not None:  # a rank that dies while the loop waits for requests ends the loop too
            engine.other_ranks.raise_in_main_thread_on_failure()
        services = EngineServices(engine, Path(spec.profile_dir) if spec.profile_dir else None, spec.config)
        info = services.info()
        info["torch_threads"] = threads
        info["gc_frozen_objects"] = freeze_startup_heap()
        services.metrics.forget_gc()  # /metrics counts the collections of serving, not the start-up one just made
    except BaseException as e:  # one line: torch's errors carry their C++ frames after the first
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _tell_all(socks, FromEngine("dead", error={"message": f"cannot load the model: {type(e).__name__}: {why}",
                                                   "bad_input": isinstance(e, BAD_INPUT_ERRORS)}))
        os._exit(1)
    _tell_all(socks, FromEngine("ready", value=info))
    code = EngineLoop(engine, services, socks, max_silence_s=spec.max_silence_s).run()
    try:
        engine.shutdown()  # tensor-parallel ranks are processes of their own
    finally:
        os._exit(code)


class _Peer:
    """One front end: its socket, what it has sent so far, the requests it owns (by engine id), and the frames it
    has not taken yet (the first `sent` bytes of the first frame already went out)."""

    __slots__ = ("backlog", "backlog_bytes", "dropped", "heard", "index", "leave_by", "pid", "progress", "reader",
                 "requests", "sent", "sock", "writing")

    def __init__(self, sock: socket.socket, index: int = 0) -> None:
        self.sock = sock
        self.index = index
        self.reader = FrameReader()
        self.requests: set[str] = set()
        self.backlog: collections.deque[bytes] = collections.deque()
        self.backlog_bytes = 0
        self.sent = 0
        self.writing = False  # the selector watches the socket for room to write
        self.dropped = False  # told why it was dropped; closed when it closes its end, or killed past leave_by
        self.leave_by = 0.0  # once dropped: when it is killed if it has not taken why and gone by then
        self.pid: int | None = None  # the front end's process, from its "hello"
        self.progress = time.monotonic()  # when the socket last took bytes, or the backlog last began
        self.heard = time.monotonic()  # when the front end last sent anything

    def engine_id(self, request_id: str) -> str:
        """The engine's id of this front end's request `request_id` (its client's id, unique among the front end's
        requests in flight, but not among every front end's): a front end names, and so touches, only its own
        requests. "/" is not among a client id's characters, so no two pairs give one engine id."""
        return f"{self.index}/{request_id}"

    def flush(self) -> None:
        """Send what the socket takes now, without blocking. OSError when the front end is gone."""
        backlog = self.backlog
        while backlog:
            head = backlog[0]
            n = self.sock.send(memoryview(head)[self.sent:]) if self.sent else self.sock.send(head)
            if n:
                self.progress = time.monotonic()
            self.sent += n
            self.backlog_bytes -= n
            if self.sent < len(head):
                return  # the socket is full: the rest waits until it is writable
            backlog.popleft()
            self.sent = 0

    def discard_backlog(self) -> None:
        """Forget every frame not yet begun; the one in flight is kept, so the stream stays whole frames."""
        in_flight = self.backlog[0] if self.sent else None
        self.backlog.clear()
        self.backlog_bytes = 0
        if in_flight is not None:
            self.backlog.append(in_flight)
            self.backlog_bytes = len(in_flight) - self.sent


class EngineLoop:
    def __init__(self, engine: Any, services: Any, socks: list[socket.socket],
                 max_backlog_bytes: int = MAX_BACKLOG_BYTES, max_stall_s: float = MAX_STALL_S,
                 farewell_s: float = FAREWELL_S, max_silence_s: float = MAX_SILENCE_S) -> None:
        self.engine = engine
        self.services = services
        self.max_backlog_bytes = max_backlog_bytes
        self.max_stall_s = max_stall_s
        self.farewell_s = farewell_s
        self.max_silence_s = max_silence_s
        self.peers = {sock: _Peer(sock, index) for index, sock in enumerate(socks)}
        self.leaving: dict[socket.socket, _Peer] = {}  # dropped, not yet told why
        self.trace_owner: _Peer | None = None  # the front end tracing itself in the running capture
        self.owner: dict[str, tuple[_Peer, str]] = {}  # engine id -> the front end and its id of the request
        self.selector = selectors.DefaultSelector()
        for sock, peer in self.peers.items():
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, peer)

    def run(self) -> int:
        """Serve until every front end is gone; the process's exit code."""
        engine = self.engine
        try:
            while self.peers:
                # with a step in flight, new requests are taken until the next must be planned (pace.py)
                plan = timeout = engine.plan_delay() if engine.has_unfinished() else None
                dues = [peer.leave_by for peer in self.leaving.values()]
                dues += [peer.heard + self.max_silence_s for peer in self.peers.values() if self._watched(peer)]
                if dues:  # idle, the loop still wakes to judge silence and farewells
                    due = min(dues) - time.monotonic()
                    timeout = max(0.0, min(due, timeout if timeout is not None else due))
                for key, events in self._select(timeout, exact=timeout == plan):
                    peer = key.data
                    if events & selectors.EVENT_WRITE:
                        self._flush(peer)
                    if events & selectors.EVENT_READ and peer.sock.fileno() != -1:
                        self._read(peer)
                self._drop_silent()  # after reading: what a front end sent during a long step counts
                if self.leaving:
                    self._evict_overdue()
                if engine.has_unfinished():
                    self._step()
            self._farewell()
            return 0
        except BaseException as e:  # the loop must never die silently: every front end hears why
            log.exception("the engine loop failed")
            self._tell_all(FromEngine("dead", error={"message": f"{type(e).__name__}: {e}"}))
            return 1

    def _select(self, timeout: float | None, exact: bool) -> list:
        """The selector's events within `timeout` seconds (None: until one comes). epoll waits whole milliseconds,
        rounded up, and a step's planning deadline is finer than that: the last SPIN_S of an `exact` wait polls.
        A wait for a silence or farewell deadline is not exact: a millisecond late there costs no step."""
        if timeout is None or timeout <= 0 or not exact:
            return self.selector.select(timeout)
        end = time.perf_counter() + timeout
        if timeout > SPIN_S and (events := self.selector.select(timeout - SPIN_S)):
            return events
        while not (events := self.selector.select(0)) and time.perf_counter() < end:
            pass
        return events

    def _farewell(self) -> None:
        """Every live front end is gone: the ones dropped before get the rest of their farewell time to take why,
        then the loop ends."""
        while self.leaving and (left := min(p.leave_by for p in self.leaving.values()) - time.monotonic()) > 0:
            for key, events in self.selector.select(timeout=left):
                peer = key.data
                if events & selectors.EVENT_WRITE:
                    self._flush(peer)
                if events & selectors.EVENT_READ and peer.sock.fileno() != -1:
                    self._read(peer)  # its end of the socket closing closes ours
            self._evict_overdue()
        self._evict_overdue()  # those already past their time when the last live front end left

    def _watched(self, peer: _Peer) -> bool:
        """Whether `peer`'s silence is judged: once it said "hello" (before that, its start is the server's to time),
        and unless it is the first front end, the process that started this one: that is the server itself, whose
        stop is the whole server's stop (its own connections wait in its backlog until it runs again; dropping it
        would only fail it when it does)."""
        return peer.pid is not None and peer.pid != os.getppid()

    def _drop_silent(self) -> None:
        """Drop every front end heard from last more than max_silence_s ago (stopped or hung): dropped, it is killed
        past its farewell time like any other."""
        now = time.monotonic()
        for peer in [p for p in self.peers.values() if self._watched(p) and now - p.heard > self.max_silence_s]:
            self._drop(peer, f"sent nothing, not even its heartbeat, for more than {self.max_silence_s:g} s "
                             f"(stopped or hung)")

    def _evict_overdue(self) -> None:
        """A dropped front end that has not taken why and gone within its farewell time is stopped or hung: its
        process is killed, or its listening socket would go on taking its share of new connections (SO_REUSEPORT
        spreads them over every listener, awake or not) that nobody answers. The process that started this one
        (the first front end) is left to its own watchdogs: killing it would take the whole server down."""
        now = time.monotonic()
        for peer in [p for p in self.leaving.values() if p.leave_by <= now]:
            if peer.pid is not None and peer.pid != os.getppid():
                log.error("killing front end pid %d: dropped %g s ago, it has not read why", peer.pid,
                          self.farewell_s)
                try:
                    os.kill(peer.pid, signal.SIGKILL)
                except OSError as e:
                    log.error("could not kill front end pid %d: %s", peer.pid, e)
            self._close(peer)

    def _tell_all(self, message: FromEngine) -> None:
        """`message` to every front end, after the frame in flight, waiting at most a second on each one."""
        data = frame(message)
        for peer in list(self.peers.values()):
            peer.discard_backlog()
            peer.backlog.append(data)
            try:
                peer.sock.settimeout(1.0)
                peer.flush()
            except OSError:
                pass

    # ----- input -----
    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(peer)
            return
        peer.heard = time.monotonic()
        if peer.dropped:
            return  # it has not read why yet; what it asks for now is not served
        try:
            messages = [decode_to_engine(body) for body in peer.reader.feed(data)]
        except ValueError as e:  # a front end that breaks the protocol is dropped, not obeyed
            log.error("dropping a front end: %s", e)
            self._close(peer)
            return
        for message in messages:
            self._handle(peer, message)

    def _handle(self, peer: _Peer, msg: ToEngine) -> None:
        kind = msg.kind
        if kind == "add":
            engine_id = peer.engine_id(msg.request_id)
            try:
                self.engine.add_request(engine_id, msg.prompt, msg.params, label=msg.request_id)
            except ValueError as e:
                self._send(peer, FromEngine("refused", request_id=msg.request_id,
                                            error={"message": str(e), "field": getattr(e, "field", None)}))
                return
            peer.requests.add(engine_id)
            self.owner[engine_id] = (peer, msg.request_id)
        elif kind == "abort":
            engine_id = peer.engine_id(msg.request_id)
            if engine_id in peer.requests:
                self._abort(engine_id)
            if msg.call_id:
                self._send(peer, FromEngine("reply", call_id=msg.call_id))
        elif kind == "count":
            self.services.metrics.count(msg.args)
        elif kind == "beat":
            pass  # reading it was the point (peer.heard)
        elif kind == "hello":
            peer.pid = msg.args.get("pid")
            peer.heard = time.monotonic()
        elif kind == "stamp":  # the front end's times of requests it ended: [[its request id, times], ...]
            log = self.engine.request_log
            if log is not None:
                for entry in msg.args.get("requests", ()):
                    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) \
                            and isinstance(entry[1], dict):
                        log.stamp(peer.engine_id(entry[0]), entry[1])
        elif kind == "call":
            self._send(peer, self._profiled_call(peer, msg) if msg.name in PROFILE_CALLS else self._call(msg))
        else:
            log.error("unknown message kind %r from a front end", kind)

    def _profiled_call(self, peer: _Peer, msg: ToEngine) -> FromEngine:
        """start_profile and stop_profile, which may land on different front ends: the one that started a capture
        with its own front-end trace ("frontend": true) is told to stop that trace and write it whichever front
        end asks to stop (or its profile hook stayed on, slowing every request it served), and the stop's answer
        names it."""
        traced = msg.name == "start_profile" and bool(msg.args.pop("frontend_trace", False))
        reply = self._call(msg)
        if reply.error is not None:
            return reply
        if msg.name == "start_profile":
            self.trace_owner = peer if traced else None
            return reply
        owner, self.trace_owner = self.trace_owner, None
        if owner is not None and owner is not peer and isinstance(reply.value, dict):
            if owner.sock in self.peers and not owner.dropped:
                self._send(owner, FromEngine("trace_stop", value={"output_dir": reply.value.get("output_dir")}))
                reply.value["frontend_trace_pid"] = owner.pid
            else:
                reply.value["frontend_trace_error"] = "the front end that traced itself is gone"
        return reply

    def _call(self, msg: ToEngine) -> FromEngine:
        from infertrace.server.frontend.protocol import ApiError

        try:
            value = self.services.command(msg.name, msg.args)
        except ApiError as e:
            return FromEngine("reply", call_id=msg.call_id, error={"status": e.status, "message": e.message,
                                                                    "code": e.code, "param": e.param})
        except Exception as e:
            log.exception("engine command %s failed", msg.name)
            return FromEngine("reply", call_id=msg.call_id, error={"status": 500, "code": "internal_error",
                                                                    "message": f"{type(e).__name__}: {e}"})
        return FromEngine("reply", call_id=msg.call_id, value=value)

    def _abort(self, engine_id: str) -> None:
        final = self.engine.abort(engine_id)
        if final is not None:
            self._deliver([final])

    def _abort_all(self, peer: _Peer) -> None:
        """Abort what `peer` still has running; nobody will read those outputs."""
        for engine_id in list(peer.requests):
            self.owner.pop(engine_id, None)
            self.engine.abort(engine_id)
        peer.requests.clear()

    def _close(self, peer: _Peer) -> None:
        """A front end is gone (or done with): abort its requests and forget it."""
        self.peers.pop(peer.sock, None)
        self.leaving.pop(peer.sock, None)
        if peer.requests and not peer.dropped:  # a front end that drains ends its requests before it goes
            log.error("a front end (pid %s) went away with %d request(s) running; the engine aborted them",
                      peer.pid, len(peer.requests))
        self._abort_all(peer)
        peer.backlog.clear()
        peer.backlog_bytes = 0
        if peer.sock.fileno() != -1:
            self.selector.unregister(peer.sock)
            peer.sock.close()

    def _drop(self, peer: _Peer, behind: str) -> None:
        """A front end past its backlog, stall or silence bound (`behind` says which): its requests are aborted and it is
        told why, after the frame in flight; its socket closes once it closes its end (a front end that reads why
        exits), or it is killed past its farewell time (FAREWELL_S): a why sent into the socket's buffer is not yet
        read, and a stopped front end never reads it. It no longer counts among the
        front ends."""
        why = f"this front end {behind}; its {len(peer.requests)} request(s) were aborted"
        log.error("dropping front end pid %s: %s", peer.pid, why)
        self.peers.pop(peer.sock, None)
        self.leaving[peer.sock] = peer
        self._abort_all(peer)
        peer.discard_backlog()
        peer.dropped = True
        peer.leave_by = time.monotonic() + self.farewell_s
        self._queue(peer, frame(FromEngine("dropped", error={"message": why})))

    # ----- output -----
    def _step(self) -> None:
        engine = self.engine
        steps = engine.counters["steps"]
        outputs = engine.step()
        if outputs:  # the tokens first: the step's metrics can wait for the front ends to have them
            self._deliver(outputs)
        if engine.counters["steps"] != steps:
            self.services.on_step(engine.last_step)

    def _deliver(self, outputs: list) -> None:
        """One message per front end with its requests' outputs, and the batch's size for admission control."""
        by_peer: dict[_Peer, list[Delta]] = {}
        owner = self.owner
        for out in outputs:
            found = owner.pop(out.request_id, None) if out.finished else owner.get(out.request_id)
            if found is None:
                continue
            peer, request_id = found
            if out.finished:
                peer.requests.discard(out.request_id)
            by_peer.setdefault(peer, []).append(Delta(
                request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens))
        if not by_peer:
            return
        stats = {"running": self.engine.num_running, "waiting": self.engine.num_waiting}
        for peer, deltas in by_peer.items():
            self._send(peer, FromEngine("step", outputs=deltas, stats=stats))

    def _send(self, peer: _Peer, message: FromEngine) -> None:
        if peer.dropped:
            return
        self._queue(peer, frame(message))
        if peer.backlog_bytes > self.max_backlog_bytes:
            self._drop(peer, f"fell more than {self.max_backlog_bytes / (1 << 20):g} MiB of outputs behind the engine "
                             f"(it stopped reading)")
        elif peer.backlog and time.monotonic() - peer.progress > self.max_stall_s:
            self._drop(peer, f"took no output for more than {self.max_stall_s:g} s while outputs waited (it stopped "
                             f"reading)")

    def _queue(self, peer: _Peer, data: bytes) -> None:
        """Send `data` after what `peer` has not taken yet, as far as its socket takes it now; the rest waits."""
        was_waiting = bool(peer.backlog)
        if not was_waiting:
            peer.progress = time.monotonic()  # a stall is counted from when something waits
        peer.backlog.append(data)
        peer.backlog_bytes += len(data)
        if not was_waiting:
            self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        if peer.sock.fileno() == -1:
            return
        try:
            peer.flush()
        except BlockingIOError:
            pass
        except OSError:
            self._close(peer)
            return
        if peer.writing != bool(peer.backlog):
            peer.writing = bool(peer.backlog)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.writing else 0)
            self.selector.modify(peer.sock, events, peer)


def _tell_all(socks: list[socket.socket], message: FromEngine) -> None:
    data = frame(message)
    for sock in socks:
        try:
            sock.sendall(data)
        except OSError:
            pass


def describe_exit(proc: multiprocessing.Process) -> str:
    """How the engine process ended, in words. Called when its socket closed: the exit itself follows at once."""
    proc.join(timeout=2.0)
    code = proc.exitcode
    if code is None:
        return "the engine process is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine process was killed by {name}"
    return f"the engine process exited with code {code}"

