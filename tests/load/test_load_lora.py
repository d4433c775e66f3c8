"""bench --lora-modules: each request names a LoRA adapter drawn by the shares, and the run is split per adapter."""

import json
import urllib.error
import urllib.request
from collections import Counter

import pytest
from aiohttp import web
from click.testing import CliRunner

from infertrace.exits import BAD_INPUT
from infertrace.gate.command import gate
from infertrace.load.client.adapters import AdapterMix
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig, parse_lora_modules
from tests.load.conftest import ThreadedServer

TOKENS = {"base": 2, "a": 3, "b": 5}  # output tokens the stand-in streams for each model: a per-adapter signature


class LoraServer(ThreadedServer):
    """/v1/completions that streams TOKENS[model] one-token chunks, refuses a model it does not serve with vLLM's
    404, and keeps (request id, model, prompt length) of every request."""

    def __init__(self, served=("base", "a", "b")) -> None:
        super().__init__()
        self.served = served
        self.seen: list[tuple[str, str, int]] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model, prompt = body["model"], body["prompt"]
        if model not in self.served:
            return web.json_response({"error": {"message": f"The model `{model}` does not exist."}}, status=404)
        self.seen.append((request.headers["X-Request-Id"], model, len(prompt)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = TOKENS[model]
        for i in range(1, n + 1):
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": "length" if i == n else None}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": i}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": m} for m in self.served]})

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app



@pytest.fixture
def server():
    with LoraServer() as s:
        yield s


def invoke(*args, command=bench):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def run(server, tmp_path, *extra, num_prompts=40, seed=0):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = invoke("--base-url", server.url, "--model", "base", "--lora-modules", "a=3,b=1", "--input-len", 8,
                 "--output-len", 8, "--num-prompts", num_prompts, "--warmup", 1, "--seed", seed,
                 "--scrape-interval", 0, "--result-json", out, "--requests-jsonl", reqs, *extra)
    assert res.exit_code == 0, res.output
    return res, json.loads(out.read_text()), [json.loads(x) for x in reqs.read_text().splitlines()]


def test_each_request_names_its_adapter_and_the_run_splits_by_adapter(server, tmp_path):
    res, data, lines = run(server, tmp_path)
    by_id = {rid: model for rid, model, _ in server.seen}
    assert all(line["adapter"] == by_id[line["request_id"]] for line in lines)  # the record names what was sent
    measured = [x for x in lines if x["phase"] == "measured"]
    sent = Counter(by_id[x["request_id"]] for x in measured)
    assert set(sent) == {"a", "b"} and sent["a"] + sent["b"] == 40 and sent["a"] > sent["b"]  # shares 3:1
    per = data["per_adapter"]
    assert list(per) == ["a", "b"] and per["a"]["share"] == 0.75 and per["b"]["share"] == 0.25
    for name in ("a", "b"):
        f = per[name]
        assert (f["requests"], f["completed"], f["failed"]) == (sent[name], sent[name], 0)
        assert f["total_output_tokens"] == TOKENS[name] * sent[name]
        assert f["total_input_tokens"] == 8 * sent[name]
        assert f["request_throughput"] == pytest.approx(sent[name] / data["duration"])
        assert f["output_throughput"] == pytest.approx(TOKENS[name] * sent[name] / data["duration"])
        mine = [x for x in measured if x["adapter"] == name]
        assert f["median_tpot_ms"] is not None and f["p99_e2el_ms"] >= f["median_e2el_ms"] > 0
        assert len(mine[0]["itl_ms"]) == TOKENS[name] - 1
        assert data[f"adapter_{name}_requests"] == sent[name]
        assert data[f"adapter_{name}_median_ttft_ms"] == f["median_ttft_ms"]
    assert per["a"]["request_throughput"] + per["b"]["request_throughput"] == pytest.approx(data["request_throughput"])
    assert "per LoRA adapter" in res.output and "75%" in res.output
    gated = invoke(tmp_path / "r.json", "--max", "adapter_b_failed=0",
                   "--min", f"adapter_a_requests={sent['a']}", command=gate)
    assert gated.exit_code == 0, gated.output
    gated = invoke(tmp_path / "r.json", "--min", f"adapter_b_output_throughput={per['b']['output_throughput'] * 2}",
                   command=gate)
    assert gated.exit_code == 1, gated.output


def test_the_draw_is_the_seeds_and_follows_the_shares():
    mix = AdapterMix.of({"a": 3, "b": 1, "c": 0.5}, seed=7)
    counts = Counter(mix.pick(i) for i in range(20000))
    assert counts["a"] / 20000 == pytest.approx(3 / 4.5, abs=0.015)
    assert counts["c"] / 20000 == pytest.approx(0.5 / 4.5, abs=0.01)
    assert [mix.pick(i) for i in range(50)] == [AdapterMix.of({"a": 3, "b": 1, "c": 0.5}, 7).pick(i) for i in range(50)]
    assert [mix.pick(i) for i in range(50)] != [AdapterMix.of({"a": 3, "b": 1, "c": 0.5}, 8).pick(i) for i in range(50)]
    assert {AdapterMix.of({"only": 1}, 0).pick(i) for i in range(100)} == {"only"}
    assert AdapterMix.of({}, 0) is None


def test_an_adapter_the_server_does_not_serve_is_named_in_one_line(tmp_path):
    with LoraServer(served=("base", "a")) as s:  # infertrace serve lists its one model likewise
        res = CliRunner().invoke(bench, ["--base-url", s.url, "--lora-modules", "a,c", "--num-prompts", "2",
                                         "--scrape-interval", "0"])
    assert res.exit_code == BAD_INPUT
    assert "the server refuses LoRA adapter 'c'" in res.output and len(res.output.strip().splitlines()) == 1
    assert s.seen == []  # refused before any load


@pytest.mark.parametrize("text, message", [
    ("a=/models/lora-1", "NAME=SHARE"), ("a,a", "named twice"), ("", "expected NAME"),
])
def test_bad_lora_modules_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(text)


@pytest.mark.parametrize("fields, message", [
    ({"lora_modules": {"a": 1.0}}, "--base-url"),
    ({"lora_modules": {"a": 0.0}, "base_url": "http://x"}, "positive"),
    ({"lora_modules": {"a b": 1.0}, "base_url": "http://x"}, "letters, digits"),
])
def test_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**fields)


def test_the_cli_gives_one_line_for_a_path_where_a_share_goes(server):
    res = CliRunner().invoke(bench, ["--base-url", server.url, "--lora-modules", "a=./loras/lora-1"])
    assert res.exit_code == BAD_INPUT and "NAME=SHARE" in res.output


def test_infertrace_serve_serves_no_adapter_and_bench_says_so_in_one_line(served_tiny):
    res = CliRunner().invoke(bench, ["--base-url", served_tiny, "--lora-modules", "a", "--num-prompts", "2",
                                     "--scrape-interval", "0"])
    assert res.exit_code == BAD_INPUT and "the server refuses LoRA adapter 'a'" in res.output
    assert "infertrace serve serves no adapters" in " ".join(res.output.split())
    # a request that names an adapter anyway gets vLLM's answer for a model it does not serve: 404, naming both
    request = urllib.request.Request(f"{served_tiny}/v1/completions", method="POST",
                                     data=json.dumps({"model": "a", "prompt": "x", "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"].startswith("the model 'a' does not exist; this server serves")
