"""Which trace files form which capture, and which rank each file is: the naming of vLLM 0.33, SGLang 0.5.23 and
infertrace, so that a directory where captures accumulate is read capture by capture.

- vLLM (vllm/v1/worker/gpu_worker.py `profile`, vllm/distributed/utils.py `get_worker_rank_suffix`,
  vllm/v1/engine/async_llm.py; the file written by torch's `tensorboard_trace_handler` as `{worker_name}.{time_ns}
  .pt.trace.json[.gz]`): `{prefix_}dp{d}_pp{p}_tp{t}_dcp{c}_ep{e}_rank{r}.{ns}.pt.trace.json.gz` per worker, or
  `{prefix_}rank{r}.{ns}...` where the parallel groups are not set up (vLLM CPU 0.32 writes `rank0.{ns}...`), and
  the API server's CPU-only `{prefix_}{host}_{pid}.async_llm.{ns}.pt.trace.json.gz`, which is the frontend, not a
  rank. Every `/start_profile`..`/stop_profile` writes a new set into the same `torch_profiler_dir`: without a
  prefix, a capture ends where a rank or frontend repeats, or where the stamps lie far apart.
- SGLang (sglang/srt/managers/scheduler_components/profiler_manager.py): `[prefix-]{id}-TP-{t}[-DP-d][-PP-p][-EP-e]
  [-EXTEND|-DECODE].trace.json.gz`; the EXTEND and DECODE files are two stages of one rank; `merged-{id}.trace.json
  .gz` repeats the per-rank files and is read only when they are absent.
- infertrace serve's front end (server/frontend_trace.py): `frontend{i}-{pid}.trace.json` beside the engine's
  traces, the frontend, not a rank.
- Anything else (torch.profiler, infertrace's `capture-*` directories, nsys exports): one capture per directory.

Only regular files are read: a FIFO, socket or device named like a trace is passed over. infertrace's own
documents are never traces, whatever their name: they are known by what they start with
(`own_document`), and the outputs of the run at hand are left out by path (`catalog(..., exclude=)`).
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite", ".nsys-rep")
MANIFEST_SUFFIXES = (".manifest.json", ".infertrace.json")  # written beside captures; not traces
UNNAMED_GAP_MS = 120_000  # vLLM files of one prefix (or none) stamped further apart belong to different captures

_VLLM_RANK = re.compile(r"^(?:(?P<prefix>.+)_)?dp(?P<dp>\d+)_pp(?P<pp>\d+)_tp(?P<tp>\d+)_dcp(?P<dcp>\d+)_ep(?P<ep>\d+)"
                        r"_rank(?P<rank>\d+)\.(?P<ms>\d+)\.pt\.trace\.json(?:\.gz)?$")
# get_worker_rank_suffix's fallback (vllm/distributed/utils.py, vLLM 0.33.0): `rank{r}` alone
_VLLM_BARE_RANK = re.compile(r"^(?:(?P<prefix>.+)_)?rank(?P<rank>\d+)\.(?P<ms>\d+)\.pt\.trace\.json(?:\.gz)?$")
_VLLM_FRONTEND = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<host>[^_]+)_(?P<pid>\d+)\.async_llm\.(?P<ms>\d+)"
                            r"\.pt\.trace\.json(?:\.gz)?$")
_SGLANG = re.compile(r"^(?P<capture>.+?)-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?(?:-EP-(?P<ep>\d+))?"
                     r"(?:-(?P<stage>EXTEND|DECODE))?\.trace\.json\.gz$")
_INFERTRACE_FRONTEND = re.compile(r"^frontend(?P<index>\d+)-(?P<pid>\d+)\.trace\.json$")  # server/frontend_trace.py
_SGLANG_MERGED = re.compile(r"^merged-(?P<capture>.+)\.trace\.json\.gz$")

OWN_HEAD_BYTES = 64 << 10  # read (decompressed) from each file to tell infertrace's documents from traces
# What each document infertrace writes starts with. Kineto writes "schemaVersion", never these keys.
_OWN_DOCUMENTS = (
    # analyze --json (schema first), ablate --json, profile's `{name}.infertrace.json` and capture manifests
    ("a report or manifest", re.compile(rb'"schema"\s*:\s*"infertrace[.-]')),
    ("a bench result", re.compile(rb'^\s*\{\s*"schema_version"\s*:')),  # load/result.py: run, sweep, --find-max
    ("a bench request log", re.compile(rb'^\s*\{\s*"point"\s*:\s*\d+\s*,\s*"phase"\s*:')),  # --requests-jsonl
    ("a gate baseline", re.compile(rb'^\s*\{\s*"kind"\s*:\s*"infertrace-')),  # gate/results.py
    # the server's request log beside a capture (`<capture>.request_log.json`, engine/request_log.py's read())
    ("a server request log", re.compile(rb'^\s*\{\s*"clock"\s*:\s*"perf_counter"')),
    ("an HTML report", re.compile(rb"^\s*<(?:!doctype html|html)", re.IGNORECASE)),  # analyze --html
)


class Role(str, Enum):
    RANK = "rank"
    FRONTEND = "frontend"  # vLLM's API-server CPU trace
    MERGED = "merged"  # SGLang's merge of every rank into one file


@dataclass(slots=True)
class TraceFile:
    path: Path
    capture: str  # the capture's name (prefix, profile id, or the directory)
    role: Role
    rank: int | None = None  # from the name; None when the name gives none
    stage: str | None = None  # SGLang EXTEND / DECODE
    mtime: float = 0.0
    ms: int | None = None  # vLLM's stamp in the name, in milliseconds (torch writes nanoseconds)
    stamp: str | None = None  # the stamp as written


@dataclass(slots=True)
class CaptureGroup:
    name: str
    directory: Path
    files: list[TraceFile] = field(default_factory=list)

    @property
    def newest(self) -> float:
        return max((f.mtime for f in self.files), default=0.0)

    def rank_files(self) -> list[TraceFile]:
        """The per-rank files; SGLang's merged file only when no per-rank file exists."""
        ranks = [f for f in self.files if f.role is Role.RANK]
        return ranks or [f for f in self.files if f.role is Role.MERGED]

    def frontend(self) -> list[TraceFile]:
        return [f for f in self.files if f.role is Role.FRONTEND]


