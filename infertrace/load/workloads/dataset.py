"""Request sets: random prompts of exact token length, shared prefixes, ShareGPT files and JSONL, all seeded."""

from __future__ import annotations

import functools
import json
import stat
import zlib
from pathlib import Path

import numpy as np

from infertrace import input_files
from infertrace.load.records import RequestSpec

EXACT_LENGTH_ROUNDS = 8
MAX_FILE_BYTES = 4 << 30  # a dataset or trace file larger than this is refused before it is read


class DatasetError(ValueError):
    """The dataset cannot be built (missing file, malformed record, no tokenizer where one is needed)."""


def regular_file(path: str | Path, what: str) -> Path:
    """`path` when it is a regular file (after symlinks) of at most MAX_FILE_BYTES; a device such as /dev/zero
    or a pipe would be read forever."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as e:
        raise DatasetError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DatasetError(f"cannot read {what} {path}: not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise DatasetError(f"cannot read {what} {path}: {info.st_size / 2**30:.1f} GiB, above the "
                           f"{MAX_FILE_BYTES >> 30} GiB a file may hold")
    return path


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a regular file (a byte-order mark dropped), read up to MAX_FILE_BYTES."""
    try:
        return input_files.read_text(path, MAX_FILE_BYTES)
    except input_files.InputFileError as e:
        raise DatasetError(f"cannot read {what} {path}: {e}") from None


def loads(text: str):
    """JSON as the standard allows it: no NaN or Infinity; ValueError for those, for bad JSON, and for nesting
    too deep for the parser (RecursionError)."""
    def refuse(name: str):
        raise ValueError(f"{name} is not a JSON value")

    try:
        return json.loads(text, parse_constant=refuse)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def is_text(value) -> bool:
    """A string that can be sent: UTF-8 encodable (a lone surrogate from a JSON escape is not)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def seeded_rng(seed: int, stream: str, point: int = 0) -> np.random.Generator:
    """Independent, repeatable streams: the same (seed, stream, point) always gives the same numbers."""
    return np.random.default_rng([seed, zlib.crc32(stream.encode()), point])


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """Lengths are uniform integers in [L(1-r), L(1+r)], at least 1."""
    return max(1, int(np.floor(length * (1 - ratio)))), max(1, int(np.ceil(length * (1 + ratio))))


@functools.lru_cache(maxsize=4)
def ordinary_vocab(tokenizer) -> np.ndarray:
    """Ids that are not special and decode to whole characters (a 150k vocabulary takes a moment: cached)."""
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {}) | set(tokenizer.all_special_ids)
    ids = sorted(set(tokenizer.get_vocab().values()) - special)
    pieces = tokenizer.batch_decode([[i] for i in ids])
    vocab = np.array([i for i, p in zip(ids, pieces) if p and "\ufffd" not in p], dtype=np.int64)
    if len(vocab) == 0:
        raise DatasetError("the tokenizer has no ordinary tokens to build random prompts from")
    return vocab


class PromptMaker:
    """Random text that the tokenizer reads back as exactly the requested number of tokens.

    Token ids are drawn from the tokenizer's ordinary vocabulary, leaving out special tokens and byte pieces
    that decode to no whole character (their text does not read back as themselves). Decoding and re-encoding
    merges or splits tokens, so the text is re-read and trimmed or topped up until the count is exact.
    """

    def __init__(self, tokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.vocab = ordinary_vocab(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def sample(self, n: int) -> list[int]:
        return self.rng.choice(self.vocab, n).tolist() if n > 0 else []

    def exact(self, length: int, prefix_ids: list[int] | None = None) -> tuple[str, list[int]]:
        """(text, ids) with len(ids) == length, ids == encode(text), and ids starting with `prefix_ids`."""
        prefix = prefix_ids or []
        for _ in range(EXACT_LENGTH_ROUNDS):  # a fresh random tail when the text merges into the prefix
            ids = prefix + self.sample(length - len(prefix))
            for _ in range(EXACT_LENGTH_ROUNDS):
                text = self.tokenizer.decode(ids)
                back = self.encode(text)
                if back[:len(prefix)] != prefix:
                    break
                if len(back) == length:
                    return text, back
                ids = back[:length] if len(back) > length else back + self.sample(length - len(back))
        raise DatasetError(f"could not build a prompt of exactly {length} tokens with this tokenizer")


def random_specs(maker: PromptMaker, n: int, input_len: int, output_len: int, range_ratio: float,
                 prefixes: list[list[int]] | None = None) -> list[RequestSpec]:
    """`n` prompts of uniform random length; with `prefixes`, request i starts with prefix i mod len(prefixes)."""
    rng = maker.rng
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, n)
    out_lens = rng.integers(out_lo, out_hi + 1, n)
    specs = []
    for i in range(n):
        prefix = prefixes[i % len(prefixes)] if prefixes else []
        text, ids = maker.exact(len(prefix) + int(in_lens[i]), prefix)
        specs.append(RequestSpec(i, text, int(out_lens[i]), ids, len(ids)))
    return specs


# Token ids drawn without the target's tokenizer: every vocabulary of 32k entries or more (Llama 2 and Mistral's
# 32,000 up to Qwen's 151,936) holds them, and the lowest ids, where special and byte tokens sit, are left out.
TOKEN_ID_RANGE = (1000, 32000)


def random_id_specs(rng: np.random.Generator, n: int, input_len: int, output_len: int,
                    range_ratio: float) -> list[RequestSpec]:
    """`n` prompts of random token ids sent as ids (vLLM's way without a tokenizer): their length in tokens is
    exact by construction, the server's usage confirms it, and no text exists to send over chat."""
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, n)
    out_lens = rng.integers(out_lo, out_hi + 1, n)
    return [RequestSpec(i, "", int(out_lens[i]), rng.integers(*TOKEN_ID_RANGE, int(in_lens[i])).tolist(), None)
            for i in range(n)]


