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

The reader's stages, each in its own module: kineto_stream.py (the bytes and the events array, a piece at a time),
kineto_events.py (msgspec's types for an event), kineto_columns.py (the pieces made into columns) and
kineto_split.py (one large file decoded in several processes).
"""

from __future__ import annotations

import gc
import zlib
from pathlib import Path

from infertrace.analyze import kineto_split as split
from infertrace.analyze.kineto_columns import SKIPPED_CATS, TraceColumns, TraceError, _ColumnSink
from infertrace.analyze.kineto_events import _typed_decoder
from infertrace.analyze.kineto_split import AHEAD_DECODE_BYTES_S, AHEAD_IMPORT_S, ReadAhead, read_ahead, trim_heap
from infertrace.analyze.kineto_stream import _blocks, _GzipBomb, _StreamDecoder

__all__ = ["AHEAD_DECODE_BYTES_S", "AHEAD_IMPORT_S", "SKIPPED_CATS", "ReadAhead", "TraceColumns", "TraceError",
           "read_ahead", "read_kineto", "trim_heap"]


def read_kineto(path: str | Path, keep_python: bool = False, typed: bool = True, workers: int = 1,
                ahead: ReadAhead | None = None) -> TraceColumns:
    """Read one Kineto JSON trace (`.json` or gzip, told apart by content). Raises TraceError when unusable.

    `keep_python` keeps `python_function` events (with_stack traces hold millions of them and no analysis
    here needs them). `typed=False` decodes through plain dicts even where msgspec is installed. `workers` above
    one decodes a large plain file in that many processes, a stretch of the events array each (`_read_split`);
    `ahead`, what `read_ahead` started for this file, is joined instead (and its processes ended)."""
    if ahead is not None:
        joined = split._read_ahead_result(Path(path), keep_python, ahead) if typed else ahead.cancel()
        if joined is not None:
            return joined
    if workers > 1 and typed and _typed_decoder() is not None:
        columns = split._read_split(Path(path), keep_python, workers)
        if columns is not None:
            return columns
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
