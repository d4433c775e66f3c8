from infertrace.load.http_target import decode_chunk, decode_data
from infertrace.load.sse import SSEParser


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
