"""Loading real Hugging Face checkpoints: untied heads, q/k/v biases, sharded files, missing tensors."""

from __future__ import annotations

import shutil

import pytest
import torch

from infertrace.engine import Engine, EngineConfig, SamplingParams


def write_hf_model(out, tiny_model_dir, *, shard: bool, bias: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=bias,
        max_position_embeddings=512, rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    if bias:
        with torch.no_grad():  # biases start at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out, max_shard_size="200KB" if shard else "1GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return model


@pytest.mark.parametrize(("shard", "bias"), [(True, True), (False, False)])
def test_untied_checkpoint_matches_hf(tiny_model_dir, tmp_path, shard, bias):
    model = write_hf_model(tmp_path, tiny_model_dir, shard=shard, bias=bias)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    engine = Engine(tmp_path, EngineConfig(kv_cache_tokens=1024, block_size=8))
    assert engine.runner.model.lm_head is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 37, 11)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, ignore_eos=True))
    got = {str(i): [] for i in range(3)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got[str(i)] == ref


def test_missing_tensor_is_reported(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    write_hf_model(tmp_path, tiny_model_dir, shard=False, bias=False)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        Engine(tmp_path, EngineConfig(kv_cache_tokens=1024))


def test_missing_shard_is_reported(tiny_model_dir, tmp_path):
    write_hf_model(tmp_path, tiny_model_dir, shard=True, bias=False)
    shard = max(tmp_path.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing checkpoint shard.*{shard.name}"):
        Engine(tmp_path, EngineConfig(kv_cache_tokens=1024))
