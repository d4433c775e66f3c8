"""The request log over HTTP: X-Request-Id names a request, GET /v1/request_log gives its life on the server's
clock (front-end times, arrival, the steps it rode, first token, end), read from a cursor."""

from __future__ import annotations

import asyncio

import pytest

BODY = {"model": "tiny", "prompt": "the model token batch", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_a_request_named_by_the_client_has_its_life_in_the_log(serve_tiny, read_sse, engine_process):
    async with serve_tiny(engine_process=engine_process) as client:
        cursor = (await (await client.get("/v1/request_log?limit=0")).json())["next"]
        resp = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "run1-7"})
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "run1-7"
        await read_sse(resp)
        resp = await client.post("/v1/completions", json={**BODY, "stream": False})  # the server names this one
        server_named = (await resp.json())["id"]
        for _ in range(50):  # the front end's times reach the engine in a message of their own
            log = await (await client.get(f"/v1/request_log?since={cursor}")).json()
            if len(log["requests"]) == 2 and all(r["sent"] for r in log["requests"]):
                break
            await asyncio.sleep(0.02)
    mine, other = log["requests"]
    assert (mine["request_id"], other["request_id"]) == ("run1-7", server_named)
    steps = {s["step"]: s for s in log["steps"]}
    rode = mine["steps"]
    assert sum(r[1] for r in rode if r[2]) == mine["prompt_tokens"] and sum(r[3] for r in rode) == 4
    first_token = next(steps[r[0]] for r in rode if r[3])
    # one clock, in causal order
    assert (mine["received"] <= mine["tokenized"] <= mine["arrival"] <= steps[rode[0][0]]["start"]
            <= first_token["start"] + first_token["duration"] <= mine["first_output"] <= mine["sent"])
    assert mine["finish_reason"] == "length" and mine["output_tokens"] == 4
    assert mine["finished"] <= mine["sent"] and mine["steps_complete"]


async def test_request_ids_are_checked(serve_tiny):
    async with serve_tiny() as client:
        for bad in ("", "x" * 129, "has space", "quote\"", "ü"):
            resp = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": bad})
            assert resp.status == 400, bad
            error = (await resp.json())["error"]
            assert error["code"] == "invalid_request_id" and error["param"] == "X-Request-Id"
        # an id still in flight is refused; once it ended it may be used again
        slow = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "max_tokens": 200},
                                                 headers={"X-Request-Id": "dup"}))
        for _ in range(200):
            if "dup" in client.state.in_flight:
                break
            await asyncio.sleep(0.01)
        resp = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "dup"})
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "duplicate_request_id"
        await (await slow).read()
        resp = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "dup"})
        assert resp.status == 200
        await resp.read()


async def test_read_arguments_and_the_log_switched_off(serve_tiny):
    async with serve_tiny() as client:
        for query in ("since=x", "since=-1", "limit=1.5", f"since={2**64 + 1}", f"limit={2**70}",
                      "since=" + "9" * 5000):
            resp = await client.get(f"/v1/request_log?{query}")
            assert resp.status == 400, query
            assert (await resp.json())["error"]["param"] == query.split("=")[0]
        for i in range(3):
            await (await client.post("/v1/completions", json={**BODY, "stream": False},
                                     headers={"X-Request-Id": f"c{i}"})).read()
        log = await (await client.get("/v1/request_log?since=1&limit=1")).json()
        assert [r["request_id"] for r in log["requests"]] == ["c1"] and log["next"] == 2  # where the rest begins
        log = await (await client.get(f"/v1/request_log?since={2**63 - 1}")).json()
        assert log["requests"] == [] and log["next"] == 3
    async with serve_tiny({"request_log_size": 0}) as client:
        resp = await client.get("/v1/request_log")
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "request_log_off"
        resp = await client.post("/v1/completions", json={**BODY, "stream": False})
        assert resp.status == 200


async def test_a_capture_gets_the_log_of_its_requests_beside_its_trace(serve_tiny, tmp_path):
    import json
    import re
    from pathlib import Path

    from infertrace.analyze.report import analyze_path

    async with serve_tiny(profile_dir=tmp_path) as client:
        await (await client.post("/v1/completions", json={**BODY, "stream": False},
                                 headers={"X-Request-Id": "before"})).read()
        assert (await client.post("/start_profile")).status == 200
        for name in ("a", "b"):
            await (await client.post("/v1/completions", json={**BODY, "stream": False},
                                     headers={"X-Request-Id": name})).read()
        stopped = await (await client.post("/stop_profile")).json()
    [trace] = stopped["trace_files"]
    log_path = Path(stopped["request_log"])
    assert log_path.parent == Path(trace).parent and str(log_path) in stopped["files"]
    assert log_path.name == re.split(r"\.rank\d+|\.pt\.trace", Path(trace).name)[0] + ".request_log.json"
    log = json.loads(log_path.read_text())
    assert [r["request_id"] for r in log["requests"]] == ["a", "b"]  # "before" ended before the capture

    report = analyze_path(Path(trace).parent)
    table = report.tables["step_requests"]
    assert set(table["request_id"]) == {"a", "b"}
    steps = report.tables["steps"]
    numbered = steps["label"].str.extract(r" #(\d+)\]$", expand=False).dropna().astype(int)
    assert set(table["step"]) <= set(numbered)
    for _, rows in table.groupby("step"):
        assert rows["token share"].sum() == pytest.approx(1.0)
    ridden = {r["request_id"]: r["steps"] for r in log["requests"]}
    for request_id, rows in table.groupby("request_id"):  # each step it rode in the trace, its tokens in it
        assert dict(zip(rows["step"], rows["tokens"])) == {s[0]: s[1] for s in ridden[request_id]
                                                             if s[0] in set(numbered)}


async def test_answers_are_pages_a_reader_follows_to_the_end(serve_tiny, monkeypatch):
    from infertrace.server.frontend import request_log

    monkeypatch.setattr(request_log, "MAX_PAGE_REQUESTS", 2)
    async with serve_tiny() as client:
        for i in range(5):
            await (await client.post("/v1/completions", json={**BODY, "stream": False},
                                     headers={"X-Request-Id": f"p{i}"})).read()
        pages, since = [], 0
        while True:
            page = await (await client.get(f"/v1/request_log?since={since}&limit=100000")).json()
            if not page["requests"]:
                break
            pages.append([r["request_id"] for r in page["requests"]])
            since = page["next"]
    assert pages == [["p0", "p1"], ["p2", "p3"], ["p4"]]


async def test_a_front_end_sends_the_engine_one_log_read_at_a_time(serve_tiny):
    async with serve_tiny() as client:
        await (await client.post("/v1/completions", json={**BODY, "stream": False})).read()
        engine = client.state.engine
        command, busy, most = engine.command, [0], [0]

        async def counted(name, args=None):
            if name != "request_log":
                return await command(name, args)
            busy[0] += 1
            most[0] = max(most[0], busy[0])
            try:
                return await command(name, args)
            finally:
                busy[0] -= 1

        engine.command = counted
        answers = await asyncio.gather(*(client.get("/v1/request_log") for _ in range(8)))
        assert [a.status for a in answers] == [200] * 8
        assert most[0] == 1
