"""Streaming reader of Kineto (torch.profiler) JSON traces, plain or gzipped, into columns with exact times.

The file is decoded about a megabyte of events at a time, so peak memory follows the size of the kept columns
rather than the size of the JSON, and a truncated file still yields every event before the cut. Everything held
undecoded is bounded: METADATA_LIMIT before (and after) the event array, EVENT_LIMIT for one event, so a file
of any size is read in time linear in its size and bounded memory; a gzip file stops being read once it has
decompressed to GZIP_RATIO_LIMIT times its own size (a gzip bomb), and an event name longer than NAME_LIMIT
characters is cut (with a hash of the whole name, so distinct names stay distinct), which bounds what classifying
names costs. An event whose `dur` is negative, not finite or longer than MAX_DUR_US, or whose `ts` is not finite
or beyond MAX_ABS_TS_US, is dropped and counted in a warning. Timestamps are
kept as integer nanoseconds: a float64 cannot hold `1712195495519689.047` us to the nanosecond, so traces with
such large times have their `ts` digits read from the text itself.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import mmap
import os
import re
import zlib
from array import array
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Union

import numpy as np

BLOCK = 1 << 20  # bytes decoded at once: small enough to stay in cache, large enough to amortise each call
# the same for a stretch decoded beside others (_decode_range): a quarter of BLOCK takes as long there (2-core host)
# and holds 5 MB less of a decoding process's heap at once, each such process counting in the tree's memory
STRETCH_BLOCK = 256 << 10
METADATA_LIMIT = 16 << 20  # bytes of JSON read before the traceEvents array, and after it
EVENT_LIMIT = 16 << 20  # the largest single event (or run of whitespace inside the array) read
GZIP_RATIO_LIMIT = 64  # Kineto JSON compresses 10-22x; past this many times the gzip's size, reading stops
GZIP_SLACK = 32 << 20  # decompressed bytes always allowed, whatever the ratio
NAME_LIMIT = 8192  # characters of an event name kept (real kernel names reach about 5,100)
MAX_DUR_US = 86_400e6  # one day: no event of a profile lasts longer
MAX_ABS_TS_US = 4e15  # about the year 2096 as epoch microseconds; keeps ts + dur inside int64 nanoseconds
SKIPPED_CATS = frozenset({"python_function", "Trace"})  # Python stacks and the whole-profile span
_FLOAT_EXACT_US = 2.0**43  # below this a float64 in us keeps every nanosecond, so rint(ts * 1000) is exact
_WS = b" \t\r\n"
_KEY = b'"traceEvents"'
_COLON = re.compile(rb"[ \t\r\n]*(:?)[ \t\r\n]*")
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


def read_kineto(path: str | Path, keep_python: bool = False, typed: bool = True, workers: int = 1,
                ahead: ReadAhead | None = None) -> TraceColumns:
    """Read one Kineto JSON trace (`.json` or gzip, told apart by content). Raises TraceError when unusable.

    `keep_python` keeps `python_function` events (with_stack traces hold millions of them and no analysis
    here needs them). `typed=False` decodes through plain dicts even where msgspec is installed. `workers` above
    one decodes a large plain file in that many processes, a stretch of the events array each (`_read_split`);
    `ahead`, what `read_ahead` started for this file, is joined instead (and its processes ended)."""
    if ahead is not None:
        joined = _read_ahead_result(Path(path), keep_python, ahead) if typed else ahead.cancel()
        if joined is not None:
            return joined
    if workers > 1 and typed and _typed_decoder() is not None:
        split = _read_split(Path(path), keep_python, workers)
        if split is not None:
            return split
    sink = _ColumnSink(keep_python)
    decoder = _StreamDecoder(sink, _typed_decoder() if typed else None)
    problem = late = None
    over_limit = False
    collecting = gc.isenabled()
    gc.disable()  # the decoded events hold no cycles; a collection every few thousand of them costs 3x the decode
    try:
        for block in _blocks(Path(path)):
            if not decoder.feed(block):
                break  # the rest of the file holds nothing that is read
    except _GzipBomb as exc:
        problem, over_limit = str(exc), True
    except EOFError:
        problem = "the compressed stream ends early (truncated file)"
    except (OSError, zlib.error) as exc:
        problem = f"unreadable after {sink.count:,} events ({exc})"
    except TraceError as exc:  # past a size limit: what is still buffered cannot be decoded
        if sink.count == 0:
            raise
        problem, over_limit = str(exc), True
    finally:
        if collecting:
            gc.enable()
    if not over_limit:
        try:
            late = decoder.finish()
        except TraceError as exc:
            if problem is None or sink.count == 0:
                raise TraceError(problem or str(exc)) from None
    problem = problem or late
    columns = sink.columns(decoder.metadata())
    if problem is not None and not len(columns):
        raise TraceError(problem.replace(" (truncated file)", ", before its first complete event (truncated file)"))
    if problem is not None:
        columns.problem = f"{problem}; kept the {len(columns):,} complete events before it"
    return columns


SPLIT_MIN_BYTES = 64 << 20  # a plain file at least this large is decoded in several processes when asked
_BOUNDARY = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")


def _read_split(path: Path, keep_python: bool, workers: int) -> TraceColumns | None:
    """Decode a plain JSON trace in `workers` processes (this one and forked ones, as `read_ahead` starts them),
    each a stretch of the events array cut where one event ends and the next begins. None (read it in one process
    instead) for a gzip or small file, or when this process's stretch does not decode as whole events from its start
    to its cut: the first starts at the array's real start and each later stretch must decode completely and end
    exactly at its cut, so every cut is a real event boundary."""
    started = _start_stretches(path, keep_python, [1 / workers] * workers)
    return None if started is None else _read_ahead_result(path, keep_python, started)


def _plan_split(path: Path, shares: list[float]) -> tuple[bytes, int, list[tuple[int, int]]] | None:
    """The head of a plain JSON trace, where its events array starts, and the byte ranges of its stretches, each
    about its share of the file and cut at an apparent event boundary; None for a gzip or small file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            if fh.read(2) == b"\x1f\x8b" or size < SPLIT_MIN_BYTES:
                return None
            fh.seek(0)
            head = fh.read(BLOCK)  # the array nearly always opens in the first megabyte
            start = _array_start(head)
            if start is None and len(head) == BLOCK:
                head += fh.read(METADATA_LIMIT)
                start = _array_start(head)
            if start is None:
                return None
            cuts = [start]
            done = 0.0
            for share in shares[:-1]:
                done += share
                at = _boundary_after(fh, max(start, int(size * done)))
                if at is None:
                    return None
                if at > cuts[-1]:
                    cuts.append(at)
        ranges = [(cuts[i] if i == 0 else _next_brace(path, cuts[i]), cuts[i + 1] if i + 1 < len(cuts) else size)
                  for i in range(len(cuts))]
    except OSError:
        return None
    return head, start, ranges


