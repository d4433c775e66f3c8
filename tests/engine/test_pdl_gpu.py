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


def _late_kv_store():
    """A kernel that lets the next one launch, holds the GPU `ns` nanoseconds, then writes a step's K/V at their
    slots: the q/k norm's place before decode attention, made slow, so that what attention reads before its wait is
    read while this step's K/V are not yet written."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def late_store(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ns, ROW: tl.constexpr):
        gdc_wait()
        gdc_launch_dependents()
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        i = tl.program_id(0)
        slot = tl.load(slot_ptr + i)
        offs = tl.arange(0, ROW)
        tl.store(k_cache_ptr + slot * ROW + offs, tl.load(k_ptr + i * ROW + offs))
        tl.store(v_cache_ptr + slot * ROW + offs, tl.load(v_ptr + i * ROW + offs))

    def run(k_new, v_new, k_cache, v_cache, slots, ns):
        late_store[(k_new.shape[0],)](k_new, v_new, k_cache, v_cache, slots, ns, ROW=k_new[0].numel(),
                                      launch_pdl=True)

    return run


@pytest.mark.parametrize("num_splits", [1, 4, 8])
def test_decode_attention_reads_this_steps_kv_after_its_wait(num_splits):
    """Decode attention with programmatic dependent launch, its step inputs read before its wait, after a kernel
    that writes this step's K/V 20 us after letting it launch: the slots hold NaN until then, so a read of this
    step's keys before the wait shows (a version that read the first tile of K/V before its wait, this step's key
    included, failed here on an H200). Eager and replayed from a CUDA graph, the output is bit for bit the
    attention's without programmatic dependent launch."""
    from infertrace.engine.kernels import launch
    from infertrace.engine.kernels.paged_attention import paged_attention
    from infertrace.engine.kernels.tiles import decode_order

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    torch.manual_seed(3)
    dev, dt, heads, kv_heads, dim, block_size = "cuda", torch.bfloat16, 10, 2, 128, 16
    lens = [1, 65, 64, 640, 200, 129, 17, 513]  # contexts: this step's token is the last key of each
    rows = len(lens)
    num_blocks = rows * 1024 // block_size
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev).view(rows, -1)
    q = torch.randn(rows, heads, dim, device=dev, dtype=dt)
    k_new = torch.randn(rows, kv_heads, dim, device=dev, dtype=dt)
    v_new = torch.randn_like(k_new)
    slots = torch.tensor([block_tables[i, (n - 1) // block_size].item() * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)], device=dev)
    cu = torch.arange(rows + 1, device=dev)
    ctx = torch.tensor(lens, device=dev)
    order = torch.from_numpy(decode_order(lens, rows)).to(dev)
    store = _late_kv_store()

    def attend(out):
        return paged_attention(q, k_cache, v_cache, cu, ctx, block_tables, 1, dim ** -0.5, out=out,
                               num_splits=num_splits, seq_order=order)

    def blank():  # this step's slots not yet written
        k_cache.flatten(0, 1)[slots] = float("nan")
        v_cache.flatten(0, 1)[slots] = float("nan")

    blank()
    k_cache.flatten(0, 1)[slots] = k_new
    v_cache.flatten(0, 1)[slots] = v_new
    want = attend(torch.empty_like(q))  # no programmatic dependent launch
    assert not want.isnan().any()
    out = torch.full_like(q, float("nan"))
    try:
        launch.set_enabled(True)
        blank()
        store(k_new, v_new, k_cache, v_cache, slots, 20_000)
        attend(out)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            store(k_new, v_new, k_cache, v_cache, slots, 20_000)
            attend(out)
        for _ in range(3):
            blank()
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
    finally:
        launch.set_enabled(False)
