"""AsyncEngine: streams match offline generation, abort on close, calls and callbacks in the engine thread."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from infertrace.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from infertrace.engine.outputs import EngineDeadError

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


@pytest.fixture
def aengine(tiny_model_dir):
    return AsyncEngine.from_model(tiny_model_dir, EngineConfig(kv_cache_tokens=4096))


async def collect(aeng, request_id, prompt, params):
    outs = [out async for out in aeng.generate(request_id, prompt, params)]
    return outs


async def test_streams_yield_the_tokens_generate_returns(tiny_model_dir, aengine, make_prompts):
    prompts = make_prompts([9, 50, 120], seed=21)
    expected = LLM(tiny_model_dir, kv_cache_tokens=4096).generate(prompts + prompts, [GREEDY] * 3 + [SEEDED] * 3)
    await aengine.start()
    streams = await asyncio.gather(
        *(collect(aengine, f"g{i}", p, GREEDY) for i, p in enumerate(prompts)),
        *(collect(aengine, f"s{i}", p, SEEDED) for i, p in enumerate(prompts)),
    )
    for outs, want in zip(streams, expected):
        assert [t for o in outs for t in o.new_token_ids] == want.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12
    stats = json.loads(json.dumps(aengine.stats()))
    assert stats["last_step"]["kind"] == "decode"
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0 and stats["counters"]["requests_finished"] == 6
    await aengine.shutdown()


async def test_closing_a_stream_aborts_and_frees_its_blocks(aengine, make_prompts):
    prompt = make_prompts([100], seed=22)[0]
    stream = aengine.generate("a", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    first = await stream.__anext__()
    assert first.new_token_ids and not first.finished
    assert await aengine.call(lambda: aengine.engine.kv_blocks_used) > 0
    await stream.aclose()
    # the abort command is queued before call's, so the blocks are free when the call runs
    assert await aengine.call(lambda: aengine.engine.kv_blocks_used) == 0
    assert aengine.stats()["counters"]["requests_aborted"] == 1
    await aengine.shutdown()


async def test_abort_ends_the_stream(aengine, make_prompts):
    prompt = make_prompts([20], seed=23)[0]
    outs = []

    async def consume():
        async for out in aengine.generate("a", prompt, SamplingParams(max_tokens=500, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 2:
                await aengine.abort("a")

    await asyncio.wait_for(consume(), timeout=60)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert aengine.stats()["kv_blocks_used"] == 0
    await aengine.shutdown()


async def test_errors_reach_the_caller(aengine):
    with pytest.raises(ValueError, match="maximum context"):
        await collect(aengine, "long", list(range(5000)), GREEDY)

    def boom():
        raise RuntimeError("in the engine thread")

    with pytest.raises(RuntimeError, match="in the engine thread"):
        await aengine.call(boom)
    # the loop survives both
    outs = await collect(aengine, "ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert outs[-1].finished
    await aengine.shutdown()


async def test_calls_and_step_callbacks_run_in_the_engine_thread(aengine):
    threads = set()
    kinds = []

    def on_step(stats):
        threads.add(threading.current_thread().name)
        kinds.append(stats.kind)

    aengine.add_step_callback(on_step)
    name = await aengine.call(lambda: threading.current_thread().name)
    await collect(aengine, "a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert threads == {name} and name != threading.current_thread().name
    assert kinds == ["prefill", "decode", "decode"]
    await aengine.shutdown()


async def test_shutdown_can_let_requests_finish(aengine):
    await aengine.start()
    task = asyncio.ensure_future(collect(aengine, "a", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True)))
    await asyncio.sleep(0)  # let the request reach the engine
    while aengine.stats()["counters"]["requests_added"] == 0:
        await asyncio.sleep(0.01)
    await aengine.shutdown(abort_running=False)
    outs = await task
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6


async def test_shutdown_aborts_running_requests(aengine):
    await aengine.start()
    task = asyncio.ensure_future(collect(aengine, "a", [1, 2, 3, 4], SamplingParams(max_tokens=10_000, ignore_eos=True)))
    while aengine.stats()["counters"]["generation_tokens"] == 0:
        await asyncio.sleep(0.01)
    await aengine.shutdown(abort_running=True)
    outs = await asyncio.wait_for(task, timeout=30)
    assert outs[-1].finish_reason == "abort"
    assert aengine.engine.kv_blocks_used == 0


async def test_shutdown_after_the_loop_failed_waits_for_it_and_raises_nothing(aengine):
    """A server whose engine died still shuts down: shutdown() called while the failed loop is still unwinding
    (here held in its failure handling until shutdown has been called) must not raise."""
    from infertrace.engine.async_engine import EngineDeadError

    engine = aengine.engine
    real_step = engine.step

    def failing_step():
        real_step()
        raise RuntimeError("simulated device failure")

    engine.step = failing_step
    shutting_down = threading.Event()
    fail_pending = aengine._fail_pending

    def slow_fail_pending(exc):
        shutting_down.wait(timeout=10)  # the loop thread is still alive when shutdown() looks at it
        fail_pending(exc)

    aengine._fail_pending = slow_fail_pending
    await aengine.start()
    with pytest.raises(RuntimeError, match="simulated device failure"):
        await collect(aengine, "a", [1, 2, 3], GREEDY)
    assert aengine._thread.is_alive()
    threading.Timer(0.2, shutting_down.set).start()
    await aengine.shutdown()
    assert aengine._thread is None
    with pytest.raises(EngineDeadError):
        aengine._put(("stop", True, None))  # the failure stays reported to anyone still calling in


async def test_a_step_reaches_the_event_loop_in_one_handoff(aengine, make_prompts):
    from infertrace.engine import async_engine

    handoffs = []
    post = aengine._post

    def record(fn, *args):
        if fn is async_engine.put_all:
            handoffs.append(len(args[0]))
        post(fn, *args)

    aengine._post = record
    prompts = make_prompts([10, 11, 12, 13], seed=24)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    streams = await asyncio.gather(*(collect(aengine, f"h{i}", p, params) for i, p in enumerate(prompts)))
    assert all(sum(len(o.new_token_ids) for o in outs) == 6 for outs in streams)
    steps = aengine.stats()["counters"]["steps"]
    # every output went through a handoff; decode steps with all four running hand four outputs over at once
    assert sum(handoffs) == sum(len(outs) for outs in streams) and len(handoffs) <= steps
    assert max(handoffs) == 4
    await aengine.shutdown()


async def test_a_failed_loop_gives_each_stream_an_engine_dead_error_of_its_own(aengine, caplog):
    """Each waiting stream gets its own EngineDeadError naming the failure (one instance raised in every stream
    gathered each raise's frames into one ever-longer traceback), and the failure is logged once."""
    import logging

    engine = aengine.engine
    real_step = engine.step

    def failing_step():
        if engine.counters["steps"] >= 2:
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.step = failing_step
    with caplog.at_level(logging.ERROR, logger="infertrace.engine"):
        results = await asyncio.gather(*(collect(aengine, f"f{i}", [1, 2, 3], GREEDY) for i in range(3)),
                                       return_exceptions=True)
    assert all(isinstance(e, EngineDeadError) and "simulated device failure" in str(e) for e in results)
    assert len({id(e) for e in results}) == 3
    assert [r.getMessage() for r in caplog.records] == ["the engine loop failed"]
    await aengine.shutdown()

