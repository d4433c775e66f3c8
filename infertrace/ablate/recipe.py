"""Ablation recipes: one model, one workload and an ordered list of phases, each a set of engine-config overrides.

A recipe is YAML (docs/ablate.md). Loading checks every key and reports the first problem as one line that names
the file and line. The engine overrides of a phase are checked too, but a phase whose overrides make no valid
engine config is kept, with its reason, so that `ablate` reports it in its row and still runs the others.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infertrace import input_files
from infertrace.config_fields import FieldError, parse_overrides

RECIPE_KEYS = ("name", "description", "model", "preset", "engine", "workload", "profile", "phases")
# the workload's keys are fields of the load generator's BenchConfig, with its defaults except WORKLOAD_DEFAULTS
_WORKLOAD_TYPES = {"dataset": str, "dataset_path": str, "num_prompts": int, "input_len": int, "output_len": int,
                   "range_ratio": float, "prefix_len": int, "num_prefixes": int, "concurrency": int,
                   "request_rate": float, "burstiness": float, "seed": int, "warmup": int, "ignore_eos": bool,
                   "temperature": float, "time_scale": float, "token_scale": float}
_WORKLOAD_OPTIONAL = ("output_len", "concurrency", "request_rate", "dataset_path")
WORKLOAD_KEYS = tuple(_WORKLOAD_TYPES)
# every phase generates exactly output_len tokens per request, so tok/s compares like with like
WORKLOAD_DEFAULTS = {"ignore_eos": True}
PROFILE_KEYS = ("enabled", "steps", "activities")
PHASE_KEYS = ("name", "overrides", "tuning", "reset")
DEFAULT_PRESET = "tiny"
DEFAULT_PROFILE_STEPS = 16
# --quick: caps that shrink any recipe's workload to a smoke test of a few seconds per phase
QUICK_WORKLOAD = {"num_prompts": 4, "concurrency": 2, "input_len": 32, "output_len": 8, "prefix_len": 32,
                  "num_prefixes": 2, "warmup": 1}
QUICK_PROFILE_STEPS = 4
MAX_RECIPE_BYTES = 1 << 20


class RecipeError(ValueError):
    """The recipe cannot be used; the message is one line naming the file (and line) at fault."""


@dataclass(slots=True)
class Phase:
    """One phase as written: its own overrides, applied on top of the previous phase's (or the base with reset)."""

    name: str
    overrides: dict[str, Any]
    reset: bool = False
    line: int | None = None
    override_lines: dict[str, int] = field(default_factory=dict)
    # kernel tuning rules set instead of what they pick (engine/kernels/tuning.py RULES), carried on like overrides
    tuning: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PlannedPhase:
    """A phase with the engine overrides it runs with: the base, then every phase's since the last reset."""

    index: int
    name: str
    overrides: dict[str, Any]  # this phase's own
    config: dict[str, Any]  # what the engine gets
    error: str | None  # why these overrides make no valid engine config (the phase then fails in its row)
    # why this phase cannot be measured on this machine (ablate/device.py): it is then not run
    not_applicable: str | None = None
    tuning: dict[str, Any] = field(default_factory=dict)  # the kernel rules it runs with, its own and inherited


@dataclass(slots=True)
class ProfileSpec:
    enabled: bool = False
    steps: int = DEFAULT_PROFILE_STEPS  # engine steps captured per phase, from the first full decode batch
    activities: tuple[str, ...] = ("CPU", "GPU")


