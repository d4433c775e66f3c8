"""A capture on a live server between its start and its stop: its name, where the server writes it, and, when the
server is on this host, the files it wrote and the manifest left beside them.

`infertrace profile --start` and `--stop` are two processes, so the start leaves a small record in the cache that
the stop reads back (keyed by the server's URL).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infertrace.cache import cache_dir
from infertrace.capture.peers import Flavour, file_patterns
from infertrace.output import OutputError, write_text

SERVER_MANIFEST_SCHEMA = "infertrace.server-capture/1"
WHERE_UNKNOWN = {
    Flavour.VLLM: "the torch_profiler_dir of its --profiler-config",
    Flavour.SGLANG: "SGLANG_TORCH_PROFILER_DIR of the server, else /tmp",
    Flavour.INFERTRACE: "a capture-* directory under its --profile-dir",
}


@dataclass(slots=True)
class ServerCapture:
    url: str
    flavour: str
    name: str | None
    directory: str | None  # None: the server's own default, unknown here
    patterns: list[str]
    local: bool
    num_steps: int | None = None
    sent: dict | None = None
    started_at: float = field(default_factory=time.time)
    stopped_at: float | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    schema: str = SERVER_MANIFEST_SCHEMA

    @classmethod
    def begin(cls, url: str, flavour: Flavour, name: str | None, directory: str | None, local: bool,
              num_steps: int | None, sent: dict | None) -> "ServerCapture":
        if directory is None and local and flavour is Flavour.SGLANG:
            # profiler_manager.py: output_dir or SGLANG_TORCH_PROFILER_DIR or /tmp (the server's environment; ours
            # is the best guess for a server started from this shell)
            directory = os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        return cls(url=url, flavour=flavour.value, name=name, directory=directory,
                   patterns=file_patterns(flavour, name), local=local, num_steps=num_steps, sent=sent)

    def where(self) -> str:
        """Where the server writes, as one line: the exact directory and file patterns when known."""
        place = self.directory or WHERE_UNKNOWN[Flavour(self.flavour)]
        return f"{place}/{{{','.join(self.patterns)}}}" if self.directory else f"{place}: {', '.join(self.patterns)}"

    def written(self, wait_s: float = 10.0, poll_s: float = 0.2) -> list[str]:
        """The files this capture wrote (newer than its start), once their sizes hold still; [] when the
        directory is unknown or not on this host."""
        if not (self.local and self.directory):
            return []
        deadline = time.monotonic() + wait_s
        last: dict[str, int] = {}
        while True:
            sizes = self._sizes()
            if sizes and sizes == last:
                return sorted(sizes)
            last = sizes
            if time.monotonic() >= deadline:
                return sorted(sizes)
            time.sleep(poll_s)

    def _sizes(self) -> dict[str, int]:
        sizes = {}
        for pattern in self.patterns:
            for path in glob.glob(os.path.join(glob.escape(self.directory), pattern)):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if st.st_mtime >= self.started_at - 1.0:
                    sizes[path] = st.st_size
        return sizes

    def write_manifest(self) -> Path | None:
        """`{name}.infertrace.json` beside the traces (only for a local server with files written); a capture
        without a name (a server that takes none) gets its start time to the microsecond instead, so that the
        next one in the same directory does not replace it."""
        if not self.files:
            return None
        path = Path(self.files[0]).parent / f"{self.name or self._unnamed()}.infertrace.json"
        try:
            write_text(path, json.dumps(asdict(self), indent=2) + "\n")
        except (OSError, OutputError):
            return None
        return path

    def _unnamed(self) -> str:
        micros = int(self.started_at * 1_000_000) % 1_000_000
        return f"capture-{time.strftime('%Y%m%d-%H%M%S', time.localtime(self.started_at))}-{micros:06d}"

    # ----- the record between --start and --stop -----
    def save(self) -> None:
        path = _record_path(self.url)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, url: str) -> "ServerCapture | None":
        path = _record_path(url)
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def forget(self) -> None:
        _record_path(self.url).unlink(missing_ok=True)


def _record_path(url: str) -> Path:
    key = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]
    return cache_dir() / "captures" / f"{key}.json"
