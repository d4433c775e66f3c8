"""Two reports side by side: per step type and per kernel category, before (A) and after (B)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.report import Report

DIFF_TABLES = ("phases", "categories", "phase_categories")


def diff_reports(a: Report, b: Report) -> dict[str, pd.DataFrame]:
    """Tables of A's and B's figures and B's change relative to A (`change` columns in percent)."""
    out: dict[str, pd.DataFrame] = {}
    pa, pb = a.tables.get("phases"), b.tables.get("phases")
    if _present(pa) or _present(pb):
        cols = ["steps", "step_mean (ms)", "step_p50 (ms)", "step_p99 (ms)", "gpu_busy_share", "host_wait_share",
                "kernels_per_step", "cpu_ops_per_step", "verdict"]
        merged = _join(pa, pb, ["type"], cols)
        for col in ("step_mean (ms)", "step_p99 (ms)", "kernels_per_step", "cpu_ops_per_step"):
            merged[f"{col} change"] = _change(merged[f"{col} A"], merged[f"{col} B"])
        out["phases"] = merged
    ca, cb = a.tables.get("categories"), b.tables.get("categories")
    if _present(ca) or _present(cb):
        merged = _join(ca, cb, ["category"], ["ops", "total (ms)", "share"])
        merged["total (ms) change"] = _change(merged["total (ms) A"], merged["total (ms) B"])
        out["categories"] = merged
    qa, qb = a.tables.get("phase_categories"), b.tables.get("phase_categories")
    if _present(qa) or _present(qb):
        merged = _join(qa, qb, ["type", "category"], ["per_step (ms)", "share"])
        merged["per_step (ms) change"] = _change(merged["per_step (ms) A"], merged["per_step (ms) B"])
        out["phase_categories"] = merged
    return out


def _present(table: pd.DataFrame | None) -> bool:
    return table is not None and not table.empty


def _join(a: pd.DataFrame | None, b: pd.DataFrame | None, keys: list[str], cols: list[str]) -> pd.DataFrame:
    def side(table, suffix):
        if not _present(table):
            return pd.DataFrame(columns=keys + [f"{c} {suffix}" for c in cols])
        kept = table[keys + [c for c in cols if c in table.columns]]
        return kept.rename(columns={c: f"{c} {suffix}" for c in cols})

    merged = side(a, "A").merge(side(b, "B"), on=keys, how="outer", sort=False)
    for col in cols:
        for suffix in ("A", "B"):
            if f"{col} {suffix}" not in merged.columns:
                merged[f"{col} {suffix}"] = np.nan
    return merged[keys + [f"{c} {s}" for c in cols for s in ("A", "B")]]


def _change(a: pd.Series, b: pd.Series) -> pd.Series:
    a, b = pd.to_numeric(a, errors="coerce"), pd.to_numeric(b, errors="coerce")
    return (b - a) / a.where(a != 0) * 100.0
