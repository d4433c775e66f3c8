"""Forked decoding of one large plain JSON trace: its events array cut into stretches at event boundaries, each
decoded in its own process into a region of memory shared with this one, then joined in order (`_read_split`);
and the read-ahead, which starts those processes before the analysis modules are imported (`read_ahead`).

Worth its lines where the cores are free: a 521 MB trace decodes 3.3x faster in 16 processes on 16 cores, and
1.5x faster in 2 on 2 cores, than in one process.
"""

from __future__ import annotations

import gc
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infertrace.analyze import kineto_stream as stream
from infertrace.analyze.kineto_columns import (
    TraceColumns,
    TraceError,
    _ColumnSink,
    _dtype,
    _fits_int32,
    _RegionLayout,
)
from infertrace.analyze.kineto_events import _typed_decoder
from infertrace.analyze.kineto_stream import (
    _EVENTS,
    _HEADER,
    _KEY,
    _TRAILER,
    _WS,
    EVENT_LIMIT,
    METADATA_LIMIT,
    _read_blocks,
    _StreamDecoder,
)

# a stretch decoded beside others (_decode_range) takes a quarter of kineto_stream.BLOCK at a time: that takes as
# long there (2-core host) and holds 5 MB less of a decoding process's heap at once, each such process counting in
# the tree's memory
STRETCH_BLOCK = 256 << 10
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
            head = fh.read(stream.BLOCK)  # the array nearly always opens in the first megabyte
            start = _array_start(head)
            if start is None and len(head) == stream.BLOCK:
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
    block = min(STRETCH_BLOCK, stream.BLOCK)
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
