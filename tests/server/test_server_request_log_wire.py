"""What the request log and the server counters put on the front end's link to the engine process: the front end's
times of a request and its counter updates ride in front of a message sent anyway, or go in one write at the end of
a turn of the event loop; nothing of the log crosses for a log switched off."""

from __future__ import annotations

import asyncio

from infertrace.server.engine_link.messages import FrameReader, decode_to_engine

BODY = {"model": "tiny", "prompt": "the model token batch", "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def spy_on_writes(engine) -> list[list[str]]:
    """The kinds of the messages in each write the front end makes to the engine process from now on."""
    transport, writes = engine._transport, []
    write = transport.write

    def recorded(data):
        writes.append([decode_to_engine(body).kind for body in FrameReader().feed(bytes(data))])
        return write(data)

    transport.write = recorded
    return writes


async def test_stamps_never_take_a_write_of_their_own_and_reach_the_log(serve_tiny):
    async with serve_tiny(engine_process=True) as client:
        writes = spy_on_writes(client.state.engine)
        names = [f"w{i}" for i in range(6)]
        answers = await asyncio.gather(*(client.post("/v1/completions", json=BODY, headers={"X-Request-Id": name})
                                         for name in names))
        assert [a.status for a in answers] == [200] * 6
        # read through the same link at once, without waiting: the times went ahead of this read
        log = await (await client.get("/v1/request_log")).json()
    stamped = [w for w in writes if "stamp" in w]
    assert stamped and all(len(w) > 1 for w in stamped), writes
    by_id = {r["request_id"]: r for r in log["requests"]}
    for name in names:
        rec = by_id[name]
        assert rec["received"] <= rec["tokenized"] <= rec["first_output"] <= rec["sent"], rec


async def test_no_stamps_cross_when_the_engine_keeps_no_log(serve_tiny):
    async with serve_tiny({"request_log_size": 0}, engine_process=True) as client:
        writes = spy_on_writes(client.state.engine)
        for i in range(3):
            resp = await client.post("/v1/completions", json=BODY)
            assert resp.status == 200
            await resp.read()
        await asyncio.sleep(0.05)  # a turn of the event loop for anything still to go out
    kinds = [kind for w in writes for kind in w]
    assert "add" in kinds and "stamp" not in kinds, kinds


async def test_a_request_takes_two_writes_its_counts_riding_them(serve_tiny):
    """One request alone: its admission's count goes in front of its "add", and its end's counts (finished, no
    longer in flight) and times go in one write: two writes where there were four. /metrics sees every count."""
    async with serve_tiny(engine_process=True) as client:
        writes = spy_on_writes(client.state.engine)
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 200
        await resp.read()
        await asyncio.sleep(0.05)  # the end's write goes at the end of the handler's turn of the event loop
        # the heartbeat (a bare write every HEARTBEAT_S, never carrying anything held) may fall in between
        assert [w for w in writes if w != ["beat"]] == [["count", "add"], ["count", "stamp"]], writes
        metrics = await (await client.get("/metrics")).text()
    lines = metrics.splitlines()
    success = [line for line in lines if line.startswith("infertrace:request_success_total{")]
    assert any('finished_reason="length"' in line and line.endswith(" 1") for line in success), success
    assert 'infertrace:num_requests_in_flight{model_name="tiny"} 0' in lines


def test_a_first_token_is_handed_over_before_the_steps_direct_writes():
    """A step's message wakes the handlers waiting for a first token before its direct (sink) writes go out, and a
    stream with a sink keeps its outputs in order, its last one included, across messages of one turn."""
    from infertrace.engine.outputs import OutputStream
    from infertrace.server.engine_link.client import ProcessEngine, _Link
    from infertrace.server.engine_link.messages import Delta, FromEngine, frame

    def delta(request_id, text, finished=False):
        return Delta(request_id, [1], text, finished, "length" if finished else None, 4, 1, 0)

    async def main():
        engine, seen = ProcessEngine(sock=None), []
        streaming, starting = OutputStream(), OutputStream()
        engine._streams.update({"streaming": streaming, "starting": starting})
        streaming.sink = lambda out: not out.finished and (seen.append(("sink", out.new_text)) or True)

        async def handler():
            async for out in starting.drain():
                seen.append(("handler", out.new_text))

        async def reader():
            async for out in streaming.drain():
                seen.append(("reader", out.new_text))

        tasks = [asyncio.create_task(handler()), asyncio.create_task(reader())]
        await asyncio.sleep(0)
        link = _Link(engine)  # one read that holds two steps' messages
        link.data_received(frame(FromEngine("step", outputs=[delta("streaming", "a"), delta("starting", "first", True)]))
                           + frame(FromEngine("step", outputs=[delta("streaming", "b"), delta("streaming", "end", True)])))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return seen

    assert asyncio.run(main()) == [("handler", "first"), ("sink", "a"), ("sink", "b"), ("reader", "end")]
