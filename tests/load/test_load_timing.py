"""The one timing loop, driven through HttpTarget by a scripted clock and a transport that opens no socket.

Every expected figure below is computed by hand from the scripted arrival times.
"""

import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from infertrace.load.client.http_target import HttpTarget
from infertrace.load.client.timing import measure, resolve_output_tokens
from infertrace.load.client.trace_context import traceparent
from infertrace.load.clock import ScriptedClock
from infertrace.load.records import RequestResult, RequestSpec, TokenSource

T0 = 10.0


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def comp(text, finish=None, usage=None):
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": usage}
    return body


def chat(content=None, finish=None, usage=None, role=False):
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": usage}
    return body


def usage_only(n):
    return {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}


DONE = b"[DONE]"


class ScriptedResponse:
    def __init__(self, clock, reads, status=200, body="", raise_at_end=None):
        self.clock, self.reads, self.status, self.body, self.raise_at_end = clock, reads, status, body, raise_at_end

    async def text(self):
        return self.body

    async def chunks(self):
        for t, data in self.reads:
            self.clock.set(t)
            yield data
        if self.raise_at_end is not None:
            raise self.raise_at_end

    async def finish(self):
        self.finished = True


class ScriptedTransport:
    def __init__(self, response):
        self.response = response
        self.sent = []

    @asynccontextmanager
    async def stream(self, path, body, headers=None):
        self.sent.append((path, body))
        self.headers = headers
        yield self.response


async def run(reads, endpoint="completions", **response_kw):
    clock = ScriptedClock(T0)
    transport = ScriptedTransport(ScriptedResponse(clock, [(t, sse(o) if not isinstance(o, bytes) or o == DONE
                                                            else o) for t, o in reads], **response_kw))
    target = HttpTarget("http://x", endpoint, "m", transport)
    spec = RequestSpec(0, "hello", 16, prompt_len=7)
    result = RequestResult(0, scheduled=T0, t0=0.0, end=0.0)
    await measure(result, target, spec, clock)
    return result, transport


async def test_multi_token_chunks_with_continuous_usage():
    result, transport = await run([
        (10.5, comp("Hello", usage=2)),
        (10.7, comp(" wor", usage=3)),
        (11.3, comp("ld!!", usage=6)),
        (11.4, comp("", finish="length", usage=6)),
        (11.5, usage_only(6)),
        (11.6, DONE),
    ])
    assert result.success and result.finish_reason == "length"
    assert result.t0 == T0 and result.end == pytest.approx(1.6 + T0)
    assert result.ttft == pytest.approx(0.5)
    assert result.e2el == pytest.approx(1.3)  # the finish chunk carries no text: the last text was at 11.3
    assert result.itl == pytest.approx([0.2, 0.6])
    assert result.chunk_tokens == [2, 1, 3]
    assert (result.output_tokens, result.output_source) == (6, TokenSource.USAGE)
    assert result.prompt_tokens == 7
    assert result.tpot == pytest.approx((1.3 - 0.5) / 5)
    assert result.itl_per_token() == pytest.approx([0.2, 0.2, 0.2, 0.2])  # 0.2/1, then 0.6/3 three times
    assert result.text == "Hello world!!"
    body = transport.sent[0][1]
    assert transport.sent[0][0] == "/v1/completions" and body["prompt"] == "hello"
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


async def test_role_only_first_chunk_does_not_count_as_text():
    result, transport = await run([
        (10.2, chat(role=True, usage=0)),
        (10.5, chat("Hi", usage=1)),
        (10.9, chat(" there", usage=2)),
        (11.0, chat(finish="stop", usage=2)),
        (11.1, {**usage_only(2), "object": "chat.completion.chunk"}),
        (11.2, DONE),
    ], endpoint="chat")
    assert result.success
    assert result.ttft == pytest.approx(0.5)  # not 0.2: the role chunk carries no text
    assert result.e2el == pytest.approx(0.9)
    assert result.itl == pytest.approx([0.4])
    assert result.chunk_tokens == [1, 1]
    assert result.tpot == pytest.approx(0.4)
    assert transport.sent[0][0] == "/v1/chat/completions"
    assert transport.sent[0][1]["messages"] == [{"role": "user", "content": "hello"}]


