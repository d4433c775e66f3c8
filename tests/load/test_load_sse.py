import pytest

from infertrace.load.client.http_target import _fast, decode_chunk, decode_data
from infertrace.load.client.sse import SSELineTooLong, SSEParser


def feed_all(parts):
    p = SSEParser()
    out = []
    for part in parts:
        out.extend(p.feed(part))
    return out + p.close()


def test_events_whatever_the_split():
    raw = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    want = ['{"a": 1}', '{"b": 2}', "[DONE]"]
    for size in (1, 2, 3, 7, len(raw)):
        assert feed_all([raw[i:i + size] for i in range(0, len(raw), size)]) == want


def test_crlf_comments_other_fields_and_multiline_data():
    raw = b": keep-alive\r\nevent: message\r\nid: 3\r\ndata: line1\r\ndata:line2\r\n\r\nretry: 10\n\n"
    assert feed_all([raw]) == ["line1\nline2"]


def test_a_character_split_across_reads_is_decoded_whole():
    raw = 'data: {"text": "naïve → ok"}\n\n'.encode()
    cut = raw.index("→".encode()) + 1
    assert feed_all([raw[:cut], raw[cut:]]) == ['{"text": "naïve → ok"}']


def test_an_event_without_its_blank_line_is_handed_out_at_close():
    p = SSEParser()
    assert p.feed(b"data: tail") == []
    assert p.close() == ["tail"]
    assert p.close() == []


def test_decoder_reads_both_endpoints_and_marks_usage_only_chunks():
    assert decode_chunk({"choices": [{"text": "x", "finish_reason": None}]}).text == "x"
    ev = decode_chunk({"choices": [{"delta": {"content": "y"}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    assert (ev.text, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens) == ("y", "stop", 3, 1)
    assert decode_chunk({"choices": [{"delta": {"reasoning_content": "think"}}]}).text == "think"
    assert decode_chunk({"choices": [], "usage": {"completion_tokens": 4}}).usage_only
    assert decode_chunk({"choices": [{"text": "", "finish_reason": None}], "usage": None}).completion_tokens is None
    assert decode_data("[DONE]").done
    assert decode_chunk({"object": "error", "message": "bad"}).error == "stream error: bad"
    assert decode_chunk([1, 2]).error.startswith("malformed stream")


def test_an_event_with_empty_data_is_not_handed_out():
    # `data:` alone (a keep-alive some servers send) has empty data; two empty data lines join to one newline
    raw = b'data:\n\ndata: \r\n\r\ndata: {"a": 1}\n\ndata:\ndata:\n\n'
    assert feed_all([raw]) == ['{"a": 1}', "\n"]


def test_a_long_line_over_many_reads_takes_linear_time():
    # 32 MiB in 4 KiB reads without a newline: re-joining the unfinished line on every read would copy
    # 32 MiB * 8192 / 2 = 128 GiB; kept as pieces it is one join
    import time

    piece = b"x" * 4096
    p = SSEParser(max_line_bytes=64 * 1024 * 1024)
    start = time.perf_counter()
    assert p.feed(b'data: "') == []
    for _ in range(8192):
        assert p.feed(piece) == []
    out = p.feed(b'"\n\n')
    assert time.perf_counter() - start < 2.0
    assert len(out) == 1 and len(out[0]) == 8192 * 4096 + 2


def test_a_line_over_the_cap_is_refused_whether_split_or_whole():
    for parts in ([b"data: " + b"x" * 100], [b"data: " + b"x" * 100 + b"\n\n"],
                  [b"data: xx", b"x" * 100 + b"\n\n"], [b"data: 1\n", b"data: " + b"x" * 100 + b"\n"]):
        p = SSEParser(max_line_bytes=64)
        with pytest.raises(SSELineTooLong):
            for part in parts:
                p.feed(part)
    p = SSEParser(max_line_bytes=64)
    assert p.feed(b"data: " + b"x" * 50 + b"\n\n") == ["x" * 50]  # under the cap


def test_schema_breaks_are_malformed_streams_naming_the_field():
    cases = {
        '{"choices": [{"text": 5}]}': "malformed stream: choices[0].text is 5, expected a string",
        '{"choices": {"text": "a"}}': "malformed stream: choices is {\"text\": \"a\"}, expected an array",
        '{"choices": ["a"]}': "malformed stream: choices[0] is \"a\", expected an object",
        '{"choices": [{"delta": "a"}]}': "malformed stream: choices[0].delta is \"a\", expected an object",
        '{"choices": [{"delta": {"content": 1}}]}': "malformed stream: choices[0].delta.content is 1, expected a string",
        '{"choices": [{"text": "a", "finish_reason": 3}]}': "malformed stream: choices[0].finish_reason is 3",
        '{"choices": [], "usage": [1]}': "malformed stream: usage is [1], expected an object",
        '{"choices": [], "usage": {"completion_tokens": NaN}}': "malformed stream: usage.completion_tokens is NaN, expected an integer",
        '{"choices": [], "usage": {"prompt_tokens": Infinity}}': "malformed stream: usage.prompt_tokens is Infinity",
        '{"choices": [], "usage": {"completion_tokens": -3}}': "malformed stream: usage.completion_tokens is "
                                                                "negative (-3)",
        '{"choices": [], "usage": {"completion_tokens": true}}': "malformed stream: usage.completion_tokens is true",
    }
    for data, want in cases.items():
        assert decode_data(data).error.startswith(want), (data, decode_data(data).error)


def test_the_fast_decoder_agrees_with_the_checked_one():
    # decode_data takes well-formed chunks through msgspec and leaves the rest to decode_chunk: on any JSON
    # object, whichever path answers, the event must be the one decode_chunk makes of the parsed object
    import json
    import random

    rng = random.Random(0)
    values = [None, "", "x", 0, 3, -1, True, 1.5, [], {}, [1], {"a": 1}]

    def some(keys: list[str], p: float) -> dict:
        return {k: rng.choice(values) for k in keys if rng.random() < p}

    def choice():
        c = some(["text", "finish_reason"], 0.5)
        if rng.random() < 0.5:
            delta = some(["content", "reasoning_content", "reasoning", "tool_calls", "function_call", "role"], 0.4)
            c["delta"] = delta if rng.random() < 0.8 else rng.choice(values)
        return c if rng.random() < 0.9 else rng.choice(values)

    for _ in range(20000):
        obj = some(["error", "object", "message"], 0.1)
        if rng.random() < 0.8:
            obj["choices"] = [choice() for _ in range(rng.randint(0, 2))] if rng.random() < 0.9 else rng.choice(values)
        if rng.random() < 0.5:
            obj["usage"] = some(["prompt_tokens", "completion_tokens"], 0.7) if rng.random() < 0.8 else rng.choice(values)
        data = json.dumps(obj)
        assert decode_data(data) == decode_chunk(obj), data
    for common in ('{"choices":[{"index":0,"text":" tok","finish_reason":null}],"usage":null}',
                   '{"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}],"usage":null}',
                   '{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":4,"total_tokens":12}}'):
        assert _fast(common) is not None, common  # the streams one meets take the fast path
