"""Output files are checked before any request is sent: a run must never end unable to save what it measured."""

from __future__ import annotations

from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written: one line for the user."""


def check_writable(paths: dict[str, str]) -> None:
    """Each path (keyed by the option that named it) can be created or overwritten, or OutputError.

    Probed for real (its folder made, the file opened for appending, a new one removed again) rather than
    guessed from permission bits, which say nothing about read-only mounts, full disks or running as root.
    """
    for flag, path in paths.items():
        p = Path(path)
        if p.is_dir():
            raise OutputError(f"{flag} {path}: is a directory")
        existed = p.exists()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with p.open("a"):
                pass
            if not existed:
                p.unlink()
        except OSError as e:
            raise OutputError(f"{flag} {path}: cannot write there ({e.strerror or type(e).__name__})") from None