async def test_completions_and_chat_time_identically():
    times = [10.25, 10.5, 11.0, 11.5]
    a, _ = await run([(times[0], comp("a")), (times[1], comp("b")), (times[2], comp("c", finish="stop")),
                      (times[3], DONE)])
    b, _ = await run([(times[0], chat("a")), (times[1], chat("b")), (times[2], chat("c", finish="stop")),
                      (times[3], DONE)], endpoint="chat")
    for r in (a, b):
        assert (r.ttft, r.e2el) == (pytest.approx(0.25), pytest.approx(1.0))
        assert r.itl == pytest.approx([0.25, 0.5])


async def test_usage_only_trailing_chunk_is_excluded_from_e2el():
    result, _ = await run([
        (10.1, comp("a")),
        (10.3, comp("b")),
        (10.6, comp("c", finish="stop")),
        (12.0, usage_only(3)),  # arrives late; E2EL must not stretch to it
        (12.1, DONE),
    ])
    assert result.e2el == pytest.approx(0.6)
    assert result.end == pytest.approx(12.1)
    assert (result.output_tokens, result.output_source) == (3, TokenSource.USAGE)
    # usage equals the number of text events and each holds at least one token: exactly one each
    assert result.chunk_tokens == [1, 1, 1]
    assert result.tpot == pytest.approx(0.25)


async def test_chunk_tokens_stay_unknown_when_usage_cannot_split_them():
    result, _ = await run([(10.1, comp("ab")), (10.3, comp("cde", finish="stop")), (10.4, usage_only(5)),
                           (10.5, DONE)])
    assert result.chunk_tokens == [None, None]
    assert result.itl_per_token() == []
    assert result.output_tokens == 5
    assert result.tpot == pytest.approx(0.2 / 4)


async def test_an_empty_text_finish_chunk_without_continuous_usage_is_an_output_event():
    # text chunks without usage, then a finish chunk with empty text and the final usage: nothing says that chunk
    # holds no token (it may hold the last 13), so it is an output event, as in `vllm bench serve`
    result, _ = await run([(10.1, comp("a")), (10.3, comp("b")), (10.4, comp("c")),
                           (11.5, comp("", finish="length", usage=16)), (11.6, DONE)])
    assert result.e2el == pytest.approx(1.5)
    assert result.chunk_tokens == [None, None, None, None]
    assert result.output_tokens == 16
    assert result.tpot == pytest.approx(1.4 / 15)


async def test_tokens_that_decode_to_empty_text_are_output_events_without_continuous_usage():
    # a tokenizer that emits partial UTF-8: the first two tokens decode to "" and the third completes "é"
    reads = [(10.05, comp("")), (10.10, comp("")), (10.15, comp("é")), (10.20, comp("")),
             (10.25, comp("x", finish="length")), (10.30, usage_only(5)), (10.35, DONE)]
    result, _ = await run(reads)
    assert result.success
    assert result.ttft == pytest.approx(0.05)  # the first token, not the first visible character (0.15)
    assert result.e2el == pytest.approx(0.25)
    assert result.itl == pytest.approx([0.05] * 4)
    assert result.chunk_tokens == [1] * 5  # usage 5 over 5 events: one token each
    assert result.tpot == pytest.approx(0.05)
    assert result.text == "éx"


async def test_chat_empty_content_counts_but_the_role_chunk_and_an_empty_delta_do_not():
    result, _ = await run([(10.02, chat(role=True)), (10.05, chat("")), (10.10, chat("")), (10.15, chat("é")),
                           (10.40, chat(finish="stop")), (10.45, usage_only(3)), (10.5, DONE)], endpoint="chat")
    assert result.success
    assert (result.ttft, result.e2el) == (pytest.approx(0.05), pytest.approx(0.15))
    assert result.chunk_tokens == [1, 1, 1]


async def test_a_finished_stream_without_any_output_event_is_a_failure():
    result, _ = await run([(10.1, chat(role=True)), (10.2, chat(finish="stop")), (10.3, DONE)], endpoint="chat")
    assert result.error == "empty response: the stream finished without any generated output"
    assert result.ttft is None


async def test_no_done_sentinel_after_a_finish_reason_is_a_success():
    result, _ = await run([(10.1, comp("a", usage=1)), (10.2, comp("b", finish="stop", usage=2)),
                           (10.3, usage_only(2))])
    assert result.success
    assert result.e2el == pytest.approx(0.2) and result.end == pytest.approx(10.3)
    assert result.output_tokens == 2


