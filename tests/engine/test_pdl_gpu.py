"""Programmatic dependent launch (GPU only; the launches are ordinary where the GPU is older than Hopper): a chain
of dependent kernels, each reading what the one before wrote, gives bit for bit what it gives without it, eagerly and
replayed from a CUDA graph; and an engine step's logits do too."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def _chain(x, residual, weights, norm_w):
    """A decode layer's shape of dependencies, 12 times over: norm -> GEMM (split-K into float32 partial-sum
    planes) -> norm adding them -> GEMM -> SiLU-mul -> GEMM (split 4) -> norm."""
    from infertrace.engine.kernels.fused import silu_mul
    from infertrace.engine.kernels.norm import add_rmsnorm
    from infertrace.engine.kernels.skinny_gemm import skinny_gemm

    w_out, w_up, w_down = weights
    h = add_rmsnorm(x, residual, norm_w, 1e-6)
    for _ in range(12):
        h = add_rmsnorm(skinny_gemm(h, w_out, block_n=64, block_k=256, split_k=2), residual, norm_w, 1e-6)
        up = skinny_gemm(h, w_up, block_n=32, block_k=128, num_stages=3)
        h = add_rmsnorm(skinny_gemm(silu_mul(up), w_down, block_n=64, block_k=128, split_k=4), residual, norm_w,
                        1e-6)
    return h


def test_dependent_kernels_read_what_the_one_before_wrote():
    from infertrace.engine.kernels import launch

    torch.manual_seed(0)
    dev, dt, hidden, inter = "cuda", torch.bfloat16, 2560, 9728
    weights = (torch.randn(hidden, hidden, device=dev, dtype=dt) / 50, torch.randn(2 * inter, hidden, device=dev,
               dtype=dt) / 50, torch.randn(hidden, inter, device=dev, dtype=dt) / 100)
    norm_w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    x0 = torch.randn(8, hidden, device=dev, dtype=dt)
    results = {}
    try:
        for on in (False, True):
            results[on] = []
            if launch.set_enabled(on) != on and on:
                pytest.skip("programmatic dependent launch needs compute capability 9.0")
            residual = torch.zeros(8, hidden, device=dev, dtype=dt)
            results[on].append(_chain(x0, residual, weights, norm_w).clone())
            residual.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _chain(x0, residual, weights, norm_w)
            for _ in range(3):
                residual.zero_()
                graph.replay()
                results[on].append(out.clone())
    finally:
        launch.set_enabled(False)
    assert all(torch.isfinite(r).all() for r in results[True])
    for eager_or_replay_off, with_pdl in zip(results[False], results[True]):
        assert torch.equal(eager_or_replay_off, with_pdl)


@pytest.mark.parametrize("lengths,first_max,more", [
    ([300, 7, 64, 129, 5, 1000, 33, 80], 40, 10),
    # every context within one KV split for the whole run: no program of the split merge has anything to merge
    ([7, 5, 12, 3, 20, 9, 2, 15], 30, 1),
], ids=["mixed", "one-split-contexts"])
def test_engine_logits_with_and_without_pdl(tmp_path, lengths, first_max, more):
    """bfloat16 qwen3-0.6b (skinny GEMMs, decode and token-count graphs, async scheduling): every sampled row's logits
    are identical with PDL on and off."""
    from infertrace.engine import Engine, EngineConfig, SamplingParams
    from infertrace.modelgen import init_model
    from tests.engine.conftest import random_prompts, spy_logits

    path = init_model("qwen3-0.6b", tmp_path / "m", seed=0, dtype="bfloat16")
    prompts = random_prompts(lengths)
    seen = {}
    for pdl in (False, True):
        engine = Engine(path, EngineConfig(pdl=pdl, kv_cache_tokens=32768))
        assert engine.decode_path()["pdl"] == (pdl and torch.cuda.get_device_capability() >= (9, 0))
        seen[pdl] = spy_logits(engine)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=first_max + more * i, ignore_eos=True))
            engine.step()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert len(seen[True]) == len(seen[False]) > first_max
    for a, b in zip(seen[True], seen[False]):
        assert torch.equal(a, b)
