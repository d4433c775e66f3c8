"""analyze's cache: under the project's cache root, data-only (nothing in it can run code when read), and
neither read nor written where another user could have put entries in it."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
from click.testing import CliRunner

from infertrace.analyze.column_cache import frame_doc, frame_from_doc
from infertrace.analyze.fleet import analyze_fleet
from infertrace.cli import main

from .conftest import engine_trace_events, kineto_events, write_kineto


@pytest.fixture()
def capture(tmp_path):
    write_kineto(tmp_path / "trace" / "rank0.pt.trace.json", engine_trace_events())
    return tmp_path / "trace"


def test_the_cache_goes_under_infertrace_cache(capture, tmp_path, monkeypatch):
    monkeypatch.delenv("INFERTRACE_CACHE_DIR")
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    result = CliRunner().invoke(main, ["analyze", str(capture), "--quiet"])
    assert result.exit_code == 0, result.output
    assert any((tmp_path / "root" / "analyze").rglob("*.json"))
    assert not (tmp_path / "home").exists() and not (tmp_path / "xdg").exists()
    assert stat.S_IMODE((tmp_path / "root" / "analyze").stat().st_mode) == 0o700


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # reading this pickle creates the marker file


def test_a_crafted_entry_runs_nothing_and_a_damaged_one_is_made_again(capture, tmp_path):
    cache = tmp_path / "cache"
    first = analyze_fleet(capture, jobs=1, cache_dir=cache)
    marker = tmp_path / "ran"
    for entry in {p.parent for p in cache.rglob("*") if p.is_file()}:
        (entry / "part.pickle").write_bytes(pickle.dumps(_Payload(str(marker))))
    second = analyze_fleet(capture, jobs=1, cache_dir=cache)
    assert not marker.exists()
    assert "1 from the cache" in second.run_notes[-1]
    assert second.tables["steps"].equals(first.tables["steps"])
    for part in cache.rglob("part.json"):
        part.write_text('{"format": "infertrace.analyze-part/1", "files": 7}')
    third = analyze_fleet(capture, jobs=1, cache_dir=cache)
    assert "0 from the cache" in third.run_notes[-1]
    assert third.tables["steps"].equals(first.tables["steps"])


def test_columns_that_do_not_match_their_names_are_read_again(capture, tmp_path):
    import numpy as np

    cache = tmp_path / "cache"
    first = analyze_fleet(capture, jobs=1, cache_dir=cache)
    for column in cache.rglob("name.npy"):
        np.save(column, np.full(np.load(column).shape, 10**6, dtype=np.int32))  # codes past the names
    for part in cache.rglob("part.json"):
        part.unlink()
    again = analyze_fleet(capture, jobs=1, cache_dir=cache)
    assert again.tables["steps"].equals(first.tables["steps"])


def test_a_table_comes_back_from_the_cache_with_its_types(capture, tmp_path):
    import pandas as pd

    table = pd.DataFrame({"type": pd.Series(["PREFILL", None], dtype="str"), "bs": pd.array([2, None], "Int64"),
                          "ts_ns": [1765000000123456789, 2], "ms": [0.1, float("nan")], "ok": [True, False],
                          "pid": pd.Series([1, 2], dtype="int32")})
    pd.testing.assert_frame_equal(frame_from_doc(frame_doc(table)), table)


@pytest.mark.parametrize("how", ["group-writable", "another user's"])
def test_a_cache_others_could_write_into_is_not_used(capture, tmp_path, how):
    root = tmp_path / "shared-cache"
    root.mkdir()
    if how == "group-writable":
        os.chmod(root, 0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(root, 4242, 4242)
    result = CliRunner().invoke(main, ["analyze", str(capture), "--quiet", "--cache-dir", str(root)])
    assert result.exit_code == 0, result.output
    assert f"cache {root}" in result.stderr and "running without it" in result.stderr
    assert list(root.iterdir()) == []


def test_nothing_in_the_cache_is_a_pickle(capture, tmp_path):
    write_kineto(capture / "cpu" / "rank1.pt.trace.json", kineto_events([("cpu_op", "aten::mm", 10, 5, 1, {})]))
    cache = tmp_path / "cache"
    for path in (capture, capture / "cpu"):
        analyze_fleet(path, jobs=1, cache_dir=cache)
    names = {p.suffix for p in cache.rglob("*") if p.is_file()}
    assert names == {".json", ".npy"}
