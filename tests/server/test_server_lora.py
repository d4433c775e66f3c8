"""A request naming a LoRA adapter that `infertrace model init --lora` wrote beside the served model gets one clear
400 (the bundled engine serves none); a name that is simply unknown stays vLLM's 404."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.load.conftest import serve_subprocess


@pytest.fixture(scope="module")
def model_with_adapters(tiny_model_dir, tmp_path_factory):
    """The tiny model's files (linked, not copied) with two adapters of its own under loras/."""
    from infertrace.modelgen.lora import init_adapters

    model = tmp_path_factory.mktemp("lora-model") / "tiny"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        (model / path.name).symlink_to(path)
    init_adapters(model, 2, rank=1)
    (model / "loras" / "notes").mkdir()  # a folder without adapter_config.json is no adapter
    return model


def post(url: str, path: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def test_an_adapter_is_a_clear_400_and_an_unknown_name_a_404(model_with_adapters, tmp_path):
    with serve_subprocess(model_with_adapters, tmp_path, "--served-model-name", "tiny") as url:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, error = post(url, path, "lora-2")
            assert status == 400, (path, error)
            assert error["param"] == "model" and error["code"] == "lora_not_supported"
            assert error["message"] == (
                "the model 'lora-2' is a LoRA adapter of 'tiny' (loras/lora-2 beside it), and this server serves "
                "no LoRA adapters: vllm serve --enable-lora --lora-modules lora-2=DIR does")
            for unknown in ("lora-3", "notes"):
                status, error = post(url, path, unknown)
                assert status == 404 and error["code"] == "model_not_found", (path, unknown, error)
                assert error["message"].startswith(f"the model {unknown!r} does not exist")
            status, answer = post(url, path, "tiny")
            assert status == 200 and answer["usage"]["completion_tokens"] == 1
