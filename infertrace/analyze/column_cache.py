"""analyze's cache on disk: each trace file's decoded events and each rank's analysed part, in data-only formats.

A file's events are one `.npy` column per field (read with allow_pickle=False) with their names and metadata in
JSON; a rank's part is one JSON document whose tables keep each column's dtype. Nothing in the cache can run code
when read: an entry that is damaged, or that does not hold what this code writes, is ignored and made again from
the trace. Entries are filled in a temporary directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from infertrace.analyze.kineto import TraceColumns

_COLUMNS = ("name", "cat", "pid", "tid", "ts_ns", "dur_ns", "stream", "correlation", "external_id")
PART_FORMAT = "infertrace.analyze-part/1"


class ColumnCache:
    """Decoded events (`TraceColumns`) and analysed parts on disk, keyed by the caller (fleet.py)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    def load_columns(self, key: str) -> TraceColumns | None:
        entry = self._entry(key)
        try:
            info = json.loads((entry / "info.json").read_text())
            arrays = {c: np.load(entry / f"{c}.npy", allow_pickle=False) for c in _COLUMNS}
            cols = TraceColumns(names=info["names"], cats=info["cats"], metadata=info["metadata"],
                                problem=info["problem"], warnings=info["warnings"], exact_times=info["exact_times"],
                                **arrays)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cols if _whole(cols) else None

    def has_columns(self, key: str) -> bool:
        return (self._entry(key) / "info.json").is_file()

    def store_columns(self, key: str, cols: TraceColumns) -> None:
        info = {"names": cols.names, "cats": cols.cats, "metadata": cols.metadata, "problem": cols.problem,
                "warnings": cols.warnings, "exact_times": cols.exact_times}
        try:
            text = json.dumps(info)
        except (TypeError, ValueError):
            return  # metadata that JSON cannot hold: not cached
        self._write(self._entry(key), lambda tmp: (
            (tmp / "info.json").write_text(text),
            [np.save(tmp / f"{c}.npy", getattr(cols, c), allow_pickle=False) for c in _COLUMNS]))

    def load_part(self, key: str) -> dict | None:
        """The fields of the fleet.UnitResult stored under `key`, or None (absent, damaged, or not what
        `store_part` writes)."""
        try:
            doc = json.loads((self._entry(key) / "part.json").read_text())
            return unit_from_doc(doc)
        except Exception:  # noqa: BLE001 - whatever is wrong with an entry, it is made again from the trace
            return None

    def store_part(self, key: str, result) -> None:
        try:
            text = json.dumps(unit_doc(result))
        except (TypeError, ValueError):
            return  # a part this format cannot hold exactly is not cached
        self._write(self._entry(key), lambda tmp: (tmp / "part.json").write_text(text))

    def _write(self, entry: Path, fill) -> None:
        """Fill a temporary directory and rename it into place; a cache that cannot be written is skipped."""
        try:
            entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
            try:
                fill(tmp)
                if entry.exists():
                    shutil.rmtree(entry, ignore_errors=True)
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _whole(cols: TraceColumns) -> bool:
    """Whether columns read back are what `store_columns` wrote: one length, integer codes within their names."""
    arrays = [getattr(cols, c) for c in _COLUMNS]
    if any(a.ndim != 1 or a.dtype.kind not in "iu" or len(a) != len(arrays[0]) for a in arrays):
        return False
    if not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in (cols.names, cols.cats)):
        return False
    for codes, names in ((cols.name, cols.names), (cols.cat, cols.cats)):
        if len(codes) and (codes.min() < 0 or codes.max() >= len(names)):
            return False
    return isinstance(cols.metadata, dict) and isinstance(cols.warnings, list)


