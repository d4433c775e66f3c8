"""The front end's tokenizer: the model directory's `tokenizer.json` through the Rust `tokenizers` library and its
chat template through jinja2, without transformers (whose import loads torch into the front end).

A long text is encoded in pieces at once, on the `tokenizers` thread pool, when the tokenizer provably reads the
pieces as it reads the whole (`PieceCuts`): on an H100 host's 16 cores, 2,048 tokens' text in 0.65 ms instead of
2.37. The server asks for pieces only above a length (`state.PIECES_FROM_CHARS`).

Chat templates render in the environment transformers gives them (`render_jinja_template`, transformers 5.x): a
sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now` and a
`tojson` that does not escape HTML, with the special tokens of `tokenizer_config.json` as variables.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class FrontendTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (the server needs a fast tokenizer)")
        self.backend = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        self.chat_template = _chat_template(model_dir, config)
        self.cuts = PieceCuts.of(self.backend)

    def encode(self, text: str, add_special_tokens: bool = True, pieces: bool = True) -> list[int]:
        """The text's ids; with `pieces`, encoded in pieces where it can be cut (see PieceCuts)."""
        # the batch entry point releases the GIL while it works (the server tokenizes on a thread pool)
        parts = self.cuts.pieces(text) if pieces and self.cuts is not None else [text]
        if len(parts) == 1:
            [encoding] = self.backend.encode_batch_fast(parts, add_special_tokens=add_special_tokens)
            return encoding.ids
        encodings = self.backend.encode_batch_fast(parts, add_special_tokens=False)
        if add_special_tokens and self.backend.num_special_tokens_to_add(False):
            from tokenizers import Encoding

            return self.backend.post_process(Encoding.merge(encodings), None, True).ids
        return [i for encoding in encodings for i in encoding.ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs: Any) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("the model directory has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        text = _compile(self.chat_template).render(messages=messages, tools=kwargs.pop("tools", None),
                                                   documents=kwargs.pop("documents", None),
                                                   add_generation_prompt=add_generation_prompt, **special, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class PieceCuts:
    """Where a long text may be cut so that its pieces, encoded apart, give the ids of the whole: before a space
    that sits between two ASCII letters or digits.

    That holds for a BPE model behind the GPT-2 byte-level split (ByteLevel with use_regex) or the Qwen2 and Llama-3
    splits, under no normalizer or NFC. No alternative of those patterns matches a letter or digit followed by a
    space, so a match always ends before that space, and the patterns look at no text before a match: the whole
    and the pieces are split into the same matches. BPE merges only within a match, and NFC composes nothing
    across a space. Added tokens that hold whitespace or strip it around them, and truncation or padding, would
    see the pieces apart: with those there are no cuts (`of` gives None).
    """

    MIN_CHARS = 512  # each piece is about 120 tokens or more: the pool's handoff is a few us a piece
    SPLITS = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
              "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",  # Qwen2 and Qwen3
              "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
              "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")  # Llama 3
    _CUT = re.compile(r"[A-Za-z0-9] [A-Za-z0-9]")

    def __init__(self, max_pieces: int) -> None:
        self.max_pieces = max_pieces

    @classmethod
    def of(cls, backend: Any) -> PieceCuts | None:
        def state(component: Any) -> Any:
            return None if component is None else json.loads(component.__getstate__())

        normalizer, pre = state(backend.normalizer), state(backend.pre_tokenizer)
        if normalizer not in (None, {"type": "NFC"}) or backend.truncation or backend.padding:
            return None
        if type(backend.model).__name__ != "BPE":
            return None
        if any(any(c.isspace() for c in t.content) or t.lstrip or t.rstrip
               for t in backend.get_added_tokens_decoder().values()):
            return None
        byte_level = {"type": "ByteLevel", "add_prefix_space": False}
        if not (_has(pre, byte_level, use_regex=True)
                or (pre or {}).get("type") == "Sequence" and len(pre["pretokenizers"]) == 2
                and _has(pre["pretokenizers"][1], byte_level, use_regex=False)
                and _has(pre["pretokenizers"][0], {"type": "Split", "behavior": "Isolated", "invert": False})
                and pre["pretokenizers"][0].get("pattern") in [{"Regex": p} for p in cls.SPLITS]):
            return None
        pieces = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(pieces) if pieces > 1 else None

    def pieces(self, text: str) -> list[str]:
        n = min(self.max_pieces, len(text) // self.MIN_CHARS)
        starts = [0]
        for k in range(1, n):
            m = self._CUT.search(text, max(len(text) * k // n, starts[-1] + 1))
            if m is None:
                break
            starts.append(m.start() + 1)
        if len(starts) == 1:
            return [text]
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)], strict=True)]


def _has(component: Any, fields: dict, **more: Any) -> bool:
    return isinstance(component, dict) and all(component.get(k) == v for k, v in {**fields, **more}.items())


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=4)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return dt.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
