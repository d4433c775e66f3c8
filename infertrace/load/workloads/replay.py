"""Replay of production request traces: Mooncake JSONL (with 512-token prefix-block hashes), Azure LLM inference
CSV and BurstGPT CSV, detected by content; prompts whose blocks repeat exactly where the trace's blocks repeat.

A trace gives arrival times and token counts, never text. Prompts are built from words that are single tokens and
whole pre-tokens of the target's tokenizer (a space and letters), so a prompt's token count is the sum of its
words' and two prompts that share their first k block ids share their first k blocks byte for byte: a server's
prefix cache sees the reuse production saw.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infertrace.load.records import RequestSpec
from infertrace.load.workloads.dataset import DatasetError, loads, regular_file, seeded_rng

MOONCAKE_BLOCK_TOKENS = 512
MAX_SPAN_S = 7 * 24 * 3600.0  # a replay longer than a week (the longest public trace) is refused, not waited out
MAX_REQUEST_TOKENS = 1 << 21  # the longest request built when the server does not give its context length
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_WORD = re.compile(r" [A-Za-z]+")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # 1-based line of the file, for messages
    offset_s: float  # arrival after the trace's first request
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # Mooncake only: the prompt's blocks


@dataclass(slots=True)
class Trace:
    path: str
    format: str  # "mooncake", "azure" or "burstgpt"
    requests: list[TraceRequest]
    block_tokens: int | None = None  # tokens a hash block stands for (Mooncake), after --token-scale
    notes: list[str] = field(default_factory=list)

    def implied_prefix_reuse(self) -> float | None:
        """Share of prompt tokens in leading blocks already seen in an earlier request of the trace (what a
        prefix cache of unbounded size could serve); None without block hashes."""
        if self.block_tokens is None:
            return None
        total = sum(req.input_len for req in self.requests)
        return sum(covered for _, covered in self._seen_prefixes()) / total if total else None

    def servable_prefix_reuse(self, cache_block_tokens: int, salt_tokens: int = 0) -> float | None:
        """The implied reuse a paged prefix cache of `cache_block_tokens`-token blocks can serve: of each prompt's
        leading tokens seen before (the --prompt-salt line every prompt starts with, after the first prompt, and
        the trace's blocks seen in an earlier request), the whole cache blocks that end before its last token (the
        last token is always computed: its logits give the first output token). A salt shorter than a cache block
        fills none, so it is no reuse. None without block hashes."""
        if self.block_tokens is None:
            return None
        total = sum(salt_tokens + req.input_len for req in self.requests)
        served = sum(min((salt_tokens if i else 0) + covered, salt_tokens + req.input_len - 1)
                     // cache_block_tokens * cache_block_tokens
                     for i, (req, covered) in enumerate(self._seen_prefixes()))
        return served / total if total else None

    def _seen_prefixes(self) -> Iterator[tuple[TraceRequest, int]]:
        """Each request with its prompt tokens in leading blocks an earlier request of the trace already had."""
        seen: set[int] = set()
        for req in self.requests:
            leading, covered = True, 0
            for k, h in enumerate(req.hash_ids or ()):
                size = min(self.block_tokens, req.input_len - k * self.block_tokens)
                if size <= 0:
                    break
                leading = leading and h in seen
                covered += size if leading else 0
                seen.add(h)
            yield req, covered


def read_trace(path: str | Path, time_scale: float = 1.0, token_scale: float = 1.0,
               limit: int | None = None) -> Trace:
    """The trace at `path`, its times multiplied by `time_scale` and its lengths (and block) by `token_scale`.
    Any malformed line is a DatasetError naming the file and line, raised before any load is sent."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise DatasetError(f"--time-scale must be a positive number, got {time_scale}")
    if not (math.isfinite(token_scale) and token_scale > 0):
        raise DatasetError(f"--token-scale must be a positive number, got {token_scale}")
    path = regular_file(path, "trace")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # a byte-order mark is not part of the first line
            head = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read trace {path}: {e}") from None
    try:
        trace = _read_known(path, head, limit)
    except UnicodeDecodeError as e:
        raise DatasetError(f"cannot read trace {path}: not UTF-8 text ({e.reason})") from None
    if not trace.requests:
        raise DatasetError(f"{path}: the trace holds no requests")
    trace = _scaled(trace, time_scale, token_scale)
    last = trace.requests[-1]
    if last.offset_s > MAX_SPAN_S:
        raise DatasetError(f"{path}:{last.line}: the trace's {len(trace.requests)} request(s) span "
                           f"{last.offset_s:.4g} s ({last.offset_s / 86400:.4g} days) at --time-scale {time_scale:g}; "
                           f"a replay longer than {MAX_SPAN_S / 86400:g} days is refused: pass a smaller "
                           "--time-scale or --num-prompts")
    return trace