def is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES) and not name.endswith(MANIFEST_SUFFIXES) and not name.startswith(".")


def own_document(path: Path) -> str | None:
    """What infertrace document `path` is ("a bench result", ...), or None for anything else, traces included.
    Only the first OWN_HEAD_BYTES are read (gzip decompressed); a file that cannot be read is left to the reader."""
    try:
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        with (gzip.open if gzipped else open)(path, "rb") as fh:
            head = fh.read(OWN_HEAD_BYTES)
    except (OSError, EOFError, zlib.error):
        return None
    return next((what for what, marker in _OWN_DOCUMENTS if marker.search(head)), None)


def classify(path: Path) -> TraceFile:
    name = path.name
    mtime = _mtime(path)
    if m := _VLLM_RANK.match(name) or _VLLM_BARE_RANK.match(name):
        return TraceFile(path, m["prefix"] or "", Role.RANK, int(m["rank"]), mtime=mtime, ms=_stamp_ms(m["ms"]),
                         stamp=m["ms"])
    if m := _VLLM_FRONTEND.match(name):
        return TraceFile(path, m["prefix"] or "", Role.FRONTEND, mtime=mtime, ms=_stamp_ms(m["ms"]), stamp=m["ms"])
    if _INFERTRACE_FRONTEND.match(name):
        return TraceFile(path, "", Role.FRONTEND, mtime=mtime)
    if m := _SGLANG_MERGED.match(name):
        return TraceFile(path, m["capture"], Role.MERGED, mtime=mtime)
    if m := _SGLANG.match(name):
        return TraceFile(path, m["capture"], Role.RANK, int(m["tp"]), m["stage"], mtime=mtime)
    return TraceFile(path, "", Role.RANK, mtime=mtime)


