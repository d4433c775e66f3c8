"""A Kineto JSON trace's bytes (plain or gzip) and their events array, split into pieces that end on an event
boundary and decoded a piece at a time into a `_ColumnSink`, within the bounds kineto.py's docstring gives."""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

import numpy as np

from infertrace.analyze.kineto_columns import TraceError, _ColumnSink
from infertrace.analyze.kineto_events import _DICTS, _STRUCTS, _TAGS, _TaggedDecoder

BLOCK = 1 << 20  # bytes decoded at once: small enough to stay in cache, large enough to amortise each call
METADATA_LIMIT = 16 << 20  # bytes of JSON read before the traceEvents array, and after it
EVENT_LIMIT = 16 << 20  # the largest single event (or run of whitespace inside the array) read
GZIP_RATIO_LIMIT = 64  # Kineto JSON compresses 10-22x; past this many times the gzip's size, reading stops
GZIP_SLACK = 32 << 20  # decompressed bytes always allowed, whatever the ratio
_WS = b" \t\r\n"
_KEY = b'"traceEvents"'
_COLON = re.compile(rb"[ \t\r\n]*(:?)[ \t\r\n]*")


class _GzipBomb(Exception):
    """A gzip file that decompresses to far more than any trace of its size."""


def _blocks(path: Path):
    with open(path, "rb") as raw:
        magic = raw.read(2)
        size = os.fstat(raw.fileno()).st_size
    if magic != b"\x1f\x8b":
        with open(path, "rb", buffering=0) as fh:
            yield from _read_blocks(fh)
        return
    limit = GZIP_RATIO_LIMIT * size + GZIP_SLACK
    read = 0
    for block in _gunzip(path):
        read += len(block)
        if read > limit:
            raise _GzipBomb(f"decompresses to more than {GZIP_RATIO_LIMIT}x its size (a gzip bomb?); "
                            f"the rest after {_mb(read - len(block))} was not read")
        yield block