async def test_stream_closed_before_the_end_is_a_failure():
    result, _ = await run([(10.1, comp("a", usage=1)), (10.2, comp("b", usage=2))])
    assert not result.success
    assert result.error.startswith("disconnect:")
    assert result.ttft == pytest.approx(0.1)  # what was seen is kept


async def test_transport_error_mid_stream_is_a_failure_with_its_reason():
    result, _ = await run([(10.1, comp("a"))],
                          raise_at_end=aiohttp.ClientPayloadError("Response payload is not completed"))
    assert result.error == "disconnect: ClientPayloadError: Response payload is not completed"


async def test_error_event_mid_stream_is_a_failure_with_its_reason():
    result, _ = await run([
        (10.2, comp("a", usage=1)),
        (10.4, {"error": {"message": "engine died", "type": "internal_server_error"}}),
        (10.5, DONE),
    ])
    assert not result.success
    assert result.error == "stream error: engine died"
    assert result.ttft == pytest.approx(0.2) and result.end == pytest.approx(10.4)


async def test_http_error_status_is_a_failure_with_the_servers_own_message():
    result, _ = await run([], status=500, body='{"error": {"message": "boom"}}')
    assert result.error == "HTTP 500: boom"
    assert result.ttft is None and result.e2el is None


@pytest.mark.parametrize("body, message", [
    ('{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}',
     "The model `x` does not exist."),  # vLLM 0.33, OpenAI's shape
    ('{"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}',
     "max_tokens is too large"),  # older vLLM and SGLang
    ('{"detail": "Not Found"}', "Not Found"),  # FastAPI's own 404
    ("plain\n  text", "plain text"),
])
async def test_http_error_message_is_taken_from_each_servers_error_body(body, message):
    result, _ = await run([], status=400, body=body)
    assert result.error == f"HTTP 400: {message}"


def reasoning(text):
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"reasoning": text}}]}


async def test_ttfct_is_the_first_answer_event_after_reasoning_deltas():
    """vLLM 0.33 streams thinking as `delta.reasoning`, SGLang as `delta.reasoning_content`: both are output (TTFT),
    the first `content` is the answer (TTFCT)."""
    sglang = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"reasoning_content": "b"}}]}
    result, _ = await run([(10.1, chat(role=True)), (10.2, reasoning("a")), (10.3, sglang),
                           (10.6, chat("answer")), (10.7, chat("", finish="stop")), (10.8, DONE)], endpoint="chat")
    assert result.ttft == pytest.approx(0.2) and result.ttfct == pytest.approx(0.6)
    assert result.text.startswith("ab") and result.to_json()["ttfct_ms"] == pytest.approx(600.0)


async def test_ttfct_equals_ttft_without_reasoning_and_on_completions():
    chat_result, _ = await run([(10.2, chat("x")), (10.3, chat("y", finish="stop")), (10.4, DONE)], endpoint="chat")
    comp_result, _ = await run([(10.2, comp("x")), (10.3, comp("y", finish="stop")), (10.4, DONE)])
    for result in (chat_result, comp_result):
        assert result.ttfct == result.ttft == pytest.approx(0.2)


async def test_a_delta_with_reasoning_and_content_together_is_the_answer():
    both = {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"reasoning_content": "r", "content": "c"}}]}
    result, _ = await run([(10.2, both), (10.3, chat("", finish="stop")), (10.4, DONE)], endpoint="chat")
    assert result.ttfct == result.ttft == pytest.approx(0.2)


async def test_the_checked_decoding_path_tells_reasoning_from_content_too():
    # a NaN literal, which only Python's parser takes, sends the chunk past the fast decoder to the checked one
    raw = b'{"choices": [{"index": 0, "delta": {"reasoning": "r"}}], "extra": NaN}'
    result, _ = await run([(10.2, b"data: " + raw + b"\n\n"), (10.4, chat("c")), (10.5, chat("", finish="stop")),
                           (10.6, DONE)], endpoint="chat")
    assert result.ttft == pytest.approx(0.2) and result.ttfct == pytest.approx(0.4)


