"""Reading the files a user gives (datasets, traces, recipes, results), one way: only a regular file is read (a
symlink to one is fine), opened without blocking so that a pipe is refused rather than waited on, and never more
than a bound, so that /dev/zero or a file that grows while read cannot take the memory. Memory is taken by what the
file holds, never by the bound: a 500-byte file costs 500 bytes under any bound."""

from __future__ import annotations

import os
import stat
from pathlib import Path

GROWTH_CHUNK = 1 << 20  # read past the size fstat gave (a file still being written) this much at a time


class InputFileError(ValueError):
    """Why a file cannot be read, in a few words that follow "cannot read PATH: "."""


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} bytes"


def read_bytes(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` of them (InputFileError otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InputFileError("no such file") from None
    except OSError as exc:
        raise InputFileError(exc.strerror or str(exc)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InputFileError("not a regular file")
    if info.st_size > max_bytes:
        os.close(fd)
        raise InputFileError(f"{_size(info.st_size)}, above the {_size(max_bytes)} such a file may hold")
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            data = _read_upto(f, info.st_size, max_bytes + 1)
        except OSError as exc:
            raise InputFileError(exc.strerror or str(exc)) from None
    if len(data) > max_bytes:
        raise InputFileError(f"it grew past {_size(max_bytes)} while read")
    return data


def _read_upto(f, size: int, limit: int) -> bytes:
    """At most `limit` bytes of `f`: its `size` (and one byte more, to see whether it grew) in one read, then by
    GROWTH_CHUNK while it goes on."""
    chunks, total = [], 0
    want = min(size + 1, limit)
    while total < limit:
        chunk = f.read(want)  # one read(2) returns at most about 2 GiB: loop until the end
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        want = min(max(size + 1 - total, GROWTH_CHUNK), limit - total)
    return b"".join(chunks)  # one chunk: the same object, no copy


def read_text(path: str | Path, max_bytes: int) -> str:
    """The UTF-8 text of the regular file at `path` (a byte-order mark dropped), at most `max_bytes` long."""
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"not UTF-8 text (byte {exc.start})") from None
