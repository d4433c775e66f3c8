"""Inference phases: steps found from engine annotations, with their kernels, GPU time and CPU-bound verdicts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from infertrace.analyze.capture import load_capture
from infertrace.analyze.phases import (
    StepLabel,
    find_steps,
    parse_step_name,
    phase_categories,
    phase_summary,
    step_metrics,
    verdict,
)


@pytest.mark.parametrize("name, label", [
    ("step[PREFILL bs=2 toks=300]", StepLabel("PREFILL", 2, 300)),
    ("step[DECODE bs=16]", StepLabel("DECODE", 16, None)),
    ("step[MIXED bs=9 toks=72]", StepLabel("MIXED", 9, 72)),
    ("step[EXTEND bs=15 toks=15360]", StepLabel("EXTEND", 15, 15360)),
    ("execute_context_1(888_788544)_generation_0(0)", StepLabel("PREFILL", 1, 888)),
    ("execute_context_0(0)_generation_32(32)", StepLabel("DECODE", 32, 32)),
    ("execute_context_2(100_5000)_generation_30(30)", StepLabel("MIXED", 32, 130)),
    ("execute_15360_context_15(sq15360sk15360sqsq15728640sqsk15728640)_generation_0(sq0sk0sqsq0sqsk0)",
     StepLabel("PREFILL", 15, 15360)),
    ("forward", None),
    ("ProfilerStep#5", None),
    ("step[", None),
])
def test_step_names(name, label):
    assert parse_step_name(name) == label


def _steps(path):
    capture = load_capture(path)
    events = capture.ranks[0].events
    return step_metrics(events, find_steps(events))


@pytest.fixture(scope="module")
def sglang(traces):
    return _steps(traces / "tracelens" / "sglang_prefill_decode_mi300x")


def test_sglang_steps_and_categories(sglang):
    # Checked by hand against a plain json pass over the file: one step[EXTEND] range on the scheduler thread
    # (inside a longer execute_15360_context_15(..) wrapper, which is not counted again); the hipLaunchKernel /
    # hipExtModuleLaunchKernel / hipModuleLaunchKernel / hipMemcpyWithStream calls made inside it carry the
    # correlation ids of 524 GPU ops (521 kernels, 3 copies), and the last of them ends 493.63 ms after the
    # step starts (the range itself closes after 28.9 ms: the launches are asynchronous).
    assert sglang["type"].tolist() == ["EXTEND"]
    step = sglang.iloc[0]
    assert (step["bs"], step["toks"], step["kernels"], step["gpu_ops"]) == (15, 15360, 521, 524)
    assert step["launches"] == 524  # one GPU op per launch call in this eager step
    assert step["cpu_ms"] == pytest.approx(28.915862)
    assert step["step_ms"] == pytest.approx(493.633219)
    expected_ms = {"GEMM": 420.305748, "attention": 26.076170, "norm": 26.258560, "activation": 16.508145,
                   "elementwise": 3.499272, "memcpy/memset": 0.015140, "other": 0.024911, "communication": 0.0}
    for category, ms in expected_ms.items():
        assert step[f"{category} (ms)"] == pytest.approx(ms, abs=1e-6), category
    summary = phase_summary(sglang, has_gpu=True).iloc[0]
    assert summary["verdict"] == "GPU-bound" and summary["gpu_busy_share"] > 0.99


def test_vllm_step(traces):
    steps = _steps(traces / "tracelens" / "vllm_tp8_b200_rank0")
    assert steps[["type", "bs", "toks", "kernels"]].values.tolist() == [["PREFILL", 1, 888, 768]]
    assert steps.iloc[0]["communication (ms)"] == pytest.approx(2.1415, abs=1e-4)


def test_profiler_steps_when_nothing_else_names_a_step(traces):
    steps = _steps(traces / "tracelens" / "hf_eager_h100_qwen")
    assert steps["type"].tolist() == ["ProfilerStep"] and steps.iloc[0]["kernels"] > 1000


@pytest.fixture()
def engine_steps(engine_trace):
    return _steps(engine_trace)


def test_engine_steps(engine_steps):
    s = engine_steps
    assert s["type"].tolist() == ["PREFILL", "DECODE", "DECODE", "MIXED"]
    assert s["kernels"].tolist() == [3, 3, 3, 1]
    assert s["gpu_ops"].tolist() == [3, 3, 4, 1]  # the graph launch also ran a memcpy
    assert s["step_ms"].tolist() == pytest.approx([0.370, 0.300, 0.200, 0.100])
    assert s["busy_ms"].tolist() == pytest.approx([0.320, 0.030, 0.170, 0.030])
    assert s["host_wait_ms"].tolist() == pytest.approx([0.050, 0.270, 0.030, 0.070])
    prefill = s.iloc[0]
    assert (prefill["attention (ms)"], prefill["GEMM (ms)"], prefill["norm (ms)"]) == pytest.approx((0.1, 0.2, 0.02))
    graph = s.iloc[2]
    assert (graph["GEMM (ms)"], graph["activation (ms)"], graph["communication (ms)"],
            graph["memcpy/memset (ms)"]) == pytest.approx((0.04, 0.04, 0.05, 0.04))


def test_engine_phase_summary(engine_steps):
    summary = phase_summary(engine_steps, has_gpu=True).set_index("type")
    assert summary.loc["PREFILL", "verdict"] == "GPU-bound"  # 320 of 370 us busy
    assert summary.loc["DECODE", "verdict"] == "CPU-bound"  # 300 us waiting for launches, 200 us busy
    assert summary.loc["MIXED", "verdict"] == "CPU-bound"
    decode = summary.loc["DECODE"]
    assert decode["steps"] == 2 and decode["kernels_per_step"] == 3
    assert decode["step_mean (ms)"] == pytest.approx(0.25)
    assert decode["gpu_busy_share"] == pytest.approx(0.4) and decode["host_wait_share"] == pytest.approx(0.6)
    cats = phase_categories(engine_steps)
    decode_cats = cats[cats["type"] == "DECODE"].set_index("category")
    assert decode_cats["per_step (ms)"].to_dict() == pytest.approx(
        {"GEMM": 0.025, "activation": 0.025, "elementwise": 0.005, "communication": 0.025, "memcpy/memset": 0.02})


def test_verdict_needs_the_gpu_to_have_waited():
    assert verdict(0.0, 0.0) != "CPU-bound"  # e.g. a zero-length step: the GPU neither worked nor waited
    assert verdict(0.2, 0.2) == "CPU-bound"
    assert verdict(0.9, 0.05) == "GPU-bound"


def test_steps_without_gpu_work_get_no_cpu_bound_verdict(tmp_path, make_trace, make_events):
    events = make_events([
        ("user_annotation", "step[PREFILL bs=1 toks=5]", 100, 50, 100, {}),
        ("cuda_runtime", "cudaLaunchKernel", 110, 5, 100, {"correlation": 1}),
        ("kernel", "gemv_kernel", 120, 10, 7, {"stream": 7, "correlation": 1}),
        ("user_annotation", "step[DECODE bs=1]", 200, 0, 100, {}),  # zero length, nothing launched
        ("user_annotation", "step[IDLE bs=0]", 300, 20, 100, {}),  # nothing launched
    ])
    steps = _steps(make_trace(tmp_path / "t.json", events))
    summary = phase_summary(steps, has_gpu=True).set_index("type")
    assert summary.loc["PREFILL", "verdict"] == "CPU-bound"  # 40 of 50 us waiting for the launch
    assert summary.loc["DECODE", "verdict"] == summary.loc["IDLE", "verdict"] == "no GPU work"


def test_a_rank_without_gpu_work_has_no_host_wait(tmp_path, make_trace, make_events):
    # in a capture where another rank ran kernels, this rank's file holds CPU events only: its GPU was not seen
    # waiting for anything
    events = make_events([
        ("user_annotation", "step[DECODE bs=1]", 100, 50, 100, {}),
        ("cpu_op", "aten::mm", 105, 20, 100, {}),
    ])
    steps = _steps(make_trace(tmp_path / "t.json", events))
    assert steps["host_wait_ms"].tolist() == [0.0] and steps["busy_ms"].tolist() == [0.0]


EPOCH_US = 1712195495519  # leading digits of an epoch time in microseconds


def epoch_trace(tmp_path, events) -> Path:
    """A trace of (category, name, microseconds after EPOCH_US*1000, duration, args) events with the timestamps
    written as JSON numbers in full: at epoch times a float64 of nanoseconds has a 256 ns step."""
    text = json.dumps({"traceEvents": [
        {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 7 if cat == "kernel" else 1, "ts": f"@{ts}",
         "dur": dur, "args": args} for cat, name, ts, dur, args in events]})
    path = tmp_path / "t.json"
    path.write_text(text.replace('"@', str(EPOCH_US)).replace('0",', "0,"))
    return path


def test_a_wrapper_is_found_to_the_nanosecond(tmp_path):
    # the inner range starts 100 ns before the outer one ends, which a float comparison does not see
    path = epoch_trace(tmp_path, [
        ("user_annotation", "execute_context_0(0)_generation_1(1)", "000.100", 1.0, {}),
        ("user_annotation", "step[DECODE bs=1]", "001.000", 0.05, {}),
    ])
    assert _steps(path)["label"].tolist() == ["step[DECODE bs=1]"]


def test_a_launch_at_the_end_of_a_step_is_found_to_the_nanosecond(tmp_path):
    # the launch starts 100 ns before the step ends; an earlier launch outside any step must not make the
    # comparison a float one
    path = epoch_trace(tmp_path, [
        ("cuda_runtime", "cudaLaunchKernel", "000.000", 0.01, {"correlation": 2}),
        ("user_annotation", "step[DECODE bs=1]", "000.100", 1.0, {}),
        ("cuda_runtime", "cudaLaunchKernel", "001.000", 0.01, {"correlation": 1}),
        ("kernel", "gemv_kernel", "002.000", 1.0, {"stream": 7, "correlation": 1}),
        ("kernel", "gemv_kernel", "004.000", 1.0, {"stream": 7, "correlation": 2}),
    ])
    assert _steps(path)["kernels"].tolist() == [1]


def test_host_wait_is_found_to_the_nanosecond(tmp_path):
    # the second kernel is launched 100 ns after the GPU went idle: the whole gap is host wait
    path = epoch_trace(tmp_path, [
        ("user_annotation", "step[DECODE bs=1]", "000.000", 10.0, {}),
        ("cuda_runtime", "cudaLaunchKernel", "000.100", 0.01, {"correlation": 1}),
        ("kernel", "gemv_kernel", "000.500", 0.6, {"stream": 7, "correlation": 1}),
        ("cuda_runtime", "cudaLaunchKernel", "001.200", 0.01, {"correlation": 2}),
        ("kernel", "gemv_kernel", "002.000", 1.0, {"stream": 7, "correlation": 2}),
    ])
    step = _steps(path).iloc[0]
    # idle before the first kernel (0.5 us), between the kernels (0.9 us) and after the last one (7 us)
    assert step["host_wait_ms"] * 1e6 == pytest.approx(500 + 900 + 7000)


def test_kernels_from_another_thread_are_not_the_steps(tmp_path, make_trace, make_events):
    events = make_events([
        ("user_annotation", "step[DECODE bs=1]", 100, 50, 100, {}),
        ("cpu_op", "aten::mm", 108, 10, 200, {}),  # another thread, working at the same time
        ("cuda_runtime", "cudaLaunchKernel", 110, 5, 200, {"correlation": 1}),
        ("kernel", "gemv_kernel", 120, 10, 7, {"stream": 7, "correlation": 1}),
    ])
    steps = _steps(make_trace(tmp_path / "t.json", events))
    assert steps["kernels"].tolist() == [0]


def test_launches_under_a_stale_thread_id_belong_to_the_open_step(tmp_path, make_trace, make_events):
    # a second capture in one process (seen on an H100 with torch 2.11): the step ranges and operators carry the
    # engine thread (100), the runtime calls the id of the thread that started the first capture (200)
    events = make_events([
        ("user_annotation", "step[DECODE bs=1]", 100, 50, 100, {}),
        ("cpu_op", "aten::mm", 105, 20, 100, {}),
        ("cuda_runtime", "cudaGraphLaunch", 110, 5, 200, {"correlation": 1}),
        ("kernel", "gemv_kernel", 120, 10, 7, {"stream": 7, "correlation": 1}),
        ("kernel", "rms_norm_kernel", 131, 5, 7, {"stream": 7, "correlation": 1}),
        ("cuda_runtime", "cudaLaunchKernel", 300, 5, 200, {"correlation": 2}),  # outside any step
        ("kernel", "gemv_kernel", 310, 10, 7, {"stream": 7, "correlation": 2}),
    ])
    steps = _steps(make_trace(tmp_path / "t.json", events))
    assert steps["kernels"].tolist() == [2]
    assert steps["launches"].tolist() == [1]  # one graph launch, two kernels
    assert steps["GEMM kernels"].tolist() == [1] and steps["norm kernels"].tolist() == [1]


def test_our_engine_on_cpu(tiny_model_dir, tmp_path):
    import torch

    from infertrace.engine import LLM, SamplingParams

    llm = LLM(tiny_model_dir, kv_cache_tokens=1024, max_num_batched_tokens=32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([[1, 2, 3, 4, 5, 6], list(range(100, 150))], SamplingParams(max_tokens=3, ignore_eos=True))
    path = tmp_path / "cpu" / "infertrace.1.pt.trace.json.gz"
    path.parent.mkdir()
    prof.export_chrome_trace(str(path))
    names = [e["name"] for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
             if e.get("ph") == "X" and e.get("name", "").startswith("step[")]
    steps = _steps(path)
    assert len(steps) == len(names) > 2
    assert steps["type"].tolist() == [n[5:].split()[0].rstrip("]") for n in names]
    assert {"PREFILL", "DECODE"} <= set(steps["type"])
    assert (steps["kernels"] == 0).all() and (steps["step_ms"] > 0).all()
    summary = phase_summary(steps, has_gpu=False)
    assert set(summary["verdict"]) == {"no GPU work"}


@pytest.mark.gpu
def test_our_engine_on_gpu_with_cuda_graphs(tiny_model_dir, tmp_path):
    import torch

    from infertrace.analyze.launches import launches
    from infertrace.engine import LLM, SamplingParams

    llm = LLM(tiny_model_dir, cuda_graphs=True)
    prompts = [list(range(100 + 7 * i, 164 + 7 * i)) for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # captures the decode graphs
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    path = tmp_path / "gpu" / "infertrace.1.pt.trace.json.gz"
    path.parent.mkdir()
    prof.export_chrome_trace(str(path))
    steps = _steps(path)
    decode = steps[steps["type"] == "DECODE"]
    assert len(decode) >= 10 and (steps["type"] == "PREFILL").any()
    assert (steps["kernels"] > 0).all()  # graph replays included: their kernels carry the launch's correlation
    apis = set(launches(load_capture(path).ranks[0].events)["api"])
    assert "cudaGraphLaunch" in apis


def test_steps_queued_ahead_are_spaced_by_their_last_kernels(tmp_path, make_trace, make_events):
    # async scheduling: each step is planned and launched while the one before it still runs on the GPU, so a
    # step's wall time (range start to its last kernel) spans the previous step's tail; the spacing does not
    events = make_events([
        ("user_annotation", "step[DECODE bs=8]", 100, 10, 100, {}),
        ("cuda_runtime", "cudaGraphLaunch", 105, 2, 100, {"correlation": 1}),
        ("kernel", "gemv_kernel", 120, 30, 7, {"stream": 7, "correlation": 1}),
        ("user_annotation", "step[DECODE bs=8]", 112, 8, 100, {}),
        ("cuda_runtime", "cudaGraphLaunch", 115, 2, 100, {"correlation": 2}),
        ("kernel", "gemv_kernel", 150, 30, 7, {"stream": 7, "correlation": 2}),
        ("user_annotation", "step[DECODE bs=8]", 140, 8, 100, {}),
        ("cuda_runtime", "cudaGraphLaunch", 143, 2, 100, {"correlation": 3}),
        ("kernel", "gemv_kernel", 180, 30, 7, {"stream": 7, "correlation": 3}),
    ])
    steps = _steps(make_trace(tmp_path / "t.json", events))
    assert steps["kernels"].tolist() == [1, 1, 1]
    assert steps["step_ms"].tolist() == pytest.approx([0.050, 0.068, 0.070])
    assert np.isnan(steps["spacing_ms"].iloc[0])
    assert steps["spacing_ms"].iloc[1:].tolist() == pytest.approx([0.030, 0.030])
    summary = phase_summary(steps, has_gpu=True).iloc[0]
    assert summary["spacing_p50 (ms)"] == pytest.approx(0.030)
    assert summary["step_p50 (ms)"] == pytest.approx(0.068)


def test_kernels_started_early_by_pdl_count_from_the_end_of_the_one_before(tmp_path, make_trace, make_events):
    # programmatic dependent launch: each kernel of the graph is resident (and its span recorded) while the one
    # before still runs, and waits on the device for it; its GPU time is from that kernel's end
    events = make_events([
        ("user_annotation", "step[DECODE bs=8]", 100, 100, 100, {}),
        ("cuda_runtime", "cudaGraphLaunch", 105, 2, 100, {"correlation": 1}),
        ("kernel", "_skinny_gemm_kernel", 110, 30, 7, {"stream": 7, "correlation": 1}),
        ("kernel", "_add_rmsnorm_kernel", 125, 20, 7, {"stream": 7, "correlation": 1}),  # waits 125-140
        ("kernel", "_paged_attention_kernel", 138, 22, 7, {"stream": 7, "correlation": 1}),  # waits 138-145
        ("kernel", "_skinny_gemm_kernel", 150, 5, 8, {"stream": 8, "correlation": 1}),  # another stream: its own
    ])
    step = _steps(make_trace(tmp_path / "t.json", events)).iloc[0]
    assert (step["GEMM (ms)"], step["norm (ms)"], step["attention (ms)"]) == pytest.approx((0.035, 0.005, 0.015))
    assert step["busy_ms"] == pytest.approx(0.050)  # 110-160, the union, as before


def test_cpu_only_capture_gets_cpu_operators_by_self_time(tmp_path, make_trace, make_events):
    from infertrace.analyze import analyze_path

    make_trace(tmp_path / "cpu.pt.trace.json", make_events([
        ("user_annotation", "step[DECODE bs=1]", 0, 100, 1, {}),
        ("cpu_op", "aten::linear", 10, 50, 1, {}),
        ("cpu_op", "aten::addmm", 15, 40, 1, {}),  # inside linear: linear keeps 10 us of its own
        ("cpu_op", "aten::relu", 70, 10, 1, {}),
        ("cpu_op", "aten::copy_", 200, 10, 1, {}),  # after the step
        ("cpu_op", "aten::addmm", 0, 30, 2, {}),  # another thread, no step there
    ]))
    report = analyze_path(tmp_path)
    assert report.skipped["temporal"] == "no GPU kernels in the capture (a CPU-only trace)"
    ops = report.tables["cpu_ops"]
    got = {r["name"]: (r["calls"], round(r["self (ms)"], 6), round(r["total (ms)"], 6))
           for r in ops.to_dict("records")}
    assert got == {"aten::addmm": (2, 0.07, 0.07), "aten::linear": (1, 0.01, 0.05), "aten::relu": (1, 0.01, 0.01),
                   "aten::copy_": (1, 0.01, 0.01)}
    assert ops["name"].iloc[0] == "aten::addmm" and ops["self share"].iloc[0] == pytest.approx(70 / 100)
    per_step = report.tables["cpu_steps"]
    assert per_step[["type", "name"]].values.tolist() == [["DECODE", "aten::addmm"], ["DECODE", "aten::linear"],
                                                          ["DECODE", "aten::relu"]]
    assert per_step["self per step (ms)"].tolist() == pytest.approx([0.04, 0.01, 0.01])
    assert per_step["share of step"].tolist() == pytest.approx([0.4, 0.1, 0.1])