def _boundary_after(fh, at: int) -> int | None:
    """Just past the `}` of the first apparent event boundary (`}, {`) from `at` on, within EVENT_LIMIT bytes."""
    fh.seek(at)
    window = b""
    while len(window) < EVENT_LIMIT:
        more = fh.read(1 << 16)
        if not more:
            return None
        window = window[-8:] + more if window else more  # a boundary may straddle two reads (whitespace aside)
        m = _BOUNDARY.search(window)
        if m is not None:
            return fh.tell() - len(window) + m.start() + 1
    return None


def _joined(head: bytes, start: int, first: dict, rest) -> TraceColumns:
    """The columns of the first stretch's sink extended with the other stretches' (shipped) events, taken one at a
    time from the iterable `rest` (each freed, and its "release" called, once joined), and the metadata from the head
    and the last stretch's trailer."""
    header = _StreamDecoder(_ColumnSink(False), None)
    header.feed(head[: start])
    header.header = bytearray(head[: start].lstrip(_WS))
    key = header.header.rfind(_KEY)
    if key >= 0:
        del header.header[key:]
    whole = first["sink"]
    trailer, late = first["trailer"], first["late"]
    for part in rest:
        _join(whole, part)
        trailer, late = part["trailer"], part["late"]
        release = part.pop("release", None)
        part.clear()  # a stretch's events freed once taken
        if release is not None:
            release()
    header.trailer = trailer
    columns = whole.columns(header.metadata())
    if late is not None:
        if not len(columns):
            raise TraceError(late.replace(" (truncated file)", ", before its first complete event (truncated file)"))
        columns.problem = f"{late}; kept the {len(columns):,} complete events before it"
    return columns


def _shipped(sink: _ColumnSink) -> dict:
    """What `_join` needs of a stretch's sink: its tables, counts and columns."""
    return {**_tables(sink), "arrays": sink.arrays()}


def _tables(sink: _ColumnSink) -> dict:
    """A stretch's tables and counts, without its columns."""
    return {"names": sink.names, "cats": sink.cats, "text_ids": sink.text_ids, "count": sink.count,
            "exact": sink.exact, "invalid": sink.invalid, "cut_names": sink.cut_names}


