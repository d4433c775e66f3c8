"""The FlashAttention-4 backend against the Triton one (GPU with FA4 only): one attention call over a paged cache,
then whole engines on mixed batches with prefix hits, chunked prefill and preemption: bfloat16 logits within
rounding of each other, the same step kinds, the flash calls inside the decode and token-count CUDA graphs."""

from __future__ import annotations

import gc
import random

import pytest

pytestmark = pytest.mark.gpu

VOCAB = 151936


def _flash_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("FlashAttention-4 needs a Hopper or later GPU")
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means the backend is absent here
        pytest.skip(f"flash-attn-4 does not import: {exc}")


@pytest.fixture(scope="module")
def qwen06_bf16(tmp_path_factory):
    _flash_or_skip()
    from infertrace.modelgen import init_model

    return init_model("qwen3-0.6b", tmp_path_factory.mktemp("flash-models") / "bf16", seed=0, dtype="bfloat16")


def test_one_call_matches_triton_on_a_mixed_batch():
    """Requests with cached context and new tokens, decode rows and a fresh prompt, in one varlen call: FA4's output
    within bfloat16 rounding of the Triton kernel's, and the K/V it stores the same."""
    _flash_or_skip()
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


def _run(path, waves, params, **overrides):
    """Requests added in waves (each after a few steps, so prefills join running decodes), run to completion.
    Returns (tokens per request, kinds of the steps, the logits of every sampled row per step, the engine)."""
    import torch

    from infertrace.engine import Engine, EngineConfig

    engine = Engine(path, EngineConfig.from_overrides(overrides))
    logits_seen = []
    sampler = engine.runner.sampler

    def spy(logits, sampling, generators):
        logits_seen.append(logits.float().cpu())
        return sampler(logits, sampling, generators)

    engine.runner.sampler = spy
    tokens: dict[str, list[int]] = {}
    kinds = []
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            tokens[f"w{w}r{i}"] = []
            engine.add_request(f"w{w}r{i}", prompt, params)
        for _ in range(3 if w + 1 < len(waves) else 10**6):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            last = engine.last_step
            if last is not None and len(kinds) <= last.index:
                kinds.append(last.kind)
    torch.cuda.synchronize()
    return list(tokens.values()), kinds, logits_seen, engine


def _free(engine):
    import torch

    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _waves(seed: int, sizes: list[list[int]], shared: int = 0) -> list[list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [[prefix + [rng.randrange(VOCAB) for _ in range(n)] for n in wave] for wave in sizes]


SCENARIOS = {
    "mixed with prefix hits": (dict(), _waves(1, [[40, 300, 7], [90, 16, 200], [1, 130, 64, 33]], shared=160)),
    "chunked prefill": (dict(max_num_batched_tokens=384), _waves(2, [[900, 50], [1300, 5, 700], [384, 385]])),
    "preemption": (dict(kv_cache_tokens=1024, max_num_batched_tokens=512), _waves(3, [[200, 230, 150], [180, 90]])),
}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_logits_within_rounding_of_triton(qwen06_bf16, scenario):
    """The same step kinds as the Triton engine, and logits as close to the torch reference attention's (plain
    matmul and float32 softmax, in bfloat16 like the others) as the Triton engine's are: every step is compared
    until the first one whose greedy tokens differ (random weights leave near-ties that rounding flips)."""
    from infertrace.engine import SamplingParams

    overrides, waves = SCENARIOS[scenario]
    overrides = {"kv_cache_tokens": 16384, **overrides}
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    _, kinds, logits, engine = _run(qwen06_bf16, waves, params, attention_backend="flash", **overrides)
    path = engine.decode_path()
    assert engine.runner.attention.name == "flash"
    assert path["cuda_graphs_captured"] and path["prefill_cuda_graphs_captured"]
    assert engine.runner.token_graphs.replays > 0
    if scenario == "mixed with prefix hits":
        assert "mixed" in kinds and engine.counters["prefix_cache_hits"] > 0
    if scenario == "preemption":
        assert engine.counters["preemptions"] > 0
    _free(engine)
    _, want_kinds, want_logits, triton = _run(qwen06_bf16, waves, params, attention_backend="triton", **overrides)
    _free(triton)
    _, ref_kinds, ref_logits, torch_ref = _run(qwen06_bf16, waves, params, attention_backend="torch", **overrides)
    _free(torch_ref)
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
        if not (torch_equal(ours.argmax(-1), ref.argmax(-1)) and torch_equal(theirs.argmax(-1), ref.argmax(-1))):
            break
    assert compared >= 1


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_padding_tokens_write_no_kv(qwen06_bf16):
    """A prefill padded up to its token-count bucket leaves every KV slot it does not own as it was."""
    import torch

    from infertrace.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(qwen06_bf16, EngineConfig(kv_cache_tokens=4096, attention_backend="flash"))
    runner = engine.runner
    runner.kv_cache.fill_(7.0)
    engine.add_request("a", [5] * 100, SamplingParams(max_tokens=1, ignore_eos=True))  # bucket 112: 12 padded
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    assert runner.token_graphs.replays == 1
    written = (runner.kv_cache != 7.0).flatten(3).any(-1)
    assert set(written.nonzero()[:, 2].tolist()) == set(range(100))
    _free(engine)
