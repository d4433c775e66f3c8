"""Decoded Kineto events made into columns: `TraceColumns` (one numpy array per field, names and categories as
codes, times as exact integer nanoseconds), filled a piece of events at a time by `_ColumnSink`, in this process's
memory or, for a stretch decoded in a forked process (kineto_split.py), in a region shared with the parent.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import re
from array import array
from dataclasses import dataclass, field
from itertools import compress

import numpy as np

from infertrace.analyze.kineto_events import _DICTS, _KEPT_CLASSES, _STRUCTS, _TAGS, CAT_OF

NAME_LIMIT = 8192  # characters of an event name kept (real kernel names reach about 5,100)
MAX_DUR_US = 86_400e6  # one day: no event of a profile lasts longer
MAX_ABS_TS_US = 4e15  # about the year 2096 as epoch microseconds; keeps ts + dur inside int64 nanoseconds
SKIPPED_CATS = frozenset({"python_function", "Trace"})  # Python stacks and the whole-profile span
_FLOAT_EXACT_US = 2.0**43  # below this a float64 in us keeps every nanosecond, so rint(ts * 1000) is exact
_TS_RE = re.compile(rb'"ts"\s*:\s*(-?)(\d+)(?:\.(\d*))?([eE][-+]?\d+)?')


class TraceError(Exception):
    """A trace file that cannot be used at all (not JSON, not a trace)."""


@dataclass(slots=True)
class TraceColumns:
    """The complete events ("ph": "X") of one trace file, one numpy array per field, in file order."""

    names: list[str]
    name: np.ndarray  # int32 codes into `names`
    cats: list[str]
    cat: np.ndarray  # int32 codes into `cats`
    pid: np.ndarray  # int32, or int64 where a value does not fit (so tid, stream, correlation and external_id);
    # non-integer pids get negative codes
    tid: np.ndarray
    ts_ns: np.ndarray  # int64 nanoseconds, as written in the file
    dur_ns: np.ndarray
    stream: np.ndarray  # args.stream, -1 where absent
    correlation: np.ndarray  # args.correlation, -1 where absent
    external_id: np.ndarray  # args["External id"], -1 where absent
    metadata: dict = field(default_factory=dict)
    problem: str | None = None  # why the file ended early, when it did
    warnings: list[str] = field(default_factory=list)  # events dropped or names cut, one line each
    exact_times: bool = True  # False when some timestamps could only be read at float precision

    def __len__(self) -> int:
        return int(self.ts_ns.size)


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


MIN_EVENT_BYTES = 9  # no event kept here takes less JSON, with its comma: {"ts":0}, (a kept one has a dur too)


@dataclass(frozen=True, slots=True)
class _RegionLayout:
    """Where things lie in the region a stretch's process shares with its parent: 16 bytes saying where the pickled
    tables are (offset, length), a slot per column with room for as many int64 values as the stretch can hold
    events, then the tables (_put)."""

    room: int  # bytes a column's slot holds
    tables_room: int

    @staticmethod
    def for_stretch(nbytes: int) -> _RegionLayout:
        """The layout for a stretch of `nbytes` of JSON (the region is virtual: only what is written takes memory)."""
        return _RegionLayout(_aligned((nbytes // MIN_EVENT_BYTES + 1) * 8), nbytes + (1 << 20))

    def slot(self, i: int) -> int:
        return 16 + i * self.room

    @property
    def tables_at(self) -> int:
        return self.slot(len(_FIELD_CODES))

    @property
    def size(self) -> int:
        return self.tables_at + self.tables_room


class _Slot:
    """A column growing in its slot of a shared region, its values written where the parent will read them: no
    copy in this process's heap, nothing reallocated as it grows."""

    __slots__ = ("region", "offset", "room", "typecode", "itemsize", "count")

    def __init__(self, region: mmap.mmap, offset: int, room: int, typecode: str):
        self.region, self.offset, self.room, self.typecode = region, offset, room, typecode
        self.itemsize = 4 if typecode == "i" else 8
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def frombytes(self, data: np.ndarray) -> None:
        at = self.offset + self.count * self.itemsize
        if at + data.nbytes > self.offset + self.room:
            raise TraceError("more events than the stretch's region has room for")
        self.region[at: at + data.nbytes] = data
        self.count += data.nbytes // self.itemsize

    def values(self) -> np.ndarray:
        return np.frombuffer(self.region, dtype=_dtype(self), count=self.count, offset=self.offset)

    def widen(self) -> None:
        """From int32 to int64 in place (the slot has room for int64 values)."""
        narrow = self.values().copy()
        self.typecode, self.itemsize = "q", 8
        self.count = 0
        self.frombytes(narrow.astype(np.int64).view(np.uint8))


