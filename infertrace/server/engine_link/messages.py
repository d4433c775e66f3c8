"""What crosses between the HTTP front end and the engine process: one msgspec record per direction, framed on a
stream socket.

A frame is a 4-byte big-endian length and a MessagePack body (MessagePack, not JSON: step histograms hold +Inf).
The engine sends one `FromEngine` per front end per step, with every output of that step for that front end's
requests; the front end sends one `ToEngine` per request, abort, command or counter update, and a heartbeat.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from infertrace.engine.sampling_params import SamplingParams

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30  # a longer length can only come from a broken peer


class Delta(msgspec.Struct, array_like=True, gc=False):
    """One request's output of one step: the fields of the engine's RequestOutput, which the handlers read."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


class ToEngine(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Front end to engine. kind: "add" (request_id, prompt, params), "abort" (request_id; call_id > 0 asks for a
    reply once its KV is free), "call" (name, args, call_id: an engine-side command such as start_profile, ping or
    metrics), "count" (args: server counter deltas, e.g. {"finished:stop": 1, "in_flight": -1}), "stamp"
    (args: {"requests": [[request_id, times], ...]}: the front end's times of the requests it ended, e.g.
    {"received": t, "sent": t}, for the request log; sent only while the engine keeps one),
    "hello" (args: {"pid": the front end's process id}, sent first), "beat" (nothing: the front end's heartbeat,
    every HEARTBEAT_S, so that the engine can tell a stopped front end from an idle one)."""

    kind: str
    request_id: str = ""
    prompt: list[int] = []
    params: SamplingParams | None = None
    call_id: int = 0
    name: str = ""
    args: dict[str, Any] = {}


class FromEngine(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine to front end. kind: "ready" (value: the engine's info), "step" (outputs, stats), "reply" (call_id,
    value or error), "refused" (request_id, error: the engine would not take the request), "dead" (error: why the
    engine loop stopped; the process exits after it), "dropped" (error: why the engine let this front end go, its
    requests aborted; the front end exits, or is killed), "trace_stop" (value: {"output_dir"}: another front end
    stopped the capture this one traces itself in; stop the trace and write it there)."""

    kind: str
    outputs: list[Delta] = []
    stats: dict[str, Any] | None = None
    call_id: int = 0
    value: Any = None
    error: dict[str, Any] | None = None  # {"status", "message", "code", "param"} for a command, {"message"} else
    request_id: str = ""


_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)
_encoder = msgspec.msgpack.Encoder()


def frame(message: ToEngine | FromEngine) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode_to_engine(body: bytes | memoryview) -> ToEngine:
    return _to_engine.decode(body)


def decode_from_engine(body: bytes | memoryview) -> FromEngine:
    return _from_engine.decode(body)


class FrameError(ValueError):
    """The byte stream is not a sequence of frames."""


class FrameReader:
    """Splits a byte stream into frame bodies, whatever the chunks it arrives in."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        bodies, pos, end = [], 0, len(buf)
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise FrameError(f"a frame of {size} bytes is past the {MAX_FRAME}-byte limit")
            if end - pos - HEADER.size < size:
                break
            start = pos + HEADER.size
            bodies.append(bytes(buf[start:start + size]))
            pos = start + size
        if pos:
            del buf[:pos]
        return bodies
