"""Several ranks: communication per rank and step type, the exposed part, and the skew of step ends."""

from __future__ import annotations

import numpy as np
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


ONE_SHOT = ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16**, "
            "c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)")
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
NCCL_BCAST = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel"
NORM = "triton_red_fused_add_rmsnorm_0"


def _server_rank(make_events, rank: int) -> list[dict]:
    """One rank of `infertrace serve --tensor-parallel-size 2` under load, as its profiler writes it: two DECODE
    steps replayed from a CUDA graph (GEMM, one-shot all-reduce, GEMM, one-shot all-reduce, norm) and one eager
    MIXED step whose large all-reduce goes through NCCL; every step ends with rank 0's sampled tokens broadcast.
    Rank 1's first GEMM of DECODE step 1 is 30 us slower; each all-reduce ends when the later rank arrives + 5 us."""
    spec, corr = [], 0
    for k, kind in enumerate(("DECODE", "DECODE", "MIXED")):
        t = 1000 * k
        label = f"step[{kind} bs=8{' toks=520' if kind == 'MIXED' else ''}{f' #{k}' if rank == 0 else ''}]"
        spec.append(("user_annotation", label, t, 400, 100, {}))
        first = {0: 100, 1: 130 if k == 1 else 100}
        ar = NCCL_AR if kind == "MIXED" else ONE_SHOT
        arrive1 = t + 20 + first[rank]
        end1 = t + 20 + max(first.values()) + 5
        ops = [(GEMM, t + 20, first[rank]), (ar, arrive1, end1 - arrive1), (GEMM, end1, 50),
               (ar, end1 + 50, 5), (NORM, end1 + 55, 10)]
        if kind == "MIXED":  # eager: one launch per kernel
            for name, start, dur in ops:
                corr += 1
                spec.append(("cuda_runtime", "cudaLaunchKernel", start - 10, 2, 100, {"correlation": corr}))
                spec.append(("kernel", name, start, dur, 7, {"stream": 7, "correlation": corr}))
        else:  # one graph launch for the whole forward
            corr += 1
            spec.append(("cuda_runtime", "cudaGraphLaunch", t + 10, 5, 100, {"correlation": corr}))
            spec += [("kernel", name, start, dur, 7, {"stream": 7, "correlation": corr}) for name, start, dur in ops]
        corr += 1
        spec.append(("cuda_runtime", "cudaLaunchKernel", t + 300, 2, 100, {"correlation": corr}))
        spec.append(("kernel", NCCL_BCAST, t + 310, 4, 7, {"stream": 7, "correlation": corr}))
    return make_events(spec)


@pytest.fixture()
def server_capture(tmp_path, make_trace, make_events):
    """A two-rank capture folder as `infertrace serve --tensor-parallel-size 2 --profile-dir` leaves it after
    /stop_profile: one trace per rank named after the capture, with distributedInfo, and beside them the capture's
    manifest, `infertrace profile`'s manifest and the server's request log."""
    folder = tmp_path / "capture-tp2"
    stem = "tp2.1795799207515723220"
    for rank in (0, 1):
        make_trace(folder / f"{stem}.rank{rank}.pt.trace.json.gz", _server_rank(make_events, rank), rank=rank)
    (folder / f"{stem}.manifest.json").write_text('{"label": "tp2", "schema": "infertrace.capture/1"}')
    (folder / "tp2.infertrace.json").write_text('{"url": "http://h", "schema": "infertrace.server-capture/1"}')
    (folder / f"{stem}.request_log.json").write_text(
        '{"clock": "perf_counter", "now": 10.0, "next": 3, "oldest": 0, "oldest_step": 0, "requests": []}')
    return folder


