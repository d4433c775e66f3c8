"""Load, disconnects, overload and engine failure, over real HTTP on the tiny model."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

LONG = {"prompt": "a long answer please", "max_tokens": 3000, "ignore_eos": True}


async def _first_events(resp, n: int) -> None:
    """Read until `n` SSE data events have arrived."""
    seen = 0
    async for raw in resp.content:
        if raw.startswith(b"data: "):
            seen += 1
            if seen == n:
                return


async def test_200_concurrent_streaming_clients_all_complete(serve_tiny, read_sse, wait_metrics):
    async with serve_tiny() as client:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one(i: int) -> list:
                if i % 2:
                    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
                else:
                    path, body = "/v1/completions", {"prompt": f"request number {i}"}
                body.update(max_tokens=4, ignore_eos=True, stream=True, stream_options={"include_usage": True})
                async with session.post(client.make_url(path), json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await read_sse(resp)

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(200)))
            elapsed = time.perf_counter() - t0
        print(f"200 concurrent streaming clients (4 tokens each) completed in {elapsed:.2f}s")
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 4
            assert events[-3]["choices"][0]["finish_reason"] == "length"
        m = await wait_metrics(client, lambda m: m["infertrace:kv_blocks_used"] == 0)
        assert m['infertrace:request_success_total{finished_reason="length"}'] == 200
        assert m["infertrace:num_requests_in_flight"] == 0
        assert m["infertrace:num_requests_running"] == 0 and m["infertrace:kv_blocks_used"] == 0
        assert m["infertrace:generation_tokens_total"] == 800


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
async def test_client_disconnect_mid_stream_aborts_and_frees_blocks(serve_tiny, metrics_of, wait_metrics,
                                                                   async_scheduling):
    async with serve_tiny({"async_scheduling": async_scheduling}) as client:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(client.make_url("/v1/completions"), json={**LONG, "stream": True})
            assert resp.status == 200
            await _first_events(resp, 3)
            during = await metrics_of(client)
            assert during["infertrace:num_requests_running"] == 1
            assert during["infertrace:kv_blocks_used"] > 0
            resp.close()  # drop the connection mid-stream
        after = await wait_metrics(client, lambda m: m["infertrace:kv_blocks_used"] == 0
                                   and m["infertrace:num_requests_in_flight"] == 0)
        assert after["infertrace:kv_blocks_used"] == 0
        assert after["infertrace:num_requests_running"] == 0
        assert after["infertrace:requests_aborted_total"] == 1
        assert after["infertrace:client_disconnects_total"] == 1
        assert after["infertrace:generation_tokens_total"] < 3000
        assert (after["infertrace:overlapped_steps_total"] > 0) == (async_scheduling == "on")


async def test_client_timeout_on_non_streaming_request_aborts_it(serve_tiny, wait_metrics):
    async with serve_tiny() as client:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            try:
                await session.post(client.make_url("/v1/completions"), json=LONG)
            except asyncio.TimeoutError:
                pass
            else:
                raise AssertionError("a 3000-token request on CPU finished within a second")
        after = await wait_metrics(client, lambda m: m["infertrace:num_requests_in_flight"] == 0
                                   and m["infertrace:kv_blocks_used"] == 0)
        assert after["infertrace:requests_aborted_total"] == 1
        assert after["infertrace:kv_blocks_used"] == 0


async def test_past_max_queue_is_503_with_retry_after(serve_tiny, metrics_of, wait_metrics):
    async with serve_tiny({"max_num_seqs": 1}, max_queue=1, retry_after_s=2) as client:
        async with aiohttp.ClientSession() as session:
            running = await session.post(client.make_url("/v1/completions"), json={**LONG, "stream": True})
            await _first_events(running, 1)
            queued = asyncio.ensure_future(session.post(client.make_url("/v1/completions"), json=LONG))
            m = await wait_metrics(client, lambda m: m["infertrace:num_requests_waiting"] == 1)
            assert m["infertrace:num_requests_running"] == 1

            resp = await session.post(client.make_url("/v1/completions"), json={"prompt": "x", "max_tokens": 1})
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "2"
            error = (await resp.json())["error"]
            assert error["code"] == "queue_full" and error["type"] == "service_unavailable_error"
            assert (await metrics_of(client))['infertrace:requests_rejected_total{reason="queue_full"}'] == 1

            queued.cancel()
            running.close()
        await wait_metrics(client, lambda m: m["infertrace:num_requests_in_flight"] == 0)
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status == 200  # room again once the queue drained


async def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(serve_tiny, read_sse):
    async with serve_tiny() as client:
        engine = client.engine
        real_step, steps = engine.step, []

        def failing_step():
            steps.append(1)
            if len(steps) > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.step = failing_step
        resp = await client.post("/v1/completions", json={**LONG, "stream": True})
        assert resp.status == 200
        events = await read_sse(resp)
        assert events[-1] == "[DONE]"
        assert "simulated device failure" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])

        health = await client.get("/health")
        assert health.status == 503
        assert (await health.json())["error"]["code"] == "engine_dead"
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        error = (await resp.json())["error"]  # the engine is gone, not a fault of the server: 503 with why
        assert resp.status == 503 and error["code"] == "engine_dead"
        assert "simulated device failure" in error["message"]


async def test_async_scheduling_serves_the_same_completions(serve_tiny):
    """Concurrent greedy requests of different lengths, with steps planned ahead (async) or not: same answers."""
    bodies = [{"prompt": f"request number {i} asks for text", "max_tokens": 5 + 3 * i, "ignore_eos": True,
               "temperature": 0.0} for i in range(12)]

    async def serve(mode: str) -> list[tuple[str, int]]:
        async with serve_tiny({"async_scheduling": mode}) as client:
            async def one(body):
                resp = await client.post("/v1/completions", json=body)
                assert resp.status == 200
                data = await resp.json()
                return data["choices"][0]["text"], data["usage"]["completion_tokens"]

            answers = list(await asyncio.gather(*(one(b) for b in bodies)))
            assert (client.engine.counters["overlapped_steps"] > 0) == (mode == "on")
            return answers

    sync, overlapped = await serve("off"), await serve("on")
    assert overlapped == sync
    assert [n for _, n in sync] == [b["max_tokens"] for b in bodies]