def _gunzip(path: Path):
    """A gzip file's bytes, at most BLOCK at a time, every member in turn. Unlike gzip.GzipFile.read, which drops
    what it decompressed in a call that meets the end of a cut file, every byte before the cut is given before
    EOFError: a truncated trace keeps all of its complete events."""
    with open(path, "rb", buffering=0) as fh:
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = b""
        while True:
            if not pending:
                pending = fh.read(BLOCK // 4)
                if not pending:
                    break
            block = inflate.decompress(pending, BLOCK)
            pending = inflate.unconsumed_tail
            if block:
                yield block
            if inflate.eof:  # a member ended: another may follow (gzip files can be concatenated), after padding
                pending = (inflate.unused_data + pending).lstrip(b"\x00")
                while not pending:
                    more = fh.read(BLOCK // 4)
                    if not more:
                        return
                    pending = more.lstrip(b"\x00")
                inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        if not inflate.eof:
            raise EOFError("the compressed stream ends early")


def _read_blocks(fh, limit: int | None = None, size: int | None = None):
    """A plain file's bytes (`limit` of them, else to its end) `size` at a time, as views of one buffer that each
    next block overwrites, rather than a new bytes object (fresh pages) a block. `size`: BLOCK unless given."""
    size = size or BLOCK
    chunk = bytearray(size)
    view = memoryview(chunk)
    left = limit
    while left is None or left > 0:
        n = fh.readinto(view if left is None or left >= size else view[:left])
        if not n:
            return
        if left is not None:
            left -= n
        yield view[:n]


_HEADER, _EVENTS, _TRAILER = range(3)


class _StreamDecoder:
    """Splits the `traceEvents` array into pieces that end on an event boundary and decodes each piece.

    `buf` holds undecoded events behind one spare byte: a piece is decoded in place by writing `[` into the
    spare byte and `]` over the comma after its last event, which saves copying every megabyte twice."""

    def __init__(self, sink: _ColumnSink, typed, block: int | None = None):
        self.sink = sink
        self.typed = typed
        self.block = block or BLOCK  # bytes of events gathered before a piece is decoded
        self.tagged = _TaggedDecoder(sink.skipped) if typed is not None else None
        self.state = _HEADER
        self.header = bytearray()  # bytes before the "traceEvents" key, leading whitespace dropped
        self.buf = bytearray()
        self.trailer = bytearray()  # bytes after the array
        self._searched = 0  # where the next look for the key starts
        self._header_structure = None  # (length scanned, _structure of the header), reused per block
        self._scan_at = self.block  # buffer size at which the next structural scan is worth its cost

    def feed(self, data: bytes | memoryview) -> bool:
        """Take the next bytes (copied: `data` may be reused by the caller); False once the rest of the file is not
        needed. Raises TraceError past a limit."""
        if self.state == _HEADER:
            self.header += bytes(data).lstrip(_WS) if not self.header else data
            self._find_array()
            if self.state == _HEADER and len(self.header) > METADATA_LIMIT:
                raise TraceError(f'no "traceEvents" array in the first {_mb(METADATA_LIMIT)} of JSON')
        elif self.state == _EVENTS:
            self.buf += bytes(data).lstrip(_WS) if len(self.buf) == 1 else data  # whitespace between events
        else:
            self.trailer += data
        if self.state == _EVENTS and len(self.buf) > self.block:
            self._drain(final=False)
        return not (self.state == _TRAILER and len(self.trailer) > METADATA_LIMIT)

    def finish(self) -> str | None:
        """Decode what is left at end of file; returns a problem line when the array was never closed."""
        if self.state == _HEADER:
            try:
                json.loads(self.header)
            except ValueError:
                raise TraceError("not a JSON trace (the file is not valid JSON)") from None
            raise TraceError('not a Kineto trace (no "traceEvents" array)')
        if self.state == _EVENTS:
            self._drain(final=True)
        if self.state == _EVENTS:
            return "the JSON ends inside the traceEvents array (truncated file)"
        if len(self.trailer) > METADATA_LIMIT:
            return f"more than {_mb(METADATA_LIMIT)} of JSON after the traceEvents array; it was not read"
        return None

    def metadata(self) -> dict:
        """Everything outside traceEvents, parsed as one object (empty when it cannot be)."""
        if not self.header.strip():
            return {}
        head = bytes(self.header) + b'"traceEvents": []'
        tails = (bytes(self.trailer), b"}") if len(self.trailer) <= METADATA_LIMIT else (b"}",)
        for tail in tails:
            try:
                meta = json.loads(head + tail)
                return meta if isinstance(meta, dict) else {}
            except ValueError:
                continue
        return {}

    def _find_array(self) -> None:
        """Start the events at the `[` of a top-level `"traceEvents": [`; every other occurrence of the key (a
        nested one, a string value, one whose value is not an array) is passed over exactly once."""
        header = self.header
        if header[:1] == b"[":  # the bare-array form of the Chrome trace format
            self._start_events(header[1:])
            self.header = bytearray()
            return
        while (key := header.find(_KEY, self._searched)) >= 0:
            colon = _COLON.match(header, key + len(_KEY))
            if colon.end() == len(header):  # the rest of the key has not arrived yet
                self._searched = key
                return
            self._searched = key + 1
            if colon.group(1) and header[colon.end()] == 0x5B and self._depth_at(key) == 1:
                self._start_events(header[colon.end() + 1:])
                del self.header[key:]
                return
        self._searched = max(self._searched, len(header) - len(_KEY) + 1)

    def _depth_at(self, pos: int) -> int:
        """Nesting depth of the header just before `pos`, or -1 inside a string; one scan per block."""
        if self._header_structure is None or self._header_structure[0] != len(self.header):
            self._header_structure = (len(self.header), _structure(bytes(self.header)))
        brackets, _, depth, quotes = self._header_structure[1]
        if int(np.searchsorted(quotes, pos)) % 2:
            return -1
        before = int(np.searchsorted(brackets, pos))
        return int(depth[before - 1]) if before else 0

    def _start_events(self, rest: bytes) -> None:
        self.buf = bytearray(b" ") + rest.lstrip(_WS)
        self.state = _EVENTS

    def _drain(self, final: bool) -> None:
        while self.state == _EVENTS and (final or len(self.buf) > self.block):
            comma = None if final else _last_event_end(self.buf)
            if comma is not None and self._decode_in_place(comma):
                continue
            if not final and len(self.buf) < self._scan_at:
                return  # an event larger than a block: wait for more of it before scanning again
            if not self._drain_exact(final):
                if len(self.buf) > EVENT_LIMIT:
                    raise TraceError(f"an event larger than {_mb(EVENT_LIMIT)} after {self.sink.count:,} events")
                # rescanning every block would be quadratic; the last scan falls just past the limit
                self._scan_at = min(2 * len(self.buf), EVENT_LIMIT + 1)
                return
            self._scan_at = self.block

    def _decode_in_place(self, comma: int) -> bool:
        buf = self.buf
        buf[0], buf[comma] = 0x5B, 0x5D  # "[" ... "]"
        with memoryview(buf) as view:
            taken = self._take(view[: comma + 1], False, lambda: bytes(buf[1:comma]))
        if not taken:
            buf[comma] = 0x2C
            return False
        del buf[:comma]  # the old comma becomes the spare byte
        return True

    def _drain_exact(self, final: bool) -> bool:
        """Find event ends by scanning the JSON structure; False when nothing more can be decoded now."""
        body = bytes(self.buf[1:])
        ends, close = _top_level_ends(body)
        if close is not None:
            if ends.size:
                self._decode_copy(body[: int(ends[-1]) + 1])
            self.trailer = body[close + 1:] + self.trailer
            self.buf = bytearray()
            self.state = _TRAILER
            return True
        if not ends.size:
            return False
        cut = int(ends[-1]) + 1
        self._decode_copy(body[:cut])
        self.buf = bytearray(b" ") + body[cut:].lstrip(_WS + b",")
        return not final

    def _decode_copy(self, piece: bytes) -> None:
        self._take(b"[" + piece + b"]", True, lambda: piece)

    def _take(self, text, strict: bool, piece) -> bool:
        """Decode `text` into the sink; False when it is not whole events (only when not `strict`)."""
        events, mode = self._loads(text, strict)
        if events is None:
            return False
        if not self.sink.add(events, mode, piece):  # times past float precision: read again field by field
            self.tagged = None
            events, mode = self._loads(text, strict)
            self.sink.add(events, mode, piece)
        return True

    def _loads(self, text, strict: bool) -> tuple[list | None, int]:
        """The events of `text` and how they were decoded (_TAGS, _STRUCTS or _DICTS, plain JSON values)."""
        if self.typed is not None:
            decoder, wrong_type, bad_json = self.typed
            if self.tagged is not None:
                try:
                    return self.tagged.decoder.decode(text), _TAGS
                except wrong_type:
                    pass  # decoded by _Event below, which tells the tagged decoder the categories it lacks
                except bad_json:
                    if not strict:
                        return None, _DICTS
            try:
                events = decoder.decode(text)
            except wrong_type:
                events = None  # a field of an unexpected type: decode this piece as plain dicts
            except bad_json:
                if not strict:
                    return None, _DICTS
                events = None
            if self.tagged is not None and not self.tagged.learn(events or []):
                self.tagged = None
            if events is not None:
                return events, _STRUCTS
        try:  # the standard library also takes NaN and Infinity, which some writers emit
            events = json.loads(bytes(text))
        except ValueError as exc:
            if strict:
                raise TraceError(f"invalid JSON after {self.sink.count:,} events: {exc}") from None
            return None, _DICTS
        return (events if isinstance(events, list) else []), _DICTS


def _last_event_end(buf: bytearray) -> int | None:
    """Index of the comma after the last `}` that is followed by the `{` of a next event, or None."""
    end = len(buf)
    while True:
        i = buf.rfind(b"},", 1, end)
        if i < 0:
            return None
        j = i + 2
        while j < len(buf) and buf[j] in _WS:
            j += 1
        if j < len(buf) and buf[j] == 0x7B:
            return i + 1
        end = i


def _structure(buf: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Positions of brackets outside strings, the bracket bytes, the nesting depth after each, and the
    positions of the string-delimiting quotes in `buf` (an odd count when `buf` ends inside a string)."""
    a = np.frombuffer(buf, dtype=np.uint8)
    quotes = np.flatnonzero(a == 0x22)
    if quotes.size:
        escaped = np.flatnonzero(a[np.maximum(quotes - 1, 0)] == 0x5C)
        if escaped.size:
            keep = np.ones(quotes.size, dtype=bool)
            for k in escaped:
                p, run = int(quotes[k]) - 1, 0
                while p >= 0 and a[p] == 0x5C:
                    run, p = run + 1, p - 1
                keep[k] = run % 2 == 0
            quotes = quotes[keep]
    brackets = np.flatnonzero((a == 0x7B) | (a == 0x7D) | (a == 0x5B) | (a == 0x5D))
    brackets = brackets[(np.searchsorted(quotes, brackets) & 1) == 0]
    chars = a[brackets]
    depth = np.cumsum(np.where((chars == 0x7B) | (chars == 0x5B), 1, -1))
    return brackets, chars, depth, quotes


def _top_level_ends(buf: bytes) -> tuple[np.ndarray, int | None]:
    """Ends of the complete values in `buf` (which starts between values of an array) and the array's `]`."""
    brackets, chars, depth, _ = _structure(buf)
    below = np.flatnonzero(depth < 0)
    close = int(brackets[below[0]]) if below.size else None
    ends = brackets[(depth == 0) & ((chars == 0x7D) | (chars == 0x5D))]
    if close is not None:
        ends = ends[ends < close]
    return ends, close


def _mb(limit: int) -> str:
    return f"{limit / (1 << 20):g} MB"
