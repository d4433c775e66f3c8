"""Benchmark runs as the gate reads them: `infertrace bench --result-json` files, `vllm bench serve` result files
(one JSON object, or one per line as `--append-result` writes them), and gate baselines holding several runs."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from infertrace import input_files
from infertrace.output import write_text

BASELINE_KIND = "infertrace-gate-baseline"
MAX_RESULT_BYTES = 4 << 30  # a detailed result of many requests is large, but not this
MAX_DEPTH = 64  # nesting a result may have; results nest a few levels, and deeper ones would exhaust recursion

# Top-level keys of a vLLM result that say which model and workload were run; anything else there is either a
# metric, a per-request list, or free metadata (a commit id, a label) that must not make two runs incomparable.
VLLM_WORKLOAD_KEYS = {
    "model_id", "tokenizer_id", "backend", "endpoint_type", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "dataset_name", "dataset_path", "input_len", "output_len",
}
VLLM_WORKLOAD_PREFIXES = ("random_", "sharegpt_", "sonnet_", "prefix_", "hf_", "custom_", "ramp_up_")
# Settings of `infertrace bench` that say where its outputs go, not what it measured.
# settings that change how a run is observed or sent, not what the server is asked to do
OUTPUT_SETTINGS = ("result_json", "requests_jsonl", "plot", "report", "scrape_interval_s", "metrics_url", "workers",
                   "ray_address")
# Settings that may hold a local path: an absolute or ./ path is compared by its last part, so that checkouts in
# different directories (a developer's machine, a CI runner) still compare.
PATH_SETTINGS = ("model", "tokenizer", "dataset_path", "model_id", "tokenizer_id")

# Figures the gate derives from a result that does not carry them: name -> (inputs, formula over the inputs).
DERIVED_METRICS = {
    # CPU time of the whole benchmark process (engine included) over the measured window, per output token:
    # unlike wall-clock figures it barely moves when other work shares the machine.
    "cpu_ms_per_output_token": (
        ("process_cpu_percent", "duration", "total_output_tokens"),
        lambda cpu_percent, duration, tokens: cpu_percent / 100 * duration * 1000 / tokens,
    ),
}


# Derived figures that mean what their name says only when the engine ran inside the benchmark process: against a
# --base-url the process is only the load generator, and its CPU time says nothing of the server's.
EMBEDDED_ONLY = frozenset({"cpu_ms_per_output_token"})

_ABSENT = object()  # a setting one run has and the other lacks


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

    @property
    def target_url(self) -> str | None:
        """The server an infertrace run measured (--base-url), None for the bundled engine in-process."""
        config = self.data.get("config")
        url = config.get("base_url") if isinstance(config, dict) else None
        return url if isinstance(url, str) else None

    def metric(self, name: str) -> float:
        if name not in self.data and name in EMBEDDED_ONLY and self.target_url is not None:
            raise ResultError(
                f"{self.source}: '{name}' is the benchmark process's CPU time per output token, and this run "
                f"measured --base-url {self.target_url}, so it would be the load generator's CPU, not the "
                "server's: gate it on runs of the bundled engine in-process (no --base-url)"
            )
        if name not in self.data and name in DERIVED_METRICS:
            inputs, formula = DERIVED_METRICS[name]
            try:
                return formula(*(self.metric(key) for key in inputs))
            except ZeroDivisionError:
                raise ResultError(f"{self.source}: cannot derive '{name}' (a divisor is 0)") from None
        if name not in self.data:
            raise ResultError(f"{self.source} has no metric '{name}'{self._closest(name)}")
        value = self.data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ResultError(f"{self.source}: metric '{name}' is {json.dumps(value)}, not a finite number")
        return float(value)

    def _closest(self, name: str) -> str:
        """` (did you mean 'x'?)` for a mistyped metric, among the run's numeric keys and the derived ones."""
        numeric = [key for key, value in self.data.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)]
        close = difflib.get_close_matches(name, [*numeric, *DERIVED_METRICS], n=1)
        return f" (did you mean '{close[0]}'?)" if close else ""

    def identity(self) -> dict[str, Any]:
        """What makes two runs comparable: the model and workload, as flat dotted keys."""
        if self.flavour == "infertrace":
            settings = {key: value for key, value in self.data["config"].items() if key not in OUTPUT_SETTINGS}
            flavour = "infertrace"
        else:
            settings = {
                key: value for key, value in self.data.items()
                if key in VLLM_WORKLOAD_KEYS or key.startswith(VLLM_WORKLOAD_PREFIXES)
            }
            flavour = "vllm"
        for key in PATH_SETTINGS:
            value = settings.get(key)
            if isinstance(value, str) and value.startswith(("/", ".", "~")):  # a local path, not a hub id
                settings[key] = PurePath(value).name or value
        prefix = "config." if flavour == "infertrace" else ""
        return {"flavour": flavour, **_flatten(settings, prefix)}


def load_runs(path: Path) -> list[Run]:
    """Every run in a result file, a JSON-lines file of results, or a gate baseline."""
    text = _read_regular(path)
    objects = _parse_json_objects(path, text)
    if not objects:
        raise ResultError(f"{path}: holds no benchmark results")
    if len(objects) == 1 and isinstance(objects[0], dict) and objects[0].get("kind") == BASELINE_KIND:
        objects = objects[0].get("runs")
        if not isinstance(objects, list) or not objects:
            raise ResultError(f"{path}: baseline holds no runs")
    runs = []
    for index, obj in enumerate(objects, 1):
        source = str(path) if len(objects) == 1 else f"{path} (run {index})"
        if isinstance(obj, dict) and isinstance(obj.get("sweep"), dict):
            raise ResultError(f"{source} is a sweep ({len(obj.get('runs', []))} points): gate single runs")
        if not isinstance(obj, dict) or not _looks_like_result(obj):
            raise ResultError(f"{source} is not a benchmark result (no throughput or latency metrics)")
        if obj.get("interrupted") is True:
            raise ResultError(f"{source} comes from an interrupted run: its figures cover only part of it")
        runs.append(Run(source, obj))
    return runs


