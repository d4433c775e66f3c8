"""`analyze` on directories as vLLM 0.33 and SGLang 0.5.23 fill them: captures, ranks, stages, the frontend."""

from __future__ import annotations

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
