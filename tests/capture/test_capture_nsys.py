"""nsys discovery, the exact capture command line, and `infertrace profile --nsys`."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.capture import nsys
from infertrace.cli import main

CAPTURE = ["--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--trace=cuda,nvtx,osrt",
           "--sample=none", "--cpuctxsw=none"]


def fake_nsys(directory: Path) -> Path:
    """An `nsys` that records its argv and environment, writes the report, and runs the command."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nsys"
    script.write_text(f"""#!{sys.executable}
import json, os, subprocess, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1].replace("%p", str(os.getpid()))
command = args[args.index("-o") + 2:]
with open(os.environ["FAKE_NSYS_LOG"], "w") as f:
    json.dump({{"args": args, "env": os.environ.get("{nsys.NSYS_OUTPUT_ENV}")}}, f)
rc = subprocess.run(command).returncode
if os.environ.get("FAKE_NSYS_WRITE", "1") == "1":
    open(out + ".nsys-rep", "w").close()
sys.exit(rc)
""")
    script.chmod(0o755)
    return script


@pytest.fixture
def no_nsys(monkeypatch, tmp_path):
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(nsys, "INSTALL_GLOBS", (str(tmp_path / "nothing" / "*" / "nsys"),))


def test_capture_command_line_is_exact():
    assert nsys.nsys_profile_command("out/run", ["python", "x.py"], "/opt/nsys") == [
        "/opt/nsys", "profile", *CAPTURE, "-o", "out/run", "python", "x.py"]


def test_server_line_follows_forks_for_peers_and_repeats_windows():
    repeat = [a.replace("end=stop", "end=repeat") for a in CAPTURE]
    line = nsys.server_nsys_line("vllm", "traces/vllm")
    assert line == ("nsys profile " + " ".join(repeat) + " --trace-fork-before-exec=true --cuda-graph-trace=node"
                    " -o traces/vllm vllm serve MODEL --profiler-config '{\"profiler\": \"cuda\"}'")
    ours = shlex.split(nsys.server_nsys_line("infertrace", "o", ["infertrace", "serve", "--model", "m"]))
    assert ours == ["nsys", "profile", *repeat, "-o", "o", "infertrace", "serve", "--model", "m"]


def test_find_nsys_order(tmp_path, no_nsys, monkeypatch):
    assert nsys.find_nsys() is None
    installed = [tmp_path / "opt" / v / "nsys" for v in ("2024.5.1", "2025.3.1", "2025.10.0")]
    for path in installed:
        fake_nsys(path.parent)
    monkeypatch.setattr(nsys, "INSTALL_GLOBS", (str(tmp_path / "opt" / "*" / "nsys"),))
    assert nsys.find_nsys() == installed[2]  # newest version
    on_path = fake_nsys(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert nsys.find_nsys() == on_path
    monkeypatch.setenv("NSYS", str(installed[0]))
    assert nsys.find_nsys() == installed[0]  # an explicit NSYS wins
    monkeypatch.setenv("NSYS", str(tmp_path / "missing"))
    assert nsys.find_nsys() is None
    with pytest.raises(nsys.NsysNotFoundError, match="is not an executable file"):
        nsys.require_nsys()


def test_missing_nsys_is_one_clear_line(no_nsys):
    result = CliRunner().invoke(main, ["profile", "--nsys", "--", "bench", "--concurrency", "2"])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("error: nsys (Nsight Systems) not found") and "NSYS=" in lines[0]


def test_runs_infertrace_under_nsys(tmp_path, monkeypatch):
    script = fake_nsys(tmp_path / "bin")
    log = tmp_path / "log.json"
    monkeypatch.setenv("NSYS", str(script))
    monkeypatch.setenv("FAKE_NSYS_LOG", str(log))
    out_dir = tmp_path / "reports"
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(out_dir), "--", "model", "--help"])
    assert result.exit_code == 0, result.output
    seen = json.loads(log.read_text())
    output = str(out_dir / "infertrace.%p")
    assert seen["args"][: len(CAPTURE) + 3] == ["profile", *CAPTURE, "-o", output]
    assert seen["args"][len(CAPTURE) + 3] == sys.executable  # infertrace re-executed by this interpreter
    assert seen["args"][-2:] == ["model", "--help"]
    assert seen["env"] == output  # tells CaptureSession to open the cudaProfilerApi range
    reports = result.stdout.split()
    assert len(reports) == 1 and reports[0].endswith(".nsys-rep") and Path(reports[0]).exists()


