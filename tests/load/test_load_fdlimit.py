"""Open files for many streams (load/client/fdlimit.py): ten thousand streams at once, and too low a limit is
one line before any request."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.cli import main

HERE = Path(__file__).resolve().parent



def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


@pytest.fixture
def instant_server():
    proc = subprocess.Popen([sys.executable, str(HERE / "instant_server.py")], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_ten_thousand_concurrent_streams(instant_server, tmp_path):
    out = tmp_path / "r.json"
    started = time.monotonic()
    res = bench("--base-url", instant_server, "--served-model-name", "m", "--num-prompts", 10_000,
                "--concurrency", 10_000, "--warmup", 0, "--output-len", 2, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 10_000 and doc["failed"] == 0 and doc["total_output_tokens"] == 20_000
    assert time.monotonic() - started < 120


def test_too_few_open_files_is_one_line(instant_server):
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "from infertrace.cli import main\n"
        f"sys.argv = ['infertrace', 'bench', '--base-url', {instant_server!r}, '--served-model-name', 'm',"
        " '--num-prompts', '1000', '--concurrency', '1000', '--warmup', '0']\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "1000 concurrent streams need about 1064 open files" in done.stderr
    assert "ulimit -n 1064" in done.stderr

