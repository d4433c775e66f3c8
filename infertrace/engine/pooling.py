"""The engine's answer to /v1/embeddings: each input's last-layer hidden states (after the final norm), pooled over
its LAST token or the MEAN of its tokens (--pooling-type) and L2-normalised, as vLLM 0.32's embedding pooler does
by default (vllm/model_executor/layers/pooler: `use_activation` on normalises).

Each input is one forward outside the step loop, between two steps, against a KV cache of its own length: the
engine's cache and its blocks are never touched, so pooling neither evicts a cached prefix nor waits for a free
block."""

from __future__ import annotations

import torch

from infertrace.engine.attention import AttentionMetadata


@torch.inference_mode()
def pooled_hidden(runner, token_ids: list[int], pooling_type: str) -> torch.Tensor:
    """One input's pooled, L2-normalised hidden state [hidden_size], float32 on the host."""
    n, spec, block = len(token_ids), runner.spec, runner.block_size
    blocks = -(-n // block)
    cache = torch.zeros((2, spec.num_hidden_layers, blocks * block, runner.num_kv_heads, spec.head_dim),
                        dtype=runner.kv_dtype, device=runner.device)
    long = dict(dtype=torch.long, device=runner.device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, **long), query_start_loc=torch.tensor([0, n], **long),
        seq_lens=torch.tensor([n], **long), block_tables=torch.arange(blocks, **long)[None],
        query_lens_list=[n], seq_lens_list=[n], max_query_len=n, max_seq_len=n, block_size=block,
    )
    runner.model.bind_kv_cache(list(cache[0]), list(cache[1]))
    try:
        runner.attention.prepare(meta)
        hidden = runner.model(torch.tensor(token_ids, **long), torch.arange(n, **long), meta)
    finally:  # the captured graphs and every later step read the engine's own cache
        runner.model.bind_kv_cache(list(runner.kv_cache[0]), list(runner.kv_cache[1]))
    pooled = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0, dtype=torch.float32)
    return torch.nn.functional.normalize(pooled.float(), dim=0).cpu()


def embed(engine, inputs: list[list[int]]) -> list[list[float]]:
    """Every input's vector, in order; ValueError (one line) for an input the engine cannot take whole."""
    runner, config = engine.runner, engine.config
    if runner.tp.size > 1:
        raise ValueError("embeddings run on one rank: serve with --tensor-parallel-size 1")
    limit = min(engine.max_model_len, config.max_num_batched_tokens)  # one forward: one step's activations
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            raise ValueError(f"input {i} has {len(ids)} tokens; at most {limit} (the context length, and one "
                             "step's --max-num-batched-tokens) are pooled")
        if not ids:
            raise ValueError(f"input {i} is empty")
        if not all(0 <= t < engine.vocab_size for t in ids):
            raise ValueError(f"input {i} holds a token id outside the vocabulary (0..{engine.vocab_size - 1})")
    return [pooled_hidden(runner, ids, config.pooling_type).tolist() for ids in inputs]
