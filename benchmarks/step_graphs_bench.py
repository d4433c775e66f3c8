"""Prefill and mixed steps from token-count CUDA graphs against the same steps run eagerly, in one call on a GPU:
one 512-token prefill (wall time against its GPU time), the nano-vllm workload (also over an 8-bit KV cache),
start-up time and graph memory, and the batch-8 qwen3-4b decode step with programmatic dependent launch on and off,
with its GPU time by kernel. Prints one table.

    python benchmarks/step_graphs_bench.py --models-dir /tmp/models [--only prefill,nano,nanoprof,nanoorder,startup,
        decode,increments,variants,wholerun,between,gemm_tokens]

`increments`: the batch-8 qwen3-4b decode graph by what each kernel adds to the step's time, with the bytes each
GEMM and the attention read against the copy bandwidth.

`variants`: the batch-8 qwen3-4b decode graph captured under each of `--variants` (DECODE_VARIANTS: kernel
switches; or projection tilings such as `o=64.256.4.4+d=64.128.4.5`, see PROJECTIONS) over the same step inputs,
replayed alternating at contexts 385 and 640; `wholerun`: the issue's decode measure (`engine_bench.bench_decode`)
under each of `--wholerun`, alternating.

`between`: the decode loop as the engine runs it, under torch.profiler: what the GPU runs each step besides the
decode layers' kernels (the embedding lookup inside the graph; the greedy argmax, the input copies and the copy of
the tokens back outside it) and how long it idles, then every kernel's span and increment a step.

`gemm_tokens`: a layer's four GEMMs (fused qkv, output, fused gate/up, down projections) at every token count from
256 to 1,536 in steps of 16, for qwen3-0.6b's and 4b's shapes (no weights loaded): the cost behind the token-count
buckets (`DEFAULT_CUDA_GRAPH_TOKEN_SIZES`; docs/benchmarks.md has a run and a finer bucket list tried with it).

`nanoorder`: the nano-vllm workload over an 8-bit cache with decode attention launched longest context first and in
row order, alternating, three runs each in one process.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/step_graphs_bench.py` too
from benchmarks.common import copy_bandwidth, median_call_ms, model_dir, print_rows, row  # noqa: E402
from benchmarks.engine_bench import bench_decode, bench_nano, bench_nano_requests  # noqa: E402
from infertrace.engine import LLM, SamplingParams  # noqa: E402


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _launches(prof) -> tuple[int, int]:
    """(kernels, host launch calls) of a torch.profiler window."""
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    launches = sum(e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                              "cudaLaunchKernelExC") for e in prof.events())
    return kernels, launches


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds of the union of (start, end) spans sorted by start: the time the GPU ran at least one of them."""
    busy, start, end = 0.0, None, None
    for s, e in spans:
        if end is None or s > end:
            busy += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return busy + (0.0 if end is None else end - start)


def _busy_ms(prof) -> float:
    """Milliseconds the GPU was busy in a torch.profiler window: the union of its kernels' and copies' spans."""
    return _busy_us(sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA)) / 1e3


def bench_prefill(root: Path, repeats: int = 30) -> None:
    """LLM.generate of one fresh 512-token prompt, max_tokens=1, with and without token-count graphs: wall time
    (median) against the GPU time of the same forward, the 512-token graph replayed back to back, and against all
    the GPU work of the call (the graph, the LM head of the row that samples, its argmax and the copies: the union
    of their spans under torch.profiler)."""
    path = model_dir(root, "qwen3-0.6b")
    gpu_s = None
    for graphs in (True, False):
        gpu_s = _prefill_engine(path, graphs, repeats, gpu_s)
        _free()  # the engine of one path is gone before the next starts: each sizes its KV cache from free memory


