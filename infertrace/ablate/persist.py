"""The JSON document of an ablation: the recipe as run, every phase (failed ones with their reason), provenance.

It is rewritten after every phase, through a temporary file and a rename, so that a crash or a Ctrl-C later in
the run leaves the phases already done on disk, never a half-written file.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

from infertrace import output
from infertrace.ablate.recipe import Recipe
from infertrace.ablate.run import PhaseResult, PhaseStatus
from infertrace.ablate.waterfall import waterfall

SCHEMA = "infertrace.ablate/1"


def recipe_json(recipe: Recipe) -> dict:
    return {
        "path": str(recipe.path), "name": recipe.name, "description": recipe.description,
        "model": recipe.model, "preset": recipe.preset, "engine": recipe.engine, "workload": recipe.workload,
        "profile": dataclasses.asdict(recipe.profile),
        "phases": [{"name": p.name, "overrides": p.overrides, "tuning": p.tuning, "reset": p.reset}
                   for p in recipe.phases],
    }


def phase_json(result: PhaseResult) -> dict:
    from infertrace.load.results.result import point_result

    return {
        "index": result.index, "name": result.name, "status": result.status.value, "error": result.error,
        "note": result.note, "overrides": result.overrides, "config": result.config, "tuning": result.tuning,
        "engine_config": result.engine_config, "seconds": round(result.seconds, 3),
        "result": point_result(result.record) if result.record is not None else None,
        "profile": result.profile.to_json() if result.profile is not None else None,
        "profile_error": result.profile_error, "trace_dir": result.trace_dir, "spec_decode": result.spec_decode,
    }


def ablation_document(recipe: Recipe, model_dir: Path, results: list[PhaseResult], planned: int,
                      provenance: dict | None = None) -> dict:
    """Everything about the run so far; `planned` is the number of phases the recipe has."""
    complete = len(results) == planned and all(r.status not in (PhaseStatus.INTERRUPTED, PhaseStatus.NOT_RUN)
                                               for r in results)
    return {
        "schema": SCHEMA,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe_json(recipe),
        "model_dir": str(model_dir),
        "workload": recipe.bench_config().to_json(),
        "complete": complete,
        "waterfall": [row.to_json() for row in waterfall(results)],
        "phases": [phase_json(r) for r in results],
        "provenance": provenance or {},
    }


def write_json(path: str | Path, document: dict) -> Path:
    return output.write_json(path, document, default=str)