def unit_doc(result) -> dict:
    """A fleet.UnitResult as JSON-ready data; TypeError where a table cannot be stored exactly."""
    part = result.part
    return {
        "format": PART_FORMAT,
        "files": list(result.files),
        "outcomes": [[None if cols is None else {"metadata": cols.metadata, "problem": cols.problem,
                                                 "warnings": list(cols.warnings), "exact_times": cols.exact_times},
                      failure] for cols, failure in result.outcomes],
        "part": None if part is None else {
            "row": {k: _plain(v) for k, v in part.row.items()},
            "step_names": sorted(part.step_names), "trimmed": part.trimmed, "has_gpu": part.has_gpu,
            "tables": {name: frame_doc(t) for name, t in part.tables.items()},
            "kernel_types": {k: int(v) for k, v in part.kernel_types.items()},
            "categories": None if part.categories is None else frame_doc(part.categories),
            "skipped": dict(part.skipped), "problems": list(part.problems)},
        "claim": result.claim, "events": int(result.events), "names": sorted(result.names),
    }


def unit_from_doc(doc: dict) -> dict:
    """The fields of the UnitResult `unit_doc` made; ValueError (or another exception) where `doc` is not one."""
    from infertrace.analyze.report import RankPart

    if doc.get("format") != PART_FORMAT:
        raise ValueError("not an analysed part")
    empty = np.empty(0, dtype=np.int64)
    outcomes = []
    for light, failure in doc["outcomes"]:
        cols = None if light is None else TraceColumns(
            names=[], name=empty.astype(np.int32), cats=[], cat=empty.astype(np.int32), pid=empty, tid=empty,
            ts_ns=empty, dur_ns=empty, stream=empty, correlation=empty, external_id=empty,
            metadata=dict(light["metadata"]), problem=light["problem"], warnings=[str(w) for w in light["warnings"]],
            exact_times=bool(light["exact_times"]))
        outcomes.append((cols, None if failure is None else str(failure)))
    raw = doc["part"]
    part = None if raw is None else RankPart(
        row=dict(raw["row"]), step_names=set(raw["step_names"]), trimmed=bool(raw["trimmed"]),
        has_gpu=bool(raw["has_gpu"]), tables={str(n): frame_from_doc(t) for n, t in raw["tables"].items()},
        kernel_types={str(k): int(v) for k, v in raw["kernel_types"].items()},
        categories=None if raw["categories"] is None else frame_from_doc(raw["categories"]),
        skipped={str(k): str(v) for k, v in raw["skipped"].items()}, problems=[str(p) for p in raw["problems"]])
    claim = doc["claim"]
    if claim is not None and not isinstance(claim, int):
        raise ValueError("claim")
    return {"files": [str(f) for f in doc["files"]], "outcomes": outcomes, "part": part, "claim": claim,
            "events": int(doc["events"]), "names": set(doc["names"])}


def frame_doc(frame) -> dict:
    """A table as its columns, each with its dtype; TypeError where that would not give the same table back."""
    import pandas as pd

    if frame.attrs or not frame.index.equals(pd.RangeIndex(len(frame))) or not frame.columns.is_unique:
        raise TypeError("a table with attributes or an index of its own")
    if any(str(t) not in _DTYPES for t in frame.dtypes):
        raise TypeError("a column of a type kept inexactly")
    return {"columns": [str(c) for c in frame.columns], "dtypes": [str(t) for t in frame.dtypes],
            "data": [[_plain(v) for v in frame[c].tolist()] for c in frame.columns]}


def frame_from_doc(doc: dict):
    import pandas as pd

    columns, dtypes, data = doc["columns"], doc["dtypes"], doc["data"]
    if not len(columns) == len(dtypes) == len(data) or len({len(d) for d in data}) > 1:
        raise ValueError("columns of different lengths")
    series = {c: pd.Series(d, dtype=_dtype(t)) for c, t, d in zip(columns, dtypes, data)}
    return pd.DataFrame(series, columns=columns) if series else pd.DataFrame()


_DTYPES = {"int64", "int32", "float64", "bool", "str", "string", "object", "Int64", "boolean"}


def _dtype(name: str) -> str:
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}")
    return name


def _plain(value):
    """A cell as JSON holds it: numpy scalars as Python's, NA as None (NaN stays NaN: JSON here allows it)."""
    import pandas as pd

    if isinstance(value, np.generic):
        return value.item()
    if value is pd.NA or value is None:
        return None
    if isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a cell of type {type(value).__name__}")