def test_other_commands_run_as_given_and_exit_status_passes_through(tmp_path, monkeypatch):
    monkeypatch.setenv("NSYS", str(fake_nsys(tmp_path / "bin")))
    monkeypatch.setenv("FAKE_NSYS_LOG", str(tmp_path / "log.json"))
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(tmp_path), "--",
                                       sys.executable, "-c", "raise SystemExit(3)"])
    assert result.exit_code == 3
    assert json.loads((tmp_path / "log.json").read_text())["args"][-3:] == [sys.executable, "-c",
                                                                          "raise SystemExit(3)"]


def test_no_report_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("NSYS", str(fake_nsys(tmp_path / "bin")))
    monkeypatch.setenv("FAKE_NSYS_LOG", str(tmp_path / "log.json"))
    monkeypatch.setenv("FAKE_NSYS_WRITE", "0")
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(tmp_path), "--", "true"])
    assert result.exit_code == 1
    assert "never called cudaProfilerStart" in result.stderr


def test_unwritable_report_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NSYS", str(fake_nsys(tmp_path / "bin")))
    (tmp_path / "f").write_text("")
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(tmp_path / "f" / "d"), "--", "true"])
    assert result.exit_code == 2  # an output that cannot be written, as in every command
    assert [l for l in result.stderr.splitlines() if l.startswith("error")] == [
        f"error: cannot write traces to {tmp_path / 'f' / 'd'}: Not a directory"]


def test_dry_run_prints_the_line(no_nsys, tmp_path):
    result = CliRunner().invoke(main, ["profile", "--nsys", "--dry-run", "--output-dir", "r", "--", "ablate",
                                       "recipes/x.yaml"])
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    assert words[0] == f"{nsys.NSYS_OUTPUT_ENV}=r/infertrace.%p"
    assert words[1:3 + len(CAPTURE) + 2] == ["nsys", "profile", *CAPTURE, "-o", "r/infertrace.%p"]
    assert words[-2:] == ["ablate", "recipes/x.yaml"]
    assert "nsys is not installed" in result.stderr


def test_server_line_for_a_flavour(no_nsys):
    result = CliRunner().invoke(main, ["profile", "--nsys", "--server", "sglang", "--output-dir", "t"])
    assert result.exit_code == 0, result.output
    repeat = [a.replace("end=stop", "end=repeat") for a in CAPTURE]
    assert shlex.split(result.stdout) == ["nsys", "profile", *repeat, "--trace-fork-before-exec=true",
                                          "--cuda-graph-trace=node", "-o", "t/infertrace.%p", "python", "-m",
                                          "sglang.launch_server", "--model-path", "MODEL"]
    assert "--activities CUDA_PROFILER" in result.stderr
    assert "nsys is not installed on this machine" in result.stderr


def test_server_line_detects_flavour_and_takes_the_command(vllm_server, no_nsys):
    result = CliRunner().invoke(main, ["profile", "--nsys", "--url", vllm_server.url, "--",
                                       "vllm", "serve", "m", "--profiler-config", '{"profiler": "cuda"}'])
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    assert "--trace-fork-before-exec=true" in words
    assert words[-5:] == ["vllm", "serve", "m", "--profiler-config", '{"profiler": "cuda"}']
    assert vllm_server.profile_calls() == []  # printing the line starts nothing


def test_nsys_needs_a_command(no_nsys):
    result = CliRunner().invoke(main, ["profile", "--nsys"])
    assert result.exit_code == 2 and "--nsys needs a COMMAND" in result.output


@pytest.mark.skipif(os.environ.get("NSYS") is None and nsys.find_nsys() is None, reason="needs nsys")
@pytest.mark.gpu
def test_real_nsys_capture_range(tmp_path):
    code = ("import torch; from pathlib import Path; from infertrace.capture.torch_capture import CaptureSession\n"
            f"s = CaptureSession(Path({str(tmp_path)!r}), activities=('CPU', 'GPU'))\n"
            "a = torch.ones(512, 512, device='cuda'); s.start()\n"
            "with torch.cuda.nvtx.range('step[DECODE bs=8]'):\n    b = a @ a\n"
            "s.stop()\n")
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(tmp_path), "--",
                                       sys.executable, "-c", code])
    assert result.exit_code == 0, result.output
    assert list(tmp_path.glob("infertrace.*.nsys-rep"))
    manifest = json.loads(next(tmp_path.glob("*.manifest.json")).read_text())
    assert manifest["activities"] == ["CUDA_PROFILER"] and manifest["trace"] is None
