"""Reports written to disk: one JSON document, or one CSV file per table; and JSON reports read back."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from infertrace import output
from infertrace.analyze.report import SCHEMA, TABLES, Report


def report_dict(report: Report) -> dict:
    """The report as plain JSON-ready data (`schema` first, so a reader can tell a report from a trace)."""
    return {
        "schema": SCHEMA,
        "source": report.source,
        "capture": report.capture,
        "problems": list(report.problems),
        "notes": list(report.notes),
        "skipped": dict(report.skipped),
        "ranks": table_records(report.ranks),
        "tables": {name: table_records(table) for name, table in report.tables.items()},
    }


def write_json(report: Report, path: Path) -> Path:
    return output.write_json(path, report_dict(report), indent=1)


def write_csv(report: Report, directory: Path) -> list[Path]:
    """`ranks.csv` and one `<table>.csv` per table that ran, written whole or not at all: every table is first
    written into a temporary folder beside `directory`, then moved in, and the tables of an earlier report that this
    one has not are removed, so the folder never holds two reports' tables. Other files there are left alone."""
    directory = output.check_writable_dir(directory, "--csv")
    tables = [("ranks", report.ranks), *report.tables.items()]
    targets = [output.check_writable(directory / f"{name}.csv", "--csv") for name, _ in tables]  # regular files
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory))
    try:
        for name, table in tables:
            output.write_text(staging / f"{name}.csv", table.to_csv(index=False))
        for (name, _), target in zip(tables, targets):
            if target.exists():  # the replaced file keeps its permissions, as output.write_text does
                os.chmod(staging / f"{name}.csv", stat.S_IMODE(target.stat().st_mode))
            os.replace(staging / f"{name}.csv", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    new = {f"{name}.csv" for name, _ in tables}
    for stale in ("ranks", *TABLES):
        old = directory / f"{stale}.csv"
        if f"{stale}.csv" not in new and (old.is_symlink() or old.is_file()):
            old.unlink()
    return [directory / f"{name}.csv" for name, _ in tables]


def is_report_file(path: Path) -> bool:
    """Whether `path` is a JSON report written by `write_json` (checked on its first bytes only)."""
    path = Path(path)
    if not path.is_file() or not path.name.endswith(".json"):
        return False
    with open(path, "rb") as fh:
        head = fh.read(64)
    return head.replace(b" ", b"").replace(b"\n", b"").startswith(b'{"schema":"' + SCHEMA.encode())


# the columns `analyze diff` joins each table on
_KEY_COLUMNS = {"phases": ("type",), "categories": ("category",), "phase_categories": ("type", "category")}


class ReportError(ValueError):
    """A JSON report that cannot be read back (cut short, edited, or not a report); the message is one line."""


def read_json(path: Path) -> Report:
    """A report written by `write_json`. Raises ReportError when the file is not one, whole."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except RecursionError:
        raise ReportError(f"{path}: not an infertrace analyze report (JSON nested too deeply)") from None
    except ValueError as exc:
        raise ReportError(f"{path}: not a whole infertrace analyze report (invalid JSON: {exc}; cut short?)") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ReportError(f"{path} is not an infertrace analyze report (schema {schema!r})")
    raw_tables = data.get("tables", {})
    shapes = {"tables": dict, "ranks": list, "problems": list, "notes": list, "skipped": dict}
    for key, kind in shapes.items():
        if not isinstance(data.get(key, kind()), kind):
            raise ReportError(f"{path}: not an infertrace analyze report ({key!r} is not a {kind.__name__})")
    tables = {}
    for name, rows in raw_tables.items():
        if name not in TABLES:
            continue
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ReportError(f"{path}: table {name!r} is not a list of rows")
        table = pd.DataFrame(rows)
        missing = [col for col in _KEY_COLUMNS.get(name, ()) if rows and col not in table.columns]
        if missing:
            raise ReportError(f"{path}: table {name!r} has no {missing[0]!r} column")
        tables[name] = table
    return Report(data.get("source", str(path)), pd.DataFrame(data.get("ranks", [])),
                  list(data.get("problems", [])), list(data.get("notes", [])), tables, dict(data.get("skipped", {})),
                  capture=data.get("capture") if isinstance(data.get("capture"), str) else None)


def table_records(table: pd.DataFrame) -> list[dict]:
    """Rows as JSON-ready dicts (NaN becomes null)."""
    return [{k: _plain(v) for k, v in row.items()} for row in table.to_dict("records")]


def _plain(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(value) or math.isinf(value) else float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if value is pd.NA or value is None:
        return None
    return value
