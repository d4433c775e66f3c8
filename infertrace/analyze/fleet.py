"""`infertrace analyze` over many ranks: each rank read and analysed on its own, in worker processes or as Ray
tasks, with a columnar cache of every file's events.

A worker reads one rank's files (SGLang's EXTEND and DECODE files of a rank together), runs every per-rank analysis
(`report.rank_part`) and sends back only the rank's tables, so the process that combines them never holds more than
one rank's events at a time, and each worker holds one rank's: peak memory is about one rank's per process,
whatever the number of ranks. `--jobs` bounds the processes on this host; `--ray ADDRESS` runs the ranks as Ray
tasks on a cluster instead (the trace files must be readable at the same path on every node, as on a shared file
system).

The cache (column_cache.py, data-only formats): a file's decoded events are kept as one `.npy` column per field
(names and metadata beside them, in JSON), and a rank's analysed part beside it in JSON, under the cache directory
(report_cache.default_cache_dir). An entry is keyed by the file's real path, size and modification time and a hash
of its first and last 64 KB, so a trace that changes is read again; an analysed part is keyed also by the options
that shape it and by a hash of this package's source, so new code never reads an old part. A second `analyze` of
the same folder reads only the parts. Entries are written to a temporary name and renamed, so a reader never sees
half an entry; a damaged entry is read again from the trace.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infertrace.analyze.capture import (
    PARALLEL_MIN_BYTES,
    CaptureError,
    RankTrace,
    assign_ranks,
    claimed_rank,
    no_events,
    plan_capture,
    read_trace_file,
    usable,
)
from infertrace.analyze.column_cache import ColumnCache
from infertrace.analyze.kineto import (
    AHEAD_DECODE_BYTES_S,
    AHEAD_IMPORT_S,
    ReadAhead,
    TraceColumns,
    TraceError,
    trim_heap,
)
from infertrace.analyze.kineto import read_ahead as read_file_ahead
from infertrace.analyze.report_cache import code_hash, file_key

SPLIT_CORES = 2  # a one-rank capture's large file is split over the cores from this many on (2-core machine, 523 MB
# rank, 9839ad4: one process 1.28-1.41 s, two 0.88-0.92 s; with a third process busy on one core 1.35-1.39 against
# 1.07-1.25 s)
AHEAD_MARGIN = 1  # a read-ahead's processes: at most those that decode the later stretches each in this many times
# what the first process spends importing; more only finish sooner, to wait for it, each holding memory while it
# decodes. On the 16-core H100 host, 523 MB rank (7a3ba93): 10 processes (a margin of 2) 1.28 s and 134 MB of peak
# PSS, 6 (a margin of 1) 1.38 s and 122 MB, against the fast HTA loader's 31.9 s and 1,070 MB.

@dataclass(slots=True)
class UnitResult:
    """What a worker sends back for one rank's files: the rank's part, or why nothing was usable."""

    files: list[str]
    outcomes: list[tuple[TraceColumns | None, str | None]]  # per file: columns (events dropped) or the failure
    part: object | None  # report.RankPart
    claim: int | None
    events: int = 0
    names: set = field(default_factory=set)
    from_cache: bool = False


def read_unit(paths: list[Path], keep_python: bool, cache: ColumnCache | None, split: int = 1,
              ahead: ReadAhead | None = None) -> list[tuple]:
    out = []
    for path in paths:
        key = file_key(path) + ("-py" if keep_python else "") if cache is not None else None
        cols = cache.load_columns(key) if cache is not None else None
        if cols is None:
            try:
                cols = read_trace_file(path, keep_python, split, ahead if ahead is not None and len(paths) == 1
                                       else None)
            except TraceError as exc:
                out.append((None, str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - a file we cannot read must not stop the others
                out.append((None, f"unreadable ({type(exc).__name__}: {exc})".splitlines()[0]))
                continue
            if cache is not None:
                cache.store_columns(key, cols)
        out.append((cols, None))
    return out


def analyze_unit(paths: list[str], config, trim: bool | None, cache_root: str | None,
                 keep_python: bool = False, split: int = 1, ahead: ReadAhead | None = None) -> UnitResult:
    """One rank: read (or take from the cache) its files and run every per-rank analysis. Runs in a worker, or
    here with a large file decoded in `split` processes (or by `ahead`, the read-ahead of its one file)."""
    from infertrace.analyze.events import event_frame
    from infertrace.analyze.report import rank_part, rank_row

    cache = ColumnCache(Path(cache_root)) if cache_root else None
    files = [Path(p) for p in paths]
    part_key = None
    if cache is not None:
        try:
            keys = [file_key(f) for f in files]
        except OSError:
            keys = None
        if keys is not None:
            part_key = hashlib.blake2b("|".join([*keys, repr(trim), repr(config), code_hash(),
                                                 str(keep_python)]).encode(), digest_size=16).hexdigest()
            cached = cache.load_part(part_key)
            if cached is not None:
                return UnitResult(**cached, from_cache=True)
    outcomes = read_unit(files, keep_python, cache, split, ahead)
    good = [(f, cols) for f, (cols, _) in zip(files, outcomes) if cols is not None]
    # the events are not sent back: only the lines the parent reports about each file
    light = [(None if cols is None else _without_events(cols), failure) for cols, failure in outcomes]
    del outcomes
    part, claim, count = None, None, 0
    if good:
        first_path, first = good[0]
        claim = claimed_rank(first_path, first.metadata)
        exact = all(c.exact_times for _, c in good)
        non_empty = [int(cols.ts_ns.min()) for _, cols in good if len(cols)]
        origin = min(non_empty) if non_empty else 0
        frames = []
        while good:  # each file's columns dropped as soon as its table is made: one copy of the events at a time
            frames.append(event_frame(good.pop(0)[1], origin, hta_times=False))
        import pandas as pd

        events = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        del frames
        count = len(events)
        device = RankTrace(0, first_path, events.iloc[:0], first.metadata, True, None).device
        del first
        part = rank_part(events, rank_row(first_path, events, claim, device, exact), trim, config)
        del events
        trim_heap()  # the events' freed pages given back before the report is made from the part
    result = UnitResult([str(f) for f in files], light, part, claim, count,
                        part.step_names if part is not None else set())
    if cache is not None and part_key is not None:
        cache.store_part(part_key, result)
    return result


def _without_events(cols: TraceColumns) -> TraceColumns:
    empty = np.empty(0, dtype=np.int64)
    return TraceColumns(names=[], name=empty.astype(np.int32), cats=[], cat=empty.astype(np.int32), pid=empty,
                        tid=empty, ts_ns=empty, dur_ns=empty, stream=empty, correlation=empty, external_id=empty,
                        metadata=cols.metadata, problem=cols.problem, warnings=list(cols.warnings),
                        exact_times=cols.exact_times)


def analyze_fleet(path: str | Path, config=None, capture: str | None = None, rank: int | None = None,
                  exclude: Iterable[Path] = (), jobs: int | None = None, ray_address: str | None = None,
                  cache_dir: Path | None = None, ahead: FleetAhead | None = None):
    """The report of the capture at `path`, its ranks analysed apart (in `jobs` processes, or as Ray tasks on the
    cluster at `ray_address`), each file's events cached under `cache_dir` (None: no cache). `ahead` is what
    `read_ahead` started for the same arguments; the caller still owns it (and cancels it when done)."""
    from infertrace.analyze.report import AnalyzeConfig, add_step_requests, combine, frontend_ops

    config = config or AnalyzeConfig()
    path = Path(path)
    group, notes, units = plan_capture(path, capture, rank, exclude)
    cache_root = str(cache_dir) if cache_dir is not None else None
    unit_paths = [[str(f.path) for f in unit] for unit in units]
    if ray_address is None and jobs is None and sum(_size(p) for u in unit_paths for p in u) < PARALLEL_MIN_BYTES:
        jobs = 1  # starting worker processes would cost more than it saves
    results = _run(unit_paths, config, None, cache_root, jobs, ray_address, ahead)
    names = set().union(*(r.names for r in results))
    if len(names) >= 2:  # HTA trims the last step over the whole capture: redo a rank that could not tell alone
        redo = [i for i, r in enumerate(results) if r.part is not None and not r.part.trimmed and r.names]
        if redo:
            again = _run([unit_paths[i] for i in redo], config, True, cache_root, jobs, ray_address)
            for i, r in zip(redo, again):
                results[i] = r
    problems: list[str] = []
    for result in results:
        for file, outcome in zip(result.files, result.outcomes):
            usable(Path(file), outcome, problems)
    done = [(Path(r.files[0]), r) for r in results if r.part is not None]
    if not done:
        raise CaptureError(f"no usable trace in {path}: " + "; ".join(problems))
    if all(r.events == 0 for _, r in done):
        raise no_events(path, group, problems, exclude)
    ranks = assign_ranks([(file, r.claim) for file, r in done], problems)
    parts = {}
    for (file, result), (r, claimed) in zip(done, ranks):
        result.part.row["claimed_rank"] = claimed if claimed is not None else ""
        parts[r] = result.part
        if result.events == 0:
            problems.append(f"{file.name}: no complete events")
    for unit in units:
        if len(unit) > 1:
            notes.append(f"{' and '.join(f.path.name for f in unit)}: stages of one rank, read as one")
    report = combine(str(path), parts, config, problems, notes)
    report.files = {r: result.files for (_, result), (r, _) in zip(done, ranks)}
    report.capture = group.name
    fronts = []
    for f in group.frontend():
        cols = usable(f.path, read_unit([f.path], False, None)[0], report.problems)
        if cols is not None:
            from infertrace.analyze.events import event_frame

            fronts.append(RankTrace(-1, f.path, event_frame(cols, 0), cols.metadata, cols.exact_times, None))
            report.notes.append(f"{f.path.name}: the API server's CPU trace (the frontend), not a rank")
    if fronts:
        report.tables["frontend"] = frontend_ops(fronts)
    add_step_requests(report, _Files([RankTrace(r, file, None, {}, True, None)
                                      for (file, _), (r, _) in zip(done, ranks)]))
    report.run_notes.append(f"{len(done)} rank(s) analysed apart"
                        + (f" as Ray tasks on {ray_address}" if ray_address else f" in up to {_workers(jobs, len(unit_paths))} process(es)")
                        + (f"; {sum(r.from_cache for _, r in done)} from the cache" if cache_root else ""))
    return report


@dataclass(slots=True)
class _Files:
    ranks: list


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _workers(jobs: int | None, units: int) -> int:
    return max(1, min(units, jobs or os.cpu_count() or 1))


def _run(unit_paths: list[list[str]], config, trim, cache_root, jobs, ray_address,
         ahead: FleetAhead | None = None) -> list[UnitResult]:
    if ray_address:
        return _run_ray(unit_paths, config, trim, cache_root, ray_address)
    files = ahead.files if ahead is not None else {}
    workers = _workers(jobs, len(unit_paths))
    if workers > 1:
        import multiprocessing  # here: planning and one-process reads go without it
        from concurrent.futures import ProcessPoolExecutor

        global _INHERITED
        try:
            split = _rank_split(jobs, len(unit_paths))
            _INHERITED = files  # the workers are forked: each takes up its rank's read-ahead from its own copy
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = [pool.submit(_inherited_unit, paths, config, trim, cache_root, split)
                           for paths in unit_paths]
                return [f.result() for f in futures]
        except (OSError, RuntimeError):  # no processes allowed here: one rank after another
            pass
        finally:
            _INHERITED = {}
    # one rank at a time here: a large file is decoded in several processes instead
    split = _split_workers(jobs) if len(unit_paths) == 1 else 1
    return [analyze_unit(paths, config, trim, cache_root, split=split,
                         ahead=files.get(paths[0]) if len(paths) == 1 else None) for paths in unit_paths]


_INHERITED: dict[str, ReadAhead] = {}  # a forked rank worker's copy of the read-aheads (FleetAhead.files)


def _inherited_unit(paths: list[str], config, trim, cache_root, split: int) -> UnitResult:
    """analyze_unit in a forked rank worker, with its file's read-ahead where the parent started one: the stretch
    processes are the parent's children, their pipes and regions this worker's too."""
    ahead = _INHERITED.get(paths[0]) if len(paths) == 1 else None
    return analyze_unit(paths, config, trim, cache_root, split=split, ahead=ahead)


def _rank_split(jobs: int | None, units: int) -> int:
    """The processes each of several ranks' large files is decoded in: the cores (--jobs) shared out over the ranks
    (8 ranks of 500 MB on 16 cores: 2 each; with one process a rank, 8 ranks took 3.6x one rank's wall time on the
    16-core H100 host, half its cores idle)."""
    cores = jobs or os.cpu_count() or 1
    return max(1, cores // units) if cores >= SPLIT_CORES else 1


def _split_workers(jobs: int | None) -> int:
    """The processes a one-rank capture's large file is decoded in: --jobs, else the cores from SPLIT_CORES on."""
    cores = os.cpu_count() or 1
    return jobs or (cores if cores >= SPLIT_CORES else 1)


