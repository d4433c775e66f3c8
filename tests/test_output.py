"""infertrace/output.py: one writability probe and one atomic write for every command's output files; and
infertrace/exits.py, the exit codes they share."""

from __future__ import annotations

import json
import os
import stat

import pytest
from click.testing import CliRunner

from infertrace import exits
from infertrace.cli import main
from infertrace.output import OutputError, check_writable, check_writable_dir, write_json, write_text


def test_write_replaces_a_file_whole_and_keeps_its_permissions(tmp_path):
    path = tmp_path / "deep" / "r.json"
    assert write_json(path, {"rate": 1.5}) == path
    assert json.loads(path.read_text()) == {"rate": 1.5}
    path.chmod(0o640)
    write_text(path, "new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old\n")
    with pytest.raises(ValueError):  # JSON has no NaN: nothing is written
        write_json(path, {"x": float("nan")})

    with pytest.raises(TypeError):
        write_text(path, 42)  # a write that fails half-way
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}


@pytest.mark.parametrize("make", ["directory", "fifo", "link to a directory"])
def test_only_regular_files_are_written(tmp_path, make):
    path = tmp_path / "out"
    if make == "directory":
        path.mkdir()
    elif make == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "d").mkdir()
        path.symlink_to(tmp_path / "d")
    for call in (lambda: check_writable(path, "--result-json"), lambda: write_text(path, "x")):
        with pytest.raises(OutputError, match=r"^cannot write (--result-json )?.*out: it is (a directory|not a regular file)$"):
            call()
    with pytest.raises(OutputError):
        write_text("/dev/null", "x")


def test_the_probe_creates_the_folder_and_leaves_nothing(tmp_path):
    path = tmp_path / "a" / "b" / "r.json"
    assert check_writable(path) == path and not path.exists() and list(path.parent.iterdir()) == []
    assert check_writable_dir(tmp_path / "traces", "traces to") == tmp_path / "traces"
    assert list((tmp_path / "traces").iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match=f"^cannot write the baseline {blocker / 'x'}: Not a directory$"):
        check_writable(blocker / "x", "the baseline")
    with pytest.raises(OutputError, match=f"^cannot write traces to {blocker / 'd'}: Not a directory$"):
        check_writable_dir(blocker / "d", "traces to")


def test_cannot_write_exits_the_same_code_from_every_command(tmp_path):
    """bench, gate and ablate each refuse an output under a regular file with one line and BAD_INPUT (analyze's
    is tested with a real trace in tests/analyze)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = str(blocker / "out.json")
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"output_throughput": 1.0, "completed": 1, "failed": 0}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("phases:\n  - name: a\n")
    runs = {
        "bench": ["bench", "--base-url", "http://127.0.0.1:9", "--result-json", out],
        "gate": ["gate", str(result), "--baseline", out, "--update-baseline"],
        "ablate": ["ablate", str(recipe), "--json", out],
    }
    codes = {}
    for name, args in runs.items():
        run = CliRunner().invoke(main, args)
        codes[name] = run.exit_code
        assert "cannot write" in run.stderr and len(run.stderr.strip().splitlines()) == 1, (name, run.output)
    assert set(codes.values()) == {exits.BAD_INPUT}, codes
