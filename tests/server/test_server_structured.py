"""Structured output in infertrace serve: response_format json_schema and json_object are honoured through
llguidance (the output holds to the schema, on a thread and with the engine in its own process); a bad schema is
one 400; tool calls and vLLM's guided_* keys are refused with a 400 that says so, never answered unconstrained."""

from __future__ import annotations

import asyncio
import json

import pytest

from infertrace.load.workloads.structured import violation
from infertrace.server.frontend.protocol import ApiError, Endpoint, parse_generate_request

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
          "required": ["a", "size"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("structured_outputs", {"json": SCHEMA}),
    ("guided_json", SCHEMA),
    ("guided_choice", ["a", "b"]),
])
def test_tool_calls_and_guided_keys_are_refused_with_a_400_that_says_so(field, value):
    with pytest.raises(ApiError) as err:
        parse_generate_request({"messages": USER, field: value}, Endpoint.CHAT)
    assert err.value.status == 400 and err.value.param == field
    assert err.value.message.startswith(f"structured output is not supported: this server cannot honour {field}=")
    assert "response_format json_schema and json_object only" in err.value.message


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
                                   {"tool_choice": "auto"}, {"tools": []}])
def test_unconstrained_spellings_pass(extra):
    req = parse_generate_request({"messages": USER, **extra}, Endpoint.CHAT)
    assert req.messages == USER and "grammar" not in req.sampling  # a plain request's sampling as before


@pytest.mark.parametrize("response_format", [JSON_SCHEMA, {"type": "json_object"}])
def test_a_json_response_format_becomes_a_grammar(response_format):
    req = parse_generate_request({"messages": USER, "response_format": response_format}, Endpoint.CHAT)
    assert json.loads(req.sampling["grammar"])  # llguidance's grammar, JSON text


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
     "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON schema"),
    ({"type": "regex"}, "response_format.type must be"),
    ("json", "response_format must be an object"),
])
def test_a_bad_response_format_is_one_400(response_format, message):
    with pytest.raises(ApiError) as err:
        parse_generate_request({"messages": USER, "response_format": response_format}, Endpoint.CHAT)
    assert err.value.status == 400 and err.value.param == "response_format"
    assert message in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_served_output_holds_to_the_schema_beside_plain_requests(serve_tiny, engine_process):
    async with serve_tiny(engine_process=engine_process) as client:
        async def ask(endpoint: str, extra: dict) -> dict:
            body = {"max_tokens": 48, "temperature": 0, **extra}
            body |= {"messages": USER} if endpoint == "chat/completions" else {"prompt": "a b c"}
            resp = await client.post(f"/v1/{endpoint}", json=body)
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]

        plain_alone = await ask("completions", {"ignore_eos": True, "max_tokens": 8})
        choices = await asyncio.gather(
            ask("chat/completions", {"response_format": JSON_SCHEMA}),
            ask("completions", {"response_format": JSON_SCHEMA, "ignore_eos": True}),
            ask("completions", {"ignore_eos": True, "max_tokens": 8}))
        for choice in choices[:2]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == "stop" and violation(json.loads(text), SCHEMA) is None, text
        assert choices[2]["text"] == plain_alone["text"]


async def test_an_invalid_schema_is_a_400_from_the_server(serve_tiny):
    async with serve_tiny() as client:
        resp = await client.post("/v1/chat/completions", json={"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "object", "minProperties": "x"}}}})
        body = await resp.json()
        assert resp.status == 400 and body["error"]["param"] == "response_format", body


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_speculative_decoding_refuses_a_schema_with_a_400_naming_response_format(serve_tiny, engine_process):
    async with serve_tiny({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                          engine_process=engine_process) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": USER, "response_format": JSON_SCHEMA})
        body = await resp.json()
        assert resp.status == 400 and "not supported with speculative decoding" in body["error"]["message"], body
        assert body["error"]["param"] == "response_format", body


def test_serving_without_structured_output_never_loads_llguidance():
    import subprocess
    import sys

    code = ("import sys, infertrace.server.frontend.app, infertrace.engine.engine; "
            "from infertrace.server.frontend.protocol import Endpoint, parse_generate_request; "
            "parse_generate_request({'prompt': 'hi', 'response_format': {'type': 'text'}}, Endpoint.COMPLETIONS); "
            "print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
