"""The engine in a process of its own: scheduler, model runner, sampling and detokenization, behind one stream
socket per HTTP front end.

The loop is plain: take what the front ends sent (requests, aborts, commands), run one step, send each front end
one message with the step's outputs for its requests. Detokenization stays here, beside the scheduler, because stop
strings end a request (and free its KV) in the step that produced them; measured on CPU it costs a few µs per
token (docs/benchmarks.md).

Lifetime: the process ends when every front end has closed its socket (requests still running are aborted first),
when its parent process dies (a watcher thread), or after telling the front ends why its loop failed. It ignores
SIGINT and SIGTERM: the front ends own shutdown (they drain, then close their sockets), so a signal sent to the
whole process group does not cut their in-flight requests short.

This module imports torch only inside `engine_main`, the spawned process's entry point.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

from infertrace.engine.worker import exit_with_parent
from infertrace.server.messages import (
    Delta,
    FrameReader,
    FromEngine,
    ToEngine,
    decode_to_engine,
    frame,
)

log = logging.getLogger("infertrace.server")
RECV_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process needs to start: plain values, sent to the spawned process."""

    model_dir: str
    config: dict[str, Any]  # EngineConfig fields
    profile_dir: str | None = None


def start_engine_process(spec: EngineSpec, frontends: int = 1) -> tuple[multiprocessing.Process, list[socket.socket]]:
    """Spawn the engine process; returns it and one connected socket per front end (the engine holds the others).
    Readiness comes as the first message on each socket ("ready", or "dead" with the reason)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited CUDA state or event loop
    pairs = [socket.socketpair() for _ in range(frontends)]
    proc = ctx.Process(target=engine_main, args=(spec, [theirs for _, theirs in pairs]), name="infertrace-engine")
    proc.start()
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
        from infertrace.server.engine_services import EngineServices

        engine = Engine(spec.model_dir, EngineConfig(**spec.config))
        services = EngineServices(engine, Path(spec.profile_dir) if spec.profile_dir else None, spec.config)
        info = services.info()
    except BaseException as e:
        _tell_all(socks, FromEngine("dead", error={"message": f"cannot load the model: {type(e).__name__}: {e}"}))
        os._exit(1)
    _tell_all(socks, FromEngine("ready", value=info))
    code = EngineLoop(engine, services, socks).run()
    try:
        engine.shutdown()  # tensor-parallel ranks are processes of their own
    finally:
        os._exit(code)


class _Peer:
    """One front end: its socket, what it has sent so far, and the requests it owns."""

    __slots__ = ("reader", "requests", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.requests: set[str] = set()


class EngineLoop:
    def __init__(self, engine: Any, services: Any, socks: list[socket.socket]) -> None:
        self.engine = engine
        self.services = services
        self.peers = {sock: _Peer(sock) for sock in socks}
        self.owner: dict[str, _Peer] = {}

    def run(self) -> int:
        """Serve until every front end is gone; the process's exit code."""
        engine = self.engine
        try:
            while self.peers:
                busy = engine.has_unfinished()
                for sock in multiprocessing.connection.wait(list(self.peers), timeout=0 if busy else None):
                    peer = self.peers.get(sock)
                    if peer is not None:
                        self._read(peer)
                if engine.has_unfinished():
                    self._step()
            return 0
        except BaseException as e:  # the loop must never die silently: every front end hears why
            log.exception("the engine loop failed")
            _tell_all(list(self.peers), FromEngine("dead", error={"message": f"{type(e).__name__}: {e}"}))
            return 1

    # ----- input -----
    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        try:
            messages = [decode_to_engine(body) for body in peer.reader.feed(data)]
        except ValueError as e:  # a front end that breaks the protocol is dropped, not obeyed
            log.error("dropping a front end: %s", e)
            self._drop(peer)
            return
        for message in messages:
            self._handle(peer, message)

    def _handle(self, peer: _Peer, msg: ToEngine) -> None:
        kind = msg.kind
        if kind == "add":
            try:
                self.engine.add_request(msg.request_id, msg.prompt, msg.params)
            except ValueError as e:
                self._send(peer, FromEngine("refused", request_id=msg.request_id, error={"message": str(e)}))
                return
            peer.requests.add(msg.request_id)
            self.owner[msg.request_id] = peer
        elif kind == "abort":
            self._abort(msg.request_id)
            if msg.call_id:
                self._send(peer, FromEngine("reply", call_id=msg.call_id))
        elif kind == "count":
            self.services.metrics.count(msg.args)
        elif kind == "call":
            self._send(peer, self._call(msg))
        else:
            log.error("unknown message kind %r from a front end", kind)

    def _call(self, msg: ToEngine) -> FromEngine:
        from infertrace.server.protocol import ApiError

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

    def _abort(self, request_id: str) -> None:
        final = self.engine.abort(request_id)
        if final is not None:
            self._deliver([final])

    def _drop(self, peer: _Peer) -> None:
        """A front end is gone: abort what it still had running; nobody will read those outputs."""
        self.peers.pop(peer.sock, None)
        for request_id in list(peer.requests):
            self.owner.pop(request_id, None)
            self.engine.abort(request_id)
        peer.requests.clear()
        peer.sock.close()

    # ----- output -----
    def _step(self) -> None:
        engine = self.engine
        steps = engine.counters["steps"]
        outputs = engine.step()
        if engine.counters["steps"] != steps:
            self.services.on_step(engine.last_step)
        if outputs:
            self._deliver(outputs)

    def _deliver(self, outputs: list) -> None:
        """One message per front end with its requests' outputs, and the batch's size for admission control."""
        by_peer: dict[_Peer, list[Delta]] = {}
        for out in outputs:
            if out.finished:
                peer = self.owner.pop(out.request_id, None)
                if peer is not None:
                    peer.requests.discard(out.request_id)
            else:
                peer = self.owner.get(out.request_id)
            if peer is not None:
                by_peer.setdefault(peer, []).append(Delta(
                    out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                    out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens))
        if not by_peer:
            return
        stats = {"running": self.engine.num_running, "waiting": self.engine.num_waiting}
        for peer, deltas in by_peer.items():
            self._send(peer, FromEngine("step", outputs=deltas, stats=stats))

    def _send(self, peer: _Peer, message: FromEngine) -> None:
        try:
            peer.sock.sendall(frame(message))
        except OSError:
            self._drop(peer)


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

