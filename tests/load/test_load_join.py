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


def _explainable():
    """One request's record and the steps it rode, on a server clock 100 s ahead of the client's. The request
    waits behind step 0 (another request's 512-token prefill), is prefilled in two chunks (steps 1 and 3; step 2 it
    sat out), then decodes in step 4 (beside someone's 1,024-token prefill: a mixed step), is preempted at step 5,
    recomputed in step 6 and decodes in step 7."""
    steps = [_step(0, 100.010, 0.020, "prefill", 512, 1, 1), _step(1, 100.030, 0.010, "prefill", 64, 1, 1),
             _step(2, 100.040, 0.005, "decode", 0, 0, 1), _step(3, 100.045, 0.010, "prefill", 32, 1, 1),
             _step(4, 100.055, 0.012, "mixed", 1024, 1, 2), _step(5, 100.067, 0.003),
             _step(6, 100.070, 0.009, "prefill", 97, 1, 1), _step(7, 100.079, 0.004)]
    rec = {"request_id": "q0", "received": 100.002, "tokenized": 100.004, "arrival": 100.005,
           "first_output": 100.0560, "sent": 100.090, "finished": 100.083, "preempted": [5], "waiting_ahead": 1,
           "running_at_arrival": 1, "steps_complete": True,
           "steps": [[1, 64, 1, 0], [3, 32, 1, 1], [4, 1, 0, 1], [6, 97, 1, 1], [7, 1, 0, 1]]}
    return rec, steps


def test_parts_add_up_and_gaps_name_their_steps():
    rec, steps = _explainable()
    r = _result(0, 0.0, ttft=0.0565, itl=[0.0125, 0.0150, 0.0050])
    summary = join([r], _log([rec], steps))
    assert summary["matched"] == summary["explained"] == 1 and summary["warnings"] == []
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


def test_requests_whose_steps_the_log_does_not_hold_whole_are_said_so():
    rec, steps = _explainable()
    cut = {**rec, "request_id": "q1", "steps_complete": False}
    a = _result(0, 0.0, ttft=0.0565, itl=[0.0125, 0.0150, 0.0050])
    b = _result(1, 0.0, ttft=0.0565, itl=[0.0125, 0.0150, 0.0050])
    summary = join([a, b], _log([rec, cut], steps))
    assert (summary["matched"], summary["explained"]) == (2, 1)
    assert "ttft_parts" not in b.server and "itl_steps" not in b.server
    [warning] = summary["warnings"]
    assert warning.startswith("1 of 2 matched requests have steps the server's request log no longer held")


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
    # the tail findings are printed under the table, as the result file holds them (no --report needed)
    saved = [f["what"] for f in json.loads(out.read_text())["findings"] if f["rule"] in ("ttft_tail", "itl_tail")]
    assert saved and all(" ".join(what.split()[:4]) in " ".join(result.stderr.split()) for what in saved)
    for r in map(json.loads, lines.read_text().splitlines()):
        if r["phase"] == "measured":
            assert sum(r["ttft_parts"].values()) == pytest.approx(r["ttft_ms"], abs=1e-6)
            assert r["request_id"].startswith("bench-") and len(r["itl_steps"]) == 5


# ----- a request log of the wrong shape, or too big, never costs the run -----
GOOD = {"request_id": "q0", "received": 100.002, "tokenized": 100.004, "first_output": 100.05, "steps": [],
        "steps_complete": True}
MALFORMED = [  # what a broken or hostile server may answer in place of one record
    {"received": 1.0},  # no request_id
    {**GOOD, "request_id": 7},
    {**GOOD, "request_id": None},
    {**GOOD, "received": float("nan")},
    {**GOOD, "first_output": float("inf")},
    {**GOOD, "received": 10**400},
    {**GOOD, "tokenized": "100.004"},
    {**GOOD, "steps": "all of them"},
    {**GOOD, "steps": [[1, 64, 1]]},
    {**GOOD, "steps": [[1, "64", 1, 1]]},
    {**GOOD, "preempted": "5"},
    {**GOOD, "waiting_ahead": -1},
    {**GOOD, "prompt_tokens": 10**30},
    {**GOOD, "steps_complete": "yes"},
    "q0",
    [GOOD],
]


