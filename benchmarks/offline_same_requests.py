"""The bundled engine offline (`LLM.generate`, no HTTP, no asyncio) on exactly the requests `infertrace bench`
sends with the same flags: its "measure" prompts of the random dataset, built by the same function from the same
seed. Prints output tokens per second and writes a result JSON with `output_throughput` (serve_bench.sh reads it).

    python benchmarks/offline_same_requests.py MODEL_DIR --input-len 256 --output-len 128 --num-prompts 512 \
        --seed 0 --result-json offline.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=8, help="requests run first, untimed (CUDA graphs, kernels)")
    ap.add_argument("--result-json", type=Path)
    args = ap.parse_args()

    from infertrace.engine import LLM, SamplingParams
    from infertrace.load.config import BenchConfig
    from infertrace.load.workloads.prompts import build_specs

    cfg = BenchConfig(model=str(args.model), input_len=args.input_len, output_len=args.output_len,
                      num_prompts=args.num_prompts, seed=args.seed, ignore_eos=True)
    llm = LLM(args.model)
    specs = build_specs(cfg, llm.tokenizer, args.num_prompts, "measure")
    warm = build_specs(cfg, llm.tokenizer, args.warmup, "warmup")
    params = [SamplingParams(max_tokens=s.output_len, ignore_eos=True) for s in specs]
    llm.generate([s.prompt_ids for s in warm], [SamplingParams(max_tokens=s.output_len, ignore_eos=True)
                                                for s in warm])
    start = time.perf_counter()
    done = llm.generate([s.prompt_ids for s in specs], params)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for c in done)
    result = {"num_prompts": len(specs), "total_input_tokens": sum(len(s.prompt_ids) for s in specs),
              "total_output_tokens": output_tokens, "duration": seconds,
              "output_throughput": output_tokens / seconds, "max_concurrency": "all"}
    print(f"offline: {len(specs)} requests, {output_tokens} output tokens in {seconds:.2f} s = "
          f"{result['output_throughput']:,.0f} tok/s")
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