def _prefill_engine(path: Path, graphs: bool, repeats: int, gpu_s: float | None) -> float:
    """bench_prefill's figures for one engine; returns the GPU time of the 512-token forward (measured with
    graphs, passed through without). Every reference to the engine ends with this call."""
    llm = LLM(path, prefill_cuda_graphs=graphs)
    label = f"qwen3-0.6b bf16, prefill_cuda_graphs={graphs}"
    rng = random.Random(7)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def one() -> float:
        prompt = [rng.randrange(1000, 100000) for _ in range(512)]  # fresh tokens: no prefix-cache hit
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(5):
        one()
    wall = statistics.median([one() for _ in range(repeats)])
    if graphs:
        graph, _ = llm.engine.runner.token_graphs.graphs[512]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        gpu_s = (time.perf_counter() - t) / 50
        row("512-token forward on the GPU (its graph replayed back to back)", f"{1e3 * gpu_s:.2f} ms", label)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            one()
    kernels, launches = _launches(prof)
    busy_ms = _busy_ms(prof) / 5
    row(f"one 512-token prefill, LLM.generate max_tokens=1 (median of {repeats})",
        f"{1e3 * wall:.2f} ms = {wall / gpu_s:.2f}x the forward's GPU time, {1e3 * wall / busy_ms:.2f}x the call's "
        f"({busy_ms:.2f} ms busy)",
        f"{label}; {kernels / 5:.0f} kernels, {launches / 5:.0f} launch calls per call (torch.profiler, 5 calls)")
    return gpu_s