@pytest.mark.parametrize("bad", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_request_record_is_skipped_and_counted(bad):
    a, b = _result(0, 0.0, 0.1, request_id="q0"), _result(1, 0.0, 0.1, request_id="q1")
    good = {**GOOD, "request_id": "q1"}
    summary = join([a, b], _log([good, bad], []))
    assert summary["matched"] == 1 and b.server is not None and a.server is None
    assert len(summary["warnings"]) == 1
    assert summary["warnings"][0].startswith("the server's request log had 1 malformed request record, skipped")


@pytest.mark.parametrize("bad", [{"step": 1, "start": float("nan"), "duration": 0.01},
                                 {"step": 1, "start": 1.0, "duration": -1.0}, {"start": 1.0, "duration": 0.01},
                                 {"step": "1", "start": 1.0, "duration": 0.01}, None])
def test_a_malformed_step_is_skipped_and_counted(bad):
    summary = join([_result(0, 0.0, 0.1)], _log([GOOD], [_step(0, 100.01, 0.02), bad]))
    assert summary["matched"] == 1
    assert summary["warnings"] == [summary["warnings"][0]] and "1 malformed step record" in summary["warnings"][0]


@pytest.mark.parametrize("log", [{"requests": {"q0": GOOD}, "steps": []}, {"requests": [GOOD], "steps": "x"}, "log"])
def test_a_log_whose_lists_are_not_lists_is_said_so(log):
    summary = join([_result(0, 0.0, 0.1)], log)
    assert summary["warnings"] and summary["matched"] in (0, 1)


def test_crossed_clock_bounds_leave_ttft_parts_out_with_a_warning():
    # request q0 says the server clock is 100 s ahead; q1 (sent 1 s later, answered as quickly) says 1,000 s:
    # no offset fits both, and moving times by their midpoint would make parts of hundreds of seconds
    steps = [_step(0, 100.010, 0.020, "prefill", 64, 1, 1), _step(1, 1001.010, 0.020, "prefill", 64, 1, 1)]
    recs = [{"request_id": "q0", "received": 100.002, "tokenized": 100.004, "first_output": 100.031,
             "steps": [[0, 64, 1, 1]]},
            {"request_id": "q1", "received": 1001.002, "tokenized": 1001.004, "first_output": 1001.031,
             "steps": [[1, 64, 1, 1]]}]
    a, b = _result(0, 0.0, 0.035), _result(1, 1.0, 0.035)
    summary = join([a, b], _log(recs, steps))
    assert summary["offset_consistent"] is False and summary["matched"] == 2 and summary["explained"] == 0
    assert "ttft_parts" not in a.server and "ttft_parts" not in b.server
    assert a.server["received_ms"] is None  # no time moved onto the client's clock
    assert a.server["queue_ms"] == pytest.approx(6.0)  # the server's own durations stand
    assert len(summary["warnings"]) == 1 and "clocks disagree" in summary["warnings"][0]


def _served_log(server, start=0, shape=lambda i, rec: rec):
    """The stand-in's generation requests as the server's request log would list them, from `start` on."""
    out = []
    for i, (rid, arrived) in enumerate(server.request_ids[start:], start):
        out.append(shape(i, {"request_id": rid, "seq": i, "received": arrived, "tokenized": arrived,
                             "arrival": arrived, "first_output": arrived, "steps": [], "steps_complete": True}))
    return out


def _bench(standin, prompts_jsonl, tmp_path, *extra):
    out, lines = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [
        "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts", "6",
        "--concurrency", "2", "--warmup", "0", "--result-json", str(out), "--requests-jsonl", str(lines),
        *map(str, extra)], catch_exceptions=False)
    doc = json.loads(out.read_text()) if out.exists() else None
    return res, doc, lines


