"""bench --endpoint embeddings: batches of inputs, one whole answer a request, vLLM's embedding figures."""

import asyncio
import json

import pytest
from aiohttp import web
from click.testing import CliRunner

from infertrace.gate.command import gate
from infertrace.load.client.embeddings import decode_embeddings
from infertrace.load.client.timing import measure
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestResult, RequestSpec, StreamEvent
from infertrace.load.workloads.embedding_batches import batched
from tests.load.conftest import ThreadedServer


class EmbeddingServer(ThreadedServer):
    """/v1/embeddings that counts one token per word of each input (a list of ids: one per id), answers one vector
    per input, and keeps every body it was sent; `mode` can make it misbehave."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []
        self.mode = "ok"

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        inputs = body["input"]
        tokens = sum(len(x) if isinstance(x, list) else len(x.split()) for x in inputs)
        if self.mode == "500":
            return web.json_response({"error": {"message": "too long"}}, status=400)
        vectors = inputs[:-1] if self.mode == "short" else inputs
        return web.json_response({"object": "list", "model": body["model"],
                                  "data": [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]}
                                           for i, _ in enumerate(vectors)],
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        return app



@pytest.fixture
def embedder():
    with EmbeddingServer() as server:
        yield server


@pytest.fixture
def texts_jsonl(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(["word"] * (i + 1))}) + "\n" for i in range(12)))
    return path


def invoke(*args, command=bench):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def test_the_run_report_renders_without_errors(embedder, texts_jsonl, tmp_path, browse):
    report = tmp_path / "r.html"
    res = invoke("--base-url", embedder.url, "--endpoint", "embeddings", "--random-batch-size", 2, "--dataset",
                 "jsonl", "--dataset-path", texts_jsonl, "--num-prompts", 3, "--warmup", 0, "--scrape-interval", 0,
                 "--report", report)
    assert res.exit_code == 0, res.output
    result, done = browse(report)
    assert result["errors"] == [] and "Uncaught" not in done.stderr
    assert result["svgs"] >= 1  # the client latencies' chart drew (E2EL; its TTFT traces stay empty)


def test_batches_figures_and_records_against_a_server(embedder, texts_jsonl, tmp_path):
    out, reqs, report = tmp_path / "r.json", tmp_path / "r.jsonl", tmp_path / "r.html"
    res = invoke("--base-url", embedder.url, "--endpoint", "embeddings", "--random-batch-size", 3, "--dataset",
                 "jsonl", "--dataset-path", texts_jsonl, "--num-prompts", 4, "--warmup", 0, "--concurrency", 2,
                 "--scrape-interval", 0, "--result-json", out, "--requests-jsonl", reqs, "--report", report)
    assert res.exit_code == 0, res.output
    sent = [b["input"] for b in embedder.bodies]
    assert [len(x) for x in sent] == [3, 3, 3, 3] and "stream" not in embedder.bodies[0]
    words = sum(len(x.split()) for batch in sent for x in batch)
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["total_input_sequences"] == 12 and data["total_input_tokens"] == words
    assert data["input_sequence_throughput"] == pytest.approx(12 / data["duration"])
    assert data["request_throughput"] == pytest.approx(4 / data["duration"])
    assert data["total_token_throughput"] == pytest.approx(words / data["duration"])
    assert data["median_e2el_ms"] > 0 and "mean_ttft_ms" not in data and "output_throughput" not in data
    lines = [json.loads(x) for x in reqs.read_text().splitlines()]
    assert [x["num_inputs"] for x in lines] == [3, 3, 3, 3]
    assert all(x["ttft_ms"] is None and x["e2el_ms"] > 0 and x["success"] for x in lines)
    assert sum(x["prompt_tokens"] for x in lines) == words
    assert "only E2EL is measured" in res.output and "input throughput (inputs/s)" in res.output
    assert "TPOT (ms)" not in res.output and "output token throughput" not in res.output
    assert report.read_text().startswith("<!DOCTYPE html>") or "<html" in report.read_text()[:500]
    gated = invoke(out, "--min", "input_sequence_throughput=0.001", "--max", "failed=0", command=gate)
    assert gated.exit_code == 0, gated.output
    gated = invoke(out, "--min", f"input_sequence_throughput={data['input_sequence_throughput'] * 2}",
                   command=gate)
    assert gated.exit_code == 1, gated.output


def test_a_token_count_other_than_the_built_length_is_flagged(embedder, tiny_model_dir, tmp_path):
    """Random prompts are built to an exact length in the tokenizer; the stand-in counts words, not tokens."""
    out = tmp_path / "r.json"
    res = invoke("--base-url", embedder.url, "--endpoint", "embeddings", "--tokenizer", tiny_model_dir,
                 "--input-len", 16, "--num-prompts", 2, "--warmup", 0, "--scrape-interval", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["input_tokens_compared"] == 2 and data["input_token_mismatches"] == 2
    assert "input tokens: the server counted 2 of 2 prompt(s) differently" in res.output


def test_wrong_answers_fail_the_request_with_one_reason(embedder, texts_jsonl, tmp_path):
    out = tmp_path / "r.json"
    embedder.mode = "short"
    res = invoke("--base-url", embedder.url, "--endpoint", "embeddings", "--random-batch-size", 2, "--dataset",
                 "jsonl", "--dataset-path", texts_jsonl, "--num-prompts", 2, "--warmup", 0, "--scrape-interval", 0,
                 "--result-json", out)
    assert res.exit_code == 1
    data = json.loads(out.read_text())
    assert data["failures"] == {"malformed response": 2}
    assert data["failure_examples"]["malformed response"] == "1 embeddings for 2 inputs"


@pytest.mark.parametrize("body, reason", [
    (b'{"data": [{"embedding": [1.0]}], "usage": {"prompt_tokens": 3}}', None),
    (b'{"data": [{"embedding": "AAAA"}], "usage": {"prompt_tokens": 3}}', None),  # encoding_format base64
    (b'{"usage": {"prompt_tokens": 3}}', "no `data` list"),
    (b'{"data": [{"index": 0}]}', "has no `embedding`"),
    (b'{"data": [{"embedding": [1.0]}], "usage": {"prompt_tokens": -1}}', "negative"),
    (b'{"data": [{"embedding": [1.0]}], "usage": {"prompt_tokens": true}}', "malformed response"),
    (b'not json', "malformed response"),
])
def test_decode_embeddings(body, reason):
    event = decode_embeddings(body, 1)
    if reason is None:
        assert event.error is None and event.embeddings == 1 and event.prompt_tokens == 3
    else:
        assert reason in event.error and event.error.startswith("malformed response")


class ScriptedClock:
    def __init__(self, times):
        self.times = iter(times)

    def now(self):
        return next(self.times)


class OneAnswer:
    kind, tokenizer, salt_tokens, reads_server_metrics = "scripted", None, 0, False

    def new_request_id(self):
        return None

    async def stream(self, spec):
        yield [StreamEvent(prompt_tokens=7, embeddings=len(spec.inputs))]


def test_measure_takes_the_whole_answer_as_the_end_and_no_first_token():
    spec = RequestSpec(index=0, prompt="a", output_len=0, prompt_len=7, inputs=["a b", "c d e f g"])
    result = asyncio.run(measure(RequestResult(0, 10.0, 10.0, 10.0), OneAnswer(), spec, ScriptedClock([10.0, 10.25])))
    assert result.success and result.e2el == 0.25 and result.ttft is None and result.itl == []
    assert result.num_inputs == 2 and result.prompt_tokens == 7 and result.output_tokens == 0


def test_batched_sums_lengths_and_keeps_token_ids():
    specs = [RequestSpec(index=i, prompt="" if i == 1 else f"p{i}", output_len=4, prompt_len=i + 1,
                         prompt_ids=[i] * (i + 1)) for i in range(5)]
    out = batched(specs, 2)
    assert [s.inputs for s in out] == [["p0", [1, 1]], ["p2", "p3"], ["p4"]]
    assert [s.prompt_len for s in out] == [3, 7, 5] and [s.index for s in out] == [0, 1, 2]


@pytest.mark.parametrize("kwargs, words", [
    ({"endpoint": "embeddings"}, "needs --base-url" if False else "pass --base-url"),
    ({"endpoint": "embeddings", "base_url": "http://x", "dataset": "trace", "dataset_path": "t"}, "not trace"),
    ({"endpoint": "embeddings", "base_url": "http://x", "slo": {"ttft_ms": 5}}, "no TTFT"),
    ({"endpoint": "embeddings", "base_url": "http://x", "slo": {"p99_itl_ms": 5}, "find_max": "concurrency"},
     "no ITL"),
    ({"endpoint": "completions", "embed_batch_size": 4}, "add --endpoint embeddings"),
    ({"endpoint": "embeddings", "base_url": "http://x", "embed_batch_size": 0}, "at least 1"),
    ({"endpoint": "embeddings", "base_url": "http://x", "extra_body": {"input": "x"}}, "may not set 'input'"),
])
def test_bad_embeddings_configs_are_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BenchConfig(**kwargs)


def test_against_infertrace_serve_token_counts_are_exact(served_tiny, tiny_model_dir, tmp_path):
    """Random inputs built to an exact length in the served model's tokenizer: the server's usage agrees with
    every one, and the figures add up from the records."""
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = invoke("--base-url", served_tiny, "--endpoint", "embeddings", "--tokenizer", tiny_model_dir,
                 "--input-len", 24, "--random-batch-size", 4, "--num-prompts", 5, "--warmup", 1, "--concurrency", 2,
                 "--scrape-interval", 0, "--result-json", out, "--requests-jsonl", reqs)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    lines = [json.loads(x) for x in reqs.read_text().splitlines()]
    assert [x["phase"] for x in lines] == ["warmup"] + ["measured"] * 5
    lines = lines[1:]
    assert data["completed"] == 5 and data["total_input_sequences"] == 20
    assert data["input_tokens_compared"] == 5 and data["input_token_mismatches"] == 0
    assert [x["prompt_tokens"] for x in lines] == [x["expected_prompt_tokens"] for x in lines] == [96] * 5
    assert data["total_input_tokens"] == 480
    assert data["input_sequence_throughput"] == pytest.approx(20 / data["duration"])
    e2el = sorted(x["e2el_ms"] for x in lines)
    assert data["median_e2el_ms"] == pytest.approx(e2el[2]) and data["mean_e2el_ms"] == pytest.approx(sum(e2el) / 5)


def test_an_input_as_long_as_the_context_is_not_refused_for_an_output_it_never_has():
    from infertrace.load.client.targets import check_context
    from infertrace.load.client.timing import TargetError

    check_context(BenchConfig(endpoint="embeddings", base_url="http://x", input_len=2048), 2048)
    with pytest.raises(TargetError, match="2049 prompt"):
        check_context(BenchConfig(endpoint="embeddings", base_url="http://x", input_len=2049), 2048)
    with pytest.raises(TargetError, match="2048 prompt \\+ 64 output"):
        check_context(BenchConfig(endpoint="completions", base_url="http://x", input_len=2048), 2048)
