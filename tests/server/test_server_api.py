"""The OpenAI routes and info endpoints over real HTTP, on the tiny model."""

from __future__ import annotations

import pytest


def _check_error_body(body: dict, status_type: str) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == status_type and error["message"]
    return error


async def test_completion_non_streaming(serve_tiny):
    async with serve_tiny() as client:
        prompt = "the model token batch"
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                                          "temperature": 0})
        assert resp.status == 200
        body = await resp.json()
        expected_prompt_tokens = len(client.state.tokenizer.encode(prompt))
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["id"].startswith("cmpl-")
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == expected_prompt_tokens
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["total_tokens"] == expected_prompt_tokens + 5


async def test_completion_prompt_as_token_ids_and_model_optional(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 2})
        assert resp.status == 200
        body = await resp.json()
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2
        # a batch of one, as vLLM's benchmark sends it
        resp = await client.post("/v1/completions", json={"prompt": [[11, 12, 13]], "max_tokens": 1})
        assert (await resp.json())["usage"]["prompt_tokens"] == 3


async def test_chat_streaming_with_continuous_usage(serve_tiny, read_sse):
    async with serve_tiny() as client:
        messages = [{"role": "user", "content": "hello there"}]
        resp = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
        assert events[-1] == "[DONE]"
        role, *content, usage_chunk, _ = events
        template = client.state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_tokens = len(client.state.tokenizer.encode(template, add_special_tokens=False))

        assert role["object"] == "chat.completion.chunk"
        assert role["choices"][0]["delta"]["role"] == "assistant"
        # one chunk per generated token; usage counts them as they come
        assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4]
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in content)
        assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 4
        assert usage_chunk["usage"]["total_tokens"] == prompt_tokens + 4
        assert len({e["id"] for e in events[:-1]}) == 1


async def test_streaming_usage_options(serve_tiny, read_sse):
    async with serve_tiny() as client:
        base = {"prompt": "hello", "max_tokens": 3, "stream": True}
        events = await read_sse(await client.post("/v1/completions", json=base))
        assert events[-1] == "[DONE]" and len(events) == 4
        assert all("usage" not in e for e in events[:-1])
        assert [e["object"] for e in events[:-1]] == ["text_completion"] * 3

        events = await read_sse(await client.post(
            "/v1/completions", json={**base, "stream_options": {"include_usage": True}}))
        *chunks, final, done = events
        assert [c["usage"] for c in chunks] == [None, None, None]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3


async def test_chat_non_streaming(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 3, "temperature": 0.7, "top_k": 5, "top_p": 0.5, "seed": 1})
        assert resp.status == 200
        body = await resp.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3


async def test_finish_reason_stop_on_stop_token(serve_tiny):
    async with serve_tiny() as client:
        from infertrace.engine import SamplingParams

        # the first greedy token, asked of the engine itself (its text is empty on the tiny model)

        outs = [o async for o in client.state.engine.generate("probe", client.state.tokenizer.encode("hello world"),
                                                            SamplingParams(max_tokens=1))]
        token = outs[-1].new_token_ids[0]
        resp = await client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 20,
                                                          "temperature": 0, "stop_token_ids": [token]})
        body = await resp.json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 1


async def test_stop_string_cuts_text_and_seed_repeats(serve_tiny):
    async with serve_tiny() as client:
        base = {"prompt": "hello", "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
        for seed in range(30):  # most ids of the tiny model decode to nothing: find a seed that gives text
            body = await (await client.post("/v1/completions", json={**base, "seed": seed})).json()
            text = body["choices"][0]["text"]
            if len(text.strip()) >= 2:
                break
        else:
            pytest.fail("no seed produced text")
        again = await (await client.post("/v1/completions", json={**base, "seed": seed})).json()
        assert again["choices"][0]["text"] == text  # same seed, same output
        stop = text.strip()[:2]
        body = await (await client.post("/v1/completions", json={**base, "seed": seed, "stop": [stop]})).json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["choices"][0]["text"] == text[:text.index(stop)]


async def test_models_health_version_server_info(serve_tiny):
    async with serve_tiny(max_queue=7) as client:
        models = await (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == client.state.max_model_len

        health = await client.get("/health")
        assert health.status == 200

        import infertrace

        assert (await (await client.get("/version")).json())["version"] == infertrace.__version__

        info = await (await client.get("/server_info")).json()
        assert info["model"] == "tiny" and info["max_model_len"] == client.state.max_model_len
        assert info["attention_backend"] == "torch (batched)" and info["cuda_graphs_captured"] is False
        assert info["async_scheduling"] is False and info["skinny_gemm"] is False  # CPU: both stay off
        assert info["engine_config"] == {"kv_cache_tokens": 16384}
        assert info["server"]["max_queue"] == 7
        assert info["versions"]["torch"] and info["versions"]["infertrace"] == infertrace.__version__
        assert info["device"]["type"] == "cpu"


async def test_metrics_count_tokens_and_steps(serve_tiny, metrics_of, wait_metrics):
    async with serve_tiny() as client:
        before = await metrics_of(client)
        assert before["infertrace:kv_blocks_total"] == 16384 // 16
        assert before["infertrace:num_requests_running"] == 0
        await client.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 4})
        await client.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 4})  # same prefix
        decode_steps = 'infertrace:step_duration_seconds_bucket{kind="decode",le="+Inf"}'
        after = await wait_metrics(client, lambda m: m["infertrace:generation_tokens_total"] == 8
                                   and m.get(decode_steps) == 6)
        assert after["infertrace:prompt_tokens_total"] == 80
        assert after["infertrace:generation_tokens_total"] == 8
        assert after["infertrace:prefix_cache_hits_total"] > 0
        assert 0 < after["infertrace:prefix_cache_hit_rate"] < 1
        assert after['infertrace:request_success_total{finished_reason="length"}'] == 2
        steps = sum(v for k, v in after.items() if k.startswith("infertrace:step_duration_seconds_count"))
        assert steps == 8  # one prefill and three decodes per request
        assert after[decode_steps] == 6
        assert after["infertrace:kv_blocks_used"] == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": -5}, "top_k"),
    ],
)
async def test_invalid_parameters_are_400(serve_tiny, path, body, param):
    async with serve_tiny() as client:
        resp = await client.post(path, json=body)
        assert resp.status == 400
        error = _check_error_body(await resp.json(), "invalid_request_error")
        assert error["param"] == param


