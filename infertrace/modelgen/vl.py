"""`model init --preset qwen2.5-vl-tiny`: a Qwen2.5-VL directory (config.json of Qwen2.5-VL-3B-Instruct's layout,
scaled down), seeded random weights named as transformers names them, the local tokenizer with Qwen's vision tokens at
Qwen's ids, and the image processor's preprocessor_config.json, so that a server can load it as a vision-language
model."""

from __future__ import annotations

import json
import math
from pathlib import Path

from infertrace.modelgen.presets import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE

VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = 151652, 151653, 151655, 151656
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2  # one image token per (PATCH * MERGE)^2 pixels

# Qwen2.5-VL-3B-Instruct's config.json, with the sizes cut down: text 256 wide (4 heads of 64), vision 64 wide
VL_PRESETS = {
    "qwen2.5-vl-tiny": {
        "text": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "mrope_section": [8, 12, 12]},  # sums to head_dim / 2, as 16, 24, 24 does
        "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                   "fullatt_block_indexes": [1]},
        "dtype": "float32",
    },
}
# the placeholder a message's image becomes in the prompt: vLLM and transformers expand <|image_pad|> to the image's
# tokens
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def vl_config(name: str, dtype: str) -> dict:
    p = VL_PRESETS[name]
    t, v = p["text"], p["vision"]
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0, "bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "hidden_act": "silu",
        "hidden_size": t["hidden_size"], "initializer_range": 0.02, "intermediate_size": t["intermediate_size"],
        "max_position_embeddings": 4096, "max_window_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"], "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"], "rms_norm_eps": 1e-06,
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": t["mrope_section"]},
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": dtype,
        "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB_SIZE,
        "vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID,
        "vision_token_id": 151654, "image_token_id": IMAGE_PAD_ID, "video_token_id": VIDEO_PAD_ID,
        "vision_config": {
            "depth": v["depth"], "hidden_act": "silu", "hidden_size": v["hidden_size"],
            "intermediate_size": v["intermediate_size"], "num_heads": v["num_heads"], "in_chans": 3,
            "out_hidden_size": t["hidden_size"], "patch_size": PATCH, "spatial_merge_size": MERGE,
            "spatial_patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "window_size": 112,
            "fullatt_block_indexes": v["fullatt_block_indexes"], "tokens_per_second": 2, "torch_dtype": dtype,
        },
    }


# Qwen2.5-VL-3B-Instruct's preprocessor_config.json; max_pixels cut so that no image costs more than 1024 tokens
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136, "max_pixels": 1024 * (PATCH * MERGE) ** 2,
    "patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "merge_size": MERGE,
}


def image_tokens(width: int, height: int) -> int:
    """The placeholder tokens one image of this size becomes, for images the processor does not resize (sides
    multiples of 28 within its pixel bounds): one per 28x28 pixels."""
    return (width // (PATCH * MERGE)) * (height // (PATCH * MERGE))


def weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors as transformers' Qwen2_5_VLForConditionalGeneration names them, from the model
    built on the meta device (no memory, no values)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    return [(k, tuple(t.shape)) for k, t in model.state_dict().items()
            if not (config["tie_word_embeddings"] and k == "lm_head.weight")]


def vl_parameter_count(name: str) -> int:
    return sum(math.prod(shape) for _, shape in weight_shapes(vl_config(name, VL_PRESETS[name]["dtype"])))


def write_vl_model(name: str, out: Path, seed: int, dtype: str) -> None:
    """config.json, the tokenizer (with the vision chat template), preprocessor_config.json and the weights."""

    from infertrace.modelgen.tokenizer import write_tokenizer
    from infertrace.modelgen.weights import write_single_checkpoint

    config = vl_config(name, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out, seed=seed, model_max_length=config["max_position_embeddings"])
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update(chat_template=CHAT_TEMPLATE, processor_class="Qwen2_5_VLProcessor")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_single_checkpoint(out, weight_shapes(config), dtype, seed, config["initializer_range"])