def _read_known(path: Path, head: str, limit: int | None) -> Trace:
    """The trace in the format its first line shows."""
    if head.lstrip().startswith("{") and _is_mooncake(head):
        return _read_mooncake(path, limit)
    if set(AZURE_COLUMNS) <= _columns(head):
        return _read_csv(path, "azure", AZURE_COLUMNS, _azure_time, limit)
    if set(BURSTGPT_COLUMNS) <= _columns(head):
        return _read_csv(path, "burstgpt", BURSTGPT_COLUMNS, float, limit)
    raise DatasetError(f"{path}:1: not a known trace format (Mooncake JSONL with timestamp/input_length/"
                       f"output_length/hash_ids, Azure CSV with {','.join(AZURE_COLUMNS)}, or BurstGPT CSV "
                       f"with {', '.join(BURSTGPT_COLUMNS)})")


def _is_mooncake(first_line: str) -> bool:
    try:
        rec = loads(first_line)
    except ValueError:
        return True  # JSONL that does not parse: let the reader name the line
    return isinstance(rec, dict) and bool({"input_length", "hash_ids"} & set(rec))


def _columns(header_line: str) -> set[str]:
    return {c.strip() for c in next(csv.reader([header_line]), [])}


def _read_mooncake(path: Path, limit: int | None) -> Trace:
    requests: list[TraceRequest] = []
    first = last = None
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = loads(line)
            except ValueError as e:
                raise DatasetError(f"{path}:{line_no}: not JSON ({e})") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"{path}:{line_no}: each line must be a JSON object")
            missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in rec]
            if missing:
                raise DatasetError(f"{path}:{line_no}: missing field {missing[0]!r}")
            stamp = _number(rec["timestamp"], path, line_no, "timestamp")
            n_in = _length(rec["input_length"], path, line_no, "input_length")
            n_out = _length(rec["output_length"], path, line_no, "output_length")
            ids = rec["hash_ids"]
            if not (isinstance(ids, list) and all(isinstance(h, int) and not isinstance(h, bool) for h in ids)):
                raise DatasetError(f"{path}:{line_no}: hash_ids must be a list of integers")
            if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
                raise DatasetError(f"{path}:{line_no}: {len(ids)} hash_ids for input_length {n_in} (expected "
                                   f"{math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)} blocks of {MOONCAKE_BLOCK_TOKENS})")
            first, last = _monotonic(stamp, first, last, path, line_no)
            requests.append(TraceRequest(line_no, (stamp - first) / 1000.0, n_in, n_out, tuple(ids)))
    return Trace(str(path), "mooncake", requests, MOONCAKE_BLOCK_TOKENS)


def _read_csv(path: Path, fmt: str, columns: tuple[str, str, str], parse_time, limit: int | None) -> Trace:
    requests: list[TraceRequest] = []
    skipped = 0
    first = last = None
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        reader.fieldnames = [c.strip() for c in reader.fieldnames or []]
        for rec in reader:
            line_no = reader.line_num
            if limit is not None and len(requests) >= limit:
                break
            values = [rec.get(c) for c in columns]
            if any(v is None or str(v).strip() == "" for v in values):
                missing = columns[[v is None or str(v).strip() == "" for v in values].index(True)]
                raise DatasetError(f"{path}:{line_no}: missing value for {missing!r}")
            try:
                stamp = parse_time(values[0].strip())
            except ValueError:
                raise DatasetError(f"{path}:{line_no}: cannot read the time {values[0]!r}") from None
            if not math.isfinite(stamp):
                raise DatasetError(f"{path}:{line_no}: {columns[0]} must be a finite number, got {values[0]!r}")
            n_in = _length(_int_text(values[1], path, line_no, columns[1]), path, line_no, columns[1])
            n_out = _length(_int_text(values[2], path, line_no, columns[2]), path, line_no, columns[2], minimum=0)
            first, last = _monotonic(stamp, first, last, path, line_no)
            if n_out == 0:  # BurstGPT logs failed requests with no response: nothing to replay
                skipped += 1
                continue
            requests.append(TraceRequest(line_no, stamp - first, n_in, n_out))
    notes = [f"{skipped} request(s) with 0 response tokens (failures in the original log) skipped"] if skipped else []
    return Trace(str(path), fmt, requests, None, notes)


