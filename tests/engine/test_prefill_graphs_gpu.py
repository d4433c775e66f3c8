"""Prefill and mixed steps replayed from token-count CUDA graphs against the same steps run eagerly (GPU only):
the same greedy tokens in float32 and the same logits within rounding, with prefix hits, chunked prefill and
preemption in the mix."""

from __future__ import annotations

import gc
import random

import pytest

pytestmark = pytest.mark.gpu

VOCAB = 151936


@pytest.fixture(scope="module")
def qwen06_dirs(tmp_path_factory):
    from infertrace.modelgen import init_model

    root = tmp_path_factory.mktemp("graph-models")
    return {dtype: init_model("qwen3-0.6b", root / dtype, seed=0, dtype=dtype) for dtype in ("float32", "bfloat16")}


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
            last = engine.last_step  # with async scheduling a call may finish no step, or finish the one before
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
    # decodes running while new prompts arrive, half of them behind a 160-token prefix already cached
    "mixed with prefix hits": (dict(), _waves(1, [[40, 300, 7], [90, 16, 200], [1, 130, 64, 33]], shared=160)),
    # prompts longer than the step budget: chunks beside other requests' decodes, some ending off a bucket size
    "chunked prefill": (dict(max_num_batched_tokens=384), _waves(2, [[900, 50], [1300, 5, 700], [384, 385]])),
    # a KV cache too small for every request at once: the newest is preempted and computed again later
    "preemption": (dict(kv_cache_tokens=1024, max_num_batched_tokens=512), _waves(3, [[200, 230, 150], [180, 90]])),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_graphs_give_the_eager_tokens_and_logits(qwen06_dirs, scenario):

    from infertrace.engine import SamplingParams

    overrides, waves = SCENARIOS[scenario]
    overrides = {"kv_cache_tokens": 16384, **overrides, "dtype": "float32"}
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got, kinds, logits, engine = _run(qwen06_dirs["float32"], waves, params, **overrides)
    graphs = engine.runner.token_graphs
    assert graphs is not None and graphs.replays > 0
    assert engine.decode_path()["prefill_cuda_graphs_captured"]
    if scenario == "mixed with prefix hits":
        assert "mixed" in kinds and engine.counters["prefix_cache_hits"] > 0
    if scenario == "preemption":
        assert engine.counters["preemptions"] > 0
    _free(engine)
    want, want_kinds, want_logits, eager = _run(qwen06_dirs["float32"], waves, params, prefill_cuda_graphs=False,
                                                **overrides)
    assert eager.runner.token_graphs is None
    _free(eager)
    assert got == want and kinds == want_kinds
    assert len(logits) == len(want_logits)
    for ours, ref in zip(logits, want_logits):
        assert ours.shape == ref.shape
        assert float((ours - ref).norm() / ref.norm()) < 1e-4


def test_bfloat16_logits_within_rounding_of_eager(qwen06_dirs):
    """One 512-token prefill and a mixed step (new prompts beside decodes) in bfloat16: the logits the graphs give
    against the eager path's."""

    from infertrace.engine import SamplingParams

    waves = _waves(4, [[512, 37], [300, 3, 77]])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    _, kinds, logits, engine = _run(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384)
    assert engine.runner.token_graphs.replays >= 2 and "mixed" in kinds
    _free(engine)
    _, want_kinds, want_logits, eager = _run(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384,
                                             prefill_cuda_graphs=False)
    _free(eager)
    assert kinds == want_kinds
    # the first prefill step and the first mixed step (later ones may follow different tokens in bfloat16)
    for step in (0, kinds.index("mixed")):
        ours, ref = logits[step], want_logits[step]
        assert float((ours - ref).norm() / ref.norm()) < 1e-2


def test_padding_tokens_write_no_kv(qwen06_dirs):
    """A step padded up to its bucket leaves every KV slot it does not own as it was."""
    import torch

    from infertrace.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(qwen06_dirs["bfloat16"], EngineConfig(kv_cache_tokens=4096))
    runner = engine.runner
    runner.kv_cache.fill_(7.0)
    engine.add_request("a", [5] * 100, SamplingParams(max_tokens=1, ignore_eos=True))  # bucket 112: 12 padded
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    assert runner.token_graphs.replays == 1
    written = (runner.kv_cache != 7.0).flatten(3).any(-1)  # [2, layers, slots]
    # the first request takes the first free blocks: slots 0..99 are its 100 tokens
    assert set(written.nonzero()[:, 2].tolist()) == set(range(100))
    _free(engine)


def test_decode_longest_first_changes_no_logit(qwen06_dirs):
    """Decode attention launched longest context first computes every program as the row-order launch does: the
    same tokens and bit-identical logits over decode steps of mixed context lengths, graph-replayed and eager."""
    import torch

    from infertrace.engine import SamplingParams

    waves = _waves(5, [[700, 12, 300, 1500, 64], [5, 900, 260]])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs = {}
    for ordered in (True, False):
        for graphs in (True, False):
            got, kinds, logits, engine = _run(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384,
                                              decode_longest_first=ordered, cuda_graphs=graphs)
            assert engine.runner._ordered_decode is ordered
            assert kinds.count("decode") > 20
            _free(engine)
            runs[ordered, graphs] = got, logits
    for graphs in (True, False):
        (got, logits), (want, want_logits) = runs[True, graphs], runs[False, graphs]
        assert got == want and len(logits) == len(want_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
