"""Incremental detokenization: deltas add up to the full decode; stop strings are cut and never half-streamed."""

from __future__ import annotations

import pytest

from infertrace.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def stream(tokenizer, ids, stop=None):
    d = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for t in ids:
        if d.add(t):
            deltas.append(d.take(finished=True))
            return deltas, True
        deltas.append(d.take(finished=False))
    d.flush()
    deltas.append(d.take(finished=True))
    return deltas, False


@pytest.mark.parametrize("text", ["plain words in the cache", "héllo wörld — 你好, ok", "def f(x):\n    return x[3]"])
def test_deltas_add_up_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, stopped = stream(tokenizer, ids)
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_and_unknown_ids_add_no_text(tokenizer):
    ids = tokenizer.encode("the model") + [151645, 100_000] + tokenizer.encode(" token")
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "the model token"


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode("the request ends here, then more text follows")
    deltas, stopped = stream(tokenizer, ids, stop=["ends here", "never"])
    assert stopped
    assert "".join(deltas) == "the request "
    # nothing streamed before the end could have been the start of a stop string
    assert all("end" not in d for d in deltas[:-1])


def test_hold_back_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("no stop in this one")
    d = IncrementalDetokenizer(tokenizer, ["zzzz"])
    streamed = ""
    for t in ids:
        assert not d.add(t)
        streamed += d.take(finished=False)
    assert streamed == "no stop in this one"[: len(streamed)] and len(streamed) <= len("no stop in this one") - 3
    d.flush()
    assert streamed + d.take(finished=True) == "no stop in this one"
