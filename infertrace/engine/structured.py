"""JSON-schema output through llguidance: a request's grammar, its matcher, and the logit mask of each step.

llguidance is imported only when a request asks for structured output, so a server that never sees one does not
load it.
"""

from __future__ import annotations

import json
from typing import Any

# Compact JSON: no whitespace between tokens and the default "," / ":" separators. With flexible whitespace a model
# (random weights above all) can spend its whole max_tokens on blanks the grammar allows.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}  # OpenAI's json_object: any JSON object


def grammar_from_response_format(response_format: dict) -> str | None:
    """llguidance's grammar (JSON text) for an OpenAI `response_format`, None for plain text; ValueError with one
    line for a format or schema it cannot honour."""
    from llguidance import LLMatcher

    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema: Any = ANY_OBJECT
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON schema (an object)")
        schema = spec["schema"]
    else:
        raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: {_one_line(e)}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid JSON schema: {_one_line(error)}")
    return grammar


class Grammars:
    """Matchers over one tokenizer; the llguidance tokenizer is built once (about a second for a large
    vocabulary)."""

    def __init__(self, hf_tokenizer, eos_token_ids: frozenset[int], vocab_size: int):
        import llguidance
        import llguidance.hf

        # the model's vocabulary may be wider than its tokenizer's (a padded embedding, EOS ids past the text
        # tokens): the matcher covers all of it, so that every id the model can emit has a place in the mask
        eos = sorted(t for t in eos_token_ids if t < vocab_size)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        except ValueError:  # llguidance checks explicit EOS ids against the tokenizer's own count, not n_vocab
            self.tokenizer = llguidance.LLTokenizer(hf_tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size)

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {_one_line(matcher.get_error())}")
        return matcher


def mask_logits(logits, matchers: list) -> None:
    """Set to -inf, in place, the logits of tokens the grammar of their row does not allow (rows whose matcher is
    None are left as they are). logits [B, V] on any device; the packed bitmask (V/32 words a row) is what crosses
    to the device, and is unpacked there."""
    import torch
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = logits.shape[1]
    bitmask = allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        fill_next_token_bitmask(matchers[i], bitmask, j)
    words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def advance(matcher, token: int) -> bool:
    """Feed the sampled token to the request's matcher; True when the grammar is complete (the output ends)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar refused a token it allowed: {_one_line(matcher.get_error())}")
    return matcher.is_stopped()


def _one_line(error: Any) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
