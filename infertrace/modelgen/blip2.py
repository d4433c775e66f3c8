"""`model init --preset blip2-qwen3-tiny`: a BLIP-2 directory (Salesforce/blip2-opt-2.7b's config.json layout with
the tiny Qwen3 preset as its language model, the vision tower and Q-Former scaled down), seeded random weights named
as transformers names them, the local tokenizer with BLIP-2's `<image>` token, and the image processor's
preprocessor_config.json. Its vision tower needs no torchvision, so a vLLM without one serves it with images."""

from __future__ import annotations

import json
import math
from pathlib import Path

from infertrace.modelgen.presets import ENDOFTEXT_ID, PRESETS, hf_config
from infertrace.modelgen.tokenizer import SPECIAL_TOKENS

# the first id past Qwen's special tokens: the vocabulary (151936 rows) holds it, as OPT's holds BLIP-2's 50265
IMAGE_TOKEN, IMAGE_TOKEN_ID = "<image>", ENDOFTEXT_ID + len(SPECIAL_TOKENS)

BLIP2_PRESETS = {
    "blip2-qwen3-tiny": {
        "text": "tiny",  # the language model is this Qwen3 preset
        # 64x64 pixels in 16x16 patches: 16 patches and the class token
        "vision": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "image_size": 64, "patch_size": 16},
        "qformer": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2},
        "num_query_tokens": 16,  # the image tokens each image becomes in the prompt
        "dtype": "float32",
    },
}


def blip2_config(name: str, dtype: str) -> dict:
    p = BLIP2_PRESETS[name]
    v, q = p["vision"], p["qformer"]
    return {
        "architectures": ["Blip2ForConditionalGeneration"], "model_type": "blip-2",
        "initializer_factor": 1.0, "initializer_range": 0.02, "num_query_tokens": p["num_query_tokens"],
        "image_token_index": IMAGE_TOKEN_ID, "use_decoder_only_language_model": True, "torch_dtype": dtype,
        "text_config": hf_config(PRESETS[p["text"]], dtype),
        "vision_config": {**v, "model_type": "blip_2_vision_model", "hidden_act": "gelu", "layer_norm_eps": 1e-6,
                          "qkv_bias": True, "attention_dropout": 0.0, "initializer_range": 1e-10},
        "qformer_config": {**q, "model_type": "blip_2_qformer", "hidden_act": "gelu", "layer_norm_eps": 1e-12,
                           "cross_attention_frequency": 2, "encoder_hidden_size": v["hidden_size"],
                           "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                           "max_position_embeddings": 512, "vocab_size": 30522, "initializer_range": 0.02,
                           "pad_token_id": 0, "position_embedding_type": "absolute"},
    }


def preprocessor_config(name: str) -> dict:
    """Salesforce/blip2-opt-2.7b's preprocessor_config.json, resizing to the vision tower's image size."""
    side = BLIP2_PRESETS[name]["vision"]["image_size"]
    return {
        "image_processor_type": "BlipImageProcessor", "processor_class": "Blip2Processor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"height": side, "width": side},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


def weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors as transformers' Blip2ForConditionalGeneration names them, from the model built on
    the meta device (no memory, no values)."""
    import torch
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    with torch.device("meta"):
        model = Blip2ForConditionalGeneration(Blip2Config(**config))
    tied = config["text_config"]["tie_word_embeddings"]
    return [(k, tuple(t.shape)) for k, t in model.state_dict().items()
            if not (tied and k == "language_model.lm_head.weight")]


def blip2_parameter_count(name: str) -> int:
    config = blip2_config(name, BLIP2_PRESETS[name]["dtype"])
    return sum(math.prod(shape) for _, shape in weight_shapes(config))


def write_blip2_model(name: str, out: Path, seed: int, dtype: str) -> None:
    """config.json, the tokenizer with `<image>`, preprocessor_config.json, processor_config.json and the
    weights."""

    from infertrace.modelgen.tokenizer import write_tokenizer
    from infertrace.modelgen.weights import write_single_checkpoint

    config = blip2_config(name, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out, seed=seed, model_max_length=config["text_config"]["max_position_embeddings"])
    _add_image_token(out)
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(name), indent=2))
    # Blip2Processor puts num_query_tokens `<image>` tokens before the text; vLLM inserts the same when it does not
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Blip2Processor", "num_query_tokens": config["num_query_tokens"]}, indent=2))
    write_single_checkpoint(out, weight_shapes(config), dtype, seed, config["initializer_range"])


def _add_image_token(out: Path) -> None:
    """`<image>` as a special added token at IMAGE_TOKEN_ID: vLLM's blip2.py looks it up by name in the vocabulary,
    and Blip2Processor adds one at the vocabulary's end when the tokenizer has none."""
    entry = {"content": IMAGE_TOKEN, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}
    data = json.loads((out / "tokenizer.json").read_text())
    data["model"]["vocab"][IMAGE_TOKEN] = IMAGE_TOKEN_ID
    data["added_tokens"].append({"id": IMAGE_TOKEN_ID, **entry})
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["added_tokens_decoder"][str(IMAGE_TOKEN_ID)] = entry
    tok_config["processor_class"] = "Blip2Processor"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
