"""Benchmark runs as the gate reads them: `infertrace bench --result-json` files, `vllm bench serve` result files
(one JSON object, or one per line as `--append-result` writes them), and gate baselines holding several runs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASELINE_KIND = "infertrace-gate-baseline"

# Top-level keys of a vLLM result that say which model and workload were run; anything else there is either a
# metric, a per-request list, or free metadata (a commit id, a label) that must not make two runs incomparable.
VLLM_WORKLOAD_KEYS = {
    "model_id", "tokenizer_id", "backend", "endpoint_type", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "dataset_name", "dataset_path", "input_len", "output_len",
}
VLLM_WORKLOAD_PREFIXES = ("random_", "sharegpt_", "sonnet_", "prefix_", "hf_", "custom_", "ramp_up_")


class ResultError(ValueError):
    """A result or baseline file the gate cannot use (exit status 2 at the command line)."""


@dataclass(frozen=True)
class Run:
    """One benchmark run: the result object as written, and where it came from."""

    source: str
    data: dict[str, Any]

    @property
    def flavour(self) -> str:
        return "infertrace" if isinstance(self.data.get("config"), dict) else "vllm"

    def metric(self, name: str) -> float:
        if name not in self.data:
            raise ResultError(f"{self.source} has no metric '{name}'")
        value = self.data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ResultError(f"{self.source}: metric '{name}' is {json.dumps(value)}, not a finite number")
        return float(value)

    def identity(self) -> dict[str, Any]:
        """What makes two runs comparable: the model and workload, as flat dotted keys."""
        if self.flavour == "infertrace":
            return {"flavour": "infertrace", **_flatten(self.data["config"], "config.")}
        return {"flavour": "vllm"} | {
            key: value for key, value in self.data.items()
            if key in VLLM_WORKLOAD_KEYS or key.startswith(VLLM_WORKLOAD_PREFIXES)
        }


def load_runs(path: Path) -> list[Run]:
    """Every run in a result file, a JSON-lines file of results, or a gate baseline."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: cannot read ({exc})") from None
    objects = _parse_json_objects(path, text)
    if len(objects) == 1 and objects[0].get("kind") == BASELINE_KIND:
        objects = objects[0].get("runs")
        if not isinstance(objects, list) or not objects:
            raise ResultError(f"{path}: baseline holds no runs")
    runs = []
    for index, obj in enumerate(objects, 1):
        source = str(path) if len(objects) == 1 else f"{path} (run {index})"
        if not isinstance(obj, dict) or not _looks_like_result(obj):
            raise ResultError(f"{source} is not a benchmark result (no throughput or latency metrics)")
        runs.append(Run(source, obj))
    return runs


def baseline_document(runs: list[Run]) -> dict[str, Any]:
    """A baseline holding `runs`, without the per-request lists a detailed vLLM result carries."""
    return {
        "kind": BASELINE_KIND,
        "schema_version": 1,
        "runs": [{key: value for key, value in run.data.items() if not isinstance(value, list)} for run in runs],
    }


def write_baseline(runs: list[Run], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(baseline_document(runs), indent=2) + "\n")
    partial.replace(path)


def config_differences(runs: list[Run], others: list[Run], ignore: tuple[str, ...] = ()) -> list[str]:
    """Lines naming each model or workload setting in which `others` differ from the first of `runs`."""
    reference = runs[0]
    ref_identity = _without(reference.identity(), ignore)
    lines = []
    for other in others:
        identity = _without(other.identity(), ignore)
        for key in sorted(ref_identity.keys() | identity.keys()):
            mine, theirs = ref_identity.get(key, "(absent)"), identity.get(key, "(absent)")
            if mine != theirs:
                lines.append(f"{key}: {_show(mine)} in {reference.source}, {_show(theirs)} in {other.source}")
    return lines


def _parse_json_objects(path: Path, text: str) -> list[Any]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as whole_error:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise ResultError(f"{path}: not valid JSON ({whole_error})") from None
        objects = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ResultError(f"{path}: not valid JSON or JSON lines (line {number}: {exc})") from None
        return objects
    return parsed if isinstance(parsed, list) else [parsed]


def _looks_like_result(obj: dict[str, Any]) -> bool:
    return any(key.endswith("_throughput") or key.endswith("_ms") for key in obj)


def _flatten(mapping: dict[str, Any], prefix: str) -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _without(identity: dict[str, Any], ignore: tuple[str, ...]) -> dict[str, Any]:
    """`ignore` names keys with or without the `config.` prefix; a name also drops the keys nested under it."""
    names = {name for key in ignore for name in (key, f"config.{key}")}
    return {
        key: value for key, value in identity.items()
        if not any(key == name or key.startswith(name + ".") for name in names)
    }


def _show(value: Any) -> str:
    return value if value == "(absent)" else json.dumps(value)