class _ColumnSink:
    """Turns decoded events (msgspec structs or dicts) into numpy columns, a piece at a time."""

    def __init__(self, keep_python: bool, region: mmap.mmap | None = None, layout: _RegionLayout | None = None):
        self.skipped = frozenset() if keep_python else SKIPPED_CATS
        self.names: dict[str, int] = {}
        self.cats: dict[str, int] = {}
        self.class_codes: dict[type, int] = {}  # a tagged struct class -> its category's code
        self.text_ids: dict[str, int] = {}  # non-integer pid/tid values
        # each field's values so far, in an array.array: it grows in place (a large one by remapping its pages),
        # so the events are never held twice, as joining per-piece arrays at the end would; or, in a stretch's
        # process, in its slot of the region it shares with its parent (_RegionLayout)
        self.fields = [array(code) for code in _FIELD_CODES] if region is None else \
            [_Slot(region, layout.slot(i), layout.room, code) for i, code in enumerate(_FIELD_CODES)]
        self.count = 0
        self.exact = True
        self.invalid = 0  # events dropped for their ts or dur
        self.cut_names: set[str] = set()

    def add(self, events: list, mode: int, text) -> bool:
        """Add a piece decoded as `mode` says; `text()` gives its JSON, read only for timestamps too large for a
        float. False (nothing added) for a piece of tagged structs that needs them: the events passed over hold
        `ts` keys of their own, so it must be decoded again with `_Event` (or as dicts)."""
        if mode == _TAGS:
            kept, cols = self._from_tagged(events)
        elif mode == _STRUCTS:
            kept, cols = self._from_structs(events)
        else:
            kept, cols = self._from_dicts(events)
        if not kept:
            self.count += len(events)
            return True
        ts = _floats(cols[0])
        dur = _floats(cols[1])
        valid = (np.abs(ts) <= MAX_ABS_TS_US) & (dur >= 0) & (dur <= MAX_DUR_US)  # False for NaN too
        if np.abs(ts[valid]).max(initial=0.0) >= _FLOAT_EXACT_US:
            if mode == _TAGS:
                return False
            ts_ns = self._exact_ts(events, mode == _STRUCTS, kept, text())
            if ts_ns is None:
                self.exact = False
                ts_ns = _float_us_to_ns(ts[valid])
            else:
                ts_ns = ts_ns[valid]
        else:
            ts_ns = _float_us_to_ns(ts[valid])
        self.count += len(events)
        if not valid.all():
            self.invalid += int((~valid).sum())
            cols = tuple(col[valid] if isinstance(col, np.ndarray) else [v for v, ok in zip(col, valid) if ok]
                         for col in cols)
            if not cols[0]:
                return True
        self.append((
            self._names(cols[2], mode != _DICTS),
            cols[3] if isinstance(cols[3], np.ndarray) else _codes(cols[3], self.cats, mode != _DICTS),
            self._ids(cols[4]),
            self._ids(cols[5]),
            ts_ns,
            np.rint(dur[valid] * 1000.0).astype(np.int64),
            _ints(cols[6]),
            _ints(cols[7]),
            _ints(cols[8]),
        ))
        return True

    def append(self, values: tuple[np.ndarray, ...]) -> None:
        for i, v in enumerate(values):
            if i in _WIDENED and self.fields[i].typecode == "i" and not _fits_int32(v):
                self.widen(i)
            into = self.fields[i]
            into.frombytes(np.ascontiguousarray(v, dtype=_dtype(into)).view(np.uint8))

    def widen(self, i: int) -> None:
        """Field `i` (an id held as int32 while every value fits) as int64 from now on, its values kept."""
        field = self.fields[i]
        if isinstance(field, _Slot):
            field.widen()
            return
        wide = array("q")
        wide.frombytes(np.frombuffer(field, dtype=np.int32).astype(np.int64).view(np.uint8))
        self.fields[i] = wide

    def arrays(self) -> list[np.ndarray]:
        """The fields as numpy arrays over the sink's own memory (no copy)."""
        return [f.values() if isinstance(f, _Slot) else np.frombuffer(f, dtype=_dtype(f)) for f in self.fields]

    def _names(self, values: list, text: bool) -> np.ndarray:
        """Codes of the names (`text`: all of them strings), each name longer than NAME_LIMIT cut first
        (classifying a name costs its length)."""
        if max(map(len, values), default=0) > NAME_LIMIT if text else \
                any(len(v) > NAME_LIMIT for v in values if type(v) is str):
            long = {v for v in values if type(v) is str and len(v) > NAME_LIMIT}
            self.cut_names.update(long)
            values = [_cut_name(v) if v in long else v for v in values]
        return _codes(values, self.names, text)

    def _from_tagged(self, events: list) -> tuple[list, tuple]:
        """As _from_structs, for _TaggedDecoder's structs; the categories come back as codes already."""
        kept = [e for e in compress(events, map(_KEPT_CLASSES.__contains__, map(type, events)))
                if e.dur is not None and e.ts is not None]
        code_of = self.class_codes
        for cls in dict.fromkeys(map(type, kept)):  # in order of first appearance, as _codes gives them
            if cls not in code_of:
                code_of[cls] = self.cats.setdefault(CAT_OF[cls], len(self.cats))
        cats = np.fromiter(map(code_of.__getitem__, map(type, kept)), dtype=np.int32, count=len(kept))
        args = [e.args for e in kept]
        return kept, (
            [e.ts for e in kept], [e.dur for e in kept], [e.name for e in kept], cats,
            [e.pid for e in kept], [e.tid for e in kept], [a.stream for a in args],
            [a.correlation for a in args], [a.external_id for a in args])

    def _from_structs(self, events: list) -> tuple[list, tuple]:
        skipped = self.skipped
        kept = [e for e in events if e.dur is not None and e.ts is not None and e.cat not in skipped]
        args = [e.args for e in kept]
        return kept, (
            [e.ts for e in kept], [e.dur for e in kept], [e.name for e in kept], [e.cat for e in kept],
            [e.pid for e in kept], [e.tid for e in kept], [a.stream for a in args],
            [a.correlation for a in args], [a.external_id for a in args])

    def _from_dicts(self, events: list) -> tuple[list, tuple]:
        skipped = self.skipped
        kept = [e for e in events if type(e) is dict and type(e.get("dur")) in _NUMBER
                and type(e.get("ts")) in _NUMBER and e.get("cat") not in skipped]
        args = [a if type(a := e.get("args")) is dict else _NO_ARGS for e in kept]
        return kept, (
            [e["ts"] for e in kept], [e["dur"] for e in kept], [e.get("name", "") for e in kept],
            [e.get("cat", "") for e in kept], [e.get("pid", 0) for e in kept], [e.get("tid", 0) for e in kept],
            [a.get("stream", -1) for a in args], [a.get("correlation", -1) for a in args],
            [a.get("External id", -1) for a in args])

    def _exact_ts(self, events: list, structs: bool, kept: list, piece: bytes) -> np.ndarray | None:
        """Nanoseconds read from the `"ts": ...` digits of the piece, or None when they cannot be matched."""
        if structs:
            has_ts = [e.ts is not None for e in events]
        else:
            has_ts = [type(e) is dict and type(e.get("ts")) in _NUMBER for e in events]
        found = _TS_RE.findall(piece)
        if len(found) != sum(has_ts) or any(m[3] or len(m[1]) > 16 for m in found):
            return None  # a nested "ts" key, an exponent or a value past int64 ns: fall back to float precision
        sign = np.array([-1 if m[0] else 1 for m in found], dtype=np.int64)
        whole = np.array([m[1] for m in found]).astype(np.int64)
        frac = np.array([(m[2] + b"000")[:3] for m in found]).astype(np.int64)
        ns = sign * (whole * 1000 + frac)
        kept_ids = {id(e) for e in kept}
        with_ts = [e for e, has in zip(events, has_ts) if has]
        return ns[np.fromiter((id(e) in kept_ids for e in with_ts), dtype=bool, count=len(with_ts))]

    def _ids(self, values: list) -> np.ndarray:
        try:
            arr = np.array(values)
        except (TypeError, ValueError):  # ragged values such as lists
            arr = np.empty(0)
        if arr.ndim == 1 and arr.size == len(values) and arr.dtype.kind in "iub":
            return arr.astype(np.int64)
        out = np.empty(len(values), dtype=np.int64)
        for i, v in enumerate(values):
            try:
                out[i] = int(v)
            except (TypeError, ValueError, OverflowError):
                out[i] = -1 - self.text_ids.setdefault(str(v), len(self.text_ids))
        return out

    def columns(self, metadata: dict) -> TraceColumns:
        cols = self.arrays()
        warnings = []
        if self.invalid:
            warnings.append(f"{self.invalid:,} event(s) with a negative, non-finite or impossible duration or "
                            f"timestamp (dur over {MAX_DUR_US / 3.6e9:g} h, |ts| over {MAX_ABS_TS_US:g} us) dropped")
        if self.cut_names:
            warnings.append(f"{len(self.cut_names):,} event name(s) longer than {NAME_LIMIT:,} characters cut "
                            f"to that length")
        return TraceColumns(
            names=list(self.names), name=cols[0], cats=list(self.cats), cat=cols[1], pid=cols[2],
            tid=cols[3], ts_ns=cols[4], dur_ns=cols[5], stream=cols[6], correlation=cols[7],
            external_id=cols[8], metadata=metadata, exact_times=self.exact, warnings=warnings)


