import dataclasses
import json
import os

import pytest

from infertrace.load.config import BenchConfig
from infertrace.load.workloads.dataset import DatasetError, PromptMaker, length_range, seeded_rng
from infertrace.load.workloads.prompts import build_specs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_random_prompts_have_the_exact_length_in_the_target_tokenizer(tokenizer):
    maker = PromptMaker(tokenizer, seeded_rng(0, "t"))
    for n in (1, 2, 7, 64, 333, 1024):
        text, ids = maker.exact(n)
        assert len(ids) == n
        assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_range_ratio_bounds_lengths(tokenizer):
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    cfg = BenchConfig(input_len=40, output_len=20, range_ratio=0.5, num_prompts=60)
    specs = build_specs(cfg, tokenizer, 60, "measure")
    ins = [s.prompt_len for s in specs]
    outs = [s.output_len for s in specs]
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30
    assert all(len(tokenizer.encode(s.prompt, add_special_tokens=False)) == s.prompt_len for s in specs)


def test_seed_makes_prompts_identical_byte_for_byte(tokenizer, tmp_path):
    def dump(seed, stream="measure"):
        cfg = BenchConfig(input_len=32, range_ratio=0.3, seed=seed)
        return json.dumps([dataclasses.asdict(s) for s in build_specs(cfg, tokenizer, 12, stream)]).encode()

    assert dump(7) == dump(7)
    assert dump(7) != dump(8)
    assert dump(7) != dump(7, "warmup")  # warmup prompts are not the measured ones


def test_shared_prefix_requests_start_with_one_of_the_prefixes(tokenizer):
    cfg = BenchConfig(dataset="shared-prefix", prefix_len=24, num_prefixes=3, input_len=8)
    specs = build_specs(cfg, tokenizer, 9, "measure")
    prefixes = {tuple(s.prompt_ids[:24]) for s in specs}
    assert len(prefixes) == 3
    assert all(s.prompt_len == 32 for s in specs)
    assert specs[0].prompt_ids[:24] == specs[3].prompt_ids[:24] != specs[1].prompt_ids[:24]


def test_sharegpt_file(tokenizer, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is paging?"}, {"from": "gpt", "value": "Blocks of KV."}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "gpt", "value": "starts with a reply"}, {"from": "human", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "Why batch?"}, {"from": "gpt", "value": "Throughput."}]},
    ]))
    cfg = BenchConfig(dataset="sharegpt", dataset_path=str(path))
    specs = build_specs(cfg, tokenizer, 5, "measure")
    assert len(specs) == 5 and [s.index for s in specs] == list(range(5))
    assert {s.prompt for s in specs} == {"What is paging?", "Why batch?"}
    reply = {"What is paging?": "Blocks of KV.", "Why batch?": "Throughput."}
    for s in specs:
        assert s.output_len == len(tokenizer.encode(reply[s.prompt], add_special_tokens=False))
        assert s.prompt_len == len(s.prompt_ids)
    fixed = build_specs(BenchConfig(dataset="sharegpt", dataset_path=str(path), output_len=9), None, 2, "m")
    assert [s.output_len for s in fixed] == [9, 9] and fixed[0].prompt_len is None


def test_jsonl_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b"}\n')
    specs = build_specs(BenchConfig(dataset="jsonl", dataset_path=str(path)), None, 3, "measure")
    assert [(s.prompt, s.output_len) for s in specs] == [("a", 3), ("b", 64), ("a", 3)]
    path.write_text('{"text": "a"}\n')
    with pytest.raises(DatasetError, match="p.jsonl:1: each line needs a string field 'prompt'"):
        build_specs(BenchConfig(dataset="jsonl", dataset_path=str(path)), None, 1, "measure")


def test_random_prompts_need_a_tokenizer():
    with pytest.raises(DatasetError, match="--tokenizer"):
        build_specs(BenchConfig(), None, 1, "measure")