def _read_regular(path: Path) -> str:
    """The text of `path`, which must be a regular file (a symlink to one is fine): a FIFO would be read for ever
    and /dev/zero until memory ran out."""
    try:
        return input_files.read_text(path, MAX_RESULT_BYTES)
    except input_files.InputFileError as exc:
        raise ResultError(f"{path}: {exc}") from None


def baseline_document(runs: list[Run]) -> dict[str, Any]:
    """A baseline holding `runs`, without the per-request lists a detailed vLLM result carries."""
    return {
        "kind": BASELINE_KIND,
        "schema_version": 1,
        "runs": [{key: value for key, value in run.data.items() if not isinstance(value, list)} for run in runs],
    }


def write_baseline(runs: list[Run], path: Path) -> None:
    """Write the baseline (through a temporary file and a rename). ResultError when a run holds a figure that is
    not finite: JSON has no NaN, and the next gate could not compare against it."""
    document = baseline_document(runs)
    for run, kept in zip(runs, document["runs"]):
        if (found := _first_non_finite(kept)) is not None:
            raise ResultError(f"{run.source}: '{found[0]}' is {json.dumps(found[1])}: a baseline records finite "
                              "figures only")
    text = json.dumps(document, indent=2, allow_nan=False) + "\n"
    write_text(path, text)


def _first_non_finite(data: dict[str, Any]) -> tuple[str, float] | None:
    """The dotted key and value of the first NaN or infinite number in `data` (nested dicts and lists included)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return key, value
        if isinstance(value, dict):
            stack.extend(reversed([(f"{key}.{k}" if key else str(k), v) for k, v in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{key}[{i}]", v) for i, v in enumerate(value)]))
    return None


def config_differences(runs: list[Run], others: list[Run], ignore: tuple[str, ...] = ()) -> list[str]:
    """Lines naming each model or workload setting in which `others` differ from the first of `runs`."""
    return _differences(runs[0], others, lambda run: _without(run.identity(), ignore))


def hardware_differences(runs: list[Run], others: list[Run]) -> list[str]:
    """Lines naming the GPU or CPU count, where the results record them, in which `others` differ from `runs[0]`."""
    return _differences(runs[0], others, _hardware)


def _differences(reference: Run, others: list[Run], describe) -> list[str]:
    ref_identity = describe(reference)
    lines = []
    for other in others:
        identity = describe(other)
        for key in sorted(ref_identity.keys() | identity.keys()):
            mine, theirs = ref_identity.get(key, _ABSENT), identity.get(key, _ABSENT)
            if mine != theirs and not _added_at_default(key, mine, theirs):
                lines.append(f"{key}: {_show(mine)} in {reference.source}, {_show(theirs)} in {other.source}")
    return lines


def _added_at_default(key: str, mine: Any, theirs: Any) -> bool:
    """A bench setting one result lacks and the other holds at its default: a result written before the setting
    existed, which ran as the default does."""
    if (mine is _ABSENT) == (theirs is _ABSENT) or not key.startswith("config."):
        return False
    import dataclasses

    from infertrace.load.config import BenchConfig

    field = next((f for f in dataclasses.fields(BenchConfig) if f.name == key[len("config."):]), None)
    if field is None:
        return False
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return False
    present = theirs if mine is _ABSENT else mine
    return json.loads(json.dumps(default, default=str)) == present


def _hardware(run: Run) -> dict[str, Any]:
    provenance = run.data.get("provenance") or {}
    host = provenance.get("host") or {}
    found = {"gpu": provenance.get("gpu"), "cpu_count": host.get("cpu_count")}
    return {key: value for key, value in found.items() if value is not None}


def _parse_json_objects(path: Path, text: str) -> list[Any]:
    objects = _parse_json_text(path, text)
    for obj in objects:
        if _depth(obj) > MAX_DEPTH:
            raise ResultError(f"{path}: JSON nested more than {MAX_DEPTH} levels deep; not a benchmark result")
    return objects


def _depth(value: Any) -> int:
    """How deeply `value` nests (a scalar is 0), found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH:  # deeper is already too deep
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _parse_json_text(path: Path, text: str) -> list[Any]:
    try:
        parsed = _loads(path, text)
    except json.JSONDecodeError as whole_error:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise ResultError(f"{path}: not valid JSON ({whole_error})") from None
        objects = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                objects.append(_loads(path, line, f"line {number}: "))
            except json.JSONDecodeError as exc:
                raise ResultError(f"{path}: not valid JSON or JSON lines (line {number}: {exc})") from None
        return objects
    return parsed if isinstance(parsed, list) else [parsed]


def _loads(path: Path, text: str, where: str = "") -> Any:
    """json.loads, with what it raises besides a syntax error (JSONDecodeError) made one line naming the file."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ResultError(f"{path}: {where}JSON nested more than {MAX_DEPTH} levels deep; not a benchmark "
                          "result") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer past Python's 4,300 digits: no benchmark figure has that many
        raise ResultError(f"{path}: {where}a number too long to read ({str(exc).split(':')[0]})") from None


def _looks_like_result(obj: dict[str, Any]) -> bool:
    return any(key.endswith(("_throughput", "_ms")) for key in obj)


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
    return "(absent)" if value is _ABSENT else json.dumps(value)
