"""`infertrace bench --images` against the real vLLM 0.32 (CPU build).

The tier's vLLM environment cannot serve a vision-language model: without torchvision, which it lacks (docs/peers.md),
vLLM's qwen2_vl.py fails to import (it takes `smart_resize` from transformers' image_processing_qwen2_vl, which
imports torchvision), and models whose vision tower it looks up through vision.py `get_vision_encoder_info`
(LLaVA, PaliGemma) fail at their first image, where that function imports pixtral.py, which imports torchvision too.
So the image tokens are checked against a stand-in that answers as vLLM's chat route does
(tests/load/test_load_images.py), and here the real server's answer to images sent to the text-only tiny model: each
request refused with a 400 in vLLM's words, which bench counts and says in one line, and no image tokens claimed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.peers.conftest import SERVED_NAME

pytestmark = pytest.mark.vllm

REQUESTS = 3


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
