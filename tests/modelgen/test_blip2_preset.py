"""model init --preset blip2-qwen3-tiny: a BLIP-2 directory transformers reads as one, with the tiny Qwen3 preset's
tensors as its language model, a processor that puts one `<image>` per query token before the text, and the same
bytes for the same seed."""

import pytest
from click.testing import CliRunner

from infertrace.exits import BAD_INPUT
from infertrace.modelgen import PRESETS, hf_config, init_model, weight_shapes
from infertrace.modelgen.blip2 import BLIP2_PRESETS, IMAGE_TOKEN_ID
from infertrace.modelgen.command import model

PRESET = "blip2-qwen3-tiny"


@pytest.fixture(scope="module")
def blip2_dir(tmp_path_factory):
    return init_model(PRESET, tmp_path_factory.mktemp("blip2") / "m", seed=0)


def test_transformers_loads_it_as_blip2_with_every_weight(blip2_dir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Blip2ForConditionalGeneration

    config = AutoConfig.from_pretrained(blip2_dir)
    assert config.model_type == "blip-2" and config.text_config.model_type == "qwen3"
    m = Blip2ForConditionalGeneration.from_pretrained(blip2_dir, dtype=torch.float32)
    saved = load_file(blip2_dir / "model.safetensors")
    loaded = m.state_dict()
    # every tensor of the model came from the file (the output head is the tied embedding)
    assert set(loaded) - set(saved) == {"language_model.lm_head.weight"}
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert torch.equal(loaded["language_model.lm_head.weight"], saved["language_model.model.embed_tokens.weight"])


def test_the_language_model_is_the_tiny_qwen3_under_the_names_vllm_loads(blip2_dir):
    from safetensors import safe_open

    with safe_open(blip2_dir / "model.safetensors", "pt") as f:
        names = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # vLLM 0.32 blip2.py's modules: vision_model, query_tokens, qformer, language_projection, language_model
    assert {k.split(".")[0] for k in names} == {"vision_model", "query_tokens", "qformer", "language_projection",
                                                "language_model"}
    text = {k.removeprefix("language_model."): s for k, s in names.items() if k.startswith("language_model.")}
    assert text == dict(weight_shapes(hf_config(PRESETS["tiny"], "float32")))
    n_query = BLIP2_PRESETS[PRESET]["num_query_tokens"]
    assert names["query_tokens"] == (1, n_query, BLIP2_PRESETS[PRESET]["qformer"]["hidden_size"])


def test_the_processor_puts_one_image_token_per_query_before_the_text(blip2_dir):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(blip2_dir)
    out = processor(images=Image.new("RGB", (32, 48)), text="what is it?", return_tensors="pt")
    side = BLIP2_PRESETS[PRESET]["vision"]["image_size"]
    assert tuple(out["pixel_values"].shape) == (1, 3, side, side)
    ids = out["input_ids"][0].tolist()
    n_query = BLIP2_PRESETS[PRESET]["num_query_tokens"]
    assert ids[:n_query] == [IMAGE_TOKEN_ID] * n_query and IMAGE_TOKEN_ID not in ids[n_query:]
    assert processor.tokenizer.decode(ids[n_query:]) == "what is it?"


def test_the_same_seed_writes_the_same_weights(blip2_dir, tmp_path):
    again = init_model(PRESET, tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (blip2_dir / "model.safetensors").read_bytes()


def test_the_command_writes_it_and_refuses_lora_adapters(tmp_path):
    res = CliRunner().invoke(model, ["init", "--preset", PRESET, "--out", str(tmp_path / "m")])
    assert res.exit_code == 0 and f"wrote {PRESET} (" in res.output, res.output
    assert (tmp_path / "m" / "preprocessor_config.json").is_file()
    res = CliRunner().invoke(model, ["init", "--preset", PRESET, "--out", str(tmp_path / "n"), "--lora", "1"])
    assert res.exit_code == BAD_INPUT and "--lora writes adapters for the Qwen3 presets" in res.output