# name and cat codes, pid, tid, ts_ns, dur_ns, stream, correlation, external_id: the codes and ids as int32 (the ids
# widened to int64 when one does not fit), a third less memory for a trace's events than int64 throughout
_FIELD_CODES = ("i", "i", "i", "i", "q", "q", "i", "i", "i")
_WIDENED = frozenset({2, 3, 6, 7, 8})
_INT32 = np.iinfo(np.int32)


def _dtype(field: array) -> type:
    return np.int32 if field.typecode == "i" else np.int64


def _fits_int32(values: np.ndarray) -> bool:
    return not values.size or (_INT32.min <= values.min() and values.max() <= _INT32.max)


_NO_ARGS: dict = {}
_NUMBER = (int, float)


def _floats(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:  # an integer past float range: not finite, so dropped
        return np.array([_float_or_nan(v) for v in values], dtype=np.float64)


def _float_or_nan(value) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _cut_name(name: str) -> str:
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    return f"{name[:NAME_LIMIT]}…[{len(name):,} characters, {digest}]"


def _float_us_to_ns(us: np.ndarray) -> np.ndarray:
    whole = np.floor(us)
    return whole.astype(np.int64) * 1000 + np.rint((us - whole) * 1000.0).astype(np.int64)


def _codes(values: list, table: dict[str, int], text: bool = False) -> np.ndarray:
    """The values' codes in `table`, which takes each new value's text in order of first appearance (`text`: the
    values are all strings already)."""
    setdefault = table.setdefault
    if text:
        return np.array([setdefault(v, len(table)) for v in values], dtype=np.int32)
    local: dict = {}  # equal values (1 and 1.0) share the code of the first one's text, as a factorize does
    out = np.empty(len(values), dtype=np.int32)
    for i, v in enumerate(values):
        try:
            code = local.get(v)
        except TypeError:  # unhashable (a list): by its text
            code, v = None, str(v)
        if code is None:
            code = local[v] = setdefault(str(v), len(table))
        out[i] = code
    return out


def _ints(values: list) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.int64)
        if arr.ndim == 1:
            return arr
    except (TypeError, ValueError, OverflowError):
        pass
    return np.fromiter((_int_or_missing(v) for v in values), dtype=np.int64, count=len(values))


def _int_or_missing(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return -1
