"""`infertrace profile` and `infertrace analyze` on real vLLM captures.

Two captures land in the server's one profiler directory: the first by `profile --seconds`, the second by
`profile --start`/`--stop` around two requests of known prompt length sent one after the other. `analyze` of the
directory must read the second capture only, and its step table must show what the server was sent: vLLM's CPU
worker annotates each step `execute_context_{requests}({tokens})_generation_{requests}({tokens})`, so the prefill
steps' tokens are the prompts' lengths and there is one decode step per generated token after the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

# two prompts of distinct token ids (no prefix-cache hit can shorten their prefill), sent one after the other
PROMPTS = [(list(range(1000, 1037)), 4), (list(range(2000, 2053)), 3)]
STARTED_TIMEOUT_S = 120.0


def _profile(server, env, *args, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "infertrace", "profile", "--url", server.base_url, *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"profile {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _rank_traces(directory: Path) -> set[Path]:
    """The worker's trace files (not the API server's `*.async_llm.*` one)."""
    return {p for p in directory.glob("*.pt.trace.json*") if ".async_llm." not in p.name}


def _manifest_files(trace_dir: Path) -> set[str]:
    """Every file the captures' manifests (`*.infertrace.json`, left by `--stop`) list, by name."""
    manifests = [json.loads(p.read_text()) for p in trace_dir.glob("*.infertrace.json")]
    return {Path(f).name for m in manifests for f in m.get("files", [])}


@pytest.fixture(scope="module")
def captures(vllm_server, tmp_path_factory):
    """(first capture's rank traces, second capture's, the answers sent during the second, profile env)."""
    env = {**os.environ, "INFERTRACE_CACHE": str(tmp_path_factory.mktemp("cache"))}
    trace_dir = vllm_server.trace_dir
    before = _rank_traces(trace_dir) if trace_dir.is_dir() else set()

    # the first capture: --seconds, with one request sent while it captures
    log = tmp_path_factory.mktemp("profile") / "seconds.log"
    with open(log, "w") as out:
        seconds = subprocess.Popen([sys.executable, "-m", "infertrace", "profile", "--url", vllm_server.base_url,
                                    "--seconds", "4", "--name", "first", "--output-dir", str(trace_dir)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + STARTED_TIMEOUT_S
        while "profiler started" not in log.read_text():
            assert seconds.poll() is None, f"profile --seconds ended before starting:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"profile --seconds did not start:\n{log.read_text()}"
            time.sleep(0.2)
        vllm_server.complete(list(range(3000, 3020)), 2)
        assert seconds.wait(timeout=600) == 0, log.read_text()
    finally:
        if seconds.poll() is None:
            seconds.kill()
            seconds.wait()
    first = _rank_traces(trace_dir) - before

    # the second: --start, two requests one after the other, --stop
    _profile(vllm_server, env, "--start", "--name", "second", "--output-dir", str(trace_dir))
    answers = [vllm_server.complete(ids, n) for ids, n in PROMPTS]
    _profile(vllm_server, env, "--stop")
    second = _rank_traces(trace_dir) - before - first
    return first, second, answers, env


def test_each_capture_writes_its_rank_trace(captures):
    first, second, answers, _ = captures
    assert len(first) == 1 and len(second) == 1, (first, second)
    assert [a["usage"]["prompt_tokens"] for a in answers] == [len(ids) for ids, _ in PROMPTS]


def test_profile_lists_the_rank_trace_it_captured(vllm_server, captures):
    """Told where the server writes (`--output-dir`, vLLM's torch_profiler_dir), the manifest `--stop` leaves
    names the worker's trace of that capture (vLLM 0.32's CPU worker names it
    `{profile_prefix}_rank0.*` or, without a prefix, `rank0.*`, not `..._dp0_pp0_tp0_dcp0_ep0_rank0.*`)."""
    first, second, _, _ = captures
    listed = _manifest_files(vllm_server.trace_dir)
    assert {p.name for p in first | second} <= listed, listed


@pytest.fixture(scope="module")
def analysed(vllm_server, captures, tmp_path_factory):
    out = tmp_path_factory.mktemp("analyze") / "report.json"
    done = subprocess.run([sys.executable, "-m", "infertrace", "analyze", str(vllm_server.trace_dir), "--json",
                           str(out)], capture_output=True, text=True, env=captures[3], timeout=600)
    assert done.returncode == 0, f"analyze failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr}"
    return json.loads(out.read_text()), done.stderr


def test_analyze_reads_only_the_newest_capture(captures, analysed):
    _, second, _, _ = captures
    report, stderr = analysed
    assert [r["file"] for r in report["ranks"]] == [next(iter(second)).name], (report["ranks"], stderr)


def test_step_table_shows_what_the_server_was_sent(analysed):
    """Prefill steps carry the prompts' tokens, one request each (they were sent one after the other); decode steps
    one token of one request, one per generated token after the first."""
    steps = analysed[0]["tables"]["steps"]
    prefill = [s for s in steps if s["type"] == "PREFILL"]
    decode = [s for s in steps if s["type"] == "DECODE"]
    assert [(s["bs"], s["toks"]) for s in prefill] == [(1, len(ids)) for ids, _ in PROMPTS], prefill
    assert [(s["bs"], s["toks"]) for s in decode] == [(1, 1)] * sum(n - 1 for _, n in PROMPTS), decode
    assert not [s for s in steps if s["type"] == "MIXED"]
