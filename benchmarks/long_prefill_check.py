"""First-token logits after one long prompt, without offload, under engine switches, against Hugging Face's own.

    python benchmarks/long_prefill_check.py [--prompt 65536] [--variants "default;prefix_caching=false;..."]

Each variant runs the prompt (after a 1,024-token warm-up request sharing its start) on a fresh engine with a KV
budget that holds it, and prints the relative L2 distance of its first logits to Hugging Face's.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/long_prefill_check.py` too
from benchmarks.common import model_dir  # noqa: E402
from benchmarks.offload_bench import LogitRecorder, hf_last_logits, random_tokens, release, run_one  # noqa: E402
from infertrace.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--prompt", type=int, default=65536)
    ap.add_argument("--variants", default="default;prefix_caching=false;async_scheduling=off;fused_norm=false")
    args = ap.parse_args()
    path = model_dir(args.models_dir, "qwen3-0.6b", "bfloat16", max_positions=131072)
    prompt = random_tokens(random.Random(1), args.prompt)
    want = hf_last_logits(path, prompt, "bfloat16")
    for variant in args.variants.split(";"):
        overrides = dict(kv.split("=") for kv in variant.split(",") if "=" in kv)
        config = EngineConfig.from_overrides({"dtype": "bfloat16", "max_num_batched_tokens": 8192,
                                              "kv_cache_tokens": args.prompt + 1024, **overrides})
        engine = Engine(path, config)
        recorder = engine.runner.sampler = LogitRecorder(engine.runner.sampler)
        run_one(engine, "warmup", prompt[:1024], SamplingParams(max_tokens=2, ignore_eos=True))
        recorder.rows.clear()
        run_one(engine, "long", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        got = recorder.rows[0]
        print(f"{variant:<40} relative L2 to HF {float((got - want).norm() / want.norm()):.2e}  "
              f"argmax {int(got.argmax())} vs {int(want.argmax())}  cached {engine.counters['prefix_cache_hits']}",
              flush=True)
        del engine, recorder
        release()


if __name__ == "__main__":
    main()