def test_a_malformed_request_log_costs_neither_the_run_nor_its_files(standin, prompts_jsonl, tmp_path):
    from aiohttp import web

    async def answer(server, since, limit, request):
        if limit == 0:
            return web.json_response({"next": 0, "requests": [], "steps": []})
        rows = _served_log(server, since, lambda i, rec: rec if i == 0 else {**rec, **MALFORMED[i % 14]})
        return web.Response(text=json.dumps({"next": len(server.request_ids), "requests": rows, "steps": [
            {"step": 10**400, "start": float("nan"), "duration": 1}]}), content_type="application/json")

    standin.request_log = answer
    res, doc, lines = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0, res.output
    assert doc["completed"] == 6 and len(lines.read_text().splitlines()) == 6
    assert doc["request_log"]["matched"] == 1
    assert "warning: the server's request log had 5 malformed request records, skipped" in res.stderr
    assert "malformed step record" in res.stderr


def test_the_log_is_read_page_by_page_following_next(standin, prompts_jsonl, tmp_path):
    from aiohttp import web

    async def answer(server, since, limit, request):  # two rows a page, whatever was asked
        rows = _served_log(server, since)[:min(2, limit)]
        return web.json_response({"next": rows[-1]["seq"] + 1 if rows else since, "requests": rows, "steps": []})

    standin.request_log = answer
    res, doc, _ = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0 and doc["request_log"]["matched"] == 6 and not doc["request_log"]["warnings"]
    assert sum("since=" in q for q in standin.log_reads) == 4  # three pages of two, then an empty one


def test_a_log_that_answers_the_same_page_forever_is_left(standin, prompts_jsonl, tmp_path):
    from aiohttp import web

    async def answer(server, since, limit, request):
        return web.json_response({"next": 0, "requests": _served_log(server)[:limit], "steps": []})

    standin.request_log = answer
    res, doc, _ = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0 and doc["completed"] == 6
    assert sum("since=" in q for q in standin.log_reads) == 1 and doc["request_log"]["matched"] == 6
    assert "does not move on" in res.stderr


def test_an_endless_log_is_read_to_a_bound(standin, prompts_jsonl, tmp_path, monkeypatch):
    from aiohttp import web

    from infertrace.load.client import request_log

    monkeypatch.setattr(request_log, "MAX_ROWS", 40)

    async def answer(server, since, limit, request):  # a log that always has ten more
        rows = [{"request_id": f"other-{i}", "seq": i} for i in range(since, since + 10)]
        return web.json_response({"next": since + 10, "requests": rows, "steps": []})

    standin.request_log = answer
    res, doc, _ = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0 and doc["completed"] == 6
    assert sum("since=" in q for q in standin.log_reads) == 4 and "holds over 40 requests" in res.stderr


