import json

import pytest

from infertrace.modelgen import PRESETS, hf_config, init_model, parameter_count


@pytest.mark.parametrize("preset, expected", [("qwen3-0.6b", 0.596e9), ("qwen3-4b", 4.02e9), ("qwen3-14b", 14.8e9),
                                              ("qwen3-32b", 32.8e9)])
def test_parameter_count_matches_published_size(preset, expected):
    n = parameter_count(hf_config(PRESETS[preset], "bfloat16"))
    assert abs(n - expected) / expected < 0.005


def test_real_qwen3_values():
    c06 = hf_config(PRESETS["qwen3-0.6b"], "bfloat16")
    assert (c06["num_hidden_layers"], c06["hidden_size"], c06["intermediate_size"]) == (28, 1024, 3072)
    assert (c06["num_attention_heads"], c06["num_key_value_heads"], c06["head_dim"]) == (16, 8, 128)
    assert c06["tie_word_embeddings"] and c06["vocab_size"] == 151936 and c06["rope_theta"] == 1000000
    c8 = hf_config(PRESETS["qwen3-8b"], "bfloat16")
    assert not c8["tie_word_embeddings"] and c8["num_hidden_layers"] == 36 and c8["hidden_size"] == 4096


def test_transformers_loads_and_generates_from_chat_prompt(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What limits decode throughput?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    ids = enc["input_ids"]
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>") == 151644
    out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


def test_unknown_ids_decode_to_empty_text(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.decode([120000, 99999]) == ""
    known = tok.encode(" the")
    assert tok.decode([120000] + known) == " the"


def test_weights_are_seeded(tmp_path):
    from safetensors.torch import load_file

    a = load_file(init_model("tiny", tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(init_model("tiny", tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(init_model("tiny", tmp_path / "c", seed=4) / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert a[key].equal(b[key]) and not a[key].equal(c[key])
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and a[key].dtype.is_floating_point


def test_sharded_writer_keeps_one_shard_in_memory(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from infertrace.modelgen import weights

    monkeypatch.setattr(weights, "SHARD_BYTES", 40 * 1024**2)
    out = init_model("tiny", tmp_path / "sharded", seed=0)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    loaded = {}
    for f in files:
        loaded.update(load_file(out / f))
    assert set(loaded) == set(index["weight_map"])


def test_parameter_label_reads_as_model_cards_write_it():
    from infertrace.modelgen.presets import parameter_label

    assert parameter_label(40_140_000) == "40.1 M"
    assert parameter_label(596_049_920) == "596.0 M"
    assert parameter_label(4_022_468_096) == "4.02 B"


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_model_init_writes_every_file_with_the_umasks_mode_and_says_m_parameters(tmp_path, umask):
    """safetensors wrote the weights 0600 while config.json and the tokenizer got the umask's mode."""
    import os
    import stat

    from click.testing import CliRunner

    from infertrace.cli import main

    before = os.umask(umask)
    try:
        result = CliRunner().invoke(main, ["model", "init", "--preset", "tiny", "--out", str(tmp_path / "m")])
    finally:
        os.umask(before)
    assert result.exit_code == 0, result.output
    count = parameter_count(hf_config(PRESETS["tiny"], "float32"))
    assert f"({count / 1e6:.1f} M parameters)" in result.stdout and " B parameters" not in result.stdout
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
