"""What the handlers share (ServerState): an ended app lets go of its engine."""

from __future__ import annotations

import gc
import weakref


async def test_an_ended_app_does_not_keep_its_engine_alive(serve_tiny):
    # aiohttp caches each app's middleware chain in a module-level LRU (1,024 entries) that outlives the app; an
    # app that still held its engine kept the model and the KV cache with it (about 190 MB a test on the tiny model).
    async with serve_tiny() as client:
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert resp.status == 200  # a request through the middleware puts the app in aiohttp's cache
        engine = weakref.ref(client.engine)
        handle = weakref.ref(client.state.engine)
        state = client.state
    del client
    gc.collect()
    assert state.engine is None and state.tokenizer is None
    assert handle() is None, "the engine handle outlived its app"
    assert engine() is None, "the engine outlived its app"


class _Engine:
    """An engine handle whose aborts are answered only once `answer_after` of them are waiting: the drain passes
    only if it sends every abort before it awaits the first answer."""

    info = {"max_model_len": 64}

    def __init__(self, answer_after: int) -> None:
        import asyncio

        self.answer_after = answer_after
        self.asked: list[str] = []
        self.answered = asyncio.Event()
        self.done: dict[str, asyncio.Event] = {}

    def stats(self) -> dict:
        return {"running": 0}

    def count(self, deltas: dict) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        self.asked.append(request_id)
        if len(self.asked) == self.answer_after:
            self.answered.set()
        await self.answered.wait()
        self.done[request_id].set()  # its handler ends, as an aborted stream's does


class _Tokenizer:
    def get_vocab(self) -> dict:
        return {"abc": 0}


def _state(tiny_model_dir, engine):
    from infertrace.server.frontend.state import ServerState
    from infertrace.server.settings import ServerSettings

    return ServerState(engine, _Tokenizer(), ServerSettings(model_dir=str(tiny_model_dir), served_model_name="tiny"))


async def _in_flight(state, engine, n: int) -> list:
    import asyncio

    async def handler(request_id: str) -> None:
        with state.admitted(request_id):
            await engine.done[request_id].wait()

    ids = [f"r{i}" for i in range(n)]
    for request_id in ids:
        engine.done[request_id] = asyncio.Event()
    tasks = [asyncio.ensure_future(handler(request_id)) for request_id in ids]
    await asyncio.sleep(0)  # each handler is admitted
    assert len(state.in_flight) == n
    return tasks


async def test_past_the_grace_time_every_request_is_aborted_in_one_trip_to_the_engine(tiny_model_dir):
    import asyncio

    engine = _Engine(answer_after=60)
    state = _state(tiny_model_dir, engine)
    tasks = await _in_flight(state, engine, 60)
    # one abort at a time would wait for ever on the first answer (60 streams took 84 s to stop this way)
    aborted = await asyncio.wait_for(state.drain(grace_s=0), timeout=30)
    assert aborted == 60 and sorted(engine.asked) == sorted(f"r{i}" for i in range(60))
    assert not state.in_flight
    await asyncio.gather(*tasks)


async def test_a_second_signal_aborts_at_once_whatever_the_grace_time(tiny_model_dir):
    import asyncio

    engine = _Engine(answer_after=3)
    state = _state(tiny_model_dir, engine)
    tasks = await _in_flight(state, engine, 3)
    abort_now = asyncio.Event()
    drain = asyncio.ensure_future(state.drain(grace_s=3600, abort_now=abort_now))
    await asyncio.sleep(0)
    assert state.draining and not drain.done() and not engine.asked  # within the grace time nothing is aborted
    abort_now.set()
    assert await asyncio.wait_for(drain, timeout=30) == 3
    await asyncio.gather(*tasks)