def test_our_own_two_rank_server_capture(server_capture):
    """Ranks come from the files, the one-shot all-reduce kernels (torch symmetric memory) count as
    communication beside NCCL's, and the sidecar files of a server capture are not traces (the request log was
    reported as 'not a Kineto trace; skipped' on every analysis of a server's capture)."""
    capture = load_capture(server_capture)
    assert [(r.rank, r.claimed_rank) for r in capture.ranks] == [(0, 0), (1, 1)]
    assert capture.problems == []
    report = build_report(capture)
    comm = report.table("rank_communication").set_index(["type", "rank"])
    # DECODE, rank 0: one-shot 5 + 5 us (step 0), 35 + 5 us (step 1: it waits 30 us for rank 1), broadcast 4 us
    assert comm.loc[("DECODE", 0), "all-reduce mean (ms)"] == pytest.approx((10 + 40 + 8) / 2 / 1000)
    assert comm.loc[("DECODE", 1), "all-reduce mean (ms)"] == pytest.approx((10 + 10 + 8) / 2 / 1000)
    assert comm.loc[("MIXED", 0), "all-reduce mean (ms)"] == pytest.approx((5 + 5 + 4) / 1000)
    # one stream: nothing computes while a collective runs, so all of it is exposed
    assert (report.table("rank_communication")["exposed share"]
            == report.table("rank_communication")["all-reduce share"]).all()
    overlap = report.table("overlap").set_index("rank")  # HTA's overlap, one-shot kernels counted
    assert overlap.loc[0, "comm_time(us)"] == pytest.approx(10 + 40 + 10 + 3 * 4)
    path = report.table("critical_path")
    assert path["collectives"].tolist() == [3, 3, 3]  # two all-reduces and the broadcast, matched across ranks
    slow = path.iloc[1]
    assert (slow["gating rank"], slow["gate kind"], slow["gate rank"]) == (1, "segment", 1)
    assert slow["gate"].startswith("sm90_xmma_gemm")
    assert slow["what-if saved (ms)"] == pytest.approx(0.015)  # rank 1 at the median of 100 and 130 us
    assert report.table("step_skew")["steps"].tolist() == [2, 1]


def _walked_intersection(a, b):
    """The intersection of two disjoint unions by walking both in time order, one segment at a time."""
    i = j = 0
    out_s, out_e = [], []
    while i < a[0].size and j < b[0].size:
        lo, hi = max(a[0][i], b[0][j]), min(a[1][i], b[1][j])
        if lo < hi:
            out_s.append(lo)
            out_e.append(hi)
        if a[1][i] < b[1][j]:
            i += 1
        else:
            j += 1
    return np.array(out_s, dtype=np.int64), np.array(out_e, dtype=np.int64)


def test_intersection_of_unions_equals_walking_them():
    from infertrace.analyze.intervals import union
    from infertrace.analyze.ranks import _intersection

    rng = np.random.default_rng(0)
    for _ in range(2000):
        n, m = rng.integers(0, 30, 2)
        starts_a, starts_b = rng.integers(0, 200, n), rng.integers(0, 200, m)
        a = union(starts_a, starts_a + rng.integers(0, 20, n))  # lengths of 0 too: a kernel of 0 ns
        b = union(starts_b, starts_b + rng.integers(0, 20, m))
        got, want = _intersection(a, b), _walked_intersection(a, b)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


@pytest.mark.parametrize("steps_of_rank1, words", [
    (2, "the ranks have different numbers of steps (rank 0: 3, rank 1: 2): the cross-rank tables (step skew, "
        "critical path) compare the first 2 steps of each rank; the later steps are left out of them"),
    (0, "the ranks have different numbers of steps (rank 0: 3, rank 1: 0): rank 1 has none and is left out of "
        "the cross-rank tables (step skew, critical path)"),
])
def test_ranks_with_different_step_counts_are_noted(tmp_path, steps_of_rank1, words):
    from infertrace.analyze import analyze_path

    from .conftest import kineto_events, write_kineto

    for rank, count in ((0, 3), (1, steps_of_rank1)):
        spec = [("cpu_op", "aten::mm", 0, 5, 1, {})]
        for k in range(count):
            spec += [("user_annotation", "step[DECODE bs=1]", 100 * k + 10, 50, 1, {}),
                     ("cpu_op", "c10d::allreduce_", 100 * k + 20, 10, 1, {})]
        write_kineto(tmp_path / f"rank{rank}.pt.trace.json", kineto_events(spec), rank=rank)
    report = analyze_path(tmp_path)
    assert words in report.notes
    if steps_of_rank1:
        assert report.tables["step_skew"]["steps"].tolist() == [2]
