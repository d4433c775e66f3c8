"""Several ranks: communication per rank and step type, the exposed part, and the skew of step ends."""

from __future__ import annotations

import pandas as pd
import pytest

from infertrace.analyze.capture import load_capture
from infertrace.analyze.ranks import step_communication, step_skew
from infertrace.analyze.report import build_report


def test_two_rank_nccl_trace_matches_htas_overlap(traces):
    """The first ProfilerStep is HTA's window (it leaves the last step out): there, communication and the part of
    it computation overlaps are HTA's own figures, to the microsecond."""
    capture = load_capture(traces / "hta-samples" / "two_rank_nccl")
    report = build_report(capture)
    overlap = report.table("overlap").set_index("rank")
    steps = report.table("steps")
    for rank in (0, 1):
        own = steps[steps["rank"] == rank].sort_values("ts_ns").reset_index(drop=True)
        first = step_communication(capture.rank(rank).events, own).iloc[0]
        assert first["comm_ms"] * 1000 == pytest.approx(overlap.loc[rank, "comm_time(us)"], abs=1e-6)
        hidden_us = (first["comm_ms"] - first["exposed_comm_ms"]) * 1000
        assert hidden_us == pytest.approx(overlap.loc[rank, "overlapped_time(us)"], abs=1e-6)
    table = report.table("rank_communication")
    assert list(table["rank"]) == [0, 1] and (table["all-reduce share"] > 0.2).all()
    assert (table["exposed share"] < table["all-reduce share"]).all()
    skew = report.table("step_skew")
    assert skew["steps"].tolist() == [2] and skew["straggler"].tolist() == [1]


def test_skew_by_hand():
    per_rank = {
        0: pd.DataFrame({"type": ["DECODE"] * 3, "ts_ns": [0, 10_000_000, 20_000_000], "step_ms": [5.0, 5.0, 5.0]}),
        1: pd.DataFrame({"type": ["DECODE"] * 3, "ts_ns": [0, 10_000_000, 20_000_000], "step_ms": [6.0, 4.0, 9.0]}),
    }
    per_step, summary = step_skew(per_rank)
    assert per_step["last rank"].tolist() == [1, 0, 1]
    assert per_step["skew (ms)"].tolist() == [1.0, 1.0, 4.0]
    row = summary.iloc[0]
    assert (row["straggler"], row["straggler share"], row["skew max (ms)"], row["skew p50 (ms)"]) == (1, 2 / 3, 4.0, 1.0)


@pytest.fixture(scope="module")
def tp2_capture(tiny_model_dir, tmp_path_factory):
    """A CPU capture of the bundled engine on two tensor-parallel ranks (gloo)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("tp2")
    script = f"""
from infertrace.engine import Engine, EngineConfig, SamplingParams

if __name__ == "__main__":
    engine = Engine({str(tiny_model_dir)!r}, EngineConfig(tensor_parallel_size=2, kv_cache_tokens=2048))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{{i}}", [100 + i] * 20, params)
    engine.step()
    engine.start_profile({str(out)!r}, ("CPU",), label="tp2")
    for _ in range(5):
        engine.step()
    engine.stop_profile()
    engine.shutdown()
"""
    path = out / "run.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    path.unlink()
    return out


def test_our_own_two_rank_cpu_capture(tp2_capture):
    capture = load_capture(tp2_capture)
    assert [r.rank for r in capture.ranks] == [0, 1] and not capture.problems
    report = build_report(capture)
    table = report.table("rank_communication")
    assert table["rank"].tolist() == [0, 1] and table["steps"].tolist() == [5, 5]
    assert (table["all-reduce mean (ms)"] > 0).all()  # gloo collectives count as communication
    assert (table["exposed mean (ms)"] == table["all-reduce mean (ms)"]).all()  # on the stepping thread
    skew = report.table("step_skew").iloc[0]
    assert skew["type"] == "DECODE" and skew["steps"] == 5 and skew["straggler"] in (0, 1)
    assert 0 <= skew["skew p50 (ms)"] <= skew["skew p99 (ms)"] <= skew["skew max (ms)"]
