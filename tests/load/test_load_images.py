"""bench --images: chat requests carry images as base64 data URLs, and the image tokens the server counted come back
per request and in the result."""

import base64
import io
import json

import pytest
from aiohttp import web
from click.testing import CliRunner
from PIL import Image

from infertrace.exits import BAD_INPUT
from infertrace.gate.command import gate
from infertrace.load.client.images import text_only
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig, parse_image_size
from infertrace.load.records import RequestResult
from infertrace.load.results.images import image_figures
from infertrace.load.workloads.images import folder_plan, generated_plan
from tests.load.conftest import ThreadedServer

TEMPLATE_TOKENS = 7  # what the stand-in's chat template adds around a message's text


def qwen_image_tokens(width: int, height: int) -> int:
    """Qwen2.5-VL's count, as vLLM 0.32 expands it (vllm/model_executor/models/qwen2_vl.py, 14-pixel patches merged
    2x2: one token per 28x28 pixels), plus <|vision_start|> and <|vision_end|>."""
    return (width // 28) * (height // 28) + 2


class VisionServer(ThreadedServer):
    """/v1/chat/completions as vLLM 0.32's chat route answers a vision-language model
    (vllm/entrypoints/openai/chat_completion/serving.py: `usage.prompt_tokens` is `len(res.prompt_token_ids)`, the
    prompt after each image's placeholder was expanded, so it counts the text, the chat template and the image
    tokens); streamed with stream_options.include_usage, or whole when not streamed.
    Every image part must be a data URL Pillow opens; `images_seen` keeps each request's image sizes."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.images_seen: list[list[tuple[int, int]]] = []
        self.probes = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text, sizes = "", []
        for m in body["messages"]:
            content = m["content"]
            for part in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
                if part["type"] == "text":
                    text += part["text"]
                    continue
                head, _, data = part["image_url"]["url"].partition(",")
                assert head.startswith("data:image/") and head.endswith(";base64")
                with Image.open(io.BytesIO(base64.b64decode(data))) as im:
                    sizes.append(im.size)
        prompt_tokens = len(self.tokenizer.encode(text, add_special_tokens=False)) + TEMPLATE_TOKENS \
            + sum(qwen_image_tokens(w, h) for w, h in sizes)
        if not body.get("stream"):
            self.probes += 1
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}})
        self.images_seen.append(sizes)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(1, n + 1):
            chunk = {"choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": "length" if i == n
                                  else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "vl"}]})

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app



@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def server(tokenizer):
    with VisionServer(tokenizer) as s:
        yield s


def invoke(*args, command=bench):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def run_bench(server, tiny_model_dir, tmp_path, *extra):
    return invoke("--base-url", server.url, "--endpoint", "chat", "--tokenizer", tiny_model_dir, "--input-len", 16,
                  "--output-len", 3, "--num-prompts", 5, "--warmup", 0, "--scrape-interval", 0,
                  "--result-json", tmp_path / "r.json", "--requests-jsonl", tmp_path / "req.jsonl", *extra)


def test_generated_images_reach_the_server_and_their_tokens_are_counted(server, tiny_model_dir, tmp_path):
    res = run_bench(server, tiny_model_dir, tmp_path, "--random-mm-base-items-per-request", 2,
                    "--image-size", "84x56", "--report", tmp_path / "r.html")
    assert res.exit_code == 0, res.output
    assert "infertrace run report" in (tmp_path / "r.html").read_text()  # the report builds beside the images
    assert server.images_seen == [[(84, 56), (84, 56)]] * 5
    assert server.probes == 1  # one text-only request after the run gives the template's tokens
    per_request = 2 * qwen_image_tokens(84, 56)
    lines = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert [(x["images"], x["image_tokens"]) for x in lines] == [(2, per_request)] * 5
    result = json.loads((tmp_path / "r.json").read_text())
    img = result["images"]
    assert img["mean_image_tokens"] == img["max_image_tokens"] == per_request
    assert img["mean_tokens_per_image"] == qwen_image_tokens(84, 56) and img["image_tokens_unknown"] is None
    assert img["distinct_images"] == 10 and img["images_sent"] == 10
    assert "images (generated 84x56)" in res.output
    assert invoke(tmp_path / "r.json", "--min", f"mean_image_tokens={per_request}", command=gate).exit_code == 0
    assert invoke(tmp_path / "r.json", "--max", f"mean_image_tokens={per_request - 1}",
                  command=gate).exit_code == 1


def test_images_of_a_folder_go_as_they_are(server, tiny_model_dir, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (56, 56), "red").save(folder / "a.png")
    Image.new("RGB", (112, 28), "blue").save(folder / "b.jpg")
    res = run_bench(server, tiny_model_dir, tmp_path, "--images", 1, "--image-dir", folder)
    assert res.exit_code == 0, res.output
    assert server.images_seen == [[(56, 56)], [(112, 28)], [(56, 56)], [(112, 28)], [(56, 56)]]
    lines = [json.loads(x) for x in (tmp_path / "req.jsonl").read_text().splitlines()]
    assert [x["image_tokens"] for x in lines] == [qwen_image_tokens(56, 56), qwen_image_tokens(112, 28)] * 2 \
        + [qwen_image_tokens(56, 56)]


@pytest.mark.parametrize("name, data, message", [
    ("notes.txt", b"not an image", "is not an image Pillow can read"),
    ("broken.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 20, "is not an image Pillow can read"),
])
def test_a_folder_file_that_is_no_image_stops_the_run_in_one_line(server, tiny_model_dir, tmp_path, name, data,
                                                                 message):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (28, 28)).save(folder / "ok.png")
    (folder / name).write_bytes(data)
    res = run_bench(server, tiny_model_dir, tmp_path, "--images", 1, "--image-dir", folder)
    assert res.exit_code == BAD_INPUT and message in res.output and name in res.output
    assert len(res.output.strip().splitlines()) == 1 and server.images_seen == []


def test_an_unreadable_folder_file_says_so(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    import os

    os.mkfifo(folder / "pipe.png")  # a pipe would block a plain read: refused as no regular file
    with pytest.raises(ValueError, match="cannot read .*pipe.png: not a regular file"):
        folder_plan(1, folder)


def test_generated_images_are_distinct_and_seeded():
    a, b = generated_plan(2, (32, 32), 3, seed=1), generated_plan(2, (32, 32), 3, seed=1)
    assert a.urls == b.urls and len(set(a.urls)) == 6
    assert a.urls_of(1) == a.urls[2:4]
    assert generated_plan(1, (32, 32), 1, seed=2).urls != generated_plan(1, (32, 32), 1, seed=1).urls
    with Image.open(io.BytesIO(base64.b64decode(a.urls[0].partition(",")[2]))) as im:
        assert im.format == "JPEG" and im.size == (32, 32)


def test_the_probe_body_has_the_text_alone():
    plan = generated_plan(1, (8, 8), 1, seed=0)
    messages = plan.messages([{"role": "user", "content": "hi"}], 0)
    assert [p["type"] for p in messages[0]["content"]] == ["image_url", "text"]
    probe = text_only({"model": "m", "messages": messages, "stream": True, "stream_options": {}, "max_tokens": 9})
    assert probe == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False, "max_tokens": 1}


def test_unknown_image_tokens_are_flagged():
    plan = generated_plan(1, (8, 8), 1, seed=0)
    r = RequestResult(0, 0.0, 0.0, 1.0, images=1)
    figures = image_figures(plan, [r], "no tokenizer counted the requests' text (pass --tokenizer)")["images"]
    assert figures["mean_image_tokens"] is None and "no tokenizer" in figures["image_tokens_unknown"]


def test_parse_image_size():
    assert parse_image_size("640x480") == (640, 480)
    for bad in ("640", "0x3", "ax3", "9000x1"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            parse_image_size(bad)


@pytest.mark.parametrize("fields, message", [
    ({"images": 1}, "images are not supported by the bundled engine"),
    ({"images": 1, "base_url": "http://x", "endpoint": "completions"}, "--endpoint chat"),
    ({"image_dir": "x"}, "need --random-mm-base-items-per-request"),
    ({"images": -1, "base_url": "http://x", "endpoint": "chat"}, "at least 0"),
])
def test_config_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(**fields)


def test_the_bundled_engine_refusal_is_one_line():
    res = invoke("--images", "1", "--num-prompts", "1")
    assert res.exit_code == BAD_INPUT and "images are not supported by the bundled engine" in res.output


def test_infertrace_serve_refuses_images_and_bench_says_so_in_one_line(served_tiny, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", served_tiny, "--endpoint", "chat", "--tokenizer", tiny_model_dir, "--input-len", 8,
                 "--output-len", 2, "--num-prompts", 3, "--warmup", 0, "--scrape-interval", 0, "--images", 1,
                 "--image-size", "16x16", "--result-json", out)
    img = json.loads(out.read_text())["images"]
    assert img["refused"] == 3 and img["requests_counted"] == 0 and img["image_tokens_unknown"] == "no request succeeded"
    assert "HTTP 400: images are not supported by the bundled engine" in img["refused_example"]
    line = "the server refused 3 of 3 requests with images: HTTP 400: images are not supported by the bundled engine"
    assert line in " ".join(res.output.split())