@dataclass(slots=True)
class Recipe:
    path: Path
    name: str
    description: str = ""
    model: str | None = None  # a model directory; None: `preset`
    preset: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # base overrides for every phase
    workload: dict[str, Any] = field(default_factory=dict)  # BenchConfig fields
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    phases: list[Phase] = field(default_factory=list)
    lines: dict[tuple, int] = field(default_factory=dict, repr=False)  # key path -> line in the file

    def where(self, *key) -> str:
        return located(self.path, self.lines, key)

    def bench_config(self):
        """The workload as the load generator's config (closed loop at the recipe's concurrency)."""
        from infertrace.load.config import BenchConfig

        return BenchConfig(**{**WORKLOAD_DEFAULTS, **self.workload})

    def plan(self) -> list[PlannedPhase]:
        """Every phase with its effective overrides and, where they are not a valid engine config, why."""
        from infertrace.engine.config import EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        planned = []
        current: dict[str, Any] = {}
        rules: dict[str, Any] = {}
        origin: dict[str, tuple[Phase, int | None]] = {}
        for i, phase in enumerate(self.phases):
            if phase.reset:
                current, origin, rules = {}, {}, {}
            rules = {**rules, **phase.tuning}
            for key, value in phase.overrides.items():
                current[key] = value
                origin[key] = (phase, phase.override_lines.get(key))
            config = {**self.engine, **current}
            error = None
            try:
                parse_overrides(EngineConfig, current, "engine config")  # each key a field, each value of its type
                EngineConfig.from_overrides(config)
            except ValueError as exc:
                culprit = exc.name if isinstance(exc, FieldError) else _culprit(exc, current)
                site = origin[culprit] if culprit else (phase, phase.line)
                hint = _quote_hint(current[culprit]) if culprit in known else ""
                error = self._at(phase, site, f"{exc}{hint}")
            planned.append(PlannedPhase(i, phase.name, dict(phase.overrides), config, error, tuning=rules))
        return planned

    def _at(self, phase: Phase, site: tuple[Phase, int | None], message: str) -> str:
        owner, line = site
        where = f"{self.path}:{line}" if line else str(self.path)
        inherited = f" (set in phase {owner.name!r})" if owner is not phase else ""
        return f"{where}: {message}{inherited}"

    def with_changes(self, model: str | None = None, preset: str | None = None, quick: bool = False,
                     workload: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
                     profile: bool | None = None, profile_steps: int | None = None) -> Recipe:
        """The recipe with command-line changes applied: another model, a shrunk or changed workload, more base
        overrides, profiling on or off. Raises RecipeError when the result is not valid."""
        if model is not None and preset is not None:
            raise RecipeError("give --model or --preset, not both")
        if preset is not None:
            _check_preset(preset, "--preset")
        load = dict(self.workload)
        if quick:
            from infertrace.load.config import DEFAULT_CONCURRENCY

            load.setdefault("concurrency", DEFAULT_CONCURRENCY)
            for key, cap in QUICK_WORKLOAD.items():
                if key in load and load[key] is not None:
                    load[key] = min(load[key], cap)
                elif key != "concurrency":
                    load[key] = cap
        load.update(workload or {})
        prof = dataclasses.replace(self.profile)
        if quick:
            prof.steps = min(prof.steps, QUICK_PROFILE_STEPS)
        if profile is not None:
            prof.enabled = profile
        if profile_steps is not None:
            if profile_steps < 1:
                raise RecipeError(f"--profile-steps must be at least 1, got {profile_steps}")
            prof.steps, prof.enabled = profile_steps, True
        base = {**self.engine, **(engine or {})}
        _check_engine(base, lambda key: f"--engine-opt {key}" if key in (engine or {}) else self.where("engine", key))
        if model is not None:
            model = str(Path(model).expanduser().resolve())
        changed = dataclasses.replace(
            self, model=model if (model or preset) else self.model,
            preset=preset if (model or preset) else self.preset, engine=base, workload=load, profile=prof)
        _check_workload(changed, cli=set(workload or {}) | (set(QUICK_WORKLOAD) if quick else set()))
        return changed


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a recipe file. Raises RecipeError with one line naming the file and line at fault."""
    path = Path(path)
    data, lines = read_yaml(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping (name, model or preset, engine, workload, profile, "
                          "phases)")

    def where(*key) -> str:
        return located(path, lines, key)

    _check_keys(data, RECIPE_KEYS, "recipe", (), where)
    name = data.get("name", path.stem)
    description = data.get("description", "")
    for key, value in (("name", name), ("description", description)):
        if not isinstance(value, str):
            raise RecipeError(f"{where(key)}: {key} must be text, got {value!r}")
    if "model" in data and "preset" in data:
        raise RecipeError(f"{where('preset')}: give model or preset, not both")
    model = data.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise RecipeError(f"{where('model')}: model must be a directory path, got {model!r}")
        given = Path(model).expanduser()
        model = str(given if given.is_absolute() else (path.parent / given).resolve())  # beside the recipe
    preset = data.get("preset")
    if preset is not None:
        _check_preset(preset, where("preset") + ": preset")
    if model is None and preset is None:
        preset = DEFAULT_PRESET

    engine = _mapping(data, "engine", where)
    _check_engine(engine, lambda key: where("engine", key))
    workload = _mapping(data, "workload", where)
    _check_keys(workload, WORKLOAD_KEYS, "workload", ("workload",), where)
    if workload.get("dataset_path"):
        p = Path(str(workload["dataset_path"])).expanduser()
        workload["dataset_path"] = str(p if p.is_absolute() else (path.parent / p).resolve())
    profile = _profile(data.get("profile"), where)
    phases = _phases(data.get("phases"), where, lines)
    recipe = Recipe(path, name, description, model, preset, engine, workload, profile, phases, lines)
    _check_workload(recipe)
    return recipe


def read_yaml(path: Path) -> tuple[Any, dict[tuple, int]]:
    """The document and the 1-based line of every mapping key and list item, by key path. Duplicate keys are an
    error (YAML would silently keep the last one)."""
    text = _recipe_text(path)
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except RecursionError:
        raise RecipeError(f"{path}: not a recipe: nested too deeply") from None
    except _AnchorRefused as exc:
        raise RecipeError(f"{path}:{exc.mark.line + 1}: YAML anchors and aliases (&name, *name) are not "
                          "allowed in a recipe; write the values out") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    if node is None:
        raise RecipeError(f"{path}: the recipe is empty")
    lines: dict[tuple, int] = {}
    try:
        _walk(node, (), lines, path)
    except RecursionError:
        raise RecipeError(f"{path}: not a recipe: nested too deeply") from None
    return data, lines


def _recipe_text(path: Path) -> str:
    """The recipe's UTF-8 text, from a regular file of at most MAX_RECIPE_BYTES (a device or a pipe would be read
    forever)."""
    try:
        return input_files.read_text(path, MAX_RECIPE_BYTES)
    except input_files.InputFileError as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from None


class _AnchorRefused(yaml.YAMLError):
    def __init__(self, mark):
        super().__init__()
        self.mark = mark


class _RecipeLoader(yaml.SafeLoader):
    """A SafeLoader that refuses anchors and aliases before composing them: each alias is expanded in place, so
    a kilobyte of nested aliases ("billion laughs") would build billions of nodes. A recipe never needs one."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _AnchorRefused(event.start_mark)
        return super().compose_node(parent, index)


