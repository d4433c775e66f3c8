"""The figures of a --structured run: valid / invalid / total outputs, the server's refusals, and TTFT, ITL and E2EL
of the constrained requests beside the unconstrained ones of the same run."""

from __future__ import annotations

from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics
from infertrace.load.workloads.structured import StructuredPlan


def structured_figures(plan: StructuredPlan, results: list[RequestResult]) -> dict:
    """Valid, invalid and total constrained outputs, the first reasons, and TTFT and ITL of the constrained requests
    beside the unconstrained ones of the same run (docs/bench.md, "Structured output and tool calls")."""
    constrained, free, reasons, refusals = [], [], {}, []
    valid = invalid = 0
    for r in results:
        verdict = plan.verdict(r)
        if verdict is None:
            free.append(r)
            continue
        constrained.append(r)
        if not r.success:
            if r.error.startswith("HTTP 4"):  # the server would not constrain it (infertrace serve: 400)
                refusals.append(r.error)
            continue
        r.structured_violation = verdict
        if verdict:
            invalid += 1
            reasons.setdefault(verdict.split(" ", 1)[-1] if verdict.startswith("$") else verdict, r.index)
        else:
            valid += 1

    def latencies(group: list[RequestResult]) -> dict:
        m = compute_metrics(group)
        return {"requests": len(group), "completed": m.completed,
                **{f"{stat}_{name}_ms": getattr(getattr(m, name), stat) for name in ("ttft", "itl", "e2el")
                   for stat in ("median", "p99")}}

    return {"structured": {
        "mode": plan.mode, **({"tool_choice": plan.tool_choice} if plan.mode == "tools" else {}),
        "schemas": "generated" if not plan.schemas else len(plan.schemas), "share": plan.share,
        "valid": valid, "invalid": invalid, "total": valid + invalid,
        "invalid_examples": dict(list(reasons.items())[:5]),
        "refused": len(refusals), "refused_example": refusals[0] if refusals else None,
        "constrained": latencies(constrained), "unconstrained": latencies(free),
    }, "structured_valid": valid, "structured_invalid": invalid, "structured_total": valid + invalid}


def refusal_line(figures: dict) -> str | None:
    """One line when the server refused constrained requests, in its own words."""
    if not figures["refused"]:
        return None
    return (f"the server refused structured output ({figures['mode']}) on {figures['refused']} of "
            f"{figures['constrained']['requests']} constrained requests: {figures['refused_example']}")


def structured_table(figures: dict):
    """The valid / invalid / total outputs and the constrained requests' TTFT and ITL beside the unconstrained."""
    from rich.table import Table

    s = figures
    t = Table(title=f"structured output ({s['mode']}{', tool_choice ' + s['tool_choice'] if 'tool_choice' in s else ''})",
              title_justify="left")
    for column in ("requests", "outputs valid / invalid / total", "TTFT median / p99 (ms)",
                   "ITL median / p99 (ms)"):
        t.add_column(column, justify="right")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for label, group in (("constrained", s["constrained"]), ("unconstrained", s["unconstrained"])):
        if not group["requests"]:
            continue
        counts = f"{s['valid']} / {s['invalid']} / {s['total']}" if label == "constrained" else "-"
        t.add_row(f"{label}: {group['requests']}", counts,
                  f"{num(group['median_ttft_ms'])} / {num(group['p99_ttft_ms'])}",
                  f"{num(group['median_itl_ms'])} / {num(group['p99_itl_ms'])}")
    return t
