"""Response bodies and SSE framing, without a server."""

from __future__ import annotations

import json

from infertrace.server.frontend.protocol import Endpoint, StreamOptions
from infertrace.server.frontend.stream import SSE_DONE, ResponseBuilder, sse, usage


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_chunks():
    b = ResponseBuilder(Endpoint.CHAT, "m", "chatcmpl-1")
    role = b.role_chunk(usage(5, 0))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "usage" not in role
    assert b.chunk("hi", None, usage(5, 1))["choices"][0]["delta"] == {"content": "hi"}
    assert b.chunk("", None, usage(5, 2))["choices"][0]["delta"] == {"content": ""}
    last = b.chunk("", "stop", usage(5, 3))
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert last["object"] == "chat.completion.chunk" and last["model"] == "m" and last["id"] == "chatcmpl-1"


def test_usage_in_stream_chunks_follows_stream_options():
    u = usage(5, 2, cached_tokens=3)
    assert u == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                 "prompt_tokens_details": {"cached_tokens": 3}}
    plain = ResponseBuilder(Endpoint.COMPLETIONS, "m", "cmpl-1")
    assert "usage" not in plain.chunk("x", None, u)
    final_only = ResponseBuilder(Endpoint.COMPLETIONS, "m", "cmpl-1", StreamOptions(include_usage=True))
    assert final_only.chunk("x", None, u)["usage"] is None
    tail = final_only.usage_chunk(u)
    assert tail["choices"] == [] and tail["usage"] == u and tail["object"] == "text_completion"
    continuous = ResponseBuilder(Endpoint.COMPLETIONS, "m", "cmpl-1",
                                 StreamOptions(include_usage=True, continuous_usage_stats=True))
    assert continuous.chunk("x", None, u)["usage"] == u


def test_non_streaming_bodies():
    u = usage(1, 2)
    chat = ResponseBuilder(Endpoint.CHAT, "m", "chatcmpl-1").full("hello", "length", u)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert chat["usage"] == u
    text = ResponseBuilder(Endpoint.COMPLETIONS, "m", "cmpl-1").full("hello", "stop", u)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hello"
    json.dumps(text)
