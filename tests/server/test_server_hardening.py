"""Hostile requests: a request-supplied chat template, huge prompts and lists, browser-style bodies, and values that
used to reach the engine or the tokenizer unchecked; each is a clean 4xx and the server keeps answering."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

import pytest

from infertrace.server.frontend.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hello"}]
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def _server_errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("infertrace") and r.levelno >= logging.ERROR]


async def _error_of(resp, status: int = 400) -> dict:
    assert resp.status == status, await resp.text()
    return (await resp.json())["error"]


# ----- chat templates -----
async def test_a_request_cannot_supply_its_own_chat_template(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 1,
                                             "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}})
        error = await _error_of(resp)
        assert error["param"] == "chat_template_kwargs" and "chat_template" in error["message"]
        for kwargs in ({"tools": []}, {"enable_thinking": "no"}, {"tokenize": True}):
            resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs})
            assert (await _error_of(resp))["param"] == "chat_template_kwargs"
        # the allow-listed ones still work, add_generation_prompt included (it used to be a duplicate argument)
        resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 1, "chat_template_kwargs": {
            "enable_thinking": False, "add_generation_prompt": True}})
        assert resp.status == 200, await resp.text()


@contextlib.contextmanager
def _threads_calling(obj, name: str):
    """The threads that call `obj.name` inside the block, in call order."""
    real, threads = getattr(obj, name), []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    setattr(obj, name, recording)
    try:
        yield threads
    finally:
        delattr(obj, name)


async def test_the_chat_template_renders_off_the_event_loop(serve_tiny):
    async with serve_tiny() as client:
        with _threads_calling(client.state.tokenizer, "apply_chat_template") as threads:
            assert (await client.post(CHAT, json={"messages": USER, "max_tokens": 1})).status == 200
        assert threads and threads[0] is not threading.main_thread()
        assert threads[0].name.startswith("infertrace-tokenize")


async def test_a_short_prompt_tokenizes_on_the_loop_and_a_long_one_off_it(serve_tiny):
    from infertrace.server.frontend.state import INLINE_TOKENIZE_CHARS

    async with serve_tiny() as client:
        with _threads_calling(client.state.tokenizer, "encode") as threads:
            for prompt in ("hello " * (INLINE_TOKENIZE_CHARS // 6), "hello " * (INLINE_TOKENIZE_CHARS // 6 + 1)):
                resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                assert resp.status == 200, await resp.text()
        assert len(threads) == 2
        assert threads[0] is threading.main_thread()  # at most INLINE_TOKENIZE_CHARS characters: on the loop
        assert threads[1].name.startswith("infertrace-tokenize")  # one word more: on a tokenizer thread


# ----- big prompts -----
async def test_health_answers_within_100ms_while_big_prompts_tokenize(serve_tiny):
    async with serve_tiny() as client:
        big = "hello world " * (client.state.limits.max_chars // 12)  # as big as the cheap bound lets through
        assert len(big) <= client.state.limits.max_chars
        body = json.dumps({"prompt": big, "max_tokens": 1}).encode()  # the client shares the loop: encode once
        assert (await client.get("/health")).status == 200  # connection and engine warm
        posts = [asyncio.ensure_future(client.post("/v1/completions", data=body,
                                                   headers={"Content-Type": "application/json"}))
                 for _ in range(12)]
        latencies = []
        while not all(p.done() for p in posts):
            t0 = time.perf_counter()
            resp = await client.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert resp.status == 200
            await asyncio.sleep(0.005)
        for p in posts:  # tokenized, then refused for its length: the tokenization did happen
            error = await _error_of(p.result())
            assert error["code"] == "context_length_exceeded" and "tokens" in error["message"]
        assert len(latencies) >= 3
        assert max(latencies) < 0.1, f"/health took {max(latencies) * 1e3:.0f} ms while prompts were tokenized"


async def test_a_prompt_too_long_to_fit_is_refused_before_tokenization(serve_tiny):
    async with serve_tiny() as client:
        state = client.state
        calls = []
        real = state._encode
        state._encode = lambda *a, **k: calls.append(1) or real(*a, **k)
        over = "x" * (state.limits.max_chars + 1)
        error = await _error_of(await client.post("/v1/completions", json={"prompt": over}))
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert f"{state.limits.max_chars + 1} characters" in error["message"]
        error = await _error_of(await client.post(CHAT, json={"messages": [{"role": "user", "content": over}]}))
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        many = [{"role": "user", "content": ""}] * (state.max_model_len + 1)
        error = await _error_of(await client.post(CHAT, json={"messages": many}))
        assert error["param"] == "messages"
        assert calls == []
        # the bound is safe: the longest vocabulary entry repeated to fill it is still too many tokens
        assert state.limits.max_chars == state.max_model_len * max(map(len, state.tokenizer.get_vocab()))


# ----- list parameters -----
@pytest.mark.parametrize(("field", "value"), [
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop", "x" * (MAX_STOP_STRING_CHARS + 1)),
])
async def test_list_parameters_are_bounded(serve_tiny, field, value):
    async with serve_tiny() as client:
        error = await _error_of(await client.post("/v1/completions", json={"prompt": "x", field: value}))
        assert error["param"] == field and "at most" in error["message"]


async def test_limits_themselves_are_accepted_and_refusals_stay_short(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 1, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
            "stop": ["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS})
        assert resp.status == 200, await resp.text()
        error = await _error_of(await client.post("/v1/completions", json={
            "prompt": "x", "logit_bias": {str(i): 1 for i in range(100_000)}}))
        assert error["param"] == "logit_bias" and len(error["message"]) < 200


# ----- browser-reachable side effects -----
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
async def test_form_and_text_bodies_are_415(serve_tiny, tmp_path, content_type):
    async with serve_tiny(profile_dir=tmp_path) as client:
        body = b'{"prompt": "x", "max_tokens": 1}'
        resp = await client.post("/v1/completions", data=body, headers={"Content-Type": content_type})
        assert (await _error_of(resp, 415))["code"] == "unsupported_media_type"
        for path, data in (("/start_profile", b""), ("/start_profile", b"{}"), ("/stop_profile", b"")):
            resp = await client.post(path, data=data, headers={"Content-Type": content_type})
            assert resp.status == 415
        assert list(tmp_path.iterdir()) == []  # no capture was started


async def test_json_media_types_are_taken(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        for content_type in ("application/json; charset=utf-8", "application/vnd.api+json", "Application/JSON"):
            resp = await client.post("/v1/completions", data=b'{"prompt": "x", "max_tokens": 1}',
                                     headers={"Content-Type": content_type})
            assert resp.status == 200, (content_type, await resp.text())
        resp = await client.post("/v1/completions", data=b'{"prompt": "x", "max_tokens": 1}')  # no type
        assert resp.status == 415
        resp = await client.post("/start_profile", skip_auto_headers=["Content-Type"])  # curl -X POST
        assert resp.status == 200, await resp.text()
        assert (await client.post("/stop_profile", skip_auto_headers=["Content-Type"])).status == 200


async def test_profiler_routes_are_post_only(serve_tiny, tmp_path):
    async with serve_tiny(profile_dir=tmp_path) as client:
        for path in ("/start_profile", "/stop_profile"):
            resp = await client.get(path)
            assert (await _error_of(resp, 405))["code"] == "method_not_allowed"
        assert list(tmp_path.iterdir()) == []


# ----- values that used to be 500s -----
@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": -Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", b'{"prompt": "x", "seed": 9223372036854775808}', "seed"),
    ("/start_profile", b'{"output_dir": "a\\u0000b"}', "output_dir"),
    ("/start_profile", b'{"output_dir": "\\ud800"}', "output_dir"),
])
async def test_bad_values_are_400_naming_the_field_without_a_traceback(serve_tiny, tmp_path, caplog, path, raw,
                                                                      param):
    async with serve_tiny(profile_dir=tmp_path) as client:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        error = await _error_of(resp)
        assert error["param"] == param, error
        assert "Overflow" not in error["message"] and "internal" not in error["message"]
    assert _server_errors(caplog) == []


async def test_deeply_nested_json_is_400_without_a_traceback(serve_tiny, caplog):
    async with serve_tiny() as client:
        raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        assert (await _error_of(resp))["code"] == "invalid_json"
        assert (await client.get("/health")).status == 200
    assert _server_errors(caplog) == []


async def test_seeds_across_the_accepted_range_generate(serve_tiny):
    async with serve_tiny() as client:
        for seed in (0, 2**63 - 1, -(2**63)):
            resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": seed,
                                                              "temperature": 1.0})
            assert resp.status == 200, (seed, await resp.text())
