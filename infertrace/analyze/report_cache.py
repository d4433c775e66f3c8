"""The finished report of a capture, cached beside the decoded events (fleet.py): a second `analyze` of unchanged
traces prints the report it made before (and writes it with --json) without reading a trace or an analysed part,
and without importing pandas or numpy (a 523 MB rank on 2 cores: 0.08 s, where reading its cached analysed rank
took 0.35 s).

An entry is keyed by every trace file under the path and every request log there (each by `file_key`: its real
path, size, modification time and both ends' bytes), by the options that shape the report (--capture, --rank,
--top) and by a hash of this package's source, so a changed, added or removed file, another option or new code
makes a new report. It holds the document `analyze --json` writes, written whole or not at all; an entry that
cannot be read is made again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

CACHE_VERSION = 1
EDGE_BYTES = 64 << 10  # hashed from each end of a trace for its cache key
REQUEST_LOG_SUFFIX = ".request_log.json"  # requests.LOG_SUFFIX: a log beside the capture changes the report


def default_cache_dir() -> Path:
    """$INFERTRACE_CACHE_DIR, else `analyze` under the project's cache root ($INFERTRACE_CACHE, ~/.cache/infertrace)."""
    if env := os.environ.get("INFERTRACE_CACHE_DIR"):
        return Path(env)
    from infertrace.cache import cache_dir

    return cache_dir() / "analyze"


def own_cache_root(root: Path) -> tuple[Path | None, str | None]:
    """`root` made (0700 where it is new) and usable, or None and why: a directory that is not ours, or that others
    may write into, could hold entries we did not write, so it is neither read nor written."""
    root = Path(root)
    try:
        if not root.exists():
            root.mkdir(parents=True, mode=0o700)
            os.chmod(root, 0o700)  # mkdir's mode goes through the umask
        st = os.stat(root)
    except OSError as exc:
        return None, f"cache {root} cannot be made ({exc.strerror or type(exc).__name__}); running without it"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"cache {root} is not a directory; running without it"
    if st.st_uid != os.getuid():
        return None, f"cache {root} belongs to another user; running without it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None, f"cache {root} may be written by other users; running without it (chmod go-w to use it)"
    return root, None


def file_key(path: Path) -> str:
    """What identifies a trace file's content: its real path, size, modification time and both ends' bytes."""
    real = os.path.realpath(path)
    st = os.stat(real)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{CACHE_VERSION}\0{real}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with open(real, "rb") as fh:
        digest.update(fh.read(EDGE_BYTES))
        if st.st_size > EDGE_BYTES:
            fh.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
            digest.update(fh.read(EDGE_BYTES))
    return digest.hexdigest()


_CODE_HASH: str | None = None


def code_hash() -> str:
    """A hash of this package's source: an analysed part or report made by other code is never read back."""
    global _CODE_HASH
    if _CODE_HASH is None:
        digest = hashlib.blake2b(digest_size=8)
        for source in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(source.read_bytes())
        _CODE_HASH = digest.hexdigest()
    return _CODE_HASH


def report_key(path: Path, options: dict, exclude: Iterable[Path] = ()) -> str | None:
    """The key of the report of the traces at `path` made with `options`, or None where the files cannot all be
    read (the full run says why)."""
    from infertrace.analyze.catalog import catalog

    path = Path(path)
    try:
        files = {f.path for group in catalog(path, exclude) for f in group.files}
        # a log beside a trace is read with it (requests.find_request_log): beside one file given, or anywhere below
        logs = path.rglob(f"*{REQUEST_LOG_SUFFIX}") if path.is_dir() else path.parent.glob(f"*{REQUEST_LOG_SUFFIX}")
        files.update(p for p in logs if p.is_file())
        keys = sorted(f"{os.path.realpath(f)}={file_key(f)}" for f in files)
    except OSError:
        return None
    if not keys:
        return None
    text = "|".join([*keys, json.dumps(options, sort_keys=True, default=str), code_hash()])
    return "report-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _entry(root: Path, key: str) -> Path:
    return Path(root) / key[7:9] / f"{key}.json"


def load_report(root: Path, key: str) -> dict | None:
    """The report document stored under `key`, or None (absent, cut short or not a report)."""
    try:
        doc = json.loads(_entry(root, key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), dict) or not isinstance(doc.get("ranks"), list):
        return None
    return doc


def store_report(root: Path, key: str, doc: dict) -> None:
    """Keep `doc` under `key`, written whole or not at all; a cache that cannot be written is skipped."""
    from infertrace.output import OutputError, write_json

    entry = _entry(root, key)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json(entry, doc, indent=None)
    except (OSError, OutputError):
        pass
