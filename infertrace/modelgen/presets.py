"""Qwen3 model shapes, as published in each model's config.json, and the parameter count they imply."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_SIZE = 151936
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str  # the dtype a model of this preset is written in unless told otherwise


PRESETS: dict[str, Preset] = {
    # small enough to generate with in about a second on a CPU; real vocabulary and special-token ids
    "tiny": Preset(256, 512, 2, 4, 2, 64, True, 4096, "float32"),
    "qwen3-0.6b": Preset(1024, 3072, 28, 16, 8, 128, True, 40960, "bfloat16"),
    "qwen3-4b": Preset(2560, 9728, 36, 32, 8, 128, True, 40960, "bfloat16"),
    "qwen3-8b": Preset(4096, 12288, 36, 32, 8, 128, False, 40960, "bfloat16"),
    "qwen3-14b": Preset(5120, 17408, 40, 40, 8, 128, False, 40960, "bfloat16"),
    "qwen3-32b": Preset(5120, 25600, 64, 64, 8, 128, False, 40960, "bfloat16"),
}


def hf_config(preset: Preset, dtype: str) -> dict:
    """config.json as Hugging Face writes it for Qwen3ForCausalLM."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "max_window_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3 checkpoint, in file order, with its shape."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_out, hidden)),
            (p + "self_attn.k_proj.weight", (kv_out, hidden)),
            (p + "self_attn.v_proj.weight", (kv_out, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_out)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def parameter_count(config: dict) -> int:
    total = 0
    for _, shape in weight_shapes(config):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def parameter_label(count: int) -> str:
    """A parameter count as model cards write it: `40.1 M`, `4.02 B`."""
    return f"{count / 1e6:.1f} M" if count < 1e9 else f"{count / 1e9:.2f} B"
