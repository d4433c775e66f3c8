"""The text-only probe behind bench's image-token counts (infertrace/load/results/images.py): request 0's chat body
without its images, answered with one token and not streamed, gives what the server counts for the text alone."""

from __future__ import annotations

from infertrace.load.client.timing import TargetError


def text_only(body: dict) -> dict:
    """A chat body with its image parts left out, answered with one token and not streamed: the probe for what the
    server counts for the text alone."""
    messages = []
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        messages.append({**m, "content": content})
    out = {**body, "messages": messages, "max_tokens": 1, "stream": False}
    out.pop("stream_options", None)
    return out


async def probe_text_tokens(target, spec) -> tuple[int | None, str | None]:
    """(the server's prompt tokens for `spec`'s text alone, None) or (None, why not)."""

    try:
        status, answer = await target.transport.request_json("POST", target.path, text_only(target.body(spec)))
    except TargetError as e:
        return None, f"the text-only probe failed: {e}"
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if status != 200 or isinstance(tokens, bool) or not isinstance(tokens, int):
        return None, f"the text-only probe got HTTP {status} without usage.prompt_tokens"
    return tokens, None


async def probe_for(target, first_spec) -> tuple[int | None, str | None]:
    """probe_text_tokens for the run's first request where its text was counted; (None, None) where there is nothing
    to probe (results/images.py says why)."""
    if first_spec is None or first_spec.prompt_len is None:
        return None, None
    return await probe_text_tokens(target, first_spec)