def _conversation(ask, reply):
    return {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": reply}]}


def test_sharegpt_records_that_cannot_be_sent_are_skipped(tmp_path):
    """A non-string value, NaN, a lone surrogate: the record is skipped like any malformed one, never a crash."""
    path = tmp_path / "sg.json"
    good = json.dumps([_conversation("fine", "ok")])[1:-1]
    path.write_text("[" + ", ".join([
        json.dumps(_conversation({"text": "not a string"}, "r")), json.dumps(_conversation("q", ["a", "list"])),
        '{"conversations": [{"from": "human", "value": NaN}, {"from": "gpt", "value": "r"}]}',
        '{"conversations": [{"from": "human", "value": "lone \\ud800 surrogate"}, {"from": "gpt", "value": "r"}]}',
        '{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\\udfff"}]}',
    ]) + "]")
    with pytest.raises(DatasetError, match="NaN is not a JSON value"):  # JSON has no NaN
        build_specs(BenchConfig(dataset="sharegpt", dataset_path=str(path)), None, 2, "measure")
    path.write_text(path.read_text().replace("NaN", "1.5")[:-1] + ", " + good + "]")
    specs = build_specs(BenchConfig(dataset="sharegpt", dataset_path=str(path)), None, 2, "measure")
    assert [s.prompt for s in specs] == ["fine", "fine"]
    path.write_text(path.read_text().replace(", " + good, ""))
    with pytest.raises(DatasetError, match="no conversation with a human turn followed by a reply"):
        build_specs(BenchConfig(dataset="sharegpt", dataset_path=str(path)), None, 2, "measure")


@pytest.mark.parametrize("dataset, body, words", [
    ("sharegpt", "[" * 200_000 + "]" * 200_000, "cannot read ShareGPT file {p}: nested too deeply"),
    ("sharegpt", b'[{"conversations": "caf\xe9"}]', "cannot read ShareGPT file {p}: not UTF-8 text (byte 23)"),
    ("jsonl", '{"prompt": "a"}\n' + '{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}\n",
     "{p}:2: not JSON (nested too deeply)"),
    ("jsonl", '{"prompt": "a", "max_tokens": NaN}\n', "{p}:1: not JSON (NaN is not a JSON value)"),
    ("jsonl", '{"prompt": "\\ud800"}\n', "{p}:1: 'prompt' is not valid Unicode text (a lone surrogate)"),
])
def test_unreadable_dataset_files_are_one_line(tmp_path, dataset, body, words):
    path = tmp_path / "data"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(DatasetError) as caught:
        build_specs(BenchConfig(dataset=dataset, dataset_path=str(path)), None, 5, "measure")
    assert str(caught.value) == words.format(p=path)


@pytest.mark.parametrize("dataset", ["sharegpt", "jsonl", "conversation", "trace"])
def test_a_dataset_path_that_is_not_a_regular_file_is_refused_before_reading(tmp_path, dataset):
    """/dev/zero (through a symlink) would be read until memory ran out; a FIFO would wait forever."""
    from infertrace.load.workloads.conversation import ConversationLoad
    from infertrace.load.workloads.replay import read_trace

    link = tmp_path / "data.json"
    link.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (link, fifo):
        cfg = BenchConfig(dataset=dataset, dataset_path=str(path))
        with pytest.raises(DatasetError, match=f"^cannot read .* {path}: not a regular file$"):
            if dataset == "trace":
                read_trace(path)
            elif dataset == "conversation":
                ConversationLoad(cfg, None, 8)
            else:
                build_specs(cfg, None, 1, "measure")


def test_bench_with_a_deeply_nested_sharegpt_file_is_one_line_and_exit_2(standin, tmp_path):
    from click.testing import CliRunner

    from infertrace.cli import main

    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    res = CliRunner().invoke(main, ["bench", "--base-url", standin.url, "--dataset", "sharegpt", "--dataset-path",
                                    str(path), "--num-prompts", "2", "--warmup", "0"])
    assert res.exit_code == 2, res.output
    assert f"cannot read ShareGPT file {path}: nested too deeply" in res.output and "Traceback" not in res.output


def test_a_small_dataset_is_read_under_a_memory_cap(tmp_path):
    # the bound a file may hold (4 GiB) must not be what is allocated to read a 500-byte one
    import subprocess
    import sys

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "x" * 400},
                                                   {"from": "gpt", "value": "y"}]}]))
    child = ("import resource, sys\n"
             "from infertrace.load.workloads.dataset import read_text\n"
             "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
             "print(len(read_text(sys.argv[1], 'dataset')))\n")
    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == path.stat().st_size


def test_a_file_that_grows_past_its_size_while_read_is_read_whole_or_refused(tmp_path, monkeypatch):
    from infertrace import input_files

    path = tmp_path / "growing.jsonl"
    path.write_bytes(b"a" * 100)
    real_fstat = os.fstat
    monkeypatch.setattr(input_files.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 10,
                                                                           *real_fstat(fd)[7:])))
    assert input_files.read_bytes(path, 1000) == b"a" * 100  # fstat said 10 bytes: the rest is read too
    with pytest.raises(input_files.InputFileError, match="grew past"):
        input_files.read_bytes(path, 50)
