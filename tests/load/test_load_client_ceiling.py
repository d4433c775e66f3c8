"""benchmarks/client_ceiling.py end to end on a small load: the instant server and the paced one, counted at the
server, with the client's CPU from /proc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "client_ceiling.py"


def ceiling(tmp_path: Path, port: int, *args: str) -> dict:
    out = tmp_path / f"ceiling-{port}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "1", "--tokens", "16", "--requests", "64",
                           "--concurrency", "8", "--server-procs", "1", "--port", str(port), "--json", str(out),
                           *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["median"][0]


@pytest.mark.slow
def test_instant_and_paced_servers_are_counted_at_the_server(tmp_path):
    instant = ceiling(tmp_path, 18911)
    assert instant["client"] == "infertrace" and instant["exit_code"] == 0
    assert instant["events"] == 64 * 16 and instant["window_requests"] == 64 - 8 - 1
    assert instant["cpu_us_per_event"] > 0 and instant["events_per_s"] > 0
    # paced: 8 streams, one event a write every 20 ms, so at most 400 events/s reach the client (5% more allows
    # for a write of each stream at the window's two ends); an unpaced count of this run would be many times that
    paced = ceiling(tmp_path, 18921, "--events-per-write", "1", "--pace-ms", "20")
    assert paced["events"] == 64 * 16
    assert 200 < paced["events_per_s"] <= 400 * 1.05
    assert paced["window_requests"] == pytest.approx(paced["window_events"] / 16)
    assert paced["cpu_us_per_event"] > 0
