"""Trace replay: the three formats, their errors by line, scaling, prefix-block prompts and the implied reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infertrace.load.workloads.dataset import DatasetError
from infertrace.load.workloads.replay import BlockPrompts, TraceRequest, read_trace, trace_specs

MOONCAKE = Path(__file__).resolve().parents[2].parent / "shared" / "workloads" / "mooncake_conversation_first2000.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mooncake(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_mooncake_times_lengths_and_scales(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(1000, 1024, 10, [7, 8]), mooncake(1500, 600, 33, [7, 9]),
                                             mooncake(3000, 512, 1, [7])])
    trace = read_trace(path)
    assert trace.format == "mooncake" and trace.block_tokens == 512
    assert [r.offset_s for r in trace.requests] == [0.0, 0.5, 2.0]
    fast = read_trace(path, time_scale=0.5, token_scale=1 / 32)
    assert [r.offset_s for r in fast.requests] == [0.0, 0.25, 1.0]
    assert fast.block_tokens == 16
    assert [(r.input_len, r.output_len, r.hash_ids) for r in fast.requests] == [
        (32, 1, (7, 8)), (19, 1, (7, 9)), (16, 1, (7,))]


def test_implied_reuse_by_hand(tmp_path):
    # request 1: 1024 tokens, nothing seen; request 2: block 7 seen (512 of 600); request 3: block 7 seen (512)
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 1024, 10, [7, 8]), mooncake(1, 600, 3, [7, 9]),
                                             mooncake(2, 512, 1, [7])])
    assert read_trace(path).implied_prefix_reuse() == pytest.approx((512 + 512) / (1024 + 600 + 512))



def test_servable_reuse_leaves_out_the_block_holding_the_last_token(tmp_path):
    # as above; a paged cache of 16-token blocks serves request 2's 512 seen tokens (its last token lies beyond
    # them), but of request 3, a prompt made only of block 7, only the 496 tokens before the block of its last token
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 1024, 10, [7, 8]), mooncake(1, 600, 3, [7, 9]),
                                             mooncake(2, 512, 1, [7])])
    assert read_trace(path).servable_prefix_reuse(16) == pytest.approx((512 + 496) / (1024 + 600 + 512))
    assert read_trace(path).servable_prefix_reuse(500) == pytest.approx((500 + 500) / (1024 + 600 + 512))


def test_equal_block_ids_give_identical_text_and_exact_counts(tokenizer):
    prompts = BlockPrompts(tokenizer, block_tokens=16, seed=3)
    a = prompts.spec(0, TraceRequest(1, 0.0, 40, 5, (1, 2, 3)))
    b = prompts.spec(1, TraceRequest(2, 0.0, 37, 5, (1, 2, 4)))
    c = prompts.spec(2, TraceRequest(3, 0.0, 40, 5, (5, 2, 3)))
    for spec, n in ((a, 40), (b, 37), (c, 40)):
        assert tokenizer.encode(spec.prompt, add_special_tokens=False) == spec.prompt_ids
        assert spec.prompt_len == n
    assert a.prompt_ids[:32] == b.prompt_ids[:32] and a.prompt_ids[32:37] != b.prompt_ids[32:37]
    shared = tokenizer.decode(a.prompt_ids[:32])
    assert a.prompt.startswith(shared) and b.prompt.startswith(shared)  # byte-identical blocks
    assert a.prompt_ids[:16] != c.prompt_ids[:16]  # a different first block


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the shared workload trace is not at {MOONCAKE}")
def test_shared_trace_first_200_at_token_scale(tokenizer):
    trace = read_trace(MOONCAKE, token_scale=1 / 32, limit=200)
    specs, offsets = trace_specs(trace, tokenizer)
    assert len(specs) == 200 and offsets == sorted(offsets) and offsets[0] == 0.0
    assert all(len(tokenizer.encode(s.prompt, add_special_tokens=False)) == r.input_len
               for s, r in zip(specs, trace.requests))
    assert 0.0 < trace.implied_prefix_reuse() < 1.0


def test_azure_and_burstgpt_csv_detected_by_content(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    trace = read_trace(azure)
    assert trace.format == "azure" and trace.block_tokens is None and trace.implied_prefix_reuse() is None
    assert [(r.input_len, r.output_len) for r in trace.requests] == [(374, 44), (396, 109)]
    assert trace.requests[1].offset_s == pytest.approx(4.314579)
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,0,1087,Conversation log\n"
                     "47,ChatGPT,417,132,549,Conversation log\n")
    trace = read_trace(burst)
    assert trace.format == "burstgpt"
    assert [(r.offset_s, r.input_len, r.output_len) for r in trace.requests] == [(0.0, 472, 18), (42.0, 417, 132)]
    assert "1 request(s) with 0 response tokens" in trace.notes[0]


@pytest.mark.parametrize("lines, message", [
    ([mooncake(0, 10, 1, [1]), {"timestamp": 5, "input_length": 10, "hash_ids": [1]}],
     ":2: missing field 'output_length'"),
    ([mooncake(10, 10, 1, [1]), mooncake(5, 10, 1, [1])], ":2: timestamp 5 is earlier than the line before"),
    ([mooncake(0, -3, 1, [])], ":1: input_length must be at least 1, got -3"),
    ([mooncake(0, 10, 1, [1]), mooncake(1, 1030, 1, [1, 2])], ":2: 2 hash_ids for input_length 1030"),
    ([mooncake(0, 10, 1, [1]), "not json"], ":2: not JSON"),
    ([{"prompt": "hi"}], ":1: not a known trace format"),
])
def test_bad_jsonl_lines_are_named(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(path)


@pytest.mark.parametrize("rows, message", [
    ("2023-11-16 18:15:46,374,44\nyesterday,1,1\n", ":3: cannot read the time 'yesterday'"),
    ("2023-11-16 18:15:46,374,-4\n", ":2: GeneratedTokens must be at least 0, got -4"),
    ("2023-11-16 18:15:46,3.5,4\n", ":2: ContextTokens must be a whole number"),
    ("2023-11-16 18:15:46,,4\n", ":2: missing value for 'ContextTokens'"),
])
def test_bad_csv_rows_are_named(tmp_path, rows, message):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    with pytest.raises(DatasetError, match=message):
        read_trace(path)


def test_scales_must_be_positive_and_finite(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [1])])
    for kwargs in ({"time_scale": 0}, {"time_scale": float("nan")}, {"token_scale": -1}, {"token_scale": float("inf")}):
        with pytest.raises(DatasetError, match="must be a positive number"):
            read_trace(path, **kwargs)


def test_replay_needs_a_tokenizer(tmp_path):
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [1])]))
    with pytest.raises(DatasetError, match="needs the target's tokenizer"):
        trace_specs(trace, None)


BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf"])
def test_burstgpt_times_must_be_finite(tmp_path, stamp):
    path = tmp_path / "burst.csv"
    path.write_text(BURST_HEAD + f"5,ChatGPT,472,18,490,Conversation log\n{stamp},ChatGPT,4,1,5,Conversation log\n")
    with pytest.raises(DatasetError, match=f":3: Timestamp must be a finite number, got '{stamp}'"):
        read_trace(path)


def test_an_absurd_span_is_refused_with_the_replay_it_would_take(tmp_path):
    mooncake_path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 10, 1, [1]), mooncake(1e15, 10, 1, [1])])
    with pytest.raises(DatasetError, match=r"t.jsonl:2: the trace's 2 request\(s\) span 1e\+12 s \(1.157e\+07 "
                                           r"days\) at --time-scale 1; a replay longer than 7 days is refused"):
        read_trace(mooncake_path)
    burst = tmp_path / "burst.csv"
    burst.write_text(BURST_HEAD + "0,ChatGPT,472,18,490,Conversation log\n1e300,ChatGPT,4,1,5,Conversation log\n")
    with pytest.raises(DatasetError, match="span 1e\\+300 s"):
        read_trace(burst)
    assert read_trace(mooncake_path, time_scale=1e-9).requests[-1].offset_s == pytest.approx(1e3)  # scaled: fine


def test_lengths_are_checked_before_any_prompt_is_built(tmp_path, monkeypatch):
    from infertrace.load.workloads import replay

    built = []
    monkeypatch.setattr(replay, "trace_specs", lambda *a: built.append(a) or ([], []))
    big = 20_000_000
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 600, 1, [1, 2]),
                                              mooncake(1, big, 4, list(range(-(-big // 512))))])

    class Cfg:
        dataset_path, time_scale, token_scale, num_prompts, seed = str(path), 1.0, 1.0, None, 0

    with pytest.raises(DatasetError, match=r"t.jsonl:2: 20000000 input \+ 4 output tokens, above the server's "
                                           r"context of 32768 tokens; 1 of 2 request\(s\) are: pass --token-scale"):
        replay.TraceReplay(Cfg, None, max_model_len=32768)
    with pytest.raises(DatasetError, match="t.jsonl:2: 20000000 input tokens, above the 2097152 bench builds"):
        replay.TraceReplay(Cfg, None)  # the server gives no context: the client's own bound
    assert built == []
    Cfg.token_scale = 1 / 1024
    replay.TraceReplay(Cfg, None, max_model_len=32768)
    assert len(built) == 1


def test_a_byte_order_mark_is_not_part_of_the_format(tmp_path):
    moon = tmp_path / "bom.jsonl"
    # two records in the shape of the shared Mooncake file's (its blocks hold 512 tokens), so that this test needs
    # no file from outside the repository
    moon.write_bytes(b"\xef\xbb\xbf" + b'{"timestamp": 0, "input_length": 1000, "output_length": 50, "hash_ids": [0, 1]}\n'
                     b'{"timestamp": 27, "input_length": 600, "output_length": 20, "hash_ids": [0, 2]}\n')
    trace = read_trace(moon)
    assert trace.format == "mooncake" and trace.requests[0].offset_s == 0.0
    azure = tmp_path / "azure.csv"
    azure.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n",
                     encoding="utf-8")
    assert read_trace(azure).format == "azure"


def test_a_salt_shorter_than_a_cache_block_is_no_servable_reuse(tmp_path):
    # --prompt-salt's line before every prompt: 10 tokens fill no 16-token block, so they add no reuse (the trace's
    # blocks shift by 10 tokens, which here still leaves the same whole blocks); 20 tokens fill one block that every
    # prompt after the first finds
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 1024, 10, [7, 8]), mooncake(1, 600, 3, [7, 9]),
                                             mooncake(2, 512, 1, [7])])
    trace = read_trace(path)
    assert trace.servable_prefix_reuse(16, 10) == pytest.approx((512 + 512) / (1024 + 600 + 512 + 3 * 10))
    assert trace.servable_prefix_reuse(16, 20) == pytest.approx((528 + 528) / (1024 + 600 + 512 + 3 * 20))
    no_hashes = write_jsonl(tmp_path / "u.jsonl", [mooncake(0, 64, 1, [1]), mooncake(1, 64, 1, [2])])
    assert read_trace(no_hashes).servable_prefix_reuse(16, 10) == 0.0