async def test_an_empty_keep_alive_event_is_neither_text_nor_a_failure():
    result, _ = await run([(10.1, comp("a", usage=1)), (10.2, b"data:\n\n"), (10.4, comp("b", usage=2)),
                           (10.5, b"data: \n\n"), (10.6, comp("", finish="stop", usage=2)), (10.7, DONE)])
    assert result.success
    assert (result.ttft, result.e2el) == (pytest.approx(0.1), pytest.approx(0.4))
    assert result.itl == pytest.approx([0.3])
    assert result.chunk_tokens == [1, 1]


async def test_malformed_json_is_a_failure():
    result, _ = await run([(10.1, b"data: {not json\n\n")])
    assert result.error.startswith("malformed stream:")


async def test_events_split_across_reads_take_the_time_of_the_read_that_completes_them():
    raw = sse(comp("a")) + sse(comp("b", finish="stop")) + sse(DONE)
    cut1, cut2 = len(sse(comp("a"))) - 3, len(sse(comp("a"))) + 10
    result, _ = await run([(10.1, raw[:cut1]), (10.4, raw[cut1:cut2]), (10.9, raw[cut2:])])
    assert result.ttft == pytest.approx(0.4)  # "a" was complete only with the second read
    assert result.itl == pytest.approx([0.5])


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


async def test_no_usage_falls_back_to_the_tokenizer_and_records_the_source():
    reads = [(10.1, comp("one two")), (10.2, comp(" three", finish="stop")), (10.3, DONE)]
    with_tok, _ = await run(reads)
    without, _ = await run(reads)
    assert with_tok.output_source is None  # resolved after the run, off the hot path
    resolve_output_tokens([with_tok], WordTokenizer())
    resolve_output_tokens([without], None)
    assert (with_tok.output_tokens, with_tok.output_source) == (3, TokenSource.TOKENIZER)
    assert (without.output_tokens, without.output_source) == (2, TokenSource.CHUNKS)
    assert with_tok.tpot == pytest.approx(0.1 / 2)


async def test_usage_is_kept_and_the_tokenizer_count_recorded_beside_it():
    result, _ = await run([(10.1, comp("one two", usage=1)), (10.2, comp(" three", finish="stop", usage=4)),
                           (10.3, DONE)])
    resolve_output_tokens([result], WordTokenizer(), check_usage=True)
    assert (result.output_tokens, result.output_source) == (4, TokenSource.USAGE)
    assert result.tokenizer_output_tokens == 3


async def test_usage_that_goes_down_is_a_malformed_stream():
    result, _ = await run([(10.1, comp("a", usage=2)), (10.2, comp("b", usage=1)), (10.3, DONE)])
    assert result.error == "malformed stream: usage.completion_tokens went down from 2 to 1"


async def test_a_chunk_that_breaks_the_schema_fails_as_malformed_not_a_client_error():
    result, _ = await run([(10.1, comp("a")), (10.2, {"choices": [{"delta": ["x"]}]}), (10.3, DONE)],
                          endpoint="chat")
    assert result.error == "malformed stream: choices[0].delta is [\"x\"], expected an object"
    nan, _ = await run([(10.1, comp("a", finish="stop")), (10.2, b'data: {"choices": [], "usage": '
                                                                  b'{"completion_tokens": NaN}}\n\n')])
    assert nan.error.startswith("malformed stream: usage.completion_tokens is NaN, expected an integer")
    assert nan.output_tokens is None  # no non-finite value reaches the figures


async def test_an_oversized_line_is_a_malformed_stream(monkeypatch):
    monkeypatch.setattr("infertrace.load.client.sse.MAX_LINE_BYTES", 1024)
    result, _ = await run([(10.1, comp("a")), (10.2, b"data: " + b"x" * 600), (10.3, b"x" * 600)])
    assert result.error == "malformed stream: an SSE line exceeds 1024 bytes"


async def test_every_send_names_its_request_for_the_server_log():
    reads = [(T0 + 0.010, {"choices": [{"text": "a", "finish_reason": "length"}]}), (T0 + 0.011, DONE)]
    result, transport = await run(reads)
    assert result.request_id and transport.headers == {"X-Request-Id": result.request_id,
                                                       "traceparent": traceparent(result.request_id)}
    second, _ = await run(reads)
    assert second.request_id != result.request_id  # a new target, a new run prefix
    assert result.to_json()["request_id"] == result.request_id
