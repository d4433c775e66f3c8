"""Prefill and mixed steps replayed from token-count CUDA graphs against the same steps run eagerly (GPU only):
the same greedy tokens in float32 and the same logits within rounding, with prefix hits, chunked prefill and
preemption in the mix."""

from __future__ import annotations

import pytest

from tests.engine.conftest import MIXED_SCENARIOS, free_engine, prompt_waves, run_in_waves, skip_without_flash_attn

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen06_dirs(tmp_path_factory):
    from infertrace.modelgen import init_model

    root = tmp_path_factory.mktemp("graph-models")
    return {dtype: init_model("qwen3-0.6b", root / dtype, seed=0, dtype=dtype) for dtype in ("float32", "bfloat16")}


SCENARIOS = MIXED_SCENARIOS


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_graphs_give_the_eager_tokens_and_logits(qwen06_dirs, scenario):

    from infertrace.engine import SamplingParams

    overrides, waves = SCENARIOS[scenario]
    overrides = {"kv_cache_tokens": 16384, **overrides, "dtype": "float32"}
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    got, kinds, logits, engine = run_in_waves(qwen06_dirs["float32"], waves, params, **overrides)
    graphs = engine.runner.token_graphs
    assert graphs is not None and graphs.replays > 0
    assert engine.decode_path()["prefill_cuda_graphs_captured"]
    if scenario == "mixed with prefix hits":
        assert "mixed" in kinds and engine.counters["prefix_cache_hits"] > 0
    if scenario == "preemption":
        assert engine.counters["preemptions"] > 0
    free_engine(engine)
    want, want_kinds, want_logits, eager = run_in_waves(qwen06_dirs["float32"], waves, params,
                                                        prefill_cuda_graphs=False, **overrides)
    assert eager.runner.token_graphs is None
    free_engine(eager)
    assert got == want and kinds == want_kinds
    assert len(logits) == len(want_logits)
    for ours, ref in zip(logits, want_logits):
        assert ours.shape == ref.shape
        assert float((ours - ref).norm() / ref.norm()) < 1e-4


def test_bfloat16_logits_within_rounding_of_eager(qwen06_dirs):
    """One 512-token prefill and a mixed step (new prompts beside decodes) in bfloat16: the logits the graphs give
    against the eager path's."""

    from infertrace.engine import SamplingParams

    waves = prompt_waves(4, [[512, 37], [300, 3, 77]])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    _, kinds, logits, engine = run_in_waves(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384)
    assert engine.runner.token_graphs.replays >= 2 and "mixed" in kinds
    free_engine(engine)
    _, want_kinds, want_logits, eager = run_in_waves(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384,
                                                     prefill_cuda_graphs=False)
    free_engine(eager)
    assert kinds == want_kinds
    # the first prefill step and the first mixed step (later ones may follow different tokens in bfloat16)
    for step in (0, kinds.index("mixed")):
        ours, ref = logits[step], want_logits[step]
        assert float((ours - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_padding_tokens_write_no_kv(qwen06_dirs, backend):
    """A step padded up to its bucket leaves every KV slot it does not own as it was, with either attention
    backend (the flash one runs the bucket's padded batch of requests where the Triton one runs a tile list)."""
    import torch

    from infertrace.engine import Engine, EngineConfig, SamplingParams

    if backend == "flash":
        skip_without_flash_attn()
    engine = Engine(qwen06_dirs["bfloat16"], EngineConfig(kv_cache_tokens=4096, attention_backend=backend))
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
    free_engine(engine)


def test_decode_longest_first_changes_no_logit(qwen06_dirs):
    """Decode attention launched longest context first computes every program as the row-order launch does: the
    same tokens and bit-identical logits over decode steps of mixed context lengths, graph-replayed and eager."""
    import torch

    from infertrace.engine import SamplingParams

    waves = prompt_waves(5, [[700, 12, 300, 1500, 64], [5, 900, 260]])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs = {}
    for ordered in (True, False):
        for graphs in (True, False):
            got, kinds, logits, engine = run_in_waves(qwen06_dirs["bfloat16"], waves, params, kv_cache_tokens=16384,
                                                      decode_longest_first=ordered, cuda_graphs=graphs)
            assert engine.runner._ordered_decode is ordered
            assert kinds.count("decode") > 20
            free_engine(engine)
            runs[ordered, graphs] = got, logits
    for graphs in (True, False):
        (got, logits), (want, want_logits) = runs[True, graphs], runs[False, graphs]
        assert got == want and len(logits) == len(want_logits)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