def shared_prefixes(maker: PromptMaker, num_prefixes: int, prefix_len: int) -> list[list[int]]:
    return [maker.exact(prefix_len)[1] for _ in range(num_prefixes)]


def _measured(index: int, prompt: str, output_len: int, tokenizer) -> RequestSpec:
    if tokenizer is None:
        return RequestSpec(index, prompt, output_len)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return RequestSpec(index, prompt, output_len, ids, len(ids))


def read_sharegpt(path: str | Path) -> list:
    """The conversations of a ShareGPT-format file (a JSON list), unvalidated."""
    text = read_text(path, "ShareGPT file")
    try:
        records = loads(text)
    except ValueError as e:
        raise DatasetError(f"cannot read ShareGPT file {path}: {e}") from None
    if not isinstance(records, list):
        raise DatasetError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    return records


def sharegpt_specs(path: str | Path, n: int, rng: np.random.Generator, tokenizer, output_len: int | None,
                   default_output_len: int, max_model_len: int | None = None) -> list[RequestSpec]:
    """First human turn as the prompt; the reply's token length as max_tokens unless `output_len` is given.

    Conversations are shuffled with the seed; ones without a reply, or too long for the target, are skipped.
    """
    records = read_sharegpt(path)
    pairs = []
    for rec in records:
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") not in ("human", "user") or not is_text(first.get("value")) or not first["value"] \
                or not is_text(second.get("value")):
            continue
        pairs.append((first["value"], second["value"]))
    if not pairs:
        raise DatasetError(f"{path}: no conversation with a human turn followed by a reply")
    specs: list[RequestSpec] = []
    for k in rng.permutation(len(pairs)):
        if len(specs) == n:
            break
        prompt, reply = pairs[k]
        out_len = output_len
        if out_len is None:
            out_len = max(1, len(tokenizer.encode(reply, add_special_tokens=False))) if tokenizer else \
                default_output_len
        spec = _measured(len(specs), prompt, out_len, tokenizer)
        if max_model_len and spec.prompt_len is not None and spec.prompt_len + out_len > max_model_len:
            continue
        specs.append(spec)
    return _cycle(specs, n, path)


def jsonl_specs(path: str | Path, n: int, tokenizer, output_len: int | None,
                default_output_len: int) -> list[RequestSpec]:
    """One JSON object per line: `prompt` (text), optional `max_tokens` or `output_len`. File order is kept."""
    specs: list[RequestSpec] = []
    lines = read_text(path, "JSONL file").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{lineno}: not JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise DatasetError(f"{path}:{lineno}: each line needs a string field 'prompt'")
        if not is_text(rec["prompt"]):
            raise DatasetError(f"{path}:{lineno}: 'prompt' is not valid Unicode text (a lone surrogate)")
        out_len = output_len or rec.get("max_tokens") or rec.get("output_len") or default_output_len
        if not isinstance(out_len, int) or out_len < 1:
            raise DatasetError(f"{path}:{lineno}: max_tokens must be a positive integer")
        specs.append(_measured(len(specs), rec["prompt"], out_len, tokenizer))
        if len(specs) == n:
            break
    return _cycle(specs, n, path)


def _cycle(specs: list[RequestSpec], n: int, path) -> list[RequestSpec]:
    """Repeat the file's prompts when it holds fewer than `n`."""
    if not specs:
        raise DatasetError(f"{path}: no usable prompts")
    out = list(specs)
    while len(out) < n:
        s = specs[len(out) % len(specs)]
        out.append(RequestSpec(len(out), s.prompt, s.output_len, s.prompt_ids, s.prompt_len))
    return out
