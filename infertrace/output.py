"""Writing output files, one way for every command: each path is probed before the work (`check_writable`), and
written whole or not at all (`write_text`, `write_json`: a temporary file in the same folder, then os.replace), so
a reader never sees half a file and a failed write leaves the old one. Only regular files are written: a symlink
is followed to the file it names (the link stays a link), and a directory, device or pipe is refused.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infertrace.console import fail
from infertrace.exits import BAD_INPUT


class OutputError(ValueError):
    """An output path that cannot be written: one line for the user, "cannot write PATH: why" (exit code
    exits.BAD_INPUT)."""


def check_writable(path: str | Path, label: str | None = None) -> Path:
    """Prove now that `path` can be written as `write_text` will write it (its folder made, a temporary file
    created there and removed), rather than guess from permission bits, which say nothing about read-only mounts,
    full disks or running as root. Returns the file that will be written; OutputError names `label` (the option)
    or the path."""
    target = _target(path, label)
    try:
        _make_folder(target.parent)
        _temporary(target).unlink()
    except OSError as exc:
        raise OutputError(f"cannot write {_name(path, label)}: {exc.strerror or type(exc).__name__}") from None
    return target


def check_writable_dir(path: str | Path, label: str | None = None) -> Path:
    """Make the folder `path` and prove that files can be created in it; OutputError otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _temporary(folder / ".infertrace-probe").unlink()
    except OSError as exc:
        raise OutputError(f"cannot write {_name(path, label)}: {exc.strerror or type(exc).__name__}") from None
    return folder


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (OSError or OutputError when it cannot be); returns `path`."""
    return write_pieces(path, (text,))


def write_pieces(path: str | Path, pieces: Iterable[str]) -> Path:
    """Write the strings `pieces` yields, one after another, to `path` atomically: a document too large to hold as
    one string is streamed, and still lands whole or not at all."""
    target = _target(path)
    _make_folder(target.parent)
    tmp = _temporary(target)
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for piece in pieces:
                f.write(piece)
        if target.exists():
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))  # an overwritten file keeps its permissions
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Path(path)


def write_json(path: str | Path, document: Any, indent: int | None = 2, default=None) -> Path:
    """`document` as strict JSON (no NaN or Infinity), written atomically."""
    return write_text(path, json.dumps(document, indent=indent, allow_nan=False, default=default) + "\n")


def writing(path: str | Path, label: str | None, write) -> Path:
    """Call `write(path)` for a command: one line and exit BAD_INPUT when it cannot be written."""
    try:
        write(path)
    except OutputError as exc:
        fail(str(exc), BAD_INPUT)
    except OSError as exc:
        fail(f"cannot write {_name(path, label)}: {exc.strerror or exc}", BAD_INPUT)
    return Path(path)


def _target(path: str | Path, label: str | None = None) -> Path:
    """The file a write of `path` replaces: a symlink's target, which must be a regular file or not exist yet."""
    p = Path(path)
    target = p.resolve() if p.is_symlink() else p
    if target.exists() and not target.is_file():
        what = "a directory" if target.is_dir() else "not a regular file"
        raise OutputError(f"cannot write {_name(path, label)}: it is {what}")
    return target


def _make_folder(folder: Path) -> None:
    if not folder.exists():  # one that exists but is a file fails below as "Not a directory"
        folder.mkdir(parents=True, exist_ok=True)


def _temporary(target: Path) -> Path:
    """A new empty file beside `target` (created with the permissions a new file gets), for the atomic rename."""
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    return tmp


def _name(path: str | Path, label: str | None) -> str:
    return f"{label} {path}" if label else str(path)