def _azure_time(text: str) -> float:
    """Seconds since the epoch of "2023-11-16 18:15:46.6805900" (Azure writes 7 fractional digits)."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(.*)", text)
    if not match:
        raise ValueError(text)
    base = dt.datetime.fromisoformat(match[1] + (match[3] or ""))
    if base.tzinfo is None:
        base = base.replace(tzinfo=dt.timezone.utc)
    return base.timestamp() + (float("0." + match[2]) if match[2] else 0.0)


def _number(value, path, line_no, name) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DatasetError(f"{path}:{line_no}: {name} must be a finite number, got {value!r}")
    return float(value)


def _int_text(text: str, path, line_no, name) -> int:
    try:
        value = float(text)
    except ValueError:
        _fail(path, line_no, name, text)
    if not value.is_integer():
        _fail(path, line_no, name, text)
    return int(value)


def _fail(path, line_no, name, value):
    raise DatasetError(f"{path}:{line_no}: {name} must be a whole number, got {value!r}")


def _length(value, path, line_no, name, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, line_no, name, value)
    if value < minimum:
        raise DatasetError(f"{path}:{line_no}: {name} must be at least {minimum}, got {value}")
    return value


def _monotonic(stamp: float, first, last, path, line_no):
    if last is not None and stamp < last:
        raise DatasetError(f"{path}:{line_no}: timestamp {stamp:g} is earlier than the line before ({last:g}); "
                           "a trace must be in arrival order")
    return (stamp if first is None else first), stamp


def _scaled(trace: Trace, time_scale: float, token_scale: float) -> Trace:
    if time_scale == 1.0 and token_scale == 1.0:
        return trace
    block = None
    if trace.block_tokens is not None:
        block = max(1, round(trace.block_tokens * token_scale))
    requests = []
    for r in trace.requests:
        n_in = max(1, round(r.input_len * token_scale))
        ids = r.hash_ids[:math.ceil(n_in / block)] if r.hash_ids is not None else None
        requests.append(TraceRequest(r.line, r.offset_s * time_scale, n_in, max(1, round(r.output_len * token_scale)),
                                     ids))
    return Trace(trace.path, trace.format, requests, block, trace.notes)


# ----- prompts -----
@functools.lru_cache(maxsize=4)
def word_vocab(tokenizer) -> np.ndarray:
    """Ids whose text is one space and ASCII letters and that read back as themselves: each is a whole
    pre-token of a byte-level BPE, so a sequence of them re-encodes to exactly itself."""
    vocab = tokenizer.get_vocab()
    ids = sorted(vocab.values())
    pieces = tokenizer.batch_decode([[i] for i in ids])
    words = [(i, p) for i, p in zip(ids, pieces) if _WORD.fullmatch(p)]
    back = tokenizer([p for _, p in words], add_special_tokens=False)["input_ids"] if words else []
    keep = [i for (i, _), enc in zip(words, back) if enc == [i]]
    if len(keep) < 16:
        raise DatasetError("the tokenizer has too few single-token words to build trace prompts from")
    return np.array(keep, dtype=np.int64)


class BlockPrompts:
    """Prompts built block by block: block id h always becomes the same `block_tokens` words (its tail cut for a
    partial last block); a request without block ids gets fresh words seeded by its line."""

    def __init__(self, tokenizer, block_tokens: int | None, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        self.seed = seed
        self.vocab = word_vocab(tokenizer)
        self._blocks: dict[int, list[int]] = {}

    def block(self, h: int) -> list[int]:
        ids = self._blocks.get(h)
        if ids is None:
            rng = seeded_rng(self.seed, "trace-block", h & 0x7FFFFFFF)
            ids = self._blocks[h] = rng.choice(self.vocab, self.block_tokens).tolist()
        return ids

    def prompt_ids(self, req: TraceRequest) -> list[int]:
        if req.hash_ids is None or self.block_tokens is None:
            return seeded_rng(self.seed, "trace-request", req.line).choice(self.vocab, req.input_len).tolist()
        ids: list[int] = []
        for h in req.hash_ids:
            ids.extend(self.block(h))
        if len(ids) < req.input_len:  # fewer blocks than tokens (a trace cut by --token-scale rounding)
            ids.extend(seeded_rng(self.seed, "trace-tail", req.line).choice(self.vocab, req.input_len - len(ids)))
        return ids[:req.input_len]

    def spec(self, index: int, req: TraceRequest) -> RequestSpec:
        ids = self.prompt_ids(req)
        text = self.tokenizer.decode(ids)
        return RequestSpec(index, text, req.output_len, ids, len(ids))


def check_lengths(trace: Trace, max_model_len: int | None) -> None:
    """DatasetError before any prompt is built when a request cannot fit the server's context (its input and
    output), or without a known context is longer than MAX_REQUEST_TOKENS: building it would cost the client
    gigabytes for a request the server must refuse."""
    limit = max_model_len or MAX_REQUEST_TOKENS
    over = [r for r in trace.requests if r.input_len + (r.output_len if max_model_len else 0) > limit]
    if not over:
        return
    r = over[0]
    if max_model_len:
        what = f"{r.input_len} input + {r.output_len} output tokens, above the server's context of {limit} tokens"
    else:
        what = f"{r.input_len} input tokens, above the {limit} bench builds when the server gives no context length"
    raise DatasetError(f"{trace.path}:{r.line}: {what}; {len(over)} of {len(trace.requests)} request(s) are: "
                       "pass --token-scale to scale the trace's lengths down")


def trace_specs(trace: Trace, tokenizer, seed: int = 0) -> tuple[list[RequestSpec], list[float]]:
    """The requests to send and their send offsets in seconds, in trace order."""
    if tokenizer is None:
        raise DatasetError("trace replay builds prompts of exact length: it needs the target's tokenizer "
                           "(--tokenizer)")
    prompts = BlockPrompts(tokenizer, trace.block_tokens, seed)
    specs = [prompts.spec(i, r) for i, r in enumerate(trace.requests)]
    return specs, [r.offset_s for r in trace.requests]


def warmup_specs(trace: Trace, tokenizer, seed: int, n: int) -> list[RequestSpec]:
    """`n` requests of the trace's first lengths made of fresh words, sharing no block with the replay, so a
    warmup (only when asked) warms the server without seeding its prefix cache with the trace's blocks."""
    vocab = word_vocab(tokenizer)
    out = []
    for i, req in enumerate(trace.requests[:n]):
        ids = seeded_rng(seed, "trace-warmup", i).choice(vocab, req.input_len).tolist()
        out.append(RequestSpec(i, tokenizer.decode(ids), req.output_len, ids, len(ids)))
    return out


