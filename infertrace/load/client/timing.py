"""The one timing loop: turns any target's stream of events into a RequestResult, for completions and chat alike."""

from __future__ import annotations

import dataclasses
from contextlib import aclosing

from infertrace.load.client.target import Target
from infertrace.load.clock import Clock
from infertrace.load.records import RequestResult, RequestSpec, TokenSource, text_cap
from infertrace.load.server_metrics import server_view


class TargetError(Exception):
    """The target cannot be used (unreachable, cannot load, refuses the profiler, ...): one line for the user."""


async def measure(result: RequestResult, target: Target, spec: RequestSpec, clock: Clock) -> RequestResult:
    """Send `spec` through `target` and fill `result` in place (so a cancelled request keeps what it saw).

    An event counts as generated output when it carries an output choice (even one whose text is empty: tokens
    can decode to nothing) that usage does not show to hold zero tokens, or a positive token count: a role-only
    first chunk and a usage-only trailing chunk do not, nor does `[DONE]`. Usage that goes down is malformed. Events that arrived together share their arrival
    time. The stream must end with `[DONE]` or a finish reason; otherwise the request failed (the connection
    closed early).
    """
    result.expected_prompt_tokens = spec.prompt_len
    if (request_id := target.new_request_id()) is not None:  # the id the target's request log will use
        spec = dataclasses.replace(spec, request_id=request_id)
        result.request_id = spec.request_id
    texts: list[str] = []
    room = text_cap(spec.output_len)  # characters still kept
    usage_tokens: int | None = None  # cumulative completion tokens reported so far
    continuous = True  # every choice chunk so far carried usage: a chunk's tokens are the growth of the count
    last_text_t: float | None = None
    server_metrics: dict | None = None
    reads_metrics = target.reads_server_metrics
    finished = False
    t0 = result.t0 = result.end = clock.now()
    try:
        async with aclosing(target.stream(spec)) as batches:
            async for events in batches:
                t = result.end = clock.now()
                for ev in events:
                    if ev.error is not None:
                        result.error = ev.error
                        break
                    if ev.done:
                        finished = True
                        break
                    if ev.prompt_tokens is not None:
                        result.prompt_tokens = ev.prompt_tokens
                    if ev.server_metrics is not None and reads_metrics:
                        server_metrics = ev.server_metrics
                    if ev.embeddings is not None:  # one whole answer: no first token, only the end (E2EL)
                        result.num_inputs, result.e2el = ev.embeddings, t - t0
                        result.output_tokens, result.output_source = 0, TokenSource.USAGE
                        finished = True
                        break
                    n = ev.num_tokens
                    if ev.completion_tokens is None:
                        continuous = continuous and (not ev.output or n is not None)
                    else:
                        if ev.completion_tokens < (usage_tokens or 0):
                            result.error = (f"malformed stream: usage.completion_tokens went down from "
                                            f"{usage_tokens} to {ev.completion_tokens}")
                            break
                        if n is None and continuous and not ev.usage_only:
                            n = ev.completion_tokens - (usage_tokens or 0)
                        usage_tokens = ev.completion_tokens
                    # an output choice is an event unless usage proves it holds no token (a finish-only chunk)
                    if (ev.output and n != 0) or (not ev.usage_only and n is not None and n > 0):
                        if last_text_t is None:
                            result.ttft = t - t0
                        else:
                            result.itl.append(t - last_text_t)
                        if result.ttfct is None and not ev.reasoning_only:
                            result.ttfct = t - t0
                        last_text_t = t
                        result.chunk_tokens.append(n)
                        if ev.tool_calls:
                            room = _add_tool_calls(result, ev.tool_calls, room)
                        if ev.text:
                            if len(ev.text) <= room:  # the usual case: kept whole, no copy
                                texts.append(ev.text)
                                room -= len(ev.text)
                            else:
                                if room:
                                    texts.append(ev.text[:room])
                                    room = 0
                                result.text_cut = True
                    if ev.finish_reason is not None:
                        result.finish_reason = ev.finish_reason
                        finished = True
                else:
                    continue
                break  # an error or [DONE] ends the stream
    finally:
        if last_text_t is not None:
            result.e2el = last_text_t - t0
        result.text = "".join(texts)
        if server_metrics is not None:
            result.server = server_view(server_metrics, result.ttft)
        if usage_tokens is not None:
            result.output_tokens = usage_tokens
            result.output_source = TokenSource.USAGE
            if usage_tokens == len(result.chunk_tokens) and None in result.chunk_tokens:
                result.chunk_tokens = [1] * usage_tokens  # every text event holds >= 1 token, so exactly 1
    if result.expected_prompt_tokens is not None and (salt := target.salt_tokens):
        # --prompt-salt's line went before the prompt (before each input of an embeddings batch)
        result.expected_prompt_tokens += salt * (len(spec.inputs) if spec.inputs is not None else 1)
    if result.error is None and not finished:
        result.error = "disconnect: the stream ended before the response finished"
    elif result.error is None and last_text_t is None and result.num_inputs is None:  # as `vllm bench serve`
        result.error = "empty response: the stream finished without any generated output"
    return result


def _add_tool_calls(result: RequestResult, pieces: list, room: int) -> int:
    """Put streamed tool-call pieces together on `result` (a call's `index` says which, its name comes once, its
    arguments in parts, as the OpenAI stream sends them); the characters kept count against `room`, which is
    returned."""
    calls = result.tool_calls if result.tool_calls is not None else []
    for piece in pieces:
        if not isinstance(piece, dict):
            continue
        index = piece.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < 64 else len(calls)
        while len(calls) <= index:
            calls.append({"name": None, "arguments": ""})
        function = piece.get("function") if isinstance(piece.get("function"), dict) else {}
        if isinstance(name := function.get("name"), str):
            calls[index]["name"] = name
        if isinstance(part := function.get("arguments"), str):
            kept = part[:room]
            calls[index]["arguments"] += kept
            room -= len(kept)
            result.text_cut = result.text_cut or len(kept) < len(part)
    result.tool_calls = calls
    return room


def resolve_output_tokens(results: list[RequestResult], tokenizer=None, check_usage: bool = False) -> None:
    """Fill output-token counts the target did not report, and keep our tokenizer's count beside the server's.

    Runs after the measured window: tokenizing every response on the hot path would cost the client CPU.
    """
    for r in results:
        counted = None
        if tokenizer is not None and (r.output_source is None or check_usage):
            counted = len(tokenizer.encode(r.text, add_special_tokens=False)) if r.text else 0
        if r.output_source is None:
            if counted is not None:  # of the text kept (text_cap): with text_cut, a lower bound
                r.output_tokens, r.output_source = counted, TokenSource.TOKENIZER
            else:
                r.output_tokens, r.output_source = len(r.chunk_tokens), TokenSource.CHUNKS
        elif check_usage and not r.text_cut:  # a cut text's count is not the server's to compare
            r.tokenizer_output_tokens = counted
