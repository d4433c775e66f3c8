"""OpenAI request bodies parsed into typed requests, and OpenAI-style error bodies.

Parsing checks types and ranges and names the offending field; nothing here touches the engine.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infertrace.engine.sampling_params import SamplingParams, SamplingParamsError

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}

# Sampling fields a model's generation_config.json may carry; they become the request defaults, as in vLLM.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k")

# ----- request limits: what one request may ask of the engine thread; past them, 400 (docs/serve.md "Limits") -----
MAX_STOP_STRINGS = 64  # each is searched for after every generated token
MAX_STOP_STRING_CHARS = 1024  # the longest stop string is also how much streamed text is held back
MAX_STOP_TOKEN_IDS = 1024  # each is compared with every generated token
# The only chat_template_kwargs a request may pass: a request never supplies a template of its own (the template
# comes from the model directory), and nothing it passes reaches the renderer unchecked.
CHAT_TEMPLATE_KWARGS = {"enable_thinking": bool, "add_generation_prompt": bool}
# A JSON string escape for a UTF-16 surrogate; only when one is present can a parsed string hold a lone surrogate
# (raw UTF-8 cannot carry one: the decoder refuses it).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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
class ContextLimits:
    """Bounds a prompt must meet before any tokenization: more tokens than the context cannot be served, and a
    text longer than `max_chars` cannot tokenize into fewer (see `ServerState`)."""

    max_model_len: int
    max_chars: int


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
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: dict) -> None:
    """400 naming the first string (or key) that holds a lone UTF-16 surrogate: no tokenizer, path or log line can
    take one. json.loads joins escaped pairs, so any surrogate left is a lone one."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if not _is_unicode(key):
                    raise bad_request(f"a field name in {path or 'the body'} is not valid Unicode (lone surrogate)",
                                      path or None, code="invalid_unicode")
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value) if isinstance(item, (str, list, dict)))
        elif isinstance(value, str) and not _is_unicode(value):
            raise bad_request(f"{path} is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)",
                              path.split(".")[0].split("[")[0], code="invalid_unicode")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """temperature/top_p/top_k from the model's generation_config.json, which override OpenAI's defaults."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in GENERATION_CONFIG_FIELDS if isinstance(config.get(k), (int, float))}


def parse_generate_request(body: dict, endpoint: Endpoint, defaults: dict[str, Any] | None = None,
                           limits: ContextLimits | None = None) -> GenerateRequest:
    """Validate an OpenAI body; ApiError(400) names the first bad field. With `limits`, a prompt that cannot fit
    the context is refused here, before it is tokenized."""
    model = _optional(body, "model", str)
    if endpoint is Endpoint.CHAT:
        prompt, messages = None, _messages(body, limits)
        max_tokens = _max_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _max_tokens(body, "max_tokens")
    else:
        prompt, messages = _prompt(body, limits), None
        max_tokens = _max_tokens(body, "max_tokens")
    _reject_unsupported(body, endpoint)
    stream = _optional(body, "stream", bool) or False
    options = _optional(body, "stream_options", dict) or {}
    stream_options = StreamOptions(
        include_usage=bool(_optional(options, "include_usage", bool, "stream_options.include_usage")),
        continuous_usage_stats=bool(
            _optional(options, "continuous_usage_stats", bool, "stream_options.continuous_usage_stats")),
    )
    sampling = _sampling(body, defaults or {})
    if (grammar := _grammar(body)) is not None:  # response_format: the engine constrains this request
        sampling["grammar"] = grammar
    try:  # value ranges are the engine's to define: check them once, there, before any work is done
        SamplingParams(max_tokens=max_tokens or 1, **sampling)
    except SamplingParamsError as e:
        raise bad_request(str(e), e.field) from None
    return GenerateRequest(endpoint=endpoint, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
                           sampling=sampling, stream=stream, stream_options=stream_options,
                           chat_template_kwargs=_chat_template_kwargs(body))


def _chat_template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    for name, value in kwargs.items():
        kind = CHAT_TEMPLATE_KWARGS.get(name)
        if kind is None:
            raise bad_request(f"chat_template_kwargs.{brief(name)} is not accepted; this server takes only "
                              f"{', '.join(CHAT_TEMPLATE_KWARGS)} (the chat template is the model's own)",
                              "chat_template_kwargs")
        if not isinstance(value, kind):
            raise bad_request(f"chat_template_kwargs.{name} must be a {kind.__name__}, got {brief(value)}",
                              "chat_template_kwargs")
    return kwargs


def _sampling(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments, type-checked; SamplingParams itself checks their ranges."""
    temperature = _optional(body, "temperature", float)
    top_p = _optional(body, "top_p", float)
    top_k = _optional(body, "top_k", int)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, list):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop")
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    if stop and max(map(len, stop)) > MAX_STOP_STRING_CHARS:
        raise bad_request(f"a stop string has {max(map(len, stop))} characters; at most {MAX_STOP_STRING_CHARS} "
                          "are accepted", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if isinstance(stop_token_ids, list) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted",
                          "stop_token_ids")
    if stop_token_ids is not None and not _is_int_list(stop_token_ids, allow_empty=True):
        raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 (off), 0 (off) or a positive integer, got {top_k}", "top_k")
    top_k = defaults.get("top_k") if top_k is None else top_k
    return {
        "temperature": float(defaults.get("temperature", 1.0) if temperature is None else temperature),
        "top_p": float(defaults.get("top_p", 1.0) if top_p is None else top_p),
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


def _prompt(body: dict, limits: ContextLimits | None) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        _check_chars(len(prompt), limits, "prompt")
        return prompt
    if isinstance(prompt, list) and limits is not None and len(prompt) >= limits.max_model_len:
        raise context_exceeded(len(prompt), limits.max_model_len, "prompt")  # before looking at a single id
    if _is_int_list(prompt, allow_empty=False):
        if min(prompt) < 0:
            raise bad_request("prompt token ids must be non-negative", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported; send one request per prompt", "prompt")
    raise bad_request("prompt must be a non-empty string or a list of token ids", "prompt")


def context_exceeded(num_prompt_tokens: int, max_model_len: int, param: str) -> ApiError:
    return bad_request(f"the prompt has {num_prompt_tokens} tokens; the maximum context is {max_model_len} tokens "
                       "(prompt plus at least one generated token)", param, code="context_length_exceeded")


def _check_chars(num_chars: int, limits: ContextLimits | None, param: str) -> None:
    if limits is not None and num_chars > limits.max_chars:
        raise bad_request(f"the prompt has {num_chars} characters, more than can fit the maximum context of "
                          f"{limits.max_model_len} tokens (at most {limits.max_chars} characters)", param,
                          code="context_length_exceeded")


def _messages(body: dict, limits: ContextLimits | None) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    # every message and every content part costs template work: no more of them than tokens in the context
    most = None if limits is None else limits.max_model_len
    if most is not None and len(messages) > most:
        raise bad_request(f"messages has {len(messages)} messages, more than the {most} tokens of the context",
                          "messages", code="context_length_exceeded")
    out, num_chars = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        content = _content_text(message.get("content"), i, most)
        num_chars += len(message["role"]) + len(content)
        _check_chars(num_chars, limits, "messages")
        out.append({"role": message["role"], "content": content})
    return out


# content parts that carry an image, in OpenAI's spellings and vLLM 0.32's own (vllm/renderers/chat_utils.py)
_IMAGE_PARTS = ("image_url", "input_image", "image_embeds", "image_pil")


def _content_text(content: Any, i: int, most_parts: int | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        if most_parts is not None and len(content) > most_parts:
            raise bad_request(f"messages[{i}].content has {len(content)} parts, more than the {most_parts} tokens "
                              "of the context", "messages", code="context_length_exceeded")
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
                raise bad_request(f"images are not supported by the bundled engine: messages[{i}].content has an "
                                  f"{part['type']} part (its models read text only)", "messages", code="unsupported")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


# Fields that change what comes back; we refuse them rather than silently ignore them. The value is the default
# that is accepted.
_UNSUPPORTED = {
    "n": 1, "best_of": 1, "echo": False, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": 1, "min_tokens": 0, "logit_bias": None,
}
# Fields that constrain the output beyond response_format (tool calls, and vLLM's own spellings): the engine
# honours only a JSON schema or object through response_format, so each is refused, never answered with
# unconstrained output.
_CONSTRAINING = ("tools", "functions", "tool_choice", "function_call", "structured_outputs",
                 "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_NOT_CONSTRAINING = (None, {}, [], "none", "auto", {"type": "text"})


def _reject_unsupported(body: dict, endpoint: Endpoint) -> None:
    for name, accepted in _UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value == accepted or value in ({}, []):
            continue
        if name == "n" and isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise bad_request(f"n must be 1, got {value}", "n")
        raise bad_request(f"{name}={brief(value)} is not supported by this server", name, code="unsupported")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported by this server", "logprobs", code="unsupported")
    for name in _CONSTRAINING:
        if body.get(name) not in _NOT_CONSTRAINING:
            raise bad_request(f"structured output is not supported: this server cannot honour {name}="
                              f"{brief(body[name])} (it honours response_format json_schema and json_object only)",
                              name, code="unsupported")


def _grammar(body: dict) -> str | None:
    """llguidance's grammar for the request's response_format (None for text), compiled and validated here so that a
    bad schema is a 400 before any work is done."""
    response_format = body.get("response_format")
    if response_format is None or response_format == {}:
        return None
    if not isinstance(response_format, dict):
        raise bad_request(f"response_format must be an object, got {brief(response_format)}", "response_format")
    if response_format.get("type") in (None, "text"):
        return None
    from infertrace.engine.structured import grammar_from_response_format  # loads llguidance only when asked

    try:
        return grammar_from_response_format(response_format)
    except ValueError as e:
        raise bad_request(str(e), "response_format") from None


def _optional(body: dict, name: str, kind: type | tuple[type, ...], param: str | None = None) -> Any:
    """body[name] when present and not null, checked against `kind` (a bool is not a number here; `float` takes
    any finite number and returns a float)."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        kinds = (*kinds, int)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        described = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "an object"}
        names = "a number" if float in kinds else " or ".join(described[k] for k in kinds)
        raise bad_request(f"{param or name} must be {names}, got {brief(value)}", param or name)
    if float in kinds and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise bad_request(f"{param or name} must be a finite number, got {brief(body.get(name))}", param or name)
    return value


def brief(value: Any) -> str:
    """A value for an error message, never more than a line however large the value."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int_list(value: Any, allow_empty: bool) -> bool:
    return (isinstance(value, list) and (allow_empty or bool(value))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
