"""The cross-rank critical path: per step, the rank and the kernel or collective that gated it, and the what-if."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from infertrace.analyze import analyze_path

AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel"
NORM = "void vllm::rms_norm_kernel<c10::BFloat16, 8, 2>(c10::BFloat16*, long)"


def _rank(make_events, ops):
    """One DECODE step from 0 to 200 us; `ops` are (name, start, duration) GPU kernels, each launched at 1 us."""
    spec = [("user_annotation", "step[DECODE bs=2]", 0, 200, 100, {})]
    for corr, (name, start, dur) in enumerate(ops, start=1):
        spec.append(("cuda_runtime", "cudaLaunchKernel", corr, 0.5, 100, {"correlation": corr}))
        spec.append(("kernel", name, start, dur, 7, {"stream": 7, "correlation": corr}))
    return make_events(spec)


@pytest.fixture()
def two_ranks(tmp_path, make_trace, make_events):
    # rank 1 reaches the first all-reduce 15 us after rank 0; rank 0 reaches the second 10 us after rank 1
    make_trace(tmp_path / "rank0.json", _rank(make_events, [(GEMM, 10, 100), (AR, 110, 20), (GEMM, 130, 50),
                                                            (AR, 180, 10), (NORM, 190, 10)]), rank=0)
    make_trace(tmp_path / "rank1.json", _rank(make_events, [(GEMM, 10, 115), (AR, 125, 5), (GEMM, 130, 40),
                                                            (AR, 170, 20), (NORM, 190, 10)]), rank=1)
    return tmp_path


def test_critical_path_through_the_collectives(two_ranks):
    report = analyze_path(two_ranks)
    path = report.tables["critical_path"]
    assert len(path) == 1
    step = path.iloc[0].to_dict()
    # segments: rank 0 110, 50, 10 us; rank 1 125, 40, 10 us; transfers: the shorter side of each all-reduce
    assert step["collectives"] == 2
    assert step["critical (ms)"] == pytest.approx((125 + 50 + 10 + 5 + 10) / 1000)
    assert step["transfer (ms)"] == pytest.approx(15 / 1000)
    assert step["path"] == "1,0,0"
    # rank 1 is 7.5 us over the median in the first segment, rank 0 5 us in the second
    assert step["gating rank"] == 1
    assert (step["gate kind"], step["gate rank"], step["gate (ms)"]) == ("segment", 1, pytest.approx(0.125))
    assert step["gate"].startswith("sm90_xmma_gemm")
    # rank 1 at the median's speed: the first segment takes 117.5 us instead of 125
    assert step["what-if saved (ms)"] == pytest.approx(7.5 / 1000)
    summary = report.tables["critical_summary"].iloc[0].to_dict()
    assert (summary["type"], summary["steps"], summary["gating rank"], summary["gating share"]) == \
        ("DECODE", 1, 1, 1.0)


def test_critical_path_in_terminal_json_and_html(two_ranks, tmp_path):
    import json

    from click.testing import CliRunner

    from infertrace.analyze.command import analyze

    out = tmp_path / "out"
    result = CliRunner().invoke(analyze, [str(two_ranks), "--json", str(out / "r.json"), "--html",
                                          str(out / "r.html")], catch_exceptions=False, terminal_width=250)
    assert result.exit_code == 0, result.output
    assert "Cross-rank critical path by step type" in result.stdout
    assert "segment on rank 1: sm90_xmma_gemm" in result.stdout
    doc = json.loads((out / "r.json").read_text())
    assert doc["tables"]["critical_path"][0]["gating rank"] == 1
    html = (out / "r.html").read_text()
    assert "Cross-rank critical path by step type" in html and "Critical path of each step" in html


def test_one_rank_gives_the_path_through_its_own_collectives(traces):
    report = analyze_path(traces / "tracelens" / "vllm_tp8_b200_rank0")
    step = report.tables["critical_path"].iloc[0]
    assert step["collectives"] == 74  # the multimem all-reduce kernels, not named nccl
    assert step["gating rank"] == 0 and "what-if saved (ms)" not in step  # no other rank's median to run at
    # a CPU-bound prefill: its longest segment is the GPU waiting for launches, named for the host
    assert step["gate"].startswith("host (GPU busy ") and "longest kernel fmhaSm100aKernel" in step["gate"]
    # the path is the whole step: its segments and the all-reduces' transfers
    assert step["critical (ms)"] == pytest.approx(report.tables["steps"].iloc[0]["step_ms"], rel=1e-6)


def _walked_segments(step_of, ts, end, is_comm, names, start, stop, types) -> pd.DataFrame:
    """critical.segments, one step and one segment at a time (how it was first written)."""
    from infertrace.analyze.critical import PATH_COLUMNS
    from infertrace.analyze.intervals import covered, union

    rows = []
    bounds = np.searchsorted(step_of, np.arange(len(start) + 1))
    for k in range(len(start)):
        lo, hi = bounds[k], bounds[k + 1]
        comm = (np.flatnonzero(is_comm[lo:hi]) + lo).tolist()
        seg_start = int(start[k])
        for j in range(len(comm) + 1):
            a = lo if j == 0 else comm[j - 1] + 1
            b = comm[j] if j < len(comm) else hi
            arrive = int(ts[comm[j]]) if j < len(comm) else int(max(stop[k], seg_start))
            if b > a:
                longest = a + int(np.argmax(end[a:b] - ts[a:b]))
                kernel, kernel_ns = names[longest], int(end[longest] - ts[longest])
                busy_ns = covered(*union(np.maximum(ts[a:b], seg_start), np.minimum(end[a:b], max(arrive, seg_start))))
            else:
                kernel, kernel_ns, busy_ns = "", 0, 0
            coll = (names[comm[j]], int(ts[comm[j]]), int(end[comm[j]] - ts[comm[j]])) if j < len(comm) \
                else ("", -1, 0)
            rows.append((k, types[k], j, seg_start, arrive, max(arrive - seg_start, 0), kernel, kernel_ns, busy_ns,
                         *coll))
            if j < len(comm):
                seg_start = int(end[comm[j]])
    return pd.DataFrame(rows, columns=PATH_COLUMNS)


def test_segments_at_once_equal_walking_each_step():
    from infertrace.analyze.critical import segments

    rng = np.random.default_rng(1)
    for _ in range(300):
        n_steps = int(rng.integers(1, 6))
        n_ops = int(rng.integers(0, 40))
        step_of = np.sort(rng.integers(0, n_steps, n_ops))
        ts = np.empty(n_ops, dtype=np.int64)
        for k in range(n_steps):  # in time order within each step, on overlapping streams
            pick = step_of == k
            ts[pick] = np.sort(rng.integers(k * 1000, k * 1000 + 900, pick.sum()))
        end = ts + rng.integers(0, 120, n_ops)  # kernels of 0 ns too
        is_comm = rng.random(n_ops) < 0.3
        names = np.array([f"k{i % 7}" for i in range(n_ops)], dtype=object)
        start = np.arange(n_steps, dtype=np.int64) * 1000 + rng.integers(-50, 50, n_steps)
        stop = start + rng.integers(100, 1100, n_steps)  # some steps end before their last ops
        types = np.array(["DECODE", "PREFILL"] * 3, dtype=object)[:n_steps]
        got = segments(step_of, ts, end, is_comm, names, start, stop, types)
        want = _walked_segments(step_of, ts, end, is_comm, names, start, stop, types)
        pd.testing.assert_frame_equal(got, want)
