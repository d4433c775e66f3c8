"""OpenAI response bodies and Server-Sent Events for both endpoints, built from engine outputs.

One chunk is sent per engine output that carries new tokens (its text may be empty: a token can decode to
nothing yet), so chunk arrival times are the engine's token times; the last chunk carries `finish_reason`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import msgspec

from infertrace.server.frontend.protocol import Endpoint, StreamOptions

SSE_DONE = b"data: [DONE]\n\n"


_json = msgspec.json.Encoder()  # compact, UTF-8 as is: json.dumps(separators=(",", ":"), ensure_ascii=False)


def sse(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_request_id(endpoint: Endpoint) -> str:
    prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponseBuilder:
    """Bodies of one request's response: the chunks of a stream, or the single non-streaming body."""

    endpoint: Endpoint
    model: str
    request_id: str
    stream_options: StreamOptions = StreamOptions()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def _chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    def _envelope(self, choices: list[dict], object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def role_chunk(self, usage_now: dict | None) -> dict:
        """The first chat chunk: the assistant role, no text."""
        body = self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], "chat.completion.chunk")
        return self._with_stream_usage(body, usage_now)

    def chunk(self, text: str, finish_reason: str | None, usage_now: dict | None) -> dict:
        """A streamed piece of text; `usage_now` is sent only under continuous_usage_stats."""
        if self._chat:
            delta = {"content": text} if text or finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope([choice], "chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope([choice], "text_completion")
        return self._with_stream_usage(body, usage_now)

    def usage_chunk(self, final_usage: dict) -> dict:
        """The trailing chunk of include_usage: no choices, the request's usage."""
        object_name = "chat.completion.chunk" if self._chat else "text_completion"
        return {**self._envelope([], object_name), "usage": final_usage}

    def error_chunk(self, message: str) -> dict:
        return {"error": {"message": message, "type": "internal_server_error", "param": None, "code": None}}

    def full(self, text: str, finish_reason: str | None, final_usage: dict) -> dict:
        """The non-streaming body."""
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            body = self._envelope([choice], "chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope([choice], "text_completion")
        return {**body, "usage": final_usage}

    def _with_stream_usage(self, body: dict, usage_now: dict | None) -> dict:
        if self.stream_options.continuous_usage_stats and usage_now is not None:
            body["usage"] = usage_now
        elif self.stream_options.include_usage or self.stream_options.continuous_usage_stats:
            body["usage"] = None
        return body