def catalog(path: Path, exclude: Iterable[Path] = ()) -> list[CaptureGroup]:
    """Every capture under `path` (a file, or a directory searched to any depth), oldest first. Files at or
    under a path in `exclude` (the outputs of this run), and infertrace's own documents, are not traces."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in _walk(path) if is_trace_name(p.name) and _regular(p))
    excluded = {Path(os.path.realpath(p)) for p in exclude}
    files = [p for p in files if not _under(p, excluded) and own_document(p) is None]
    files = _without_exported_reports(files)
    groups: dict[tuple[Path, str], CaptureGroup] = {}
    for file in files:
        entry = classify(file)
        key = entry.capture or file.parent.name or str(file.parent)
        group = groups.setdefault((file.parent, key), CaptureGroup(key, file.parent))
        group.files.append(entry)
    out: list[CaptureGroup] = []
    for group in groups.values():
        out.extend(_split_vllm(group))
    return sorted(out, key=lambda g: (g.newest, g.name))


def select(groups: list[CaptureGroup], capture: str | None = None,
           rank: int | None = None) -> tuple[CaptureGroup | None, list[str]]:
    """The capture to analyse (the newest, or the one named), its rank files filtered to `rank`, and notes."""
    notes: list[str] = []
    if not groups:
        return None, notes
    if capture is not None:
        chosen = [g for g in groups if g.name == capture] or [g for g in groups if capture in g.name]
        if not chosen:
            raise LookupError(f"no capture named {capture!r}; captures here: {', '.join(g.name for g in groups)}")
        group = chosen[-1]
    else:
        group = groups[-1]
        if len(groups) > 1:
            others = ", ".join(g.name for g in groups[:-1])
            notes.append(f"{len(groups)} captures here; analysing the newest, {group.name} (others: {others}; "
                         "choose one with --capture)")
        else:
            notes.append(f"analysing capture {group.name}, the only one here")
    if rank is not None:
        kept = [f for f in group.files if f.role is not Role.RANK or f.rank == rank or f.rank is None]
        if not any(f.role is Role.RANK and f.rank == rank for f in kept):
            ranks = sorted({f.rank for f in group.files if f.rank is not None})
            raise LookupError(f"capture {group.name} has no rank {rank} (ranks: {', '.join(map(str, ranks)) or 'none named'})")
        group = CaptureGroup(group.name, group.directory, [f for f in kept if f.role is not Role.RANK or f.rank == rank])
    return group, notes


def _walk(path: Path):
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            yield Path(root) / name


def _regular(path: Path) -> bool:
    """A regular file (or a link to one): a FIFO, socket or device named like a trace would block or never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _under(path: Path, excluded: set[Path]) -> bool:
    if not excluded:
        return False
    real = Path(os.path.realpath(path))
    return real in excluded or any(parent in excluded for parent in real.parents)


def _without_exported_reports(files: list[Path]) -> list[Path]:
    """A report exported beside itself is read once, from the faster .sqlite."""
    exported = {p.with_name(p.name[: -len(".sqlite")]) for p in files if p.name.endswith(".sqlite")}
    return [p for p in files if not (p.name.endswith(".nsys-rep") and p.with_name(p.name[: -len(".nsys-rep")])
                                     in exported)]


def _split_vllm(group: CaptureGroup) -> list[CaptureGroup]:
    """vLLM's files of one prefix (or of none) differ only in their time stamp: a capture holds each rank and the frontend once, so a
    file whose rank (or frontend) the capture already has starts the next one, as do files far apart in time."""
    stamped = sorted((f for f in group.files if f.ms is not None), key=lambda f: (f.ms, f.path.name))
    if not stamped:
        return [group]
    rest = [f for f in group.files if f.ms is None]
    parts: list[list[TraceFile]] = [[stamped[0]]]
    for f in stamped[1:]:
        seen = {_writer(g) for g in parts[-1]}
        if f.ms - parts[-1][-1].ms > UNNAMED_GAP_MS or _writer(f) in seen:
            parts.append([])
        parts[-1].append(f)
    if len(parts) == 1:
        return [group]
    # named by a rank's stamp: the one a user sees first among the files
    out = [CaptureGroup(f"{group.name}@{next((f for f in part if f.role is Role.RANK), part[0]).stamp}",
                        group.directory, part) for part in parts]
    out[-1].files.extend(rest)
    return out


def _writer(f: TraceFile) -> tuple:
    """What writes one file a capture: a rank, or the API server (one frontend trace a process)."""
    if f.role is Role.FRONTEND:
        return (Role.FRONTEND, f.path.name.split(".async_llm.")[0])
    return (f.role, f.rank)


def _stamp_ms(stamp: str) -> int:
    """torch's trace handler stamps nanoseconds (time.time_ns()); older writers milliseconds."""
    value = int(stamp)
    return value // 1_000_000 if value >= 10**15 else value


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
