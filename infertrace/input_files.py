"""Reading the files a user gives (datasets, traces, recipes, results), one way: only a regular file is read (a
symlink to one is fine), opened without blocking so that a pipe is refused rather than waited on, and never more
than a bound, so that /dev/zero or a file that grows while read cannot take the memory."""

from __future__ import annotations

import os
import stat
from pathlib import Path


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
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise InputFileError(exc.strerror or str(exc)) from None
    if len(data) > max_bytes:
        raise InputFileError(f"it grew past {_size(max_bytes)} while read")
    return data


def read_text(path: str | Path, max_bytes: int) -> str:
    """The UTF-8 text of the regular file at `path` (a byte-order mark dropped), at most `max_bytes` long."""
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"not UTF-8 text (byte {exc.start})") from None
