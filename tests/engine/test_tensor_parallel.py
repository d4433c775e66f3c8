"""Tensor parallelism on CPU with gloo: the same greedy tokens as one rank, the scheduler's paths across ranks,
clear errors for bad sizes and dead ranks, no processes left behind, and one profiler trace per rank."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from infertrace.engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from infertrace.engine.models.loader import load_weights
from infertrace.engine.models.qwen3 import Qwen3ForCausalLM, Qwen3Spec
from infertrace.engine.parallel import TensorParallel, VocabParallelEmbedding
from infertrace.engine.worker import RankFailedError

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def tokens_of(make_engine, run_engine, prompts, params=GREEDY, **config):
    engine = make_engine(**config)
    try:
        tokens, _ = run_engine(engine, prompts, params)
        return tokens, dict(engine.counters)
    finally:
        engine.shutdown()


def rank_pids(engine) -> list[int]:
    return [p.pid for p in engine.other_ranks.procs]


def gone(pid: int, within_s: float = 20.0) -> bool:
    """Whether process `pid` has ended (or is a zombie nobody reaped yet) within `within_s`."""
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_tiny_preset_splits_over_two_ranks(tiny_model_dir):
    spec = Qwen3Spec.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    assert spec.num_attention_heads % 2 == 0 and spec.num_key_value_heads % 2 == 0
    assert spec.intermediate_size % 2 == 0


def test_two_ranks_give_the_tokens_of_one(make_engine, run_engine, make_prompts):
    prompts = make_prompts([1, 40, 17, 90, 5], seed=3)
    one, _ = tokens_of(make_engine, run_engine, prompts, kv_cache_tokens=2048)
    two, _ = tokens_of(make_engine, run_engine, prompts, kv_cache_tokens=2048, tensor_parallel_size=2)
    assert two == one
    assert len({t for seq in one for t in seq}) > len(prompts)  # not one repeated token per prompt


def test_prefix_caching_chunked_prefill_and_preemption_across_ranks(make_engine, run_engine, make_prompts):
    shared = make_prompts([48], seed=5)[0]
    prompts = [shared + tail for tail in make_prompts([7, 30, 12, 21], seed=6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # 4 requests of up to 102 tokens in 128 KV slots must preempt; 32-token steps chunk every prefill
    config = dict(kv_cache_tokens=128, block_size=8, max_num_batched_tokens=32)
    one, counters_one = tokens_of(make_engine, run_engine, prompts, params, **config)
    two, counters_two = tokens_of(make_engine, run_engine, prompts, params, tensor_parallel_size=2, **config)
    assert two == one
    assert counters_two == counters_one
    assert counters_two["prefix_cache_hits"] > 0 and counters_two["preemptions"] > 0
    assert counters_two["steps"] > sum(len(p) for p in prompts) // 32  # prefills took several steps each


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_async_scheduling_across_ranks_gives_the_tokens_of_one(make_engine, run_engine, make_prompts, sampled):
    """The other ranks feed the next step's inputs from the tokens of the step before: greedy steps take the same
    argmax of the gathered logits on every rank; steps that sample get rank 0's tokens by a broadcast."""
    prompts = make_prompts([1, 40, 17, 90, 5], seed=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=11) if sampled else \
        SamplingParams(max_tokens=12, ignore_eos=True)
    one, _ = tokens_of(make_engine, run_engine, prompts, params, kv_cache_tokens=2048, async_scheduling="off")
    two, counters = tokens_of(make_engine, run_engine, prompts, params, kv_cache_tokens=2048, tensor_parallel_size=2,
                              async_scheduling="on", max_num_batched_tokens=64)
    assert two == one
    assert counters["overlapped_steps"] > 10  # the decode steps were planned ahead of their inputs


def test_the_host_timeline_marks_every_step_on_both_ranks_in_order(make_engine, run_engine, make_prompts):
    """benchmarks/tp_bench.py --timeline: each step rank 0 sends is received and launched by rank 1, later by the
    clock both processes share."""
    engine = make_engine(kv_cache_tokens=2048, tensor_parallel_size=2)
    try:
        engine.other_ranks.record_timeline(True)
        run_engine(engine, make_prompts([3, 20], seed=8), GREEDY)
        mine, (theirs,) = engine.other_ranks.record_timeline(False)
        assert engine.other_ranks.timeline is None  # off again: a mark costs one check
    finally:
        engine.shutdown()
    send = [t for what, t in mine if what == "send"]
    recv = [t for what, t in theirs if what == "recv"]
    launched = [t for what, t in theirs if what == "launched"]
    assert len(send) == len(recv) == len(launched) == engine.counters["steps"] >= 8
    assert all(s <= r <= ln for s, r, ln in zip(send, recv, launched))