def _join(whole: _ColumnSink, part: dict) -> None:
    """Append a later stretch's events (its columns part["arrays"]) to `whole`, in place, its name, category and
    text-id codes made whole's."""
    before = [len(f) for f in whole.fields]
    names = np.array([whole.names.setdefault(n, len(whole.names)) for n in part["names"]], dtype=np.int32)
    cats = np.array([whole.cats.setdefault(c, len(whole.cats)) for c in part["cats"]], dtype=np.int32)
    texts = {-1 - k: -1 - whole.text_ids.setdefault(t, len(whole.text_ids)) for t, k in part["text_ids"].items()}
    for i, column in enumerate(part["arrays"]):
        if whole.fields[i].typecode == "i" and column.dtype == np.int64 and not _fits_int32(column):
            whole.widen(i)  # the stretch has an id past int32
        into = whole.fields[i]
        into.frombytes(np.ascontiguousarray(column, dtype=_dtype(into)).view(np.uint8))
        values = np.frombuffer(into, dtype=_dtype(into))[before[i]:]  # the stretch's codes, made whole's
        if i == 0 and names.size:
            values[:] = names[values]
        elif i == 1 and cats.size:
            values[:] = cats[values]
        elif i in (2, 3) and texts and (values < 0).any():  # pid, tid
            values[:] = np.array([texts.get(v, v) for v in values.tolist()], dtype=np.int64)
        del values
    whole.count += part["count"]
    whole.exact &= part["exact"]
    whole.invalid += part["invalid"]
    whole.cut_names |= part["cut_names"]


def _array_start(head: bytes) -> int | None:
    """The offset of the first byte inside the top-level `traceEvents` array, or None."""
    decoder = _StreamDecoder(_ColumnSink(False), None)
    stripped = head.lstrip(_WS)
    lead = len(head) - len(stripped)
    if stripped[:1] == b"[":
        return lead + 1
    try:
        for at in range(0, len(head), 1 << 16):  # only until the array opens: the events are the workers'
            decoder.feed(head[at: at + (1 << 16)])
            if decoder.state != _HEADER:
                break
    except TraceError:
        return None
    if decoder.state != _EVENTS:
        return None
    key_at = lead + len(decoder.header)  # the header is cut at the key
    bracket = head.find(b"[", key_at + len(_KEY))
    return None if bracket < 0 else bracket + 1


def _next_brace(path: Path, at: int) -> int:
    with open(path, "rb") as fh:
        fh.seek(at)
        window = fh.read(EVENT_LIMIT)
    return at + window.index(b"{")


def _decode_range(path: str, lo: int, hi: int, last: bool, keep_python: bool,
                  region: tuple[mmap.mmap, _RegionLayout] | None = None) -> dict | None:
    """The events of bytes [lo, hi) of the file, a stretch of its events array (`last`: the array's end is in it),
    into a sink of columns: this process's own, or, with `region`, the slots of a region shared with the parent.
    None when the stretch is not whole events ending at its cut."""
    sink = _ColumnSink(keep_python, *region) if region is not None else _ColumnSink(keep_python)
    block = min(STRETCH_BLOCK, BLOCK)
    decoder = _StreamDecoder(sink, _typed_decoder(), block)
    decoder._start_events(b"")
    collecting = gc.isenabled()
    gc.disable()  # as in read_kineto: the decoded events hold no cycles
    try:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(lo)
            for piece in _read_blocks(fh, hi - lo, block):
                if not decoder.feed(piece):
                    break
        if not last:
            if decoder.state != _EVENTS:
                return None
            decoder.feed(b"]")
        late = decoder.finish()
    except TraceError:
        return None
    finally:
        if collecting:  # the process goes on (a test run, a caller of the library): its collector with it
            gc.enable()
    if not last and (late is not None or decoder.state != _TRAILER or decoder.trailer.strip()):
        return None
    sink.class_codes.clear()  # the tagged decoder's classes are made at run time: not sent back
    return {"sink": sink, "trailer": bytes(decoder.trailer), "late": late}


# Read-ahead: a one-rank capture's large trace is split before the analysis modules are imported, so that while
# this process imports them (pandas most of it), forked processes already decode the later stretches.
AHEAD_IMPORT_S = 0.25  # what this process spends importing before it decodes its own stretch (2-core host: 0.26 s)
AHEAD_DECODE_BYTES_S = 500e6  # bytes of JSON one process decodes a second (about 520 MB/s on that host)


