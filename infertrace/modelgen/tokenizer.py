"""A byte-level BPE tokenizer trained locally, with Qwen's special tokens at Qwen's ids and a Qwen-style chat template."""

from __future__ import annotations

import json
import random
from pathlib import Path

from infertrace.modelgen.presets import ENDOFTEXT_ID, IM_END_ID

# Qwen2/Qwen3 special tokens, in id order from <|endoftext|> (151643) on.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# Tokens that are not "special" in Qwen's tokenizer (they survive skip_special_tokens).
NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an have not they which one you "
    "were all we when there can been has more if will would about their what so up out into than them time only "
    "model token tokens batch cache kernel attention layer prefill decode latency throughput request server "
    "memory block page queue step graph stream copy host device tensor matrix weight head value key query "
    "sequence prompt output input length budget schedule sample profile trace bandwidth compute launch idle "
    "engine infer serve bench gate analyze offload prefix hash reference count evict preempt chunk merge "
    "water river mountain city people house light night morning music story friend garden window paper "
    "number system program function return class import def print list dict string float int error value"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """A deterministic mixed corpus: prose, numbers, code-like and chat-like lines."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        kind = i % 4
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if kind == 0:
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind == 1:
            out.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)} = {rng.randint(0, 99999)} + {rng.random():.4f}")
        elif kind == 2:
            out.append(f"def {words[0]}({words[1]}, {words[2]}):\n    return {words[3]}[{rng.randint(0, 64)}]")
        else:
            out.append(f"User: {' '.join(words)}\nAssistant: {' '.join(reversed(words))}")
    return out


def write_tokenizer(out_dir: Path, *, seed: int = 0, vocab_size: int = 4096, model_max_length: int = 40960) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)

    # Put the special tokens at Qwen's ids: ids between the learned vocabulary and them are unknown and decode to "".
    data = json.loads(tok.to_str())
    # The added-token table only keeps ids that the model's vocabulary already holds, so the special tokens go into
    # the vocabulary too (ids in the gap belong to nothing).
    for i, t in enumerate(SPECIAL_TOKENS):
        data["model"]["vocab"][t] = ENDOFTEXT_ID + i
    data["added_tokens"] = [
        {"id": ENDOFTEXT_ID + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t not in NON_SPECIAL}
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ENDOFTEXT_ID + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": t not in NON_SPECIAL}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
        indent=2,
    ))
