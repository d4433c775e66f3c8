"""`analyze` on directories as vLLM 0.33 and SGLang 0.5.23 fill them: captures, ranks, stages, the frontend."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from infertrace.analyze.capture import load_capture
from infertrace.analyze.report import build_report
from infertrace.cli import main

from .conftest import engine_trace_events, kineto_events, write_kineto


def cpu_trace(path, rank=None, op="aten::mm", mtime=None):
    write_kineto(path, kineto_events([("cpu_op", op, 10, 5, 1, {}), ("cpu_op", op, 20, 7, 1, {})]), rank=rank)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_vllm_ranks_and_frontend(tmp_path):
    for rank in (0, 1):
        write_kineto(tmp_path / f"run_dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}.100.pt.trace.json.gz",
                     engine_trace_events())
    cpu_trace(tmp_path / "run_gpuhost_4242.async_llm.101.pt.trace.json.gz", op="detokenize")
    capture = load_capture(tmp_path)
    assert capture.name == "run" and [r.rank for r in capture.ranks] == [0, 1]
    assert [f.path.name.split(".")[1] for f in capture.frontend] == ["async_llm"]
    assert not any("claims rank" in p for p in capture.problems)
    report = build_report(capture)
    assert report.table("frontend")["name"].tolist() == ["detokenize"]
    assert report.table("frontend")["sum (us)"].tolist() == [12.0]
    assert any("frontend" in n for n in report.notes)
    from rich.console import Console

    from infertrace.analyze.render import render

    console = Console(width=200, record=True)
    console.print(render(report, fit=False))
    text = " ".join(console.export_text().split())
    assert "API server (frontend) CPU trace" in text and "detokenize 2 0.012 0.007" in text


def test_sglang_stages_are_one_rank_and_merged_is_skipped(tmp_path):
    cpu_trace(tmp_path / "abc-TP-0-EXTEND.trace.json.gz", op="extend_op")
    cpu_trace(tmp_path / "abc-TP-0-DECODE.trace.json.gz", op="decode_op")
    cpu_trace(tmp_path / "merged-abc.trace.json.gz", op="merged_op")
    capture = load_capture(tmp_path)
    (rank,) = capture.ranks
    assert rank.rank == 0 and set(rank.events["name"].astype(str)) == {"extend_op", "decode_op"}
    assert not capture.problems
    assert any("stages of one rank" in n for n in capture.notes)


def test_newest_capture_by_default_and_the_others_named(tmp_path):
    cpu_trace(tmp_path / "old" / "rank0.pt.trace.json", mtime=1000)
    cpu_trace(tmp_path / "new" / "rank0.pt.trace.json", mtime=2000, op="newest_op")
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "analysing the newest, new" in result.stderr and "old" in result.stderr
    capture = load_capture(tmp_path, capture="old")
    assert capture.name == "old" and capture.notes == []


def test_capture_and_rank_filters_on_the_command_line(tmp_path):
    for rank in (0, 1):
        cpu_trace(tmp_path / f"x-TP-{rank}.trace.json.gz", op=f"op{rank}")
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--rank", "1", "--quiet"])
    assert result.exit_code == 0, result.output
    assert [r.rank for r in load_capture(tmp_path, rank=1).ranks] == [1]
    for args, words in ((["--capture", "nope"], "no capture named 'nope'; captures here: x"),
                        (["--rank", "5"], "has no rank 5")):
        result = CliRunner().invoke(main, ["analyze", str(tmp_path), *args])
        assert result.exit_code == 2 and words in result.output
        assert len([l for l in result.output.splitlines() if l.strip()]) == 1


def test_an_idle_newest_capture_points_to_the_older_one_with_events(tmp_path):
    # vLLM CPU 0.32's names: `rank0.{time_ns}` for the engine, `{host}_{pid}.async_llm.{time_ns}` for the API server
    old, new = 1_765_000_000_000_000_000, 1_765_000_030_000_000_000
    cpu_trace(tmp_path / f"rank0.{old}.pt.trace.json.gz", mtime=1000, op="busy_op")
    cpu_trace(tmp_path / f"cpuhost_77.async_llm.{old + 5}.pt.trace.json.gz", mtime=1000, op="detokenize")
    write_kineto(tmp_path / f"rank0.{new}.pt.trace.json.gz", [])
    os.utime(tmp_path / f"rank0.{new}.pt.trace.json.gz", (2000, 2000))
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--no-cache"])
    assert result.exit_code == 2
    (line,) = [l for l in result.stderr.splitlines() if l.strip()]
    assert f"capture {tmp_path.name}@{new} holds no complete event" in line
    assert f"{tmp_path.name}@{old} (2 events)" in line and f"--capture {tmp_path.name}@{old}" in line
    out = tmp_path.parent / f"{tmp_path.name}-report.json"
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--capture", str(old), "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["capture"] == f"{tmp_path.name}@{old}"
    assert doc["ranks"][0]["file"] == f"rank0.{old}.pt.trace.json.gz" and len(doc["ranks"]) == 1
    assert [r["name"] for r in doc["tables"]["frontend"]] == ["detokenize"]


def test_the_capture_read_is_named_on_stderr(tmp_path):
    cpu_trace(tmp_path / "rank0.pt.trace.json")
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"analysing capture {tmp_path.name}, the only one here" in result.stderr


def vllm_cpu_steps() -> list[dict]:
    """A vLLM CPU worker's steps as vLLM 0.33.0 annotates them: vllm/v1/worker/gpu_worker.py `annotate_profile`
    wraps each `execute_model` in `execute_context_{requests}({tokens})_generation_{requests}({tokens})` (torch
    `record_function`, category user_annotation), with the model runner's own `gpu_model_runner: ...` ranges
    (vllm/v1/worker/gpu_model_runner.py) inside; with `detailed_trace_annotation` the name carries the scheduled
    tokens first and sq/sk figures in the brackets."""
    spec = []
    t = 1000
    steps = [("execute_context_2(96)_generation_0(0)", 400), ("execute_context_0(0)_generation_2(2)", 100),
             ("execute_context_1(30)_generation_1(1)", 200),
             ("execute_2_context_0(sq0sk0sqsq0sqsk0)_generation_2(sq2sk196sqsq2sqsk196)", 100)]
    for name, dur in steps:
        spec.append(("user_annotation", name, t, dur, 1, {}))
        for inner, share in (("gpu_model_runner: preprocess", 0.1), ("gpu_model_runner: forward", 0.7),
                             ("gpu_model_runner: sample", 0.1)):
            spec.append(("user_annotation", inner, t + 1, int(dur * share), 1, {}))
        spec.append(("cpu_op", "aten::linear", t + 2 + int(dur * 0.1), int(dur * 0.5), 1, {}))
        t += dur + 50
    return kineto_events(spec)


def test_vllm_cpu_step_annotations_fill_the_step_table(tmp_path):
    write_kineto(tmp_path / "rank0.1765000000000000000.pt.trace.json.gz", vllm_cpu_steps())
    out = tmp_path.parent / f"{tmp_path.name}-steps.json"
    result = CliRunner().invoke(main, ["analyze", str(tmp_path), "--json", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    steps = doc["tables"]["steps"]
    assert [(s["type"], s["bs"], s["toks"]) for s in steps] == [
        ("PREFILL", 2, 96), ("DECODE", 2, 2), ("MIXED", 2, 31), ("DECODE", 2, 2)]
    assert [s["cpu_ms"] for s in steps] == [0.4, 0.1, 0.2, 0.1]
    phases = {p["type"]: p for p in doc["tables"]["phases"]}
    assert {t: p["steps"] for t, p in phases.items()} == {"PREFILL": 1, "DECODE": 2, "MIXED": 1}
