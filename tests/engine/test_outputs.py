"""OutputStream: the one loop that reads a request's outputs, in the in-process engine and the engine process's
client alike."""

import asyncio

import pytest

from infertrace.engine.outputs import OutputStream, RequestOutput, put_all


def out(n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[n], new_text="", finished=finished,
                         finish_reason="stop" if finished else None, num_prompt_tokens=1, num_output_tokens=n,
                         num_cached_tokens=0)


async def test_drain_yields_in_order_until_the_finished_output_and_waits_for_late_ones():
    stream = OutputStream()
    stream.put(out(1))
    got = []

    async def read():
        async for item in stream.drain():
            got.append(item.new_token_ids[0])

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    assert got == [1] and not reader.done()  # waiting for more
    stream.put(out(2))
    stream.put(out(3, finished=True))
    stream.put(out(4))  # after the finished one: never read
    await asyncio.wait_for(reader, 1)
    assert got == [1, 2, 3] and stream.finished


async def test_an_exception_put_in_is_raised_in_the_reader_and_the_stream_is_not_finished():
    stream = OutputStream()
    stream.put(out(1))
    stream.put(ValueError("the engine refused the request"))
    seen = []
    with pytest.raises(ValueError, match="refused"):
        async for item in stream.drain():
            seen.append(item)
    assert len(seen) == 1 and not stream.finished


async def test_a_sink_takes_outputs_only_while_nothing_is_queued():
    stream = OutputStream()
    taken = []
    stream.sink = lambda item: taken.append(item) or item.new_token_ids[0] != 2
    stream.put(out(1))
    stream.put(out(2))  # refused by the sink: queued
    stream.put(out(3, finished=True))  # something is queued: the sink is skipped to keep the order
    assert [o.new_token_ids[0] for o in taken] == [1, 2]
    assert [o.new_token_ids[0] async for o in stream.drain()] == [2, 3]


async def test_a_handoff_wakes_first_token_handlers_before_its_sink_writes():
    """A step's outputs that a sink writes straight to a socket wait for the next turn of the event loop, after the
    handlers the step woke (the in-process engine and the engine process's client both hand over through put_all);
    a stream keeps its order, its last output included."""

    def delta(request_id, text, finished=False):
        return RequestOutput(request_id=request_id, new_token_ids=[1], new_text=text, finished=finished,
                             finish_reason="length" if finished else None, num_prompt_tokens=4,
                             num_output_tokens=1, num_cached_tokens=0)

    seen = []
    streaming, starting = OutputStream(), OutputStream()
    streaming.sink = lambda o: not o.finished and (seen.append(("sink", o.new_text)) or True)

    async def read(stream, name):
        async for o in stream.drain():
            seen.append((name, o.new_text))

    tasks = [asyncio.create_task(read(starting, "handler")), asyncio.create_task(read(streaming, "reader"))]
    await asyncio.sleep(0)
    put_all([(streaming, delta("s", "a")), (starting, delta("f", "first", True))])
    put_all([(streaming, delta("s", "b")), (streaming, delta("s", "end", True))])
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert seen == [("handler", "first"), ("sink", "a"), ("sink", "b"), ("reader", "end")]