@dataclass(slots=True)
class FleetAhead:
    """The read-aheads `read_ahead` started, by file path; `cancel()` ends every process not taken up."""

    files: dict[str, ReadAhead]

    def cancel(self) -> None:
        for ahead in self.files.values():
            ahead.cancel()


def read_ahead(path: str | Path, capture: str | None = None, rank: int | None = None, exclude: Iterable[Path] = (),
               jobs: int | None = None, ray_address: str | None = None,
               cache_dir: Path | None = None) -> FleetAhead | None:
    """Where `analyze_fleet` will decode large JSON traces in several processes each, start the processes for their
    later stretches now (kineto.read_ahead), before the caller imports the analysis modules (pandas, a quarter of a
    second to most of one), so that the traces are decoded meanwhile; pass the result to `analyze_fleet` and
    `cancel()` it after. One rank: its file over `_split_workers`; several ranks of one JSON file each: each file
    over the processes `_rank_split` gives a rank and one more, its first stretch left to the rank's worker
    (started once this process has imported). Nothing starts
    (None) under Ray, where each rank gets one process, or for files whose events are cached."""
    if ray_address is not None:
        return None
    try:
        _, _, units = plan_capture(Path(path), capture, rank, exclude)
    except CaptureError:
        return None  # analyze_fleet says why
    if any(len(u) != 1 or u[0].path.name.endswith((".sqlite", ".nsys-rep")) for u in units):
        return None
    total = sum(_size(str(u[0].path)) for u in units)
    if len(units) == 1:
        workers = _split_workers(jobs)
    elif jobs is None and total < PARALLEL_MIN_BYTES or _workers(jobs, len(units)) < 2 \
            or _rank_split(jobs, len(units)) < 2:
        return None  # one process for every rank (analyze_fleet's rule), or one for each rank's file
    else:  # a rank's cores, and one more: while this process imports, no rank's worker has started its own stretch
        workers = _rank_split(jobs, len(units)) + 1
    if workers < 2:
        return None
    files = {}
    cache = ColumnCache(Path(cache_dir)) if cache_dir is not None else None
    for unit in units:
        file = unit[0].path
        try:
            if cache is not None and cache.has_columns(file_key(file)):
                continue
        except OSError:
            continue
        started = read_file_ahead(file, False, _ahead_workers(workers, _size(str(file))))
        if started is not None:
            files[str(file)] = started
    return FleetAhead(files) if files else None


def _ahead_workers(workers: int, size: int) -> int:
    """The processes a read-ahead of a `size`-byte trace starts with: `workers`, at most AHEAD_MARGIN's bound."""
    if AHEAD_IMPORT_S <= 0:
        return workers
    return min(workers, 1 + math.ceil(AHEAD_MARGIN * size / AHEAD_DECODE_BYTES_S / AHEAD_IMPORT_S))


def _run_ray(unit_paths, config, trim, cache_root, address: str) -> list[UnitResult]:
    try:
        import ray
    except ImportError:
        raise CaptureError("--ray needs Ray: pip install -e '.[distributed]'") from None
    try:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        task = ray.remote(num_cpus=1, max_retries=0)(analyze_unit)
        return ray.get([task.remote(paths, config, trim, cache_root) for paths in unit_paths])
    except Exception as exc:  # noqa: BLE001 - no cluster there, or a task lost: one line, not Ray's traceback
        text = str(exc).strip().splitlines()
        raise CaptureError(f"--ray {address}: {type(exc).__name__}: {text[0] if text else ''}") from None