@pytest.mark.parametrize(("size", "message"), [
    (3, r"tensor_parallel_size=3 does not divide the model's attention heads \(4\)"),
    (4, r"tensor_parallel_size=4 does not divide the model's KV heads \(2\)"),
])
def test_a_size_that_does_not_split_the_heads_is_a_value_error(make_engine, size, message):
    import multiprocessing

    with pytest.raises(ValueError, match=message):
        make_engine(kv_cache_tokens=256, tensor_parallel_size=size)
    assert not multiprocessing.active_children()  # refused before any rank was started


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
    ({"tensor_parallel_size": 2, "offload": "prefix"}, "offload='prefix' is not supported"),
    ({"tensor_parallel_size": 2, "device": "cpu", "all_reduce": "custom"}, "all_reduce='custom' needs CUDA"),
    ({"tensor_parallel_size": 2, "all_reduce": "ring"}, "all_reduce must be one of auto, nccl, custom"),
    ({"tensor_parallel_size": 2, "device": "cuda:1"}, "rank r runs on cuda:r"),
])
def test_config_refuses_what_tensor_parallelism_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_overrides(overrides)


def test_config_reads_the_size_from_a_command_line():
    assert EngineConfig.from_overrides({"tensor_parallel_size": "2"}).tensor_parallel_size == 2


