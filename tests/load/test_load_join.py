"""bench joined to the server's request log: every request's TTFT split into parts that add up to it, against
`infertrace serve` on the tiny model; the offset estimate and the attribution of gaps on scripted logs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infertrace.load.command import bench
from infertrace.load.records import RequestResult
from infertrace.load.results.join import TTFT_PARTS, estimate_offset, join


def test_every_request_s_ttft_is_explained_by_the_server_log(served_tiny, tiny_model_dir, tmp_path):
    out, lines, page = tmp_path / "r.json", tmp_path / "requests.jsonl", tmp_path / "run.html"
    result = CliRunner().invoke(bench, [
        "--base-url", served_tiny, "--tokenizer", str(tiny_model_dir), "--input-len", "96", "--output-len", "12",
        "--num-prompts", "120", "--request-rate", "40", "--seed", "3", "--result-json", str(out),
        "--requests-jsonl", str(lines), "--report", str(page)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 120 and doc["failed"] == 0
    joined = doc["request_log"]
    assert joined["matched"] == joined["explained"] == 120 and joined["offset_consistent"]
    assert abs(joined["offset_ms"]) < 50 and joined["offset_error_ms"] < 50  # one host, one monotonic clock
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    measured = [r for r in records if r["phase"] == "measured"]
    assert len({r["request_id"] for r in records}) == len(records)  # every send had its own id
    close = 0
    for r in measured:
        parts = r["ttft_parts"]
        assert set(parts) == set(TTFT_PARTS)
        total = sum(parts.values())
        close += abs(total - r["ttft_ms"]) <= max(1.0, 0.05 * r["ttft_ms"])
        # each part is a duration: none below zero by more than the clock offset's error
        assert min(parts.values()) >= -joined["offset_error_ms"] - 1e-6, parts
        server = r["server"]
        assert server["queue_ms"] == pytest.approx(parts["queue"])
        assert server["received_ms"] <= server["tokenized_ms"] <= server["first_step_ms"] \
            <= server["first_token_ms"] <= server["sent_ms"]
        assert len(r["itl_steps"]) == len(r["itl_ms"]) == 11
        assert {g["cause"] for g in r["itl_steps"]} <= {"decode", "mixed", "preemption", "skipped_steps"}
    assert close >= 0.99 * len(measured)
    assert {f["rule"] for f in doc["findings"]} >= {"ttft_tail", "itl_tail"}
    cohorts = joined["cohorts"]
    assert cohorts["p99"]["ttft_ms"] >= cohorts["p50"]["ttft_ms"]
    html = page.read_text()
    assert "120 of 120 requests explained" in html and 'id="ttft-slowest"' in html


def _result(index, t0, ttft, itl=(), request_id=None):
    r = RequestResult(index, t0, t0, t0 + 1.0, ttft=ttft, itl=list(itl), chunk_tokens=[1] * (len(itl) + 1))
    r.request_id = request_id or f"q{index}"
    return r


def test_offset_is_bounded_by_send_and_receive_on_both_clocks():
    # server clock = client + 5.0; one-way delays of 1-3 ms up, 2-4 ms down
    pairs = [(t0, t0 + 5.0 + up, t0 + 5.0 + up + 0.010, t0 + up + 0.010 + down)
             for t0, up, down in [(0.0, 0.003, 0.002), (1.0, 0.001, 0.004), (2.0, 0.002, 0.003)]]
    offset = estimate_offset(pairs)
    # bounds: offset <= 5.001 (the fastest way up), offset >= 4.998 (the fastest way down)
    assert offset.offset_s == pytest.approx(4.9995) and offset.error_s == pytest.approx(0.0015)
    assert offset.consistent and offset.pairs == 3


def _log(requests, steps):
    return {"requests": requests, "steps": steps}


def _step(n, start, dur, kind="decode", prefill_tokens=0, prefill_rows=0, batch=2):
    return {"step": n, "kind": kind, "start": start, "duration": dur, "batch_size": batch, "num_tokens": 0,
            "prefill_tokens": prefill_tokens, "prefill_rows": prefill_rows, "preempted": 0}


def test_parts_add_up_and_gaps_name_their_steps():
    # server = client + 100. The request waits behind step 0 (another request's 512-token prefill), is prefilled
    # in two chunks (steps 1 and 3; step 2 it sat out), then decodes in step 4 (beside someone's 1,024-token
    # prefill: a mixed step), is preempted at step 5, recomputed in step 6 and decodes in step 7.
    steps = [_step(0, 100.010, 0.020, "prefill", 512, 1, 1), _step(1, 100.030, 0.010, "prefill", 64, 1, 1),
             _step(2, 100.040, 0.005, "decode", 0, 0, 1), _step(3, 100.045, 0.010, "prefill", 32, 1, 1),
             _step(4, 100.055, 0.012, "mixed", 1024, 1, 2), _step(5, 100.067, 0.003),
             _step(6, 100.070, 0.009, "prefill", 97, 1, 1), _step(7, 100.079, 0.004)]
    rec = {"request_id": "q0", "received": 100.002, "tokenized": 100.004, "arrival": 100.005,
           "first_output": 100.0560, "sent": 100.090, "finished": 100.083, "preempted": [5], "waiting_ahead": 1,
           "running_at_arrival": 1, "steps_complete": True,
           "steps": [[1, 64, 1, 0], [3, 32, 1, 1], [4, 1, 0, 1], [6, 97, 1, 1], [7, 1, 0, 1]]}
    r = _result(0, 0.0, ttft=0.0565, itl=[0.0125, 0.0150, 0.0050])
    summary = join([r], _log([rec], steps))
    assert summary["matched"] == summary["explained"] == 1
    assert summary["offset_ms"] == pytest.approx(100_000.0, abs=1.0)
    offset = summary["offset_ms"] / 1e3
    parts = r.server["ttft_parts"]
    assert sum(parts.values()) == pytest.approx(56.5)
    assert parts["tokenize"] == pytest.approx(2.0) and parts["queue"] == pytest.approx(26.0)
    assert parts["prefill_steps"] == pytest.approx(20.0) and parts["between_prefill_waits"] == pytest.approx(5.0)
    assert parts["network_and_frontend"] == pytest.approx((100.002 - offset) * 1e3)
    assert r.server["queue_behind"] == {"steps": 1, "prefill_rows": 1, "prefill_tokens": 512}
    assert r.server["preempted_at_steps"] == [5] and r.server["resumed_at_steps"] == [6]
    causes = [(g["step"], g["cause"], g["others_prefill_tokens"]) for g in r.server["itl_steps"]]
    assert causes == [(4, "mixed", 1024), (6, "preemption", 0), (7, "decode", 0)]
    assert r.server["itl_steps"][0]["server_gap_ms"] == pytest.approx(12.0)


def test_unmatched_and_unexplainable_requests_are_counted_not_guessed():
    rec = {"request_id": "q0", "received": None, "tokenized": None, "first_output": None, "steps": [],
           "steps_complete": True}
    a, b = _result(0, 0.0, 0.010), _result(1, 0.0, 0.010)
    summary = join([a, b], _log([rec], []))
    assert (summary["requests"], summary["matched"], summary["explained"]) == (2, 1, 0)
    assert summary["offset_ms"] is None and b.server is None and "ttft_parts" not in a.server


def test_the_bundled_engine_in_process_is_joined_on_one_clock(tiny_model_dir, tmp_path):
    out, lines = tmp_path / "r.json", tmp_path / "r.jsonl"
    result = CliRunner().invoke(bench, [
        "--model", str(tiny_model_dir), "--num-prompts", "24", "--concurrency", "6", "--input-len", "40",
        "--output-len", "6", "--ignore-eos", "--result-json", str(out), "--requests-jsonl", str(lines)],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    joined = json.loads(out.read_text())["request_log"]
    assert joined["matched"] == joined["explained"] == 24 and joined["offset_consistent"]
    assert abs(joined["offset_ms"]) <= joined["offset_error_ms"] + 1e-6  # the same process: the same clock
    for r in map(json.loads, lines.read_text().splitlines()):
        if r["phase"] == "measured":
            assert sum(r["ttft_parts"].values()) == pytest.approx(r["ttft_ms"], abs=1e-6)
            assert r["request_id"].startswith("bench-") and len(r["itl_steps"]) == 5
