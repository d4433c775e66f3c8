"""GPU benchmarks of the bundled engine; prints one table. Run on the GPU machine.

    python benchmarks/engine_bench.py --models-dir /tmp/models [--only decode,nano,looped,latency,memory,hf]

Models are made with `infertrace model init` when missing. Every figure printed goes into docs/benchmarks.md
with the device, the date and this command.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/engine_bench.py` too
from benchmarks.common import copy_bandwidth, median_call_ms, model_dir, print_rows, row  # noqa: E402
from infertrace.engine import LLM, SamplingParams  # noqa: E402
from infertrace.modelgen import parameter_count  # noqa: E402


def run_steps(llm: LLM, prompts, params) -> dict:
    """Run to completion through the engine's step loop.

    Decode step times are the intervals between consecutive decode steps' completions on the wall clock: with
    async scheduling a step's own duration overlaps the next one's host work, so only this spacing gives the rate.
    """
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}-{time.monotonic_ns()}", p, params[i] if isinstance(params, list) else params)
    decode_times, out_tokens, first_token_at = [], 0, None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps, last_decode_end = eng.counters["steps"], None
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        out_tokens += sum(len(o.new_token_ids) for o in outs)
        if first_token_at is None and outs:
            first_token_at = now - t0
        if eng.counters["steps"] != steps:
            steps = eng.counters["steps"]
            if eng.last_step.kind == "decode":
                if last_decode_end is not None:
                    decode_times.append(now - last_decode_end)
                last_decode_end = now
            else:
                last_decode_end = None
    torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t0, "out_tokens": out_tokens, "decode_times": decode_times,
            "ttft_s": first_token_at}


def host_profile(llm: LLM, prompts) -> None:
    """cProfile of 100 decode steps at batch 8: where the host's share of a step goes."""
    import cProfile
    import pstats

    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"prof{i}", p, SamplingParams(max_tokens=140, ignore_eos=True))
    for _ in range(20):
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        eng.step()
    prof.disable()
    while eng.has_unfinished():
        eng.step()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * dtype_bytes


