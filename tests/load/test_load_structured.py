"""bench --structured: constrained requests carry their schema, each output is judged against it, and the run
reports valid / invalid / total beside TTFT and ITL of constrained and unconstrained requests."""

import json

import pytest
from aiohttp import web
from click.testing import CliRunner

from infertrace.exits import BAD_INPUT
from infertrace.load.client.http_target import decode_data
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig
from infertrace.load.workloads.structured import (
    StructuredPlan,
    generated_schema,
    read_schemas,
    unsupported,
    violation,
)
from tests.load.conftest import ThreadedServer


def instance(schema: dict):
    """A value that holds to `schema` (the subset the stand-in is sent)."""
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema.get("type")
    if kind == "object":
        return {k: instance(v) for k, v in schema.get("properties", {}).items()}
    return {"boolean": True, "integer": schema.get("minimum", 3), "string": "s", "array": []}[kind]


class ChatServer(ThreadedServer):
    """Chat completions: an unconstrained request streams text; a constrained one streams a value of its schema, or
    (every third constrained request) one that breaks it. Keeps, by X-Request-Id, what it made of each request."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[str, str] = {}  # request id -> "free", "valid" or "invalid"
        self.bodies: list[dict] = []
        self._constrained = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        rid = request.headers["X-Request-Id"]
        schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
        tools = body.get("tools")
        schema = schema or (tools[0]["function"]["parameters"] if tools else None)
        deltas = [{"content": " x"}, {"content": " y"}]
        if schema is not None:
            self._constrained += 1
            bad = self._constrained % 3 == 0
            value = {"surprise": 1} if bad else instance(schema)
            self.made[rid] = "invalid" if bad else "valid"
            text = json.dumps(value)
            if tools:
                name = tools[0]["function"]["name"]
                deltas = [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": name, "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": text[:3]}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": text[3:]}}]}]
            else:
                deltas = [{"content": text[:4]}, {"content": text[4:]}]
        else:
            self.made[rid] = "free"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, delta in enumerate(deltas, 1):
            chunk = {"choices": [{"index": 0, "delta": delta,
                                  "finish_reason": ("tool_calls" if tools else "stop") if i == len(deltas) else None}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": i}}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app



@pytest.fixture
def server():
    with ChatServer() as s:
        yield s


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    return path


def run(server, prompts, tmp_path, *extra):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", server.url, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path", prompts,
        "--num-prompts", 24, "--warmup", 0, "--scrape-interval", 0, "--result-json", out, "--requests-jsonl", reqs,
        *extra)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res, json.loads(out.read_text()), [json.loads(x) for x in reqs.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["json-schema", "tools"])
def test_valid_and_invalid_outputs_are_counted_as_the_server_made_them(server, prompts, tmp_path, mode):
    res, data, lines = run(server, prompts, tmp_path, "--structured", mode, "--structured-share", 0.5)
    made = [server.made[x["request_id"]] for x in lines]
    s = data["structured"]
    assert s["valid"] == made.count("valid") > 0 and s["invalid"] == made.count("invalid") > 0
    assert s["total"] == made.count("valid") + made.count("invalid") == s["constrained"]["requests"]
    assert s["unconstrained"]["requests"] == made.count("free") > 0
    assert (data["structured_valid"], data["structured_total"]) == (s["valid"], s["total"])
    for line, what in zip(lines, made):
        assert line.get("structured_valid") == {"valid": True, "invalid": False, "free": None}[what]
    assert s["constrained"]["median_ttft_ms"] > 0 and s["unconstrained"]["median_itl_ms"] is not None
    assert "structured output" in res.output and f"{s['valid']} / {s['invalid']} / {s['total']}" in res.output
    constrained = [b for b in server.bodies if "response_format" in b or "tools" in b]
    assert len(constrained) == s["total"]
    if mode == "tools":
        assert all(b["tool_choice"] == "required" for b in constrained)
        assert all(b["tools"][0]["function"]["strict"] is True for b in constrained)
        assert all(x["tool_calls"][0]["name"].startswith("record_") for x in lines if x.get("tool_calls"))
    else:
        assert all(b["response_format"]["type"] == "json_schema" for b in constrained)


def test_named_tool_choice_names_the_offered_function(server, prompts, tmp_path):
    _, data, _ = run(server, prompts, tmp_path, "--structured", "tools", "--tool-choice", "named")
    assert data["structured"]["total"] == 24
    assert all(b["tool_choice"] == {"type": "function", "function": {"name": b["tools"][0]["function"]["name"]}}
               for b in server.bodies)


def test_a_schema_file_is_cycled_and_judged(server, prompts, tmp_path):
    schemas = tmp_path / "s.jsonl"
    schemas.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}},
                                   "required": ["n"]}) + "\n\n")
    _, data, _ = run(server, prompts, tmp_path, "--structured", "json-schema", "--schemas", schemas)
    assert data["structured"]["schemas"] == 1 and data["structured"]["valid"] == 16
    assert {b["response_format"]["json_schema"]["schema"]["required"][0] for b in server.bodies} == {"n"}


def test_the_validator_holds_and_breaks_the_rules_it_knows():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                               "b": {"type": "array", "items": {"type": "string", "maxLength": 2},
                                                     "maxItems": 2},
                                               "c": {"enum": ["x", "y"]}},
              "required": ["a"], "additionalProperties": False}
    assert violation({"a": 5, "b": ["ab"], "c": "y"}, schema) is None
    for value, why in [({"b": []}, "$.a is missing"), ({"a": 6}, "out of range"), ({"a": True}, "not an integer"),
                       ({"a": 1, "b": ["abc"]}, "wrong length"), ({"a": 1, "b": ["", "", ""]}, "number of items"),
                       ({"a": 1, "c": "z"}, "enum"), ({"a": 1, "d": 0}, "$.d is not allowed"), ([], "not object")]:
        assert why in violation(value, schema), value
    for i in range(20):  # every generated schema is in the subset, and a value of it holds
        g = generated_schema(i, seed=1)
        assert unsupported(g) is None and violation(instance(g), g) is None
    assert generated_schema(3, 1) == generated_schema(3, 1)


def test_the_stream_keeps_tool_call_pieces():
    ev = decode_data(json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "f", "arguments": "{\"a\""}}]}}]}))
    assert ev.output and ev.tool_calls[0]["function"]["arguments"] == "{\"a\""
    slow = decode_data(json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
                                                "finish_reason": 7}]}))  # the checked path
    assert slow.error is not None
    checked = decode_data(" " + json.dumps({"choices": [{"delta": {"tool_calls": [{"index": 0}], "content": None}}]}))
    assert checked.tool_calls == [{"index": 0}]


def test_a_plan_constrains_the_share_it_is_given():
    plan = StructuredPlan("json-schema", 0.25, seed=0)
    constrained = sum(plan.schema(i) is not None for i in range(4000))
    assert constrained / 4000 == pytest.approx(0.25, abs=0.03)
    assert all(StructuredPlan("tools", 1.0, 0).body(i)["tools"] for i in range(10))


@pytest.mark.parametrize("line, message", [
    ('{"type": "object", "pattern": "x"}', "keyword 'pattern'"), ("[1]", "schema object"), ("{", "not JSON"),
    ('{"properties": {"a": {"type": "date"}}}', "type 'date'"),
])
def test_a_schema_file_outside_the_subset_is_refused_by_line(tmp_path, line, message):
    path = tmp_path / "s.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        read_schemas(str(path))


def test_a_bad_schema_file_stops_the_run_in_one_line(server, tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"type": "object", "patternProperties": {}}\n')
    res = CliRunner().invoke(bench, ["--base-url", server.url, "--endpoint", "chat", "--structured", "json-schema",
                                     "--schemas", str(path)])
    assert res.exit_code == BAD_INPUT and "line 1: keyword 'patternProperties'" in res.output
    assert server.bodies == []


@pytest.mark.parametrize("fields, message", [
    ({"schemas_path": "s.jsonl"}, "--schemas needs --structured"),
    ({"structured": "tools", "base_url": "http://x"}, "--endpoint chat"),
    ({"structured": "json-schema"}, "--base-url"),
    ({"structured": "json-schema", "base_url": "http://x", "structured_share": 0}, "structured-share"),
    ({"structured": "json-schema", "base_url": "http://x", "extra_body": {"response_format": {}}}, "sets it"),
])
def test_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**fields)


def test_infertrace_serve_answers_json_schema_and_every_output_is_valid(served_tiny, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", served_tiny, "--endpoint", "chat", "--tokenizer", tiny_model_dir, "--input-len", 8,
        "--output-len", 64, "--num-prompts", 6, "--warmup", 0, "--scrape-interval", 0, "--structured", "json-schema",
        "--structured-share", 0.5, "--result-json", out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    s = json.loads(out.read_text())["structured"]
    assert s["refused"] == 0 and s["constrained"]["requests"] > 0
    assert s["valid"] == s["total"] == s["constrained"]["requests"], s
    assert s["unconstrained"]["completed"] == s["unconstrained"]["requests"] > 0


def test_an_output_cut_at_max_tokens_says_so():
    from infertrace.load.records import RequestResult

    plan = StructuredPlan("json-schema", 1.0, seed=0)
    cut = RequestResult(0, 0.0, 0.0, 1.0, text='{"field_0": ', finish_reason="length")
    assert plan.verdict(cut).startswith("cut at max_tokens")
    broken = RequestResult(0, 0.0, 0.0, 1.0, text='{"field_0": ', finish_reason="stop")
    assert plan.verdict(broken) == "not JSON"
    tools = StructuredPlan("tools", 1.0, seed=0)
    call = RequestResult(1, 0.0, 0.0, 1.0, finish_reason="length", tool_calls=[{"name": "record_1", "arguments": "{"}])
    assert tools.verdict(call).startswith("cut at max_tokens")
    assert tools.verdict(RequestResult(1, 0.0, 0.0, 1.0, tool_calls=[{"name": "other", "arguments": "{}"}])) \
        == "called 'other', not the tool offered"


def test_tool_call_pieces_join_by_index_within_the_text_cap():
    from infertrace.load.client.timing import _add_tool_calls
    from infertrace.load.records import RequestResult

    r = RequestResult(0, 0.0, 0.0, 0.0)
    room = _add_tool_calls(r, [{"index": 0, "function": {"name": "f", "arguments": ""}},
                               {"index": 1, "function": {"name": "g", "arguments": "{\"b\""}}], 100)
    room = _add_tool_calls(r, [{"index": 0, "function": {"arguments": "{}"}}, "junk",
                               {"index": 1, "function": {"arguments": ": 1}"}}], room)
    assert r.tool_calls == [{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": "{\"b\": 1}"}]
    assert room == 100 - 2 - 4 - 4 and not r.text_cut
    _add_tool_calls(r, [{"index": 0, "function": {"arguments": "x" * 200}}], room)
    assert len(r.tool_calls[0]["arguments"]) == 2 + room and r.text_cut
