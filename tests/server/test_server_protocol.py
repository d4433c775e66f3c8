"""Request parsing and validation, without a server."""

from __future__ import annotations

import json

import pytest

from infertrace.server.frontend.protocol import (
    ApiError,
    Endpoint,
    load_sampling_defaults,
    parse_generate_request,
    parse_json_body,
)

CHAT = Endpoint.CHAT
COMPLETIONS = Endpoint.COMPLETIONS


def _error(body: dict, endpoint: Endpoint = COMPLETIONS) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_generate_request(body, endpoint)
    assert err.value.status == 400
    return err.value


def test_openai_defaults_then_generation_config_then_request():
    req = parse_generate_request({"prompt": "hi"}, COMPLETIONS)
    assert req.sampling["temperature"] == 1.0 and req.sampling["top_p"] == 1.0 and req.sampling["top_k"] is None
    assert req.max_tokens is None and req.stream is False and req.model is None
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    req = parse_generate_request({"prompt": "hi"}, COMPLETIONS, defaults)
    assert (req.sampling["temperature"], req.sampling["top_p"], req.sampling["top_k"]) == (0.6, 0.95, 20)
    req = parse_generate_request({"prompt": "hi", "temperature": 0, "top_k": -1}, COMPLETIONS, defaults)
    assert req.sampling["temperature"] == 0.0 and req.sampling["top_k"] is None


def test_load_sampling_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}))
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("{broken")
    assert load_sampling_defaults(tmp_path) == {}


def test_sampling_fields_pass_through():
    req = parse_generate_request({"prompt": [1, 2], "max_tokens": 7, "seed": 3, "stop": "END", "ignore_eos": True,
                                  "stop_token_ids": [9], "top_k": 5, "stream": True,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                                 COMPLETIONS)
    assert req.prompt == [1, 2] and req.max_tokens == 7
    assert req.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 5, "seed": 3, "ignore_eos": True,
                            "stop": ["END"], "stop_token_ids": [9]}
    assert req.stream and req.stream_options.include_usage and req.stream_options.continuous_usage_stats


def test_chat_messages_and_max_completion_tokens():
    req = parse_generate_request({
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None}],
        "max_completion_tokens": 4, "max_tokens": 99, "chat_template_kwargs": {"enable_thinking": False}}, CHAT)
    assert req.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]
    assert req.max_tokens == 4 and req.chat_template_kwargs == {"enable_thinking": False}
    assert req.prompt_param == "messages"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "seed": 1.0}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_invalid_fields_name_the_param(body, param):
    assert _error(body).param == param


def test_defaults_of_unsupported_fields_are_accepted():
    body = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logprobs": None, "logit_bias": {}, "user": "someone", "suffix": None}
    assert parse_generate_request(body, COMPLETIONS).prompt == "x"


@pytest.mark.parametrize("messages", [None, [], "hi", [{"content": "no role"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                                      [{"role": "user", "content": 5}]])
def test_bad_messages(messages):
    assert _error({"messages": messages}, CHAT).param == "messages"


@pytest.mark.parametrize("raw", [b"", b"  ", b"{", b"[]", b'"text"', b"\xff"])
def test_parse_json_body_rejects_non_objects(raw):
    with pytest.raises(ApiError) as err:
        parse_json_body(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"
    body = err.value.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