# ----- the load -----
DEFAULT_CACHE_BLOCK_TOKENS = 16  # vLLM's and the bundled engine's KV block, when the target does not say


def cache_block_tokens(target) -> tuple[int, str]:
    """The target's prefix-cache block in tokens, and where that figure comes from."""
    return target.cache_block_tokens() or (DEFAULT_CACHE_BLOCK_TOKENS, "assumed (vLLM's and infertrace's default)")


class TraceReplay:
    """`--dataset trace`: the first --num-prompts requests of the trace, each sent at its time × --time-scale (an
    open loop on the trace's own schedule, capped by --concurrency when given)."""

    reads_prefix_cache = True  # the run's own hit rate, against the reuse the trace implies

    def __init__(self, cfg, tokenizer, max_model_len: int | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.trace = read_trace(cfg.dataset_path, cfg.time_scale, cfg.token_scale, cfg.num_prompts)
        check_lengths(self.trace, max_model_len)
        self.specs, self.offsets = trace_specs(self.trace, tokenizer, cfg.seed)

    @property
    def total(self) -> int:
        return len(self.specs)

    def warmup_specs(self, n: int) -> list[RequestSpec]:
        return warmup_specs(self.trace, self.tokenizer, self.cfg.seed, n)

    def phase(self, runner, clock, window: float | None):
        return runner.open_loop(self.specs, self.offsets, self.cfg.concurrency)

    def figures(self, results, target) -> dict:
        block, block_source = cache_block_tokens(target)
        t = self.trace
        return {
            "trace": {"path": t.path, "format": t.format, "requests": len(t.requests),
                      "span_s": t.requests[-1].offset_s if t.requests else 0.0, "block_tokens": t.block_tokens,
                      "time_scale": self.cfg.time_scale, "token_scale": self.cfg.token_scale, "notes": t.notes},
            "trace_implied_prefix_reuse": t.implied_prefix_reuse(),
            "trace_servable_prefix_reuse": t.servable_prefix_reuse(block, target.salt_tokens),
            "cache_block_tokens": block, "cache_block_tokens_source": block_source,
        }