def check_dataset(recipe: Recipe) -> None:
    """Read the workload's dataset file (sharegpt, jsonl, a trace) the way a run will, without a tokenizer.
    RecipeError with the reader's one line when it is not a readable dataset of that kind. A trace's lengths are
    checked against the model's context by each run, which loads the model."""
    from infertrace.load.workloads.dataset import DatasetError
    from infertrace.load.workloads.prompts import build_specs
    from infertrace.load.workloads.replay import check_lengths, read_trace

    cfg = recipe.bench_config()
    if cfg.dataset not in ("sharegpt", "jsonl", "trace"):
        return
    where = recipe.where("workload", "dataset_path")
    path = Path(cfg.dataset_path)
    if not path.is_file():  # a directory, a device (/dev/zero) or a pipe is never a dataset
        problem = "does not exist" if not path.exists() else "is not a regular file"
        raise RecipeError(f"{where}: dataset_path {path} {problem}")
    try:
        if cfg.dataset == "trace":
            check_lengths(read_trace(path, cfg.time_scale, cfg.token_scale, cfg.num_prompts), None)
        else:
            build_specs(cfg, None, cfg.num_prompts, "check")
    except DatasetError as exc:
        raise RecipeError(f"{where}: {cfg.dataset} dataset: {exc}") from None