@pytest.mark.parametrize("raw", [b'{"prompt": "hi"', b"", b"[1, 2]", b"\xff\xfe"])
async def test_malformed_json_is_400(serve_tiny, raw):
    async with serve_tiny() as client:
        resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert _check_error_body(await resp.json(), "invalid_request_error")["code"] == "invalid_json"


async def test_unknown_model_is_404(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": "gpt-5", "messages": [{"role": "user", "content": "x"}]})
        assert resp.status == 404
        error = _check_error_body(await resp.json(), "not_found_error")
        assert error["param"] == "model" and "gpt-5" in error["message"]


async def test_prompt_beyond_context_is_400_naming_the_limit(serve_tiny):
    async with serve_tiny({"max_model_len": 64}) as client:
        resp = await client.post("/v1/completions", json={"prompt": [7] * 100})
        assert resp.status == 400
        error = _check_error_body(await resp.json(), "invalid_request_error")
        assert error["code"] == "context_length_exceeded"
        assert "100 tokens" in error["message"] and "64" in error["message"]

        resp = await client.post("/v1/completions", json={"prompt": [7] * 60, "max_tokens": 10})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == "max_tokens" and "64" in error["message"]

        # no max_tokens: generation runs to the end of the context
        body = await (await client.post("/v1/completions", json={"prompt": [7] * 60, "ignore_eos": True})).json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"


async def test_unknown_route_method_and_big_body_get_json_errors(serve_tiny):
    async with serve_tiny(max_body_mb=1) as client:
        resp = await client.get("/v1/nothing")
        assert resp.status == 404
        _check_error_body(await resp.json(), "not_found_error")

        resp = await client.get("/v1/completions")
        assert resp.status == 405
        _check_error_body(await resp.json(), "invalid_request_error")

        resp = await client.post("/v1/completions", data=b"x" * (2 * 1024 * 1024),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 413
        assert "too large" in _check_error_body(await resp.json(), "invalid_request_error")["message"]


@pytest.mark.parametrize("engine_process", [False, True])
async def test_the_prefix_cache_is_reset_by_vllms_and_sglangs_routes(serve_tiny, engine_process):
    prompt = {"prompt": list(range(100, 164)), "max_tokens": 2, "ignore_eos": True}  # 4 full blocks of 16

    async def cached(client) -> int:
        resp = await client.post("/v1/completions", json=prompt)
        assert resp.status == 200
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with serve_tiny(engine_process=engine_process) as client:
        assert await cached(client) == 0
        assert await cached(client) == 48  # the same prompt again: its full blocks but the last one's
        resp = await client.post("/reset_prefix_cache")  # vLLM's bare POST
        assert resp.status == 200 and await resp.json() == {"success": True}
        assert await cached(client) == 0
        assert await cached(client) == 48
        resp = await client.post("/flush_cache")  # SGLang's
        assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")
        assert await cached(client) == 0

        # while a request runs, both refuse as the peers do, and the cache stays
        stream = await client.post("/v1/completions", json={"prompt": "busy", "max_tokens": 3000,
                                                            "ignore_eos": True, "stream": True})
        await stream.content.readline()  # it runs
        assert await (await client.post("/reset_prefix_cache")).json() == {"success": False}
        busy = await client.post("/flush_cache")
        assert busy.status == 400 and "running or waiting" in await busy.text()
        stream.close()  # the client goes: its request is aborted, and ?timeout waits for that
        resp = await client.post("/flush_cache?timeout=600")
        assert resp.status == 200, await resp.text()

        refused = await client.post("/reset_prefix_cache?reset_running_requests=true")
        assert refused.status == 400 and (await refused.json())["error"]["param"] == "reset_running_requests"
        assert (await client.post("/flush_cache?timeout=-1")).status == 400
        assert (await client.get("/flush_cache")).status == 405  # a side effect takes POST only
        form = await client.post("/flush_cache", data="x=1",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert form.status == 415
