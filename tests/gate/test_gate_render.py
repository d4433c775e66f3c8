from __future__ import annotations

from infertrace.gate.bounds import Bound, Kind
from infertrace.gate.check import GateConfig, evaluate
from infertrace.gate.render import markdown, rows
from infertrace.gate.results import Run


def report():
    current = [Run(f"c{i}", {"output_throughput": v, "p99_ttft_ms": t, "failed": 0})
               for i, (v, t) in enumerate([(1190.0, 430.0), (1210.0, 445.0), (1200.0, 440.0)])]
    baseline = [Run("b", {"output_throughput": 1250.0, "p99_ttft_ms": 400.0, "failed": 0})]
    bounds = [Bound("output_throughput", Kind.MAX_DROP, 0.05, relative=True),
              Bound("p99_ttft_ms", Kind.MAX_RISE, 20.0), Bound("failed", Kind.MAX, 0.0)]
    return evaluate(current, baseline, bounds, GateConfig(confidence=0.9))


def test_rows_carry_units_signs_and_verdicts():
    assert rows(report()) == [
        ("output_throughput", "ok", "-4.0%", "[-4.8%, -3.2%]", "≥ -5%", "1,250 tok/s", "1,200 tok/s"),
        ("p99_ttft_ms", "regression", "+40.00 ms", "[+30.00, +50.00] ms", "≤ +20 ms", "400.0 ms", "440.0 ms"),
        ("failed", "ok", "-", "[0.00, 0.00]", "≤ 0", "-", "0.00"),
    ]


def test_markdown_is_a_table_with_a_headline_and_the_method():
    text = markdown(report())
    lines = text.splitlines()
    assert lines[0] == "### infertrace gate: regression"
    assert lines[2] == "| metric | verdict | change | 90% interval | allowed | baseline | current |"
    assert lines[5] == (
        "| `p99_ttft_ms` | **regression** | +40.00 ms | [+30.00, +50.00] ms | ≤ +20 ms | 400.0 ms | 440.0 ms |"
    )
    assert "3 runs against 1 baseline run; medians with 90% bootstrap intervals (2000 resamples, seed 0)" in text
