"""OpenAI request bodies parsed into typed requests, and OpenAI-style error bodies.

Parsing checks types and ranges and names the offending field; nothing here touches the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}

# Sampling fields a model's generation_config.json may carry; they become the request defaults, as in vLLM.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k")


class ApiError(Exception):
    """An HTTP error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One /v1/completions or /v1/chat/completions request, validated."""

    endpoint: Endpoint
    model: str | None
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat, contents flattened to text
    max_tokens: int | None  # None: up to the end of the context
    sampling: dict[str, Any]  # SamplingParams keyword arguments other than max_tokens
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.endpoint is Endpoint.CHAT else "prompt"


def parse_json_body(raw: bytes) -> dict:
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def load_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """temperature/top_p/top_k from the model's generation_config.json, which override OpenAI's defaults."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in GENERATION_CONFIG_FIELDS if isinstance(config.get(k), (int, float))}


def parse_generate_request(body: dict, endpoint: Endpoint, defaults: dict[str, Any] | None = None) -> GenerateRequest:
    """Validate an OpenAI body; ApiError(400) names the first bad field."""
    model = _optional(body, "model", str)
    if endpoint is Endpoint.CHAT:
        prompt, messages = None, _messages(body)
        max_tokens = _max_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _max_tokens(body, "max_tokens")
    else:
        prompt, messages = _prompt(body), None
        max_tokens = _max_tokens(body, "max_tokens")
    _reject_unsupported(body, endpoint)
    stream = _optional(body, "stream", bool) or False
    options = _optional(body, "stream_options", dict) or {}
    stream_options = StreamOptions(
        include_usage=bool(_optional(options, "include_usage", bool, "stream_options.include_usage")),
        continuous_usage_stats=bool(
            _optional(options, "continuous_usage_stats", bool, "stream_options.continuous_usage_stats")),
    )
    template_kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    return GenerateRequest(endpoint=endpoint, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
                           sampling=_sampling(body, defaults or {}), stream=stream, stream_options=stream_options,
                           chat_template_kwargs=template_kwargs)


def _sampling(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    temperature = _optional(body, "temperature", (int, float))
    temperature = defaults.get("temperature", 1.0) if temperature is None else temperature
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _optional(body, "top_p", (int, float))
    top_p = defaults.get("top_p", 1.0) if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _optional(body, "top_k", int)
    top_k = defaults.get("top_k") if top_k is None else top_k
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 (off), 0 (off) or a positive integer, got {top_k}", "top_k")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not _is_int_list(stop_token_ids, allow_empty=True):
        raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
    return {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": top_k if top_k and top_k > 0 else None,
        "seed": _optional(body, "seed", int),
        "ignore_eos": bool(_optional(body, "ignore_eos", bool)),
        "stop": stop or None,
        "stop_token_ids": stop_token_ids or None,
    }


def _max_tokens(body: dict, name: str) -> int | None:
    value = _optional(body, name, int)
    if value is not None and value < 1:
        raise bad_request(f"{name} must be at least 1, got {value}", name)
    return value


def _prompt(body: dict) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return prompt
    if _is_int_list(prompt, allow_empty=False):
        if min(prompt) < 0:
            raise bad_request("prompt token ids must be non-negative", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported; send one request per prompt", "prompt")
    raise bad_request("prompt must be a non-empty string or a list of token ids", "prompt")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        out.append({"role": message["role"], "content": _content_text(message.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


# Fields that change what comes back; we refuse them rather than silently ignore them. The value is the default
# that is accepted.
_UNSUPPORTED = {
    "n": 1, "best_of": 1, "echo": False, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": 1, "min_tokens": 0, "logit_bias": None, "tools": None, "functions": None,
}


def _reject_unsupported(body: dict, endpoint: Endpoint) -> None:
    for name, accepted in _UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value == accepted or value in ({}, []):
            continue
        if name == "n" and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise bad_request(f"n must be 1, got {value}", "n")
        raise bad_request(f"{name}={value!r} is not supported by this server", name, code="unsupported")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported by this server", "logprobs", code="unsupported")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_request("response_format other than text is not supported", "response_format", code="unsupported")


def _optional(body: dict, name: str, kind: type | tuple[type, ...], param: str | None = None) -> Any:
    """body[name] when present and not null, checked against `kind` (a bool is not a number here)."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        described = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "an object"}
        names = "a number" if float in kinds else " or ".join(described[k] for k in kinds)
        raise bad_request(f"{param or name} must be {names}, got {json.dumps(value)[:80]}", param or name)
    return value


def _is_int_list(value: Any, allow_empty: bool) -> bool:
    return (isinstance(value, list) and (allow_empty or bool(value))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
