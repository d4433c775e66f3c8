"""The FlashAttention-4 backend against the Triton one (GPU with FA4 only): one attention call over a paged cache,
then whole engines on mixed batches with prefix hits, chunked prefill and preemption: bfloat16 logits within
rounding of each other, the same step kinds, the flash calls inside the decode and token-count CUDA graphs."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import MIXED_SCENARIOS, free_engine, run_in_waves, skip_without_flash_attn

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen06_bf16(tmp_path_factory):
    skip_without_flash_attn()
    from infertrace.modelgen import init_model

    return init_model("qwen3-0.6b", tmp_path_factory.mktemp("flash-models") / "bf16", seed=0, dtype="bfloat16")


def test_one_call_matches_triton_on_a_mixed_batch():
    """Requests with cached context and new tokens, decode rows and a fresh prompt, in one varlen call: FA4's output
    within bfloat16 rounding of the Triton kernel's, and the K/V it stores the same."""
    skip_without_flash_attn()
    import torch

    from infertrace.engine.attention import AttentionMetadata, FlashAttention, TritonAttention
    from infertrace.engine.config import EngineConfig

    torch.manual_seed(0)
    block, heads, kv_heads, dim = 16, 16, 8, 128
    cached = [0, 160, 37, 900, 5, 0]  # context already in the cache
    new = [300, 1, 64, 1, 1, 7]  # this step's tokens
    num_blocks = 512
    device = torch.device("cuda")
    caches = {}
    rng = random.Random(0)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for c, n in zip(cached, new):
        pages = [free.pop() for _ in range(-(-(c + n) // block))]
        tables.append(pages)
        slots += [pages[p // block] * block + p % block for p in range(c, c + n)]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    starts = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.long, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), query_start_loc=starts,
        seq_lens=torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.long, device=device),
        block_tables=table, query_lens_list=new, seq_lens_list=[c + n for c, n in zip(cached, new)],
        max_query_len=max(new), max_seq_len=max(c + n for c, n in zip(cached, new)), block_size=block)
    total = sum(new)
    q = torch.randn(total, heads, dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(total, kv_heads, dim, dtype=torch.bfloat16, device=device)
    v = torch.randn(total, kv_heads, dim, dtype=torch.bfloat16, device=device)
    history = torch.randn(2, num_blocks * block, kv_heads, dim, dtype=torch.bfloat16, device=device)
    config = EngineConfig(block_size=block, attention_backend="flash")
    for name, backend in (("triton", TritonAttention("batched", block)),
                          ("flash", FlashAttention(config, device, torch.bfloat16))):
        k_cache, v_cache = history[0].clone(), history[1].clone()
        out = backend.forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)
        caches[name] = (out.float(), k_cache, v_cache)
    torch.cuda.synchronize()
    ours, ref = caches["flash"][0], caches["triton"][0]
    assert torch.equal(caches["flash"][1], caches["triton"][1]) and torch.equal(caches["flash"][2], caches["triton"][2])
    assert float((ours - ref).abs().max()) < 2e-2


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("backend", ["flash", "auto"])
@pytest.mark.parametrize("scenario", list(MIXED_SCENARIOS))
def test_engine_logits_within_rounding_of_triton(qwen06_bf16, scenario, backend, monkeypatch):
    """The same step kinds as the Triton engine, and logits as close to the torch reference attention's (plain
    matmul and float32 softmax, in bfloat16 like the others) as the Triton engine's are: every step is compared
    until the first one whose greedy tokens differ (random weights leave near-ties that rounding flips). `auto`
    runs here with FA4 from 256 tokens, so its steps and token-count graphs take both backends."""
    import torch

    from infertrace.engine import SamplingParams
    from infertrace.engine.kernels import tuning

    if backend == "auto":
        monkeypatch.setenv(tuning.ENV, tuning.with_rules({"flash_prefill_from": 256}))
    overrides, waves = MIXED_SCENARIOS[scenario]
    overrides = {"kv_cache_tokens": 16384, **overrides}
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    _, kinds, logits, engine = run_in_waves(qwen06_bf16, waves, params, attention_backend=backend, **overrides)
    path = engine.decode_path()
    assert engine.runner.attention.name == backend
    assert path["cuda_graphs_captured"] and path["prefill_cuda_graphs_captured"]
    if backend == "auto":
        tiled = {b: engine.runner.token_graphs.uses_tiles(b) for b in engine.runner.token_graphs.buckets}
        assert {b for b, t in tiled.items() if not t} == {b for b in tiled if b >= 256} != set()
        assert any(tiled.values())
    monkeypatch.delenv(tuning.ENV, raising=False)  # the reference engines below run without the experiment
    assert engine.runner.token_graphs.replays > 0
    if scenario == "mixed with prefix hits":
        assert "mixed" in kinds and engine.counters["prefix_cache_hits"] > 0
    if scenario == "preemption":
        assert engine.counters["preemptions"] > 0
    free_engine(engine)
    _, want_kinds, want_logits, triton = run_in_waves(qwen06_bf16, waves, params, attention_backend="triton", **overrides)
    free_engine(triton)
    _, ref_kinds, ref_logits, torch_ref = run_in_waves(qwen06_bf16, waves, params, attention_backend="torch", **overrides)
    free_engine(torch_ref)
    assert kinds == want_kinds == ref_kinds
    assert len(logits) == len(want_logits) == len(ref_logits)
    compared = 0
    for ours, theirs, ref in zip(logits, want_logits, ref_logits):
        assert ours.shape == theirs.shape == ref.shape
        flash_err, triton_err = _rel(ours, ref), _rel(theirs, ref)
        print(f"{scenario} step {compared}: |flash - torch| {flash_err:.4f}, |triton - torch| {triton_err:.4f}, "
              f"|flash - triton| {_rel(ours, theirs):.4f}")
        assert flash_err <= 1.5 * triton_err + 2e-3, f"step {compared}"
        compared += 1
        if not (torch.equal(ours.argmax(-1), ref.argmax(-1)) and torch.equal(theirs.argmax(-1), ref.argmax(-1))):
            break
    assert compared >= 1
