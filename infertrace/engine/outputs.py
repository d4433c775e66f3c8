"""What the engine hands out: per-request token deltas, per-step statistics, finished completions."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error (or its process exited); no more requests can run."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental text; stop strings already cut
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class StepStats:
    index: int
    kind: str  # "prefill" | "decode" | "mixed"
    batch_size: int
    num_tokens: int
    duration_s: float
    prefix_cache_hits: int  # prompt tokens served from the prefix cache in this step
    preemptions: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0  # after the step
    num_waiting: int = 0
    kv_blocks_used: int = 0
    # KV offload (zero when off)
    cpu_prefix_cache_hits: int = 0  # prompt tokens loaded from the host tier in this step
    recomputed_tokens: int = 0  # prompt tokens admitted for computing again although computed once before
    offload_bytes_h2d: int = 0  # bytes queued host to device in this step
    offload_bytes_d2h: int = 0
    offload_transfer_s: float = 0.0  # copy time accounted in this step (copies finish asynchronously on CUDA)
    long_context: bool = False  # a step of a request whose KV lives in host memory


@dataclass(slots=True)
class Completion:
    """One prompt's result from LLM.generate."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class OutputStream:
    """One request's outputs on their way to the coroutine that reads them, and the one loop that reads them: the
    in-process engine (`AsyncEngine`) and the engine process's client in the front end both use it. Lighter than an
    asyncio.Queue, which matters at a few hundred streams times a token each per step. Touched only on the event
    loop."""

    __slots__ = ("items", "waiter", "sink", "finished")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.sink: Callable[[Any], bool] | None = None  # takes an output before `drain` would (False: not taken)
        self.finished = False

    def put(self, item: Any) -> None:
        """An output, or an exception that `drain` raises in the reader."""
        sink = self.sink
        if sink is not None and not self.items and not isinstance(item, BaseException) and sink(item):
            return
        self.items.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> AsyncIterator[Any]:
        """Yield outputs until a finished one (then `finished` is True); an exception put in is raised here."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.items:
                self.waiter = loop.create_future()
                await self.waiter
            item = self.items.popleft()
            if isinstance(item, BaseException):
                raise item
            self.finished = item.finished
            yield item
            if self.finished:
                return


def put_all(handoff: Iterable[tuple[OutputStream, Any]]) -> None:
    """A step's outputs into their streams, on the event loop. Those a stream's sink writes straight to its socket
    wait for the next turn of the loop, so the handlers woken here (a first token) write before them: each sink write
    is a send of its own, and at a hundred streams a first token would otherwise wait for all of them. A stream's
    outputs keep their order: while it has a sink, every one of them waits."""
    later = []
    for stream, item in handoff:
        if stream.sink is None:
            stream.put(item)
        else:
            later.append((stream, item))
    if later:
        asyncio.get_running_loop().call_soon(_put_each, later)


def _put_each(handoff: list[tuple[OutputStream, Any]]) -> None:
    for stream, item in handoff:
        stream.put(item)
