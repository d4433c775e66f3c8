"""Bounds a gate checks, parsed from `METRIC=LIMIT` specs such as `output_throughput=5%` or `p99_ttft_ms=+20ms`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

# A limit: an optional sign, a number, then a percent sign or a unit.
_LIMIT = re.compile(r"^\+?(?P<number>-?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?)\s*(?P<unit>%|[a-z/]+)?$")
_TIME_UNITS_IN_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


class Kind(Enum):
    MAX_DROP = "max-drop"  # may fall at most LIMIT below the baseline
    MAX_RISE = "max-rise"  # may rise at most LIMIT above the baseline
    MIN = "min"  # must stay at or above LIMIT
    MAX = "max"  # must stay at or below LIMIT


@dataclass(frozen=True)
class Bound:
    metric: str
    kind: Kind
    limit: float  # a fraction of the baseline when `relative`, else in the metric's own unit
    relative: bool = False

    @property
    def needs_baseline(self) -> bool:
        return self.kind in (Kind.MAX_DROP, Kind.MAX_RISE)

    @property
    def is_floor(self) -> bool:
        """True when the checked quantity must stay at or above the threshold, False when at or below it."""
        return self.kind in (Kind.MAX_DROP, Kind.MIN)

    @property
    def threshold(self) -> float:
        """The checked quantity (relative change, absolute change, or value) must stay on the allowed side of this."""
        return -self.limit if self.kind is Kind.MAX_DROP else self.limit

    def allowed(self) -> str:
        """The allowed region of the checked quantity, in the sign convention of the change: `≥ -5%`, `≤ +20 ms`."""
        relation = "≥" if self.is_floor else "≤"
        if self.relative:
            return f"{relation} {self.threshold * 100:+g}%"
        unit = metric_unit(self.metric)
        number = f"{self.threshold:+g}" if self.needs_baseline else f"{self.threshold:g}"
        return f"{relation} {number}" + (f" {unit}" if unit else "")


def metric_unit(metric: str) -> str:
    """The unit of a result metric, inferred from its name as `vllm bench serve` names them ('' when unitless)."""
    if metric.endswith("_ms") or "_ms_per_" in metric:
        return "ms"
    if metric == "duration":
        return "s"
    if metric in ("request_throughput", "goodput", "request_goodput"):
        return "req/s"
    if metric.endswith("_throughput"):
        return "tok/s"
    return ""


def higher_is_better(metric: str) -> bool | None:
    """Which way a metric improves, where its name says so (None when it does not)."""
    if metric_unit(metric) in ("ms", "s") or metric == "failed":
        return False
    if metric.endswith(("throughput", "goodput")) or metric == "completed":
        return True
    return None


def parse_bounds(kind: Kind, specs: tuple[str, ...]) -> list[Bound]:
    """Bounds of one kind from specs like `a=5%,b=+20ms`; raises ValueError with a one-line reason."""
    bounds = []
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            bounds.append(_parse_one(kind, item))
    return bounds


def _parse_one(kind: Kind, item: str) -> Bound:
    metric, sep, limit_text = item.partition("=")
    metric, limit_text = metric.strip(), limit_text.strip().replace(" ", "")
    if not sep or not metric or not limit_text:
        raise ValueError(f"'{item}' is not METRIC=LIMIT")
    match = _LIMIT.match(limit_text)
    if match is None:
        raise ValueError(f"'{limit_text}' in '{item}' is not a number, a percentage or a number with a unit")
    number, unit = float(match["number"]), match["unit"]
    if not math.isfinite(number):  # 1e400 reads as inf, which the pattern refuses when spelled out
        raise ValueError(f"'{item}': the limit {match['number']} is out of range; give a finite number")
    if kind in (Kind.MAX_DROP, Kind.MAX_RISE) and number < 0:
        raise ValueError(f"'{item}': a {kind.value} limit cannot be negative")
    if unit == "%":
        if kind in (Kind.MIN, Kind.MAX):
            raise ValueError(f"'{item}': --{kind.value} takes a value, not a percentage (use --max-drop/--max-rise)")
        return Bound(metric, kind, number / 100, relative=True)
    return Bound(metric, kind, _convert(metric, number, unit, item))


def _convert(metric: str, number: float, unit: str | None, item: str) -> float:
    if unit is None:
        return number
    own = metric_unit(metric)
    if own in ("ms", "s") and unit in _TIME_UNITS_IN_MS:
        return number * _TIME_UNITS_IN_MS[unit] / _TIME_UNITS_IN_MS[own]
    if unit == own:
        return number
    known = f"is in {own}" if own else "has no unit"
    raise ValueError(f"'{item}': unit '{unit}' does not fit {metric}, which {known}")

