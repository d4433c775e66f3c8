"""Every engine step is a named profiler range, with schedule / prepare_inputs / forward / sample inside."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch

from infertrace.engine import SamplingParams
from infertrace.engine import annotate as annotate_module
from infertrace.engine.annotate import step_range_name

STEP = re.compile(r"^step\[(PREFILL bs=\d+ toks=\d+|DECODE bs=\d+|MIXED bs=\d+ toks=\d+) #\d+\]$")
PHASES = ("schedule", "prepare_inputs", "forward", "sample")


def test_torch_profiler_trace_holds_the_step_annotations(make_engine, run_engine, make_prompts, tmp_path):
    engine = make_engine(kv_cache_tokens=4096, max_num_batched_tokens=32)
    prompts = make_prompts([6, 50], seed=31)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _, steps = run_engine(engine, prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]

    step_events = sorted((e for e in events if e["name"].startswith("step[")), key=lambda e: e["ts"])
    assert [e["name"] for e in step_events] == [
        step_range_name(s.kind, s.batch_size, s.num_tokens, s.index) for s in steps
    ]
    assert all(STEP.match(e["name"]) for e in step_events)
    kinds = {e["name"].split()[0] for e in step_events}
    assert kinds == {"step[PREFILL", "step[MIXED", "step[DECODE"}
    assert step_events[0]["name"] == "step[PREFILL bs=2 toks=32 #0]"
    for step in step_events:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [e["name"] for e in events if e["name"] in PHASES and start <= e["ts"] and e["ts"] + e["dur"] <= end]
        assert sorted(inside) == sorted(PHASES), (step["name"], inside)


def test_range_names():
    assert step_range_name("prefill", 2, 300) == "step[PREFILL bs=2 toks=300]"
    assert step_range_name("decode", 16, 16) == "step[DECODE bs=16]"
    assert step_range_name("mixed", 9, 72) == "step[MIXED bs=9 toks=72]"
    assert step_range_name("decode", 16, 16, 42) == "step[DECODE bs=16 #42]"
    assert step_range_name("mixed", 9, 72, 7) == "step[MIXED bs=9 toks=72 #7]"


def test_nvtx_ranges_go_to_the_nvtx_package_without_cuda():
    if torch.cuda.is_available():
        assert annotate_module._NVTX == (torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)
    else:
        import nvtx

        assert annotate_module._NVTX == (nvtx.push_range, nvtx.pop_range)
    with annotate_module.annotate("step[DECODE bs=1]"):
        pass


def test_gzip_export_is_readable(make_engine, tmp_path):
    # what capture tools write: a .json.gz trace; the annotations survive the round trip
    engine = make_engine(kv_cache_tokens=1024)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    path = tmp_path / "trace.pt.trace.json.gz"
    prof.export_chrome_trace(str(path))
    with gzip.open(path) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "step[PREFILL bs=1 toks=3 #0]" in names and set(PHASES) <= names


def test_ranges_reach_torch_profiler_only_while_it_records(monkeypatch):
    """A range costs no torch.profiler record when no profiler records this thread; under one it is in the trace,
    and an exception inside it passes through with the NVTX range closed."""
    made = []
    record_function = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: made.append(name) or record_function(name))
    pops = []
    if annotate_module._NVTX is not None:
        push, pop = annotate_module._NVTX
        monkeypatch.setattr(annotate_module, "_NVTX", (push, lambda: pops.append(1) or pop()))
    with annotate_module.annotate("idle"):
        pass
    assert made == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(KeyError), annotate_module.annotate("recorded"):
            raise KeyError("inside")
    assert made == ["recorded"] and "recorded" in {e.name for e in prof.events()}
    assert len(pops) == (2 if annotate_module._NVTX is not None else 0)