@dataclass(slots=True)
class ReadAhead:
    """The later stretches of one trace file, being decoded in forked processes (`read_ahead`) for `read_kineto`
    of that file to take up. Its owner calls `cancel()` when done, which ends any process not taken up."""

    key: tuple  # the file it was started for (_ahead_key)
    head: bytes  # the file's bytes before the events array
    start: int
    ranges: list[tuple[int, int]]
    children: list[tuple[int, int, mmap.mmap]]  # (pid, read end of its pipe, its region) per stretch after the first

    def cancel(self) -> None:
        _cancel(self.children)
        self.children = []


def _ahead_key(path: Path, keep_python: bool) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), st.st_size, st.st_mtime_ns, keep_python


def read_ahead(path: str | Path, keep_python: bool = False, workers: int = 2) -> ReadAhead | None:
    """Start decoding the later stretches of a large plain JSON trace in `workers - 1` forked processes, for
    `read_kineto(path, ahead=...)` to join; this process keeps the first stretch, smaller by what it has to import
    first. None (nothing started) for a gzip or small file, one worker, or where processes cannot be made. The
    caller owns the processes: `cancel()` the result when done."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    if workers < 2:
        return None
    whole_s = size / AHEAD_DECODE_BYTES_S
    own = min(max((whole_s - AHEAD_IMPORT_S * (workers - 1)) / (whole_s * workers), 0.02), 1 / workers)
    return _start_stretches(path, keep_python, [own] + [(1 - own) / (workers - 1)] * (workers - 1))


def _start_stretches(path: Path, keep_python: bool, shares: list[float]) -> ReadAhead | None:
    """Cut the file's events array into stretches of about these shares and fork a process for each but the
    first. A process decodes its stretch and leaves the result in a region of memory it shares with this one
    (`_put`), then ends: it holds nothing while this process is still busy, and the region is this process's memory
    from the start, so its pages count here. None where nothing was started."""
    key = _ahead_key(path, keep_python)
    if key is None or _typed_decoder() is None:
        return None
    plan = _plan_split(path, shares)
    if plan is None or len(plan[2]) < 2:
        return None
    head, start, ranges = plan
    children: list[tuple[int, int, mmap.mmap]] = []
    parent = os.getpid()
    # this process's freed heap pages given back first: a forked process allocating into them would copy each
    # (13 MB of them after the imports, 2-core host), where fresh pages cost only what it uses
    trim_heap()
    for i, (lo, hi) in enumerate(ranges[1:], start=1):
        layout = _RegionLayout.for_stretch(hi - lo)
        try:
            region = mmap.mmap(-1, layout.size, flags=mmap.MAP_SHARED | _NORESERVE)
        except (OSError, ValueError):
            _cancel(children)
            return None
        try:
            read_end, write_end = os.pipe()
        except OSError:
            region.close()
            _cancel(children)
            return None
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            region.close()
            _cancel(children)
            return None
        if pid == 0:  # the child: decode, leave the result, and end without running the parent's exit handlers
            code = 1
            try:
                _die_with_parent(parent)
                os.close(read_end)
                for _, earlier, earlier_region in children:  # the earlier stretches' are the parent's alone
                    os.close(earlier)
                    earlier_region.close()
                _put(region, layout, write_end,
                     _decode_range(str(path), lo, hi, i == len(ranges) - 1, keep_python, (region, layout)))
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        children.append((pid, read_end, region))
    return ReadAhead(key, head[:start], start, ranges, children)


_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0)  # a region's unused room is never counted against the system


def _die_with_parent(parent: int) -> None:
    """(Linux) Have this forked process killed when its parent ends, however it ends: a stretch's decoder never
    outlives the analysis that wanted it, even one killed before its exit handlers could run."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # elsewhere the child ends once its stretch is decoded, at the latest
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