def test_checkpoint_tensors_are_sharded_per_rank(tiny_model_dir):
    from safetensors.torch import load_file

    hf = json.loads((tiny_model_dir / "config.json").read_text())
    spec = Qwen3Spec.from_hf_config(hf)
    model = Qwen3ForCausalLM(spec, torch.float32, TensorParallel(rank=1, size=2))
    load_weights(model, tiny_model_dir)  # no process group needed: loading only slices
    ckpt = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        ckpt |= load_file(f)
    p = "model.layers.0."
    q, k, v = (ckpt[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
    second_half = [t[t.shape[0] // 2:] for t in (q, k, v)]
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, torch.cat(second_half))
    o = ckpt[f"{p}self_attn.o_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o[:, o.shape[1] // 2:])
    gate, up = ckpt[f"{p}mlp.gate_proj.weight"], ckpt[f"{p}mlp.up_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([gate[gate.shape[0] // 2:], up[up.shape[0] // 2:]]))
    embed = ckpt["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed[embed.shape[0] // 2:])


def test_an_uneven_vocabulary_pads_the_last_shard():
    layer = VocabParallelEmbedding(5, 3, torch.float32, TensorParallel(rank=1, size=2))
    loaded = torch.arange(15, dtype=torch.float32).view(5, 3)
    dest, src = layer.weight_loader(layer.weight.data, loaded, None)
    assert torch.equal(src, torch.cat([loaded[3:], torch.zeros(1, 3)]))
    with pytest.raises(ValueError, match="4 rows for a vocabulary of 5"):
        layer.weight_loader(layer.weight.data, loaded[:4], None)


def test_shutdown_and_garbage_collection_end_the_ranks(make_engine, tiny_model_dir):
    import gc

    from infertrace.engine import LLM

    llm = LLM(tiny_model_dir, kv_cache_tokens=256, tensor_parallel_size=2)
    engine = llm.engine
    pids = rank_pids(engine)
    assert pids and all(not gone(pid, 0.0) for pid in pids)
    llm.shutdown()
    assert all(gone(pid) for pid in pids)
    with pytest.raises(RankFailedError, match="shut down"):
        engine.add_request("r", [1, 2, 3], GREEDY)
        engine.step()
    engine.shutdown()  # idempotent

    engine = make_engine(kv_cache_tokens=256, tensor_parallel_size=2)
    pids = rank_pids(engine)
    del engine
    gc.collect()
    assert all(gone(pid) for pid in pids)


def test_a_dead_rank_is_an_error_not_a_hang(make_engine):
    engine = make_engine(kv_cache_tokens=256, tensor_parallel_size=2)
    try:
        (pid,) = rank_pids(engine)
        os.kill(pid, signal.SIGKILL)
        assert gone(pid)
        engine.add_request("r", [1, 2, 3], GREEDY)
        with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {pid}\) exited"):
            engine.step()
    finally:
        engine.shutdown()


def test_a_rank_dying_inside_a_step_is_named(make_engine, monkeypatch):
    from infertrace.engine.worker import OtherRanks

    engine = make_engine(kv_cache_tokens=256, tensor_parallel_size=2)
    (pid,) = rank_pids(engine)
    send = OtherRanks.step

    def send_then_die(self, inputs):
        send(self, inputs)
        os.kill(pid, signal.SIGKILL)  # rank 0 then waits for it in the step's first all-reduce

    monkeypatch.setattr(OtherRanks, "step", send_then_die)
    try:
        engine.add_request("r", [1, 2, 3], GREEDY)
        with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {pid}\) exited"):
            engine.step()
    finally:
        engine.shutdown()


def test_the_ranks_exit_when_the_engine_process_dies(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from infertrace.engine import Engine, EngineConfig
        if __name__ == "__main__":
            engine = Engine({str(tiny_model_dir)!r}, EngineConfig(kv_cache_tokens=256, tensor_parallel_size=2))
            print(engine.other_ranks.procs[0].pid, flush=True)
            os._exit(0)  # no shutdown, no finalizers: as if the process were killed
    """)
    (tmp_path / "die.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "die.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert gone(int(out.stdout.split()[0]))


async def test_async_engine_runs_two_ranks(tiny_model_dir, make_prompts):
    prompts = make_prompts([9, 30], seed=8)
    one = Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024))
    want = [[t for o in outs for t in o] for outs in _offline(one, prompts)]
    aeng = AsyncEngine.from_model(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, tensor_parallel_size=2))
    try:
        got = []
        for i, p in enumerate(prompts):
            got.append([t async for out in aeng.generate(f"a{i}", p, GREEDY) for t in out.new_token_ids])
        assert got == want and all(len(g) == GREEDY.max_tokens for g in got)
    finally:
        await aeng.shutdown()
        aeng.engine.shutdown()


def _offline(engine, prompts):
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(f"o{i}", p, GREEDY)
        tokens = []
        while engine.has_unfinished():
            tokens += [o.new_token_ids for o in engine.step()]
        outs.append(tokens)
    return outs


def test_profile_writes_one_trace_per_rank_with_its_steps(make_engine, run_engine, make_prompts, tmp_path):
    engine = make_engine(kv_cache_tokens=512, tensor_parallel_size=2)
    try:
        engine.start_profile(tmp_path, activities=("CPU",), label="tp")
        _, steps = run_engine(engine, make_prompts([6, 20], seed=9), SamplingParams(max_tokens=3, ignore_eos=True))
        paths = engine.stop_profile()
    finally:
        engine.shutdown()
    assert [p.name.split(".")[2] for p in paths] == ["rank0", "rank1"]
    assert all(p.name.startswith("tp.") and p.name.endswith(".pt.trace.json.gz") for p in paths)
    for rank, path in enumerate(paths):
        trace = json.loads(gzip.decompress(path.read_bytes()))
        info = trace["distributedInfo"]
        assert (info["rank"], info["world_size"], info["backend"]) == (rank, 2, "gloo")
        names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert [re.sub(r" #\d+\]$", "]", n) for n in names if n.startswith("step[")] == [
            f"step[{s.kind.upper()} bs={s.batch_size} toks={s.num_tokens}]" if s.kind != "decode"
            else f"step[DECODE bs={s.batch_size}]" for s in steps
        ]
        assert {"prepare_inputs", "forward"} <= set(names)
        assert any("allreduce" in n.lower() or "all_reduce" in n.lower() for n in names)


def test_profile_with_one_rank_writes_one_trace(make_engine, run_engine, make_prompts, tmp_path):
    engine = make_engine(kv_cache_tokens=512)
    engine.start_profile(tmp_path / "traces", activities=("CPU",))
    with pytest.raises(RuntimeError, match="already being captured"):
        engine.start_profile(tmp_path / "traces")
    run_engine(engine, make_prompts([6], seed=9), SamplingParams(max_tokens=2, ignore_eos=True))
    (path,) = engine.stop_profile()
    assert path.parent == tmp_path / "traces" and ".rank0.pt.trace.json.gz" in path.name
    names = {e["name"] for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}
    assert any(re.fullmatch(r"step\[DECODE bs=1 #\d+\]", n) for n in names)
    with pytest.raises(RuntimeError, match="no profile"):
        engine.stop_profile()


def test_the_custom_all_reduce_where_it_cannot_run_is_a_value_error_naming_why(make_engine):
    import multiprocessing

    with pytest.raises(ValueError, match=r"all_reduce='custom' is not available: it needs CUDA GPUs \(device cpu\)"):
        make_engine(kv_cache_tokens=256, tensor_parallel_size=2, all_reduce="custom")
    assert not multiprocessing.active_children()


def test_auto_all_reduce_on_cpu_is_torch_distributed_s(make_engine):
    engine = make_engine(kv_cache_tokens=256, tensor_parallel_size=2)
    try:
        path = engine.decode_path()
        assert path["all_reduce"] == "nccl"  # torch.distributed's all-reduce: gloo here
        assert path["all_reduce_note"] == "it needs CUDA GPUs (device cpu)"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("split", [1, 2, 4])
def test_a_row_parallel_decode_projection_writes_its_planes_where_the_all_reduce_reads_them(monkeypatch, split):
    """all_reduce_fusion: the skinny GEMM writes its float32 split-K planes into the all-reduce's planes buffer and
    the planes, all-reduced, go on to the residual add + RMSNorm (which adds them); the GEMM and the peer-memory
    kernel are stood in for by torch ops (both are CUDA-only)."""
    from infertrace.engine.models import qwen3
    from infertrace.engine.parallel import RowParallelLinear

    def decode_config(n, k, planes):
        return 32, 128, split if planes else 1, 4

    def skinny_gemm(x, weight, out=None, *, block_n, block_k, split_k=1, num_stages):
        parts = torch.stack([p @ w.T for p, w in zip(x.float().chunk(split_k, 1), weight.float().chunk(split_k, 1))])
        target = out if split_k > 1 else out[None]
        target.copy_(parts)
        return out

    class TwoRanks:  # the other rank wrote the same planes: the all-reduce doubles them
        def __init__(self):
            self.buffer = torch.full((4096,), float("nan"))
            self.reduced = []

        def planes_out(self, s, rows, cols):
            return self.buffer[: s * rows * cols].view(s, rows, cols)

        def reduce_planes(self, planes):
            assert planes.data_ptr() == self.buffer.data_ptr()  # the GEMM wrote straight into the buffer
            self.reduced.append(planes.shape)
            return planes * 2

    monkeypatch.setattr(qwen3, "_skinny_kernels", lambda: (decode_config, skinny_gemm))
    reduce = TwoRanks()
    layer = RowParallelLinear(64, 24, False, torch.float32, TensorParallel(0, 2, reduce))
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 32)
    planes = qwen3.row_parallel_decode(x, layer)
    assert reduce.reduced == [(split, 3, 24)] and planes.shape == (split, 3, 24) and planes.dtype == torch.float32
    torch.testing.assert_close(planes.sum(0), 2 * x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    # "norm" fusion: this rank's own planes, not all-reduced here (the all-reduce + norm kernel after does it)
    local = qwen3.row_parallel_decode(x, layer, reduce=False)
    assert reduce.reduced == [(split, 3, 24)] and local.data_ptr() != reduce.buffer.data_ptr()
    torch.testing.assert_close(local.sum(0), x @ layer.weight.T, rtol=1e-5, atol=1e-5)


def test_tp_bench_counts_each_kernel_s_own_time_as_analyze_does():
    """benchmarks/tp_bench.py's all-reduce share: under programmatic dependent launch a kernel starts before the one
    ahead of it on its stream ends, and only its time past that end is its own, as `analyze`'s exclusive_ns counts."""
    import importlib.util
    from pathlib import Path

    import numpy as np
    import pandas as pd

    from infertrace.analyze.phases import exclusive_ns

    spec = importlib.util.spec_from_file_location(
        "tp_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "tp_bench.py")
    tp_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_bench)
    # stream 7: a GEMM, an all-reduce launched early that waits for it, a kernel after a gap; stream 8 apart
    kernels = [{"ts": 0, "dur": 10, "args": {"stream": 7}}, {"ts": 5, "dur": 12, "args": {"stream": 7}},
               {"ts": 3, "dur": 4, "args": {"stream": 8}}, {"ts": 30, "dur": 2, "args": {"stream": 7}}]
    assert tp_bench.exclusive_us(kernels) == [10, 7, 4, 2]
    gpu = pd.DataFrame({"pid": [0] * 4, "stream": [k["args"]["stream"] for k in kernels],
                        "ts_ns": [k["ts"] * 1000 for k in kernels], "dur_ns": [k["dur"] * 1000 for k in kernels]})
    assert list(exclusive_ns(gpu)) == [t * 1000 for t in tp_bench.exclusive_us(kernels)]
    assert np.sum(tp_bench.exclusive_us(kernels)) < sum(k["dur"] for k in kernels)
