"""POST /v1/embeddings in OpenAI's request and response shapes (https://platform.openai.com/docs/api-reference/
embeddings): the inputs checked and tokenized here, pooled by the engine between two steps (engine/pooling.py)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from infertrace.server.frontend.protocol import ContextLimits, _check_chars, _is_int_list, bad_request, brief
from infertrace.server.frontend.request_log import client_request_id

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request; each is one forward on the engine thread
ENCODING_FORMATS = ("float", "base64")  # base64: the float32 little-endian bytes of each vector, as OpenAI's
SHAPE = "input must be a string, a list of token ids, or a non-empty list of strings or of lists of token ids"


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str


def parse_embedding_request(body: dict, limits: ContextLimits | None) -> EmbeddingRequest:
    """The request, or 400 naming the field: an empty input, a wrong type, too many inputs, one too long."""
    if "input" not in body or body["input"] is None:
        raise bad_request("input is required", "input")
    raw = body["input"]
    if raw == [] or raw == "":
        raise bad_request("input is empty", "input")
    if isinstance(raw, str) or _is_int_list(raw, allow_empty=False):
        inputs = [raw]
    elif isinstance(raw, list) and all(isinstance(x, str) or _is_int_list(x, allow_empty=True) for x in raw):
        inputs = raw
    else:
        raise bad_request(f"{SHAPE}, not {brief(raw)}", "input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input holds {len(inputs)} inputs; at most {MAX_INPUTS} a request", "input")
    for i, x in enumerate(inputs):
        if not x:
            raise bad_request(f"input {i} is empty", "input")
        if isinstance(x, str):
            _check_chars(len(x), limits, "input")
        elif min(x) < 0:
            raise bad_request(f"input {i}: token ids must be non-negative", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, not {brief(fmt)}",
                          "encoding_format")
    if body.get("dimensions") is not None:
        raise bad_request("dimensions is not supported: the vectors have the model's hidden size", "dimensions")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, not {brief(model)}", "model")
    return EmbeddingRequest(model, inputs, fmt)


def encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def answer(state: Any, body: dict, headers: Mapping[str, str]) -> web.Response:
    """Tokenize every text input (with the model's special tokens, as vLLM does), have the engine pool them, and
    answer with one vector per input and the inputs' tokens as usage."""
    req = parse_embedding_request(body, state.limits)
    model = state.check_model(req.model)
    request_id = client_request_id(headers, state.in_flight) or f"embd-{uuid.uuid4().hex}"
    with state.admitted(request_id):
        texts = [x for x in req.inputs if isinstance(x, str)]
        encoded_texts = iter(await asyncio.get_running_loop().run_in_executor(
            state.tokenize_pool, lambda: [state.tokenizer.encode(t, add_special_tokens=True) for t in texts]))
        ids = [next(encoded_texts) if isinstance(x, str) else x for x in req.inputs]
        for i, x in enumerate(ids):
            if len(x) > state.max_model_len:
                raise bad_request(f"input {i} has {len(x)} tokens; the maximum context is {state.max_model_len} "
                                  "tokens", "input", code="context_length_exceeded")
        vectors = await state.engine.command("embed", {"inputs": ids})
    tokens = sum(len(x) for x in ids)
    return web.json_response({
        "id": request_id, "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": encoded(v, req.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    })
