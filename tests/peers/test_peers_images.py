"""`infertrace bench --images` against the real vLLM 0.32 (CPU build).

The tier's vLLM has no torchvision (docs/peers.md), which Qwen2-VL, LLaVA, PaliGemma and most other vision-language
models need; BLIP-2 does not (vLLM's blip2.py and blip.py, transformers' BlipImageProcessorPil). So the real server
runs `model init --preset blip2-qwen3-tiny` (BLIP-2 over the tiny Qwen3), and the image tokens bench reports for each
request are checked against what that server counts for an image: a chat request's usage.prompt_tokens with the image
less without it. vLLM's blip2.py takes one image per prompt: two are refused, and bench says so in vLLM's words. The
real server's answer to images sent to the text-only tiny model is checked too: each request refused with a 400,
counted, said in one line, and no image tokens claimed.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import urllib.request

import pytest

from tests.peers.conftest import SERVED_NAME, VllmServer, run_infertrace_bench

pytestmark = pytest.mark.vllm

REQUESTS = 3
BLIP2 = "blip2-qwen3-tiny"


def test_a_text_only_model_refuses_images_and_bench_says_so_in_one_line(vllm_server, tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "infertrace", "bench", "--base-url", vllm_server.base_url,
                           "--model", SERVED_NAME, "--tokenizer", str(vllm_server.model_dir), "--endpoint", "chat",
                           "--images", "1", "--image-size", "32x32", "--num-prompts", str(REQUESTS),
                           "--input-len", "16", "--output-len", "2", "--warmup", "0", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    images = json.loads(out.read_text())["images"]
    assert images["refused"] == REQUESTS and images["requests_counted"] == 0, (images, done.stderr[-2000:])
    # vllm/multimodal/registry.py (0.32): "{model_name} is not a multimodal model", answered as a 400
    assert images["refused_example"] == f"HTTP 400: {SERVED_NAME} is not a multimodal model"
    assert images["image_tokens_unknown"] == "no request succeeded"
    said = " ".join(done.stderr.split())
    assert f"the server refused {REQUESTS} of {REQUESTS} requests with images: HTTP 400: {SERVED_NAME} is not a " \
        "multimodal model" in said


@pytest.fixture(scope="module")
def blip2_server(vllm_servers) -> VllmServer:
    return vllm_servers.get((), preset=BLIP2)


def test_bench_reports_the_image_tokens_the_real_server_counted(blip2_server, tmp_path):
    text = [{"type": "text", "text": "what is in the picture?"}]
    counted = _prompt_tokens(blip2_server, [_image_part(48, 32), *text]) - _prompt_tokens(blip2_server, text)
    # vllm/model_executor/models/blip2.py (0.32) puts num_query_tokens `<image>` tokens before the prompt
    assert counted == json.loads((blip2_server.model_dir / "config.json").read_text())["num_query_tokens"]

    requests = tmp_path / "requests.jsonl"
    result = run_infertrace_bench(blip2_server, tmp_path, "blip2", "--endpoint", "chat", "--images", "1",
                                  "--image-size", "48x32", "--num-prompts", str(REQUESTS), "--input-len", "16",
                                  "--output-len", "2", "--warmup", "0", "--requests-jsonl", str(requests))
    images = result["images"]
    assert images["refused"] == 0 and images["image_tokens_unknown"] is None, images
    assert images["requests_counted"] == REQUESTS and images["images_sent"] == REQUESTS
    assert [json.loads(line)["image_tokens"] for line in requests.read_text().splitlines()] == [counted] * REQUESTS
    assert images["mean_tokens_per_image"] == result["mean_image_tokens"] == counted


def test_two_images_are_refused_in_vllm_words(blip2_server, tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "infertrace", "bench", "--base-url", blip2_server.base_url,
                           "--model", BLIP2, "--tokenizer", str(blip2_server.model_dir), "--endpoint", "chat",
                           "--images", "2", "--image-size", "32x32", "--num-prompts", str(REQUESTS),
                           "--input-len", "16", "--output-len", "2", "--warmup", "0", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    images = json.loads(out.read_text())["images"]
    assert images["refused"] == REQUESTS and images["requests_counted"] == 0, (images, done.stderr[-2000:])
    # vllm/multimodal/processing/context.py (0.32), for blip2.py's limit of one image; vllm/exceptions.py's
    # VLLMValidationError adds the parameter
    assert images["refused_example"] == "HTTP 400: At most 1 image(s) may be provided in one prompt. " \
        "(parameter=image)"


def _image_part(width: int, height: int) -> dict:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "JPEG")
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," +
                                               base64.b64encode(buf.getvalue()).decode()}}


def _prompt_tokens(server: VllmServer, content: list[dict]) -> int:
    """The server's usage.prompt_tokens for one chat message of this content."""
    server.check_alive()
    body = json.dumps({"model": server.served_name, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 1}).encode()
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["usage"]["prompt_tokens"]
