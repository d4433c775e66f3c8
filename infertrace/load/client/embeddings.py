"""A /v1/embeddings answer read as one event: how many vectors it holds and the server's count of input tokens.

The vectors themselves are never decoded (msgspec.Raw): a batch of 4096-float vectors is megabytes of JSON, and
parsing the floats would cost the client the CPU it needs to keep the schedule."""

from __future__ import annotations

import msgspec

from infertrace.load.records import StreamEvent


class _Item(msgspec.Struct):
    embedding: msgspec.Raw = msgspec.Raw(b"")  # absent: empty


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None


class _Answer(msgspec.Struct):
    data: list[_Item] | None = None
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode


def decode_embeddings(body: bytes, sent: int) -> StreamEvent:
    """The event of an answer to a request of `sent` inputs; an error event where the answer breaks OpenAI's shape
    (https://platform.openai.com/docs/api-reference/embeddings/object) or holds another number of vectors."""
    try:
        answer = _decode(body)
    except msgspec.DecodeError as e:
        return StreamEvent(error=f"malformed response: {str(e)[:120]}")
    if answer.data is None:
        return StreamEvent(error="malformed response: no `data` list of embeddings")
    if any(bytes(item.embedding) in (b"", b"null") for item in answer.data):
        return StreamEvent(error="malformed response: an item of `data` has no `embedding`")
    if len(answer.data) != sent:
        return StreamEvent(error=f"malformed response: {len(answer.data)} embeddings for {sent} inputs")
    tokens = answer.usage.prompt_tokens if answer.usage is not None else None
    if tokens is not None and tokens < 0:
        return StreamEvent(error=f"malformed response: usage.prompt_tokens is negative ({tokens})")
    return StreamEvent(prompt_tokens=tokens, embeddings=len(answer.data))
