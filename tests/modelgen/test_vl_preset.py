"""model init --preset qwen2.5-vl-tiny: a Qwen2.5-VL directory transformers reads as one, its tokenizer turns an
image part into the vision placeholder at Qwen's ids, and the same seed writes the same bytes."""

import json

import pytest
from click.testing import CliRunner

from infertrace.exits import BAD_INPUT
from infertrace.modelgen import init_model
from infertrace.modelgen.command import model
from infertrace.modelgen.vl import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, image_tokens


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return init_model("qwen2.5-vl-tiny", tmp_path_factory.mktemp("vl") / "m", seed=0)


def test_transformers_loads_it_as_qwen2_5_vl_with_every_weight(vl_dir):
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(vl_dir)
    assert config.model_type == "qwen2_5_vl" and config.vision_config.out_hidden_size == 256
    from safetensors.torch import load_file

    m = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
    saved = load_file(vl_dir / "model.safetensors")
    loaded = m.state_dict()
    # every tensor of the model came from the file (the output head is the tied embedding)
    assert set(loaded) - set(saved) == {"lm_head.weight"}
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert torch.equal(loaded["lm_head.weight"], saved["model.language_model.embed_tokens.weight"])


def test_the_chat_template_puts_the_image_placeholder_at_qwen_ids(vl_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    start = ids.index(VISION_START_ID)
    assert ids[start:start + 3] == [VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]
    assert tok.decode(ids[start + 3:], skip_special_tokens=True).startswith("what is it?")


def test_the_image_processor_config_gives_one_token_per_28_pixels(vl_dir):
    pre = json.loads((vl_dir / "preprocessor_config.json").read_text())
    assert pre["patch_size"] * pre["merge_size"] == 28 and pre["max_pixels"] >= 84 * 56
    assert image_tokens(84, 56) == 6


def test_the_same_seed_writes_the_same_weights(vl_dir, tmp_path):
    again = init_model("qwen2.5-vl-tiny", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (vl_dir / "model.safetensors").read_bytes()


def test_lora_adapters_are_refused_for_it(tmp_path):
    res = CliRunner().invoke(model, ["init", "--preset", "qwen2.5-vl-tiny", "--out", str(tmp_path / "m"),
                                     "--lora", "1"])
    assert res.exit_code == BAD_INPUT and "--lora writes adapters for the Qwen3 presets" in res.output