def _aligned(n: int) -> int:
    return -(-n // 8) * 8


def _put(region: mmap.mmap, layout: _RegionLayout, fd: int, result: dict | None) -> None:
    """Finish a stretch decoded into its region's slots (`_taken` reads it): the pickled tables and counts, with
    each column's type, length and place, after the slots. Then one byte down the pipe: 1 once the region holds
    the whole stretch, 0 when it does not (the stretch did not decode, or its tables do not fit)."""
    import pickle

    whole = False
    if result is not None:
        sink = result.pop("sink")
        columns = [("<i4" if f.typecode == "i" else "<i8", len(f), f.offset) for f in sink.fields]
        header = pickle.dumps({**_tables(sink), **result, "columns": columns}, protocol=pickle.HIGHEST_PROTOCOL)
        at = layout.tables_at
        if len(header) <= layout.tables_room:
            region[at: at + len(header)] = header
            region[:16] = at.to_bytes(8, "little") + len(header).to_bytes(8, "little")
            whole = True
    os.write(fd, b"\x01" if whole else b"\x00")


def _taken(fd: int, region: mmap.mmap) -> dict | None:
    """What a stretch's process left (`_put`), its columns as arrays over the region (no copy); None when it
    left no whole stretch (it failed, or ended before saying it was done). Closes `fd`."""
    import pickle

    with open(fd, "rb", buffering=0) as inp:
        if inp.read(1) != b"\x01":
            return None
    try:
        at, size = int.from_bytes(region[:8], "little"), int.from_bytes(region[8:16], "little")
        part = pickle.loads(region[at: at + size])
        part["arrays"] = [np.frombuffer(region, dtype=dtype, count=count, offset=offset)
                          for dtype, count, offset in part.pop("columns")]
    except (ValueError, EOFError, pickle.UnpicklingError):
        return None
    return part


def trim_heap() -> None:
    """(glibc) Return the free pages of this process's heap to the system; nothing elsewhere."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
def _exited_cleanly(pid: int) -> bool:
    """Whether a stretch's process ended well; True for one that is not this process's child (a rank worker taking
    up its parent's read-ahead), where the process's word that its region is whole is all there is to go on."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return True
    return status == 0


def _release(region: mmap.mmap) -> None:
    """Free a region's pages for every process that maps it (a rank worker's parent maps its read-ahead's regions
    until the end), then unmap it here."""
    try:
        region.madvise(mmap.MADV_REMOVE)
    except (AttributeError, OSError, ValueError):
        pass  # elsewhere the pages go when the last process unmaps them
    region.close()


def _cancel(children: list[tuple[int, int, mmap.mmap]]) -> None:
    import signal

    for pid, fd, region in children:
        for step in (lambda: os.kill(pid, signal.SIGKILL), lambda: os.close(fd), lambda: os.waitpid(pid, 0),
                     lambda: _release(region)):
            try:
                step()
            except OSError:
                pass


def _read_ahead_result(path: Path, keep_python: bool, ahead: ReadAhead) -> TraceColumns | None:
    """The columns of a file `read_ahead` started: this process decodes the first stretch and joins the others'.
    None (read it whole instead) when the read-ahead was for another file (or this one before it changed), or when
    a stretch does not end at its cut as whole events. The read-ahead's processes are ended either way."""
    if ahead.key != _ahead_key(path, keep_python) or not ahead.children:
        ahead.cancel()
        return None
    try:
        return _take_ahead(path, keep_python, ahead)
    except _StretchLost:
        return None
    finally:
        ahead.cancel()


class _StretchLost(Exception):
    """A stretch that did not decode as whole events ending at its cut, here or in its process."""


def _take_ahead(path: Path, keep_python: bool, ahead: ReadAhead) -> TraceColumns:
    first = _decode_range(str(path), *ahead.ranges[0], False, keep_python)
    if first is None:
        raise _StretchLost
    trim_heap()  # what decoding freed, given back before the other stretches' events arrive
    return _joined(ahead.head, ahead.start, first, _later_stretches(path, keep_python, ahead))


def _later_stretches(path: Path, keep_python: bool, ahead: ReadAhead):
    """The stretches after the first, in order, as `_joined` takes them: from each process's region (released once
    joined), or decoded here when its process left none."""
    last = len(ahead.ranges) - 1
    for k, (lo, hi) in enumerate(ahead.ranges[1:], start=1):
        pid, fd, region = ahead.children.pop(0)  # taken up here, never cancelled (its pid may be reused)
        part = _taken(fd, region)
        if not _exited_cleanly(pid) and part is not None:  # all of it left, yet the process did not end well
            part = None
        if part is None:
            _release(region)
            decoded = _decode_range(str(path), lo, hi, k == last, keep_python)  # the stretch decoded here
            if decoded is None:
                raise _StretchLost
            part = {**_shipped(decoded.pop("sink")), **decoded}
        else:
            part["release"] = lambda region=region: _release(region)
        yield part


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


try:  # decodes only the fields used here into slotted structs: about three times faster than dicts
    import msgspec
except ImportError:  # pragma: no cover - the plain-dict path is tested with typed=False
    msgspec = None

if msgspec is not None:

    class _Args(msgspec.Struct, gc=False):
        stream: int | float | str = -1
        correlation: int | float = -1
        external_id: int | float = msgspec.field(default=-1, name="External id")

    class _Event(msgspec.Struct, gc=False):
        name: str = ""
        cat: str = ""
        pid: int | float | str = 0
        tid: int | float | str = 0
        ts: int | float | None = None
        dur: int | float | None = None
        args: _Args = msgspec.field(default_factory=_Args)


    class _Fields(msgspec.Struct, gc=False, tag_field="cat"):
        """An event whose category is told by the struct's class (a tagged union on `cat`)."""

        name: str = ""
        pid: int | float | str = 0
        tid: int | float | str = 0
        ts: int | float | None = None
        dur: int | float | None = None
        args: _Args = msgspec.field(default_factory=_Args)

    class _Passed(msgspec.Struct, gc=False, tag_field="cat"):
        """An event of a category that is not kept: no field of it is decoded into an object."""


def _typed_decoder():
    if msgspec is None:
        return None
    return msgspec.json.Decoder(list[_Event]), msgspec.ValidationError, msgspec.DecodeError


# Kineto's categories (and a few other writers'): each gets its own struct class in the tagged decoder
KNOWN_CATS = ("cpu_op", "user_annotation", "gpu_user_annotation", "gpu_memcpy", "gpu_memset", "kernel",
              "cuda_runtime", "cuda_driver", "cuda_sync", "cuda_event", "cuda_profiler_range", "ac2g", "overhead",
              "cpu_instant_event", "python_function", "Trace", "fwdbwd", "mtia_runtime", "mtia_ccp_events",
              "privateuse1_runtime", "privateuse1_driver", "xpu_runtime", "hpu_op", "collective_comm",
              "gpu_pm_counter", "Kernel", "Memcpy", "Memset", "Runtime", "Driver", "Operator")
TAGGED_CATS_LIMIT = 256  # categories in one tagged decoder; a trace with more is decoded field by field
TAGGED_MISSES = 4  # pieces the tagged decoder could not take, with no new category to add, before it is dropped
_CLASSES: dict[tuple[str, bool], type] = {}  # (category, passed over) -> its struct class
CAT_OF: dict[type, str] = {}  # struct class -> its category
_KEPT_CLASSES: set[type] = set()  # the classes whose events are kept (not _Passed)
_TAGGED: dict[tuple[frozenset, frozenset], object] = {}  # (categories, those passed over) -> decoder


def _tagged_class(cat: str, passed: bool) -> type:
    cls = _CLASSES.get((cat, passed))
    if cls is None:
        cls = msgspec.defstruct(f"_{'Passed' if passed else 'Fields'}{len(_CLASSES)}", [],
                                bases=(_Passed if passed else _Fields,), tag=cat)
        _CLASSES[(cat, passed)] = cls
        CAT_OF[cls] = cat
        if not passed:
            _KEPT_CLASSES.add(cls)
    return cls


class _TaggedDecoder:
    """Decodes a piece of events into one struct class per category, the skipped categories' events into empty
    structs (their names and arguments, most of a Python-stack trace, are never made into objects): about a third
    less time than `_Event` for every event. A piece it cannot take (an event without a string `cat`, a category
    it does not know) is decoded by `_Event` instead, and the new categories join the union."""

    def __init__(self, skipped: frozenset):
        self.skipped = skipped
        self.cats = set(KNOWN_CATS)
        self.misses = 0
        self.decoder = self._build()

    def _build(self):
        key = (frozenset(self.cats), self.skipped)
        if key not in _TAGGED:
            classes = tuple(_tagged_class(c, c in self.skipped) for c in sorted(self.cats))
            _TAGGED[key] = msgspec.json.Decoder(list[Union[classes]])
        return _TAGGED[key]

    def learn(self, events: list) -> bool:
        """After a piece it could not take, decoded by `_Event`: add its new categories. False once it gives up."""
        new = {e.cat for e in events if type(e) is _Event} - self.cats
        if new and len(self.cats) + len(new) <= TAGGED_CATS_LIMIT:
            self.cats |= new
            self.decoder = self._build()
            return True
        self.misses += 1
        return self.misses < TAGGED_MISSES


_HEADER, _EVENTS, _TRAILER = range(3)
_TAGS, _STRUCTS, _DICTS = range(3)  # how a piece was decoded: _TaggedDecoder, _Event, plain JSON values


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
