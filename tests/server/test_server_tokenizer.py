"""The front end's tokenizer: a long text encoded in pieces gives the ids of the whole, for every tokenizer shape
that is cut (the tiny model's GPT-2 byte-level split, Qwen2's split under NFC, Llama 3's with a BOS), and shapes the
cut would change are not cut."""

import json
import random
import shutil

import pytest
from tokenizers import Tokenizer

from infertrace.server.frontend.tokenizer import FrontendTokenizer, PieceCuts

QWEN2_SPLIT, LLAMA3_SPLIT = PieceCuts.SPLITS
ALPHABET = (["hello", "world", "it's", "they'll", "I'M", "x", "Straße", "naïve", "e\u0301", "ß", "ﬁ", "Ω", "ı"]
            + [" ", "  ", "\t", "\n", "\r\n", " \n ", "123", "4567", "½", "3.14", "-", "--", "!?", "'", "\"",
               "日本語", "한국어", "\u1100\u1161", "😀", "<|im_start|>", "<|endoftext|>", "<think>", "a b", "Z y"])


def _model_dir(tmp_path, tiny_model_dir, edit=None):
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    if edit is not None:
        edit(spec)
    out = tmp_path / "tok"
    out.mkdir(exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(tiny_model_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def _split(pattern):
    def edit(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    return edit


def _qwen2(spec):
    _split(QWEN2_SPLIT)(spec)
    spec["normalizer"] = {"type": "NFC"}


def _llama3(spec):
    _split(LLAMA3_SPLIT)(spec)
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos["id"]], "tokens": ["<|endoftext|>"]}}}


def _texts(rng, n):
    for _ in range(n):
        words = [rng.choice(ALPHABET) for _ in range(rng.randrange(1, 400))]
        yield "".join(w if rng.random() < 0.3 else " " + w for w in words)


@pytest.mark.parametrize("shape", [None, _qwen2, _llama3], ids=["gpt2-byte-level", "qwen2-nfc", "llama3-bos"])
def test_pieces_encode_to_the_ids_of_the_whole(tmp_path, tiny_model_dir, monkeypatch, shape):
    tokenizer = FrontendTokenizer(_model_dir(tmp_path, tiny_model_dir, shape))
    whole = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    monkeypatch.setattr(PieceCuts, "MIN_CHARS", 16)  # many pieces in every text
    tokenizer.cuts = PieceCuts(max_pieces=8)
    rng = random.Random(0)
    cut = 0
    for text in _texts(rng, 300):
        cut += len(tokenizer.cuts.pieces(text)) > 1
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special) == \
                whole.encode(text, add_special_tokens=special).ids, (text, special)
    assert cut > 200  # the texts were cut, most of them more than once
    if shape is _llama3:
        assert tokenizer.encode("hello world " * 10)[0] == whole.token_to_id("<|endoftext|>")


def test_pieces_start_at_a_space_between_ascii_letters_or_digits():
    cuts = PieceCuts(max_pieces=4)
    text = ("word " * 300).strip()  # 1,499 characters: two pieces of at least 512
    pieces = cuts.pieces(text)
    assert len(pieces) == 2 and "".join(pieces) == text
    assert pieces[1].startswith(" word") and pieces[0].endswith("word")
    assert cuts.pieces("日本語" * 1000) == ["日本語" * 1000]  # nowhere to cut: whole
    assert cuts.pieces("a b" * 100) == ["a b" * 100]  # too short to cut
    assert len(cuts.pieces("1 2" * 400)) == 2 and len(cuts.pieces("é ü" * 400)) == 1
    assert len(cuts.pieces("a b" * 5000)) == 4


@pytest.mark.parametrize("edit", [
    lambda s: s.update(normalizer={"type": "NFKC"}),
    lambda s: s.update(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}),
    lambda s: s["pre_tokenizer"].update(add_prefix_space=True),
    lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
    _split("\\s+|\\S+"),
    lambda s: s["added_tokens"][0].update(rstrip=True),
    lambda s: s["added_tokens"].append({**s["added_tokens"][-1], "id": s["added_tokens"][-1]["id"] + 1,
                                        "content": "two words"}),
], ids=["nfkc", "truncation", "prefix-space", "whitespace-split", "other-regex", "strips", "spaced-added-token"])
def test_shapes_the_cut_would_change_are_never_cut(tmp_path, tiny_model_dir, edit):
    assert FrontendTokenizer(_model_dir(tmp_path, tiny_model_dir)).cuts is not None or _one_core()
    assert FrontendTokenizer(_model_dir(tmp_path, tiny_model_dir, edit)).cuts is None


def _one_core():
    import os

    return len(os.sched_getaffinity(0)) == 1


def test_the_server_cuts_only_texts_longer_than_its_bound():
    from infertrace.server.frontend import state as state_module

    asked = []

    class Recording:
        def encode(self, text, add_special_tokens=True, pieces=True):
            asked.append((len(text), pieces))
            return []

    server = state_module.ServerState.__new__(state_module.ServerState)
    server.tokenizer = Recording()
    bound = state_module.PIECES_FROM_CHARS
    for n in (bound, bound + 1):
        server._encode("x" * n, add_special_tokens=True)
    assert asked == [(bound, False), (bound + 1, True)]


def test_a_model_other_than_bpe_is_never_cut():
    from tokenizers import models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert PieceCuts.of(backend) is None
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert PieceCuts.of(backend) is not None or _one_core()
