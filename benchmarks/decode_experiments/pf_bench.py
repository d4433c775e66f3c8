"""Decode bs8 qwen3-4b: L2 prefetch of o_proj variants, alternating, each a fresh LLM."""
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
from engine_bench import ROWS, bench_decode, copy_bandwidth

from infertrace.engine.kernels import prefetch

root = Path("/tmp/models")
bw = copy_bandwidth()
print(f"copy bw {bw/1e12:.3f} TB/s", flush=True)
variants = {
    "off": dict(where="off"),
    "attn": dict(where="attention", fraction=1.0, evict_last=False),
    "attn_el": dict(where="attention", fraction=1.0, evict_last=True),
    "norm": dict(where="norm", fraction=1.0, evict_last=False),
    "attn_half": dict(where="attention", fraction=0.5, evict_last=False),
}
order = sys.argv[1].split(",")
for name in order:
    prefetch.configure(**variants[name])
    t = time.time()
    bench_decode(root, bw, repeats=3, note=f" prefetch={name}")
    print(f"{name} done in {time.time()-t:.0f}s", flush=True)
print("\n| figure | value | setup |\n| --- | --- | --- |")
for name, value, note in ROWS:
    print(f"| {name} | {value} | {note} |")