def gemm_tokens(presets: tuple[str, ...] = ("qwen3-0.6b", "qwen3-4b")) -> None:
    """GPU time of one layer's four GEMMs (F.linear, bf16, as the token-count graphs run them) by token count,
    each from a CUDA graph of 20 calls."""
    from infertrace.modelgen import PRESETS, hf_config

    for preset in presets:
        c = hf_config(PRESETS[preset], "bfloat16")
        hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        shapes = {"qkv": (hidden, (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d),
                  "o": (c["num_attention_heads"] * d, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
        weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) for k, (kk, n) in shapes.items()}
        inputs = {k: torch.randn(1536, kk, device="cuda", dtype=torch.bfloat16) for k, (kk, _) in shapes.items()}
        times = []
        for m in range(256, 1537, 16):
            total = 0.0
            for k in shapes:
                x, w = inputs[k][:m], weights[k]
                torch.nn.functional.linear(x, w)  # cuBLAS's first call for the shape, outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        torch.nn.functional.linear(x, w)
                total += 1e3 * median_call_ms(graph.replay, each=5) / 20
            times.append((m, total))
        print(f"{preset}: a layer's four GEMMs (us) by token count: "
              + " ".join(f"{m}:{us:.1f}" for m, us in times), flush=True)


def bench_startup(root: Path, preset: str) -> None:
    path = model_dir(root, preset)
    for graphs in (True, False):
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        llm = LLM(path, prefill_cuda_graphs=graphs)
        start_s = time.perf_counter() - t
        runner = llm.engine.runner
        row("engine start-up", f"{start_s:.1f} s (graphs {runner.graph_capture_s:.2f} s, "
            f"{runner.graph_memory_bytes / 2**20:.0f} MiB; KV {runner.num_blocks * runner.block_size:,} tokens)",
            f"{preset} bf16, prefill_cuda_graphs={graphs}; device memory taken {(free - torch.cuda.mem_get_info()[0]) / 2**30:.1f} GiB")
        del llm, runner
        _free()


def decode_breakdown(root: Path, batch: int = 8, **overrides) -> None:
    """GPU time of the batch-8 qwen3-4b decode graph by kernel, and the gaps between kernels."""
    llm, graphs = _decode_graph(root, batch, 260, **overrides)  # about the decode benchmark's mean context
    replay = median_call_ms(functools.partial(graphs.replay, batch)) / 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.replay(batch)
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time / 10
            by_name[e.name][1] += 1 / 10
    total = sum(v[0] for v in by_name.values())
    print(f"\ndecode graph bs={batch} qwen3-4b {overrides}: replay {1e3 * replay:.3f} ms, kernels {total / 1e3:.3f} ms, "
          f"gaps {1e3 * replay - total / 1e3:.3f} ms")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {us / 1e3:8.3f} ms  {n:5.0f}x  {name[:90]}")
    row(f"decode graph bs=8 qwen3-4b by kernel {overrides}", f"replay {1e3 * replay:.2f} ms = kernels {total / 1e3:.2f} ms + "
        f"gaps {1e3 * replay - total / 1e3:.2f} ms", "torch.profiler over 10 replays; kernels listed above the table")
    del llm, graphs
    _free()


def _decode_graph(root: Path, batch: int, steps: int, **overrides) -> tuple[LLM, object]:
    """A qwen3-4b engine with `batch` requests of 128 prompt tokens run `steps` steps (one prefill, then decode), and
    its decode graphs, to replay at that context."""
    llm = LLM(model_dir(root, "qwen3-4b"), **overrides)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request(f"r{i}", [rng.randrange(1000, 3000) for _ in range(128)],
                               SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(steps):
        llm.engine.step()
    return llm, llm.engine.runner.graphs


KERNEL_NAMES = {"_add_rmsnorm_kernel": "norm", "_skinny_gemm_kernel": "gemm", "_qk_norm_rope_kernel": "qknorm",
                "_paged_attention_kernel": "attention", "_merge_splits_kernel": "merge", "_silu_mul_kernel": "silu",
                "_qkv_norm_rope_kernel": "qkv+qknorm", "_gate_up_silu_kernel": "gate_up+silu"}


def kernel_increments(kernels: list[tuple[float, float, str]], replays: int) -> dict[str, list[float]]:
    """How much each kernel of a graph replay extends it: its end minus the end of the kernel before it in the
    stream, by kernel (a GEMM named by the kernels around it, e.g. gemm[silu>norm]). `kernels` is (start, end,
    name) of every kernel of `replays` back-to-back replays. With programmatic dependent launch a kernel's span opens
    when its programs are resident and waiting, so spans overlap and their sum overstates the step; the increments
    add up to the replay exactly."""
    short = [next((v for k, v in KERNEL_NAMES.items() if k in name), name[:40]) for _, _, name in kernels]
    ends = [end for _, end, _ in kernels]
    per = len(kernels) // replays
    out: dict[str, list[float]] = defaultdict(list)
    for r in range(replays):
        for i in range(r * per + 1, (r + 1) * per):
            label = short[i]
            if label == "gemm":
                after = short[i + 1] if i + 1 < (r + 1) * per else "-"
                label = f"gemm[{short[i - 1]}>{after}]"
            out[label].append(ends[i] - ends[i - 1])
    return out


def decode_increments(root: Path, batch: int = 8, replays: int = 5) -> None:
    """The batch-8 qwen3-4b decode graph (mean context 385) by what each kernel adds to the replay, with the bytes
    each GEMM and the attention read against the copy bandwidth."""
    cfg = json.loads((model_dir(root, "qwen3-4b") / "config.json").read_text())
    # one prefill, then 256 decode steps: every context 385 at the replays below
    llm, graphs = _decode_graph(root, batch, 257, prefill_cuda_graphs=False)
    replay = median_call_ms(functools.partial(graphs.replay, batch)) / 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(batch)
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    inc = kernel_increments(kernels, replays)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_kv = batch * 385 * 2 * kv * 2  # K and V of every context token, one layer
    reads = {"gemm[norm>silu]": 2 * inter * hidden * 2, "gemm[silu>norm]": inter * hidden * 2,
             "gemm[norm>qknorm]": (q + 2 * kv) * hidden * 2, "gemm[merge>norm]": q * hidden * 2,
             "gemm[norm>-]": vocab * hidden * 2, "attention": layer_kv,
             # the one-kernel forms (fused.qkv_norm_rope, fused.gate_up_silu) and the down projection after the latter
             "qkv+qknorm": (q + 2 * kv) * hidden * 2, "gate_up+silu": 2 * inter * hidden * 2,
             "gemm[gate_up+silu>norm]": inter * hidden * 2}
    bw = copy_bandwidth()
    print(f"\ndecode graph bs={batch} qwen3-4b, context 385: replay {1e3 * replay:.3f} ms, increments "
          f"{sum(map(sum, inc.values())) / replays / 1e3:.3f} ms; copy bw {bw / 1e12:.2f} TB/s")
    print("| kernel | ms a step | launches | us each | bytes each | % of copy bw |\n| --- | --- | --- | --- | --- | --- |")
    for label, us in sorted(inc.items(), key=lambda kv: -sum(kv[1])):
        each = statistics.mean(us)
        share = f"{100 * reads[label] / (each * 1e-6) / bw:.0f}%" if label in reads else ""
        nbytes = f"{reads[label] / 1e6:.1f} MB" if label in reads else ""
        print(f"| {label} | {sum(us) / replays / 1e3:.3f} | {len(us) // replays} | {each:.2f} | {nbytes} | {share} |")
    row(f"decode graph bs={batch} qwen3-4b by kernel increments", f"replay {1e3 * replay:.2f} ms",
        "table above: each kernel's end minus the end of the one before")
    del llm, graphs
    _free()


DECODE_VARIANTS = {  # name -> the kernels' switches it sets (the others at the engine's defaults)
    "normw": {},  # the engine's defaults
    "gemmearly": {"gemm_early": True},  # the skinny GEMMs copy their first weights before their wait (Gluon)
}
# qwen3-4b projections by letter, for variants named by their tilings: "o=64.256.4.4+d=64.128.4.5" runs the output
# projection at (block_n, block_k, split_k, num_stages) = (64, 256, 4, 4) and the down projection at (64, 128, 4, 5);
# "f=128.5.4" runs the qkv projection, q/k norm, RoPE and K/V write as one kernel (fused.qkv_norm_rope) at (block_k,
# num_stages, num_warps) = (128, 5, 4), "s=32.128.3.4" the gate/up projection with SiLU-and-multiply as one kernel
# (fused.gate_up_silu) at (block_n, block_k, num_stages, num_warps); "f=off" / "s=off": two kernels each
PROJECTIONS = {"q": (6144, 2560), "g": (19456, 2560), "o": (2560, 4096), "d": (2560, 9728)}


def _set_variant(name: str) -> None:
    """The kernels' switches and tilings of variant `name`, through the kernels' public switches and
    kernels/tuning.py (graphs captured after it take them)."""
    from infertrace.engine.kernels import skinny_gemm, tuning

    skinny_gemm.set_early(DECODE_VARIANTS.get(name, {}).get("gemm_early", False))
    # f: the qkv projection fused with the q/k norm; s: the gate/up projection fused with SiLU; others: skinny GEMMs
    kernels = {"f": ("qkv_norm_rope", "q"), "s": ("gate_up_silu", "g")}
    tilings: dict[str, dict] = {"skinny_gemm": {}, "qkv_norm_rope": {}, "gate_up_silu": {}}
    if name not in DECODE_VARIANTS:
        for part in name.split("+"):
            letter, _, tiling = part.partition("=")
            kernel, shape = kernels.get(letter, ("skinny_gemm", letter))
            tilings[kernel][PROJECTIONS[shape]] = None if tiling == "off" else tuple(int(v) for v in tiling.split("."))
    for kernel, table in tilings.items():
        tuning.set_tilings(kernel, table)


@torch.inference_mode()
def _capture_decode(graphs, bs: int) -> torch.cuda.CUDAGraph:
    """A decode graph of `bs` rows over the buffers as they stand (the last step's inputs, no padding)."""
    b, model = graphs.buffers, graphs.model
    meta = graphs.decode_meta(bs)
    model.compute_logits(model(b.input_ids[:bs], b.positions[:bs], meta))  # compiles, and writes the same K/V
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.compute_logits(model(b.input_ids[:bs], b.positions[:bs], meta))
    return graph


def decode_variants(root: Path, names: list[str], contexts=(385, 640), rounds: int = 3, batch: int = 8,
                    preset: str = "qwen3-4b") -> None:
    """The batch-8 decode graph of `preset` (qwen3-4b; `qwen3-14b/tp4` is one rank's layers of qwen3-14b at TP=4,
    run whole: see tp_bench.shard_preset) captured under each variant of DECODE_VARIANTS at the same step inputs,
    replayed alternating, at each context; one engine (the variants change only kernels' switches)."""
    name, _, shard = preset.partition("/tp")
    if shard:
        from benchmarks.tp_bench import shard_preset

        name = shard_preset(name, int(shard))
    _set_variant("normw")
    llm = LLM(model_dir(root, name, device="cuda"), prefill_cuda_graphs=False)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request(f"v{i}", [rng.randrange(1000, 3000) for _ in range(128)],
                               SamplingParams(max_tokens=max(contexts), ignore_eos=True))
    graphs, done = llm.engine.runner.graphs, 0
    results: dict[tuple[str, int], list[float]] = defaultdict(list)
    for ctx in contexts:
        while done < 1 + ctx - 128:  # one prefill, then a decode step a token: its inputs at context `ctx`
            llm.engine.step()
            done += 1
        for _ in range(rounds):
            for name in names:
                _set_variant(name)
                graph = _capture_decode(graphs, batch)
                results[(name, ctx)].append(median_call_ms(graph.replay))
                del graph
        print(f"context {ctx}: " + "  ".join(
            f"{n} {' '.join(f'{t:.3f}' for t in results[(n, ctx)])}" for n in names), flush=True)
    _set_variant("normw")  # the engine's defaults
    print(f"{preset}, batch {batch}")
    print("| variant | " + " | ".join(f"replay ms, context {c}" for c in contexts) + " |")
    print("| --- |" + " --- |" * len(contexts))
    for n in names:
        print(f"| {n} | " + " | ".join(", ".join(f"{t:.3f}" for t in results[(n, c)]) for c in contexts) + " |")
    del llm, graphs
    _free()


def decode_between(root: Path, batch: int = 8, steps: int = 30) -> None:
    """The batch-8 qwen3-4b decode loop as the engine runs it (one step after another), under torch.profiler: per
    step, what the GPU runs besides the decode layers' kernels (the embedding lookup at the graph's start; after it
    the sampler's greedy argmax, the input copies and the copy of the tokens back), and the time the GPU runs
    nothing."""
    llm = LLM(model_dir(root, "qwen3-4b"), prefill_cuda_graphs=False)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request(f"w{i}", [rng.randrange(1000, 3000) for _ in range(128)],
                               SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(200):
        llm.engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    span = events[-1][1] - events[0][0]
    busy = _busy_us([(start, end) for start, end, _ in events])
    graph_names = tuple(KERNEL_NAMES)
    outside: dict[str, list[float]] = defaultdict(list)
    for start, end, name in events:
        if not name.startswith(graph_names):
            outside[name[:70]].append(end - start)
    print(f"\ndecode loop bs={batch} qwen3-4b, {steps} steps under the profiler: {1e3 * wall / steps:.3f} ms a step "
          f"(wall), GPU span {span / steps / 1e3:.3f} ms a step, GPU idle {(span - busy) / steps:.1f} us a step")
    print("| besides the layers' kernels | count a step | us each |\n| --- | --- | --- |")
    for name, us in sorted(outside.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(us) / steps:.1f} | {statistics.mean(us):.2f} |")
    # every kernel and copy by name: its summed span (with dependent launches, from when its programs are resident)
    # and its increment (its end minus the latest end before it), which add up to the GPU's busy time
    spans: dict[str, list[float]] = defaultdict(list)
    increments: dict[str, float] = defaultdict(float)
    last_end = events[0][0]
    for start, end, name in events:
        spans[name[:48]].append(end - start)
        increments[name[:48]] += max(0.0, end - max(last_end, start))
        last_end = max(last_end, end)
    print("| kernel or copy | count a step | span a step (us) | increment a step (us) |\n| --- | --- | --- | --- |")
    for name, us in sorted(spans.items(), key=lambda kv: -increments[kv[0]]):
        print(f"| {name} | {len(us) / steps:.1f} | {sum(us) / steps:.1f} | {increments[name] / steps:.1f} |")
    del llm
    _free()


def nano_breakdown(root: Path, **overrides) -> None:
    """The nano-vllm workload once under torch.profiler (GPU activity only): GPU time by kernel over the whole run,
    the GPU's busy share of the wall time, and the wall time by step kind."""
    path = model_dir(root, "qwen3-0.6b")
    prompts, params = bench_nano_requests()
    llm = LLM(path, **overrides)
    eng = llm.engine
    for i, p in enumerate(prompts[:8]):
        eng.add_request(f"w{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params[i])
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    out_tokens = 0
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = last = time.perf_counter()
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            out_tokens += sum(len(o.new_token_ids) for o in outs)
            kinds[eng.last_step.kind if eng.last_step else "none"][0] += now - last
            kinds[eng.last_step.kind if eng.last_step else "none"][1] += 1
            last = now
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time
            by_name[e.name][1] += 1
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    total = sum(v[0] for v in by_name.values())
    print(f"\nnano-vllm workload under the profiler {overrides}: {out_tokens} tokens in {wall:.2f} s "
          f"({out_tokens / wall:.0f} tok/s); kernels {total / 1e6:.2f} s, GPU busy {busy / 1e6:.2f} s "
          f"({100 * busy / 1e6 / wall:.0f}% of wall)")
    for kind, (secs, n) in sorted(kinds.items()):
        print(f"  steps {kind:>8}: {n:5d} steps, {secs:.2f} s of wall")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:16]:
        print(f"  {us / 1e6:8.3f} s  {n:7d}x  {name[:100]}")
    row(f"nano-vllm workload by kernel {overrides}", f"wall {wall:.2f} s, GPU busy {busy / 1e6:.2f} s, "
        f"kernels {total / 1e6:.2f} s", "torch.profiler over the whole run; kernels listed above the table")
    del llm, eng
    _free()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--only", default="prefill,nano,startup,decode")
    ap.add_argument("--variants", default=",".join(DECODE_VARIANTS), help="for --only variants")
    ap.add_argument("--variants-preset", default="qwen3-4b",
                    help="for --only variants: a preset, or PRESET/tpN for one rank's layers at TP=N")
    ap.add_argument("--wholerun", default="normw,gemmearly", help="for --only wholerun")
    args = ap.parse_args()
    only = set(args.only.split(","))
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    row("device-to-device copy bandwidth (read+write)", f"{bw / 1e12:.2f} TB/s")
    if "prefill" in only:
        bench_prefill(args.models_dir)
    if "nano" in only:
        for graphs, kv in ((True, "auto"), (True, "fp8"), (False, "auto")):
            print(f"nano-vllm workload, prefill_cuda_graphs={graphs} kv_cache_dtype={kv}", flush=True)
            bench_nano(args.models_dir, hf=False, prefill_cuda_graphs=graphs, kv_cache_dtype=kv)

    if "nanoorder" in only:
        for _ in range(3):
            for ordered in (True, False):
                bench_nano(args.models_dir, hf=False, kv_cache_dtype="fp8", decode_longest_first=ordered)
    if "nanoprof" in only:
        nano_breakdown(args.models_dir, kv_cache_dtype="fp8")
    if "startup" in only:
        for preset in ("qwen3-0.6b", "qwen3-4b"):
            bench_startup(args.models_dir, preset)
    if "variants" in only:
        decode_variants(args.models_dir, args.variants.split(","), preset=args.variants_preset)
    if "wholerun" in only:
        # the decode measure, alternating the listed variants in one process
        for _ in range(2):
            for name in args.wholerun.split(","):
                _set_variant(name)
                bench_decode(args.models_dir, bw, repeats=3, note=f" variant={name}")
        _set_variant("normw")  # the engine's defaults
    if "increments" in only:
        decode_increments(args.models_dir)
    if "between" in only:
        decode_between(args.models_dir)
    if "gemm_tokens" in only:
        gemm_tokens()
    if "decode" in only:
        bench_decode(args.models_dir, bw, pdl=True)
        bench_decode(args.models_dir, bw, pdl=False)
        decode_breakdown(args.models_dir, pdl=True)
        decode_breakdown(args.models_dir, pdl=False)
    print_rows()


if __name__ == "__main__":
    main()
