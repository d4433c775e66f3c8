"""`analyze --perfetto` and `--csv` write whole or not at all, and only regular files, as every other output does."""

from __future__ import annotations

import errno
import json
import os

import pytest
from click.testing import CliRunner

from infertrace.analyze import perfetto
from infertrace.cli import main

from .conftest import kineto_events, write_kineto


def run(*args):
    return CliRunner().invoke(main, ["analyze", *[str(a) for a in args], "--quiet", "--no-cache"])


def test_perfetto_to_a_fifo_is_refused_in_one_line(engine_trace, tmp_path, run_python):
    fifo = tmp_path / "out.perfetto.json"
    os.mkfifo(fifo)  # opening it to write would wait forever for a reader
    done = run_python(["-m", "infertrace", "analyze", str(engine_trace), "--quiet", "--no-cache",
                       "--perfetto", str(fifo)], timeout=90)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: cannot write {fifo}: it is not a regular file"


def test_a_perfetto_write_that_fails_keeps_the_file_there_was(engine_trace, tmp_path, monkeypatch):
    out = tmp_path / "trace.perfetto.json"
    assert run(engine_trace, "--perfetto", out).exit_code == 0
    before = out.read_bytes()
    json.loads(before)
    pieces = perfetto._all_pieces

    def disk_fills(report, cache_root):
        for i, piece in enumerate(pieces(report, cache_root)):
            if i == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            yield piece

    monkeypatch.setattr(perfetto, "_all_pieces", disk_fills)
    result = run(engine_trace, "--perfetto", out)
    assert result.exit_code == 2 and f"cannot write {out}: No space left on device" in result.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "trace.perfetto.json"]


def cpu_capture(path):
    return write_kineto(path / "rank0.pt.trace.json", kineto_events([("cpu_op", "aten::mm", 10, 5, 1, {})]))


def test_csv_of_another_capture_leaves_no_table_of_the_last(engine_trace, tmp_path):
    out = tmp_path / "tables"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run(engine_trace, "--csv", out).exit_code == 0
    assert (out / "temporal.csv").exists() and (out / "steps.csv").exists()
    assert run(cpu_capture(tmp_path / "cpu").parent, "--csv", out).exit_code == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cpu_ops.csv", "notes.txt", "ranks.csv"]
    assert "aten::mm" in (out / "cpu_ops.csv").read_text()


def test_a_csv_write_that_fails_leaves_the_last_tables_whole(engine_trace, tmp_path, monkeypatch):
    from infertrace import output

    out = tmp_path / "tables"
    assert run(engine_trace, "--csv", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = output.write_text
    calls = []

    def fails_second(path, text):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(output, "write_text", fails_second)
    result = run(cpu_capture(tmp_path / "cpu").parent, "--csv", out)
    assert result.exit_code == 2 and "No space left on device" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("what", ["a directory", "a fifo"])
def test_csv_over_a_table_that_is_not_a_regular_file_is_refused(engine_trace, tmp_path, what):
    out = tmp_path / "tables"
    out.mkdir()
    if what == "a directory":
        (out / "ranks.csv").mkdir()
    else:
        os.mkfifo(out / "ranks.csv")
    result = run(engine_trace, "--csv", out)
    assert result.exit_code == 2 and f"cannot write --csv {out / 'ranks.csv'}" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["ranks.csv"]
