"""A phase's profile reduced to the waterfall's columns, on synthetic Kineto traces with known answers."""

import gzip
import json

import pandas as pd
import pytest

from infertrace.ablate.profile import analyze_profile, count_in_steps, leaf_ops


def _write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    return path


def _x(cat, name, ts, dur, tid=1, pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _kernel(name, ts, dur, corr):
    return _x("kernel", name, ts, dur, tid=7, pid=0, correlation=corr, stream=7, device=0)


def _launch(name, ts, corr):
    return _x("cuda_runtime", name, ts, 4, correlation=corr)


def gpu_trace(path):
    """Two decode steps: three kernels from three launches, then the same three kernels from one graph launch."""
    return _write(path, [
        _x("user_annotation", "step[DECODE bs=2]", 0, 100),
        _x("cpu_op", "aten::mm", 8, 12), _x("cpu_op", "aten::empty", 9, 1),  # mm encloses empty: one leaf
        _launch("cudaLaunchKernel", 10, 1), _kernel("gemm_a", 20, 10, 1),
        _launch("cudaLaunchKernel", 30, 2), _kernel("attn_b", 40, 10, 2),
        _launch("cudaLaunchKernel", 50, 3), _kernel("norm_c", 60, 10, 3),
        _x("user_annotation", "step[DECODE bs=2]", 200, 50),
        _launch("cudaGraphLaunch", 210, 4),
        _kernel("gemm_a", 220, 5, 4), _kernel("attn_b", 230, 5, 4), _kernel("norm_c", 240, 5, 4),
        _x("user_annotation", "step[PREFILL bs=2 toks=64]", 400, 10),
    ])


def test_gpu_trace_gives_kernels_launches_and_idle_share(tmp_path):
    gpu_trace(tmp_path / "t" / "ablate.1.pt.trace.json.gz")
    figures = analyze_profile(tmp_path / "t")
    assert figures.has_gpu and figures.steps == 3 and figures.decode_steps == 2
    assert figures.kernels_per_decode_step == 3.0  # graph-replayed kernels count as kernels
    assert figures.launches_per_decode_step == 2.0  # (3 + 1) / 2: the graph is one launch
    assert figures.gpu_idle_share == pytest.approx(1 - (30 + 15) / (100 + 50 + 10))
    assert figures.cpu_ops_per_decode_step == 0.5  # one leaf op in two decode steps
    assert figures.decode_step_p50_ms == pytest.approx(0.075)
    assert figures.decode_spacing_p50_ms == pytest.approx(0.175)  # last kernels at 70 and 245 us
    assert figures.attention_kernels_per_decode_step == 1.0  # attn_b, once a step
    assert {p["type"] for p in figures.phases} == {"DECODE", "PREFILL"}
    json.dumps(figures.to_json(), allow_nan=False)


def test_cpu_trace_counts_operators_instead_of_kernels(tmp_path):
    _write(tmp_path / "c" / "ablate.2.pt.trace.json.gz", [
        _x("user_annotation", "step[DECODE bs=1]", 0, 100),
        _x("cpu_op", "aten::linear", 1, 20), _x("cpu_op", "aten::mm", 2, 10), _x("cpu_op", "aten::add", 30, 5),
        _x("cpu_op", "aten::add", 150, 5),  # outside every step
    ])
    figures = analyze_profile(tmp_path / "c")
    assert not figures.has_gpu
    assert figures.kernels_per_decode_step is None and figures.gpu_idle_share is None
    assert figures.cpu_ops_per_decode_step == 2.0  # mm and the first add; linear only calls mm


def test_a_capture_without_steps_is_an_error(tmp_path):
    _write(tmp_path / "n" / "x.pt.trace.json.gz", [_x("cpu_op", "aten::add", 0, 5)])
    with pytest.raises(ValueError, match="no engine step"):
        analyze_profile(tmp_path / "n")


def test_leaf_ops_and_counting_respect_threads():
    ops = pd.DataFrame({"ts_ns": [0, 1, 5, 0], "dur_ns": [10, 2, 2, 3], "pid": [1, 1, 1, 1], "tid": [1, 1, 1, 2]})
    leaves = leaf_ops(ops)
    assert sorted(zip(leaves["ts_ns"], leaves["tid"])) == [(0, 2), (1, 1), (5, 1)]
    steps = pd.DataFrame({"ts_ns": [0, 4], "end_ns": [4, 8], "pid": [1, 1], "tid": [1, 1]})
    assert count_in_steps(leaves, steps).tolist() == [1, 1]  # the op on thread 2 belongs to no step
