"""Batch-8 qwen3-4b decode graph: replay time per variant (alternating), and per-kernel end-to-end increments."""
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch
from engine_bench import copy_bandwidth, model_dir
from torch.profiler import ProfilerActivity, profile

from infertrace.engine import LLM, SamplingParams
from infertrace.engine import attention as attn_mod
from infertrace.engine.kernels import launch, prefetch

root = Path("/tmp/models")
STEP_BYTES = 4_022_468_096 * 2 + 8 * 384 * 147_456
VARIANTS = {
    "base": dict(),
    "tf": dict(trigger_first=True),
    "tf_pf8": dict(trigger_first=True, gemm_prefetch_bytes=8 << 20),
    "pf8": dict(gemm_prefetch_bytes=8 << 20),
    "tf_pre": dict(trigger_first=True, gemm_preload=True),
    "pre": dict(gemm_preload=True),
    "att4": dict(attn=(4, (128, 4, 3))),
    "att3": dict(attn=(3, (128, 4, 3))),
    "opf": dict(oproj=True),
}

SHORT = {"_add_rmsnorm_kernel": "norm", "_skinny_gemm_kernel": "gemm", "_qk_norm_rope_kernel": "qknorm",
         "_paged_attention_kernel": "attn", "_merge_splits_kernel": "merge", "_silu_mul_kernel": "silu",
         "_l2_prefetch_kernel": "pf"}


def short(name):
    for k, v in SHORT.items():
        if k in name:
            return v
    return name[:40]


def configure(v):
    v = dict(v)
    attn_mod.DECODE_OVERRIDE = v.pop("attn", None)
    prefetch.configure(where="attention" if v.pop("oproj", False) else "off")
    launch.set_experiment(trigger_first=v.get("trigger_first", False), gemm_prefetch_bytes=v.get("gemm_prefetch_bytes", 0),
                          gemm_preload=v.get("gemm_preload", False))


def run(name, detail):
    configure(VARIANTS[name])
    llm = LLM(model_dir(root, "qwen3-4b"), prefill_cuda_graphs=False)
    eng = llm.engine
    rng = random.Random(0)
    for i in range(8):
        eng.add_request(f"r{i}", [rng.randrange(1000, 3000) for _ in range(128)], SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(257):
        eng.step()
    g = eng.runner.graphs
    for _ in range(5):
        g.replay(8)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(40):
            g.replay(8)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 40)
    rep = statistics.median(times)
    print(f"{name:8s} replay {1e3*rep:.3f} ms (min {1e3*min(times):.3f}) = {STEP_BYTES/rep/1e12:.3f} TB/s", flush=True)
    if detail:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay(8)
            torch.cuda.synchronize()
        ks = sorted(((e.time_range.start, e.time_range.end, short(e.name)) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
        n = len(ks) // 5
        inc = defaultdict(list)
        for r in range(5):
            seq = ks[r * n:(r + 1) * n]
            for i in range(1, len(seq)):
                prev, cur = seq[i - 1][2], seq[i][2]
                nxt = seq[i + 1][2] if i + 1 < len(seq) else "-"
                label = f"gemm[{prev}>{nxt}]" if cur == "gemm" else cur
                inc[label].append(seq[i][1] - seq[i - 1][1])
        tot = sum(sum(v) for v in inc.values()) / 5
        print(f"  {n} kernels/replay, sum of increments {tot/1e3:.3f} ms")
        for label, v in sorted(inc.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {label:28s} {sum(v)/5/1e3:7.3f} ms/step  {len(v)//5:4d}x  {statistics.mean(v):7.2f} us each (med {statistics.median(v):.2f})")
    del llm, eng, g
    torch.cuda.empty_cache()
    return rep


if __name__ == "__main__":
    print(f"copy bw {copy_bandwidth()/1e12:.3f} TB/s", flush=True)
    detail = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else set()
    res = defaultdict(list)
    for name in sys.argv[1].split(","):
        first = name not in res
        res[name].append(run(name, name in detail and first))
    print("\n| variant | replays (ms) |")
    for k, v in res.items():
        print(f"| {k} | {', '.join(f'{1e3*x:.3f}' for x in v)} |")
