"""POST /v1/embeddings: OpenAI's shape, the pooled last hidden state as Hugging Face computes it, 400s."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch


def hf_pooled(model_dir, ids: list[int], pooling: str) -> np.ndarray:
    """Hugging Face's last_hidden_state of the same weights (after the final norm), pooled and L2-normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "LAST" else hidden.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
async def test_vectors_equal_hugging_face_and_usage_counts_tokens(serve_tiny, tiny_model_dir, pooling):
    async with serve_tiny({"pooling_type": pooling}) as client:
        texts = ["the model token batch", "a second, longer input of a few more words"]
        resp = await client.post("/v1/embeddings", json={"model": "tiny", "input": [*texts, [11, 12, 13]]})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        ids = [client.state.tokenizer.encode(t) for t in texts] + [[11, 12, 13]]
        assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                                 "completion_tokens": 0}
        for item, x in zip(body["data"], ids):
            vector = np.asarray(item["embedding"])
            assert vector.shape == (json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"],)
            np.testing.assert_allclose(vector, hf_pooled(tiny_model_dir, x, pooling), atol=2e-5)
            assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


async def test_base64_is_float32_of_the_same_vector_and_generation_still_runs(serve_tiny):
    async with serve_tiny() as client:
        floats = await (await client.post("/v1/embeddings", json={"input": "one two three"})).json()
        packed = await (await client.post("/v1/embeddings", json={"input": "one two three",
                                                                  "encoding_format": "base64"})).json()
        decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, np.asarray(floats["data"][0]["embedding"], dtype=np.float32))
        resp = await client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 3})
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body, words", [
    ({}, "input is required"),
    ({"input": ""}, "input is empty"),
    ({"input": []}, "input is empty"),
    ({"input": ["a", ""]}, "input 1 is empty"),
    ({"input": ["a", []]}, "input 1 is empty"),
    ({"input": 5}, "input must be a string"),
    ({"input": ["a", 5]}, "input must be a string"),
    ({"input": [[1, "x"]]}, "input must be a string"),
    ({"input": [1, -2]}, "non-negative"),
    ({"input": [[1, 10**9]]}, "outside the vocabulary"),
    ({"input": ["a"] * 2049}, "at most 2048"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format must be one of"),
    ({"input": "a", "dimensions": 8}, "dimensions is not supported"),
    ({"input": "a", "model": "other"}, "other"),
])
async def test_bad_requests_are_one_line_400s(serve_tiny, body, words):
    async with serve_tiny() as client:
        resp = await client.post("/v1/embeddings", json=body)
        assert resp.status in (400, 404), await resp.text()
        message = (await resp.json())["error"]["message"]
        assert words in message and "\n" not in message


async def test_too_long_an_input_is_a_400_and_the_process_engine_answers(serve_tiny):
    async with serve_tiny({"max_model_len": 64}, engine_process=True) as client:
        resp = await client.post("/v1/embeddings", json={"input": [[5] * 65]})
        assert resp.status == 400 and "65 tokens" in (await resp.json())["error"]["message"]
        resp = await client.post("/v1/embeddings", json={"input": [[5] * 64, "short text"]})
        assert resp.status == 200 and len((await resp.json())["data"]) == 2


async def test_pooling_between_steps_leaves_generation_unchanged(serve_tiny):
    """The pooling forward binds a KV cache of its own and puts the engine's back: a greedy completion running
    meanwhile gives the same tokens as alone."""
    import asyncio

    async with serve_tiny() as client:
        ask = {"prompt": "the model token batch", "max_tokens": 24, "temperature": 0}
        alone = (await (await client.post("/v1/completions", json=ask)).json())["choices"][0]["text"]

        async def embed_repeatedly():
            for _ in range(6):
                resp = await client.post("/v1/embeddings", json={"input": ["a longer input of words " * 4, "x"]})
                assert resp.status == 200

        beside, _ = await asyncio.gather(client.post("/v1/completions", json=ask), embed_repeatedly())
        assert (await beside.json())["choices"][0]["text"] == alone