@pytest.mark.parametrize("chunked", [True, False])
def test_a_page_too_big_is_not_read_past_its_bound(standin, prompts_jsonl, tmp_path, monkeypatch, chunked):
    from aiohttp import web

    from infertrace.load.client import request_log

    monkeypatch.setattr(request_log, "MAX_PAGE_BYTES", 1 << 20)
    sent = []

    async def answer(server, since, limit, request):
        if limit == 0:
            return web.json_response({"next": 0, "requests": [], "steps": []})
        if not chunked:
            return web.Response(body=b" " * (8 << 20), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            for _ in range(64):  # 64 MiB unless the reader stops
                await resp.write(b" " * (1 << 20))
                sent.append(1)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    standin.request_log = answer
    res, doc, _ = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0 and doc["completed"] == 6
    assert "answered more than 1 MiB; not read" in res.stderr and doc["request_log"]["matched"] == 0
    if chunked:
        assert len(sent) < 64


def test_ctrl_c_during_the_log_fetch_stops_it_and_saves_the_run(standin, prompts_jsonl, tmp_path):
    import asyncio
    import os
    import signal
    import subprocess
    import sys
    import time

    from aiohttp import web

    done = []

    async def answer(server, since, limit, request):  # the cursor at once, then a log that takes a minute
        if limit == 0:
            return web.json_response({"next": 0, "requests": [], "steps": []})
        for _ in range(600):
            if done:
                break
            await asyncio.sleep(0.1)
        return web.json_response({"next": 0, "requests": [], "steps": []})

    standin.request_log = answer
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-c", "from infertrace.load.command import bench; bench()",
                             "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl),
                             "--num-prompts", "6", "--concurrency", "2", "--warmup", "0", "--result-json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "120"})
    deadline = time.time() + 60
    while not any("since=" in q for q in standin.log_reads) and time.time() < deadline:
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    done.append(True)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - sent < 10
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["completed"] == 6


@pytest.mark.parametrize("cursor", ["abc", -1, 10**400, 1.5, True, None])
def test_a_cursor_that_is_no_sequence_number_means_no_join(standin, prompts_jsonl, tmp_path, cursor):
    from aiohttp import web

    async def answer(server, since, limit, request):
        return web.Response(text=json.dumps({"next": cursor, "requests": [], "steps": []}),
                            content_type="application/json")

    standin.request_log = answer
    res, doc, _ = _bench(standin, prompts_jsonl, tmp_path)
    assert res.exit_code == 0 and doc["completed"] == 6 and doc.get("request_log") is None
    assert not any("since=" in q for q in standin.log_reads)


def test_fetch_keeps_only_checked_rows_page_by_page():
    import asyncio

    from infertrace.load.client.http_target import HttpTarget

    pages = {0: {"next": 3, "requests": [{**GOOD, "seq": 0}, [], {**GOOD, "request_id": "q1", "seq": 2}],
                 "steps": [_step(0, 100.01, 0.02), {}]},
             3: {"next": 5, "requests": [{}, {**GOOD, "request_id": "q2", "seq": 4}],
                 "steps": [_step(0, 100.01, 0.02)]},
             5: {"next": 5, "requests": [], "steps": []}}
    asked = []

    class Transport:
        async def request_json_sized(self, method, path, timeout_s, max_bytes):
            since = int(path.split("since=")[1].split("&")[0])
            asked.append(since)
            return 200, pages[since], 100

    log = asyncio.run(HttpTarget("http://x", "completions", "m", Transport()).fetch_request_log(0))
    assert asked == [0, 3, 5]
    assert [r["request_id"] for r in log["requests"]] == ["q0", "q1", "q2"] and len(log["steps"]) == 1
    assert log["malformed"]["requests"][0] == 2 and log["malformed"]["steps"][0] == 1
    summary = join([_result(0, 0.0, 0.1, request_id="q2")], log)
    assert summary["matched"] == 1 and len(summary["warnings"]) == 2


def test_every_request_of_a_saturated_run_is_read_whole_and_explained():
    """256 streams of 128 output tokens: each request spans ~130 steps of 256 rows. Read as bench reads it (pages
    of the front end's bound, following `next`), every request comes whole and the join explains each one."""
    import asyncio
    from urllib.parse import parse_qsl, urlsplit

    from infertrace.load.client.http_target import HttpTarget
    from infertrace.server.frontend.request_log import read_args
    from tests.engine.test_engine_request_log import saturated_log

    server, ends = saturated_log(requests=512)
    pages = []

    class Transport:
        async def request_json_sized(self, method, path, timeout_s, max_bytes):
            answer = json.loads(json.dumps(server.read(**read_args(dict(parse_qsl(urlsplit(path).query))))))
            pages.append(len(answer["requests"]))
            return 200, answer, 0

    log = asyncio.run(HttpTarget("http://x", "completions", "m", Transport()).fetch_request_log(0))
    assert len(log["requests"]) == 512 and log["fetch_warnings"] == []
    results = []
    for index, rec in enumerate(log["requests"]):  # the client's clock is the server's; 1 ms each way
        arrival, sampled = ends[rec["request_id"]]
        t0 = rec["received"] - 0.001
        gaps = [b - a for a, b in zip(sampled, sampled[1:])]
        results.append(_result(index, t0, rec["first_output"] + 0.001 - t0, gaps, rec["request_id"]))
    summary = join(results, log)
    assert (summary["matched"], summary["explained"], summary["warnings"]) == (512, 512, [])
    assert all(len(r.server["itl_steps"]) == 127 for r in results)
    assert len(pages) < 10  # many requests a page, then the empty page that ends the read