def located(path: Path, lines: dict[tuple, int], key: tuple) -> str:
    """`file:line` of a key path (its nearest parent that has a line, else the file alone)."""
    while key and key not in lines:
        key = key[:-1]
    return f"{path}:{lines[key]}" if key in lines else str(path)


def _walk(node, key: tuple, lines: dict[tuple, int], path: Path) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            if name in seen:
                raise RecipeError(f"{path}:{k.start_mark.line + 1}: {name!r} is given twice")
            seen.add(name)
            lines[key + (name,)] = k.start_mark.line + 1
            _walk(v, key + (name,), lines, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[key + (i,)] = item.start_mark.line + 1
            _walk(item, key + (i,), lines, path)


def _culprit(exc: Exception, keys) -> str | None:
    """The key a config's error message is about: messages start with the field's name."""
    return next((k for k in keys if re.match(rf"{re.escape(str(k))}\b", str(exc))), None)


def _quote_hint(value) -> str:
    """YAML reads a bare off/on/no/yes as a boolean: say so where text was meant."""
    return "; YAML reads off, on, no and yes as true/false: quote the word ('off')" if isinstance(value, bool) else ""


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(mapping: dict, allowed: tuple[str, ...], what: str, parent: tuple, where) -> None:
    for key in mapping:
        if key not in allowed:
            raise RecipeError(f"{where(*parent, key)}: unknown {what} field {key!r}{_suggest(key, allowed)}; "
                              f"known: {', '.join(allowed)}")


def _mapping(data: dict, key: str, where) -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecipeError(f"{where(key)}: {key} must be a mapping of field: value, got {value!r}")
    return dict(value)


def _check_preset(preset, label: str) -> None:
    from infertrace.modelgen.presets import PRESETS

    if preset not in PRESETS:
        raise RecipeError(f"{label} must be one of {', '.join(PRESETS)}, got {preset!r}")


def _check_engine(engine: dict, where) -> None:
    """Base overrides apply to every phase: an unknown field or a bad value there is an error of the recipe."""
    from infertrace.engine.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    try:
        parse_overrides(EngineConfig, engine, "engine config")  # each key a field, each value of its type
        EngineConfig.from_overrides(engine)
    except ValueError as exc:
        culprit = exc.name if isinstance(exc, FieldError) else _culprit(exc, engine)
        hint = _quote_hint(engine[culprit]) if culprit in known else ""
        raise RecipeError(f"{where(culprit) if culprit else where(next(iter(engine)))}: {exc}{hint}") from None


def _check_workload(recipe: Recipe, cli: set[str] = frozenset()) -> None:
    from infertrace.load.config import DATASETS

    dataset = recipe.workload.get("dataset", "random")
    if dataset not in DATASETS:
        raise RecipeError(f"{recipe.where('workload', 'dataset')}: dataset must be one of {', '.join(DATASETS)}, "
                          f"got {dataset!r}")
    for key, value in recipe.workload.items():
        if key == "dataset":
            continue
        kind = _WORKLOAD_TYPES[key]
        if value is None and key in _WORKLOAD_OPTIONAL:
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        else:
            ok = isinstance(value, str) and bool(value)
        if not ok:
            expected = {bool: "true or false", int: "an integer", float: "a number", str: "a path"}[kind]
            raise RecipeError(f"{_site(recipe, key, cli)}: {key} must be {expected}, got {value!r}")
    try:
        recipe.bench_config()
    except ValueError as exc:
        culprit = _culprit(exc, recipe.workload)
        raise RecipeError(f"{_site(recipe, culprit, cli)}: workload: {exc}") from None


def _site(recipe: Recipe, key: str | None, cli: set[str]) -> str:
    if key in cli:
        return f"--{key.replace('_', '-')}"
    return recipe.where("workload", key) if key else recipe.where("workload")


def _profile(value, where) -> ProfileSpec:
    if value is None:
        return ProfileSpec()
    if isinstance(value, bool):
        return ProfileSpec(enabled=value)
    if not isinstance(value, dict):
        raise RecipeError(f"{where('profile')}: profile must be true, false or a mapping (enabled, steps, "
                          f"activities), got {value!r}")
    _check_keys(value, PROFILE_KEYS, "profile", ("profile",), where)
    spec = ProfileSpec(enabled=value.get("enabled", True))
    if not isinstance(spec.enabled, bool):
        raise RecipeError(f"{where('profile', 'enabled')}: enabled must be true or false, got {spec.enabled!r}")
    if "steps" in value:
        steps = value["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise RecipeError(f"{where('profile', 'steps')}: steps must be a positive integer, got {steps!r}")
        spec.steps = steps
    if "activities" in value:
        from infertrace.capture.torch_capture import ACTIVITIES

        acts = value["activities"]
        acts = [acts] if isinstance(acts, str) else acts
        if not isinstance(acts, list) or not acts or any(str(a).upper() not in ACTIVITIES for a in acts):
            raise RecipeError(f"{where('profile', 'activities')}: activities must be a list of "
                              f"{', '.join(ACTIVITIES)}, got {value['activities']!r}")
        spec.activities = tuple(str(a).upper() for a in acts)
    return spec


def _phases(value, where, lines: dict[tuple, int]) -> list[Phase]:
    if not isinstance(value, list) or not value:
        raise RecipeError(f"{where('phases')}: phases must be a non-empty list of {{name, overrides}}")
    phases, names = [], set()
    for i, item in enumerate(value):
        at = ("phases", i)
        if not isinstance(item, dict):
            raise RecipeError(f"{where(*at)}: each phase is a mapping with name and overrides, got {item!r}")
        _check_keys(item, PHASE_KEYS, "phase", at, where)
        name = item.get("name")
        if isinstance(name, (bool, int, float)):
            raise RecipeError(f"{where(*at, 'name')}: a phase name is text, got {name!r}{_quote_hint(name)}")
        if not isinstance(name, str) or not name.strip():
            raise RecipeError(f"{where(*at)}: phase {i + 1} needs a name")
        if name in names:
            raise RecipeError(f"{where(*at, 'name')}: two phases are named {name!r}")
        names.add(name)
        overrides = item.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise RecipeError(f"{where(*at, 'overrides')}: overrides must be a mapping of engine config field: "
                              f"value, got {overrides!r}")
        reset = item.get("reset", False)
        if not isinstance(reset, bool):
            raise RecipeError(f"{where(*at, 'reset')}: reset must be true or false, got {reset!r}")
        override_lines = {k: lines[at + ("overrides", k)] for k in overrides if at + ("overrides", k) in lines}
        tuning = _tuning(item.get("tuning"), at, where)
        phases.append(Phase(name, dict(overrides), reset, lines.get(at), override_lines, tuning))
    return phases


def _tuning(value, at: tuple, where) -> dict[str, Any]:
    """A phase's `tuning:`, rule: value, each a rule of the kernels and a value it can take (a rule is no engine
    setting: it follows from the rank count and shapes, and an experiment overrides it, as here)."""
    from infertrace.engine.kernels.tuning import RULES

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecipeError(f"{where(*at, 'tuning')}: tuning must be a mapping of rule: value, got {value!r}")
    _check_keys(value, tuple(RULES), "tuning rule", (*at, "tuning"), where)
    for rule, chosen in value.items():
        if isinstance(chosen, bool) or chosen not in RULES[rule]:
            raise RecipeError(f"{where(*at, 'tuning', rule)}: {rule} takes {', '.join(map(str, RULES[rule]))}, got "
                              f"{chosen!r}{_quote_hint(chosen)}")
    return dict(value)