def bench_decode(root: Path, bw: float, attention: str = "batched", cuda_graphs: bool = True,
                 profile_host: bool = False, repeats: int = 1, note: str = "", **overrides) -> float:
    """Output tok/s of the fixed batch-8 workload; with repeats > 1 the median of that many runs on one engine
    (host-bound eager steps swing by a quarter from run to run), printed with the range."""
    path = model_dir(root, "qwen3-4b")
    cfg = json.loads((path / "config.json").read_text())
    llm = LLM(path, attention=attention, cuda_graphs=cuda_graphs, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 3000) for _ in range(128)] for _ in range(8)]
    params = SamplingParams(max_tokens=512, ignore_eos=True)
    run_steps(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    runs = sorted((run_steps(llm, prompts, params) for _ in range(repeats)), key=lambda x: x["out_tokens"] / x["wall_s"])
    rates = [x["out_tokens"] / x["wall_s"] for x in runs]
    r, tok_s = runs[len(runs) // 2], rates[len(runs) // 2]
    label = f"qwen3-4b bf16 bs=8 128in/512out attention={attention} cuda_graphs={cuda_graphs}"
    label += "".join(f" {k}={v}" for k, v in overrides.items()) + note
    if attention == "batched" and cuda_graphs:
        dt = sorted(r["decode_times"])[len(r["decode_times"]) // 2]
        weight_bytes = parameter_count(cfg) * 2
        mean_ctx = 128 + 256
        step_bytes = weight_bytes + 8 * mean_ctx * kv_bytes_per_token(cfg)
        achieved = step_bytes / dt
        row("decode steps/s (median spacing of decode steps)", f"{1 / dt:.1f}", label)
        row("decode achieved bytes/s", f"{achieved / 1e12:.3f} TB/s = {100 * achieved / bw:.1f}% of copy bw",
            "weights + mean KV read per step / median step time")
    spread = f", median of {repeats}: {rates[0]:.0f}..{rates[-1]:.0f}" if repeats > 1 else ""
    row("output tok/s", f"{tok_s:.0f}", label + f" (wall, incl. prefill{spread})")
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        # the decode graph alone, replayed back to back: the step's GPU time without the host's share
        gpu = median_call_ms(functools.partial(graphs.replay, 8)) / 1e3
        row("decode graph replay alone (bs=8)", f"{1e3 * gpu:.2f} ms = {step_bytes / gpu / 1e12:.2f} TB/s",
            "GPU time of one decode step without host work")
        if profile_host:
            host_profile(llm, prompts)
    del llm
    torch.cuda.empty_cache()
    return tok_s


def bench_nano_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py workload: 256 requests, input and output lengths uniform in [100, 1024]."""
    rng = random.Random(0)
    n = 256
    in_lens = [rng.randint(100, 1024) for _ in range(n)]
    out_lens = [rng.randint(100, 1024) for _ in range(n)]
    prompts = [[rng.randrange(1000, 3000) for _ in range(L)] for L in in_lens]
    return prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in out_lens]


def bench_nano(root: Path, hf: bool, note: str = "", **overrides) -> None:
    path = model_dir(root, "qwen3-0.6b")
    prompts, params = bench_nano_requests()
    llm = LLM(path, **overrides)
    run_steps(llm, prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))
    r = run_steps(llm, prompts, params)
    row("nano-vllm workload output tok/s", f"{r['out_tokens'] / r['wall_s']:.0f}",
        f"qwen3-0.6b bf16, 256 req, in/out U[100,1024], {r['out_tokens']} tokens in {r['wall_s']:.1f}s"
        + "".join(f" {k}={v}" for k, v in overrides.items()) + note)
    del llm
    torch.cuda.empty_cache()
    if hf:
        bench_hf(path, prompts[:64], 512)


def bench_hf(path: Path, prompts, max_new: int) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="paged|sdpa").cuda()
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=False)
    model.generate_batch(inputs=prompts[:4], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                         eos_token_id=-1, pad_token_id=0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    toks = sum(len(o.generated_tokens) for o in out.values())
    row("HF generate_batch paged|sdpa output tok/s", f"{toks / wall:.0f}",
        f"qwen3-0.6b bf16, {len(prompts)} of the same prompts, {max_new} new tokens each")


def bench_latency(root: Path) -> None:
    path = model_dir(root, "qwen3-4b")
    llm = LLM(path)
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 3000) for _ in range(1024)]
    run_steps(llm, [prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    ttfts = []
    for i in range(5):
        p = [rng.randrange(1000, 3000) for _ in range(1024)]  # fresh tokens: no prefix-cache hit
        ttfts.append(run_steps(llm, [p], SamplingParams(max_tokens=1, ignore_eos=True))["ttft_s"])
    row("TTFT 1024-token prompt, bs=1 (median of 5)", f"{1e3 * sorted(ttfts)[2]:.1f} ms", "qwen3-4b bf16")
    r = run_steps(llm, [prompt[:128]], SamplingParams(max_tokens=256, ignore_eos=True))
    itl = sorted(r["decode_times"])[len(r["decode_times"]) // 2]
    row("ITL bs=1 (median decode step)", f"{1e3 * itl:.2f} ms", "qwen3-4b bf16, 128 in / 256 out")
    del llm
    torch.cuda.empty_cache()


def bench_memory(root: Path) -> None:
    path = model_dir(root, "qwen3-0.6b")
    llm = LLM(path)
    eng = llm.engine
    eng.add_request("mem", [5] * 16, SamplingParams(max_tokens=10_050, ignore_eos=True))
    for _ in range(50):
        eng.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    peak_before = torch.cuda.max_memory_allocated()
    steps = 0
    while eng.has_unfinished() and steps < 10_000:
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    row("allocated GPU memory over 10,000 decode steps", f"{before} -> {after} bytes (delta {after - before})",
        f"{steps} steps, qwen3-0.6b bs=1; peak {peak_before} -> {torch.cuda.max_memory_allocated()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--only", default="decode,nano,looped,latency,memory,hf")
    args = ap.parse_args()
    only = set(args.only.split(","))
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    row("device-to-device copy bandwidth (read+write)", f"{bw / 1e12:.2f} TB/s")
    if "decode" in only:
        batched = bench_decode(args.models_dir, bw)
        bench_decode(args.models_dir, bw, skinny_gemm=False)
        bench_decode(args.models_dir, bw, async_scheduling="off", profile_host="host" in only)
    if "looped" in only:
        looped = bench_decode(args.models_dir, bw, attention="looped", cuda_graphs=False, repeats=3)
        eager = bench_decode(args.models_dir, bw, attention="batched", cuda_graphs=False, repeats=3)
        row("batched eager / looped", f"{eager / looped:.2f}x", "qwen3-4b bs=8, both without CUDA graphs")
        if "decode" in only:
            row("batched / looped", f"{batched / looped:.2f}x", "qwen3-4b bs=8 (batched with CUDA graphs)")
    if "latency" in only:
        bench_latency(args.models_dir)
    if "nano" in only:
        bench_nano(args.models_dir, hf="hf" in only)
    if "memory" in only:
        bench_memory(args.models_dir)
    print_rows()


if __name__ == "__main__":
    main()
