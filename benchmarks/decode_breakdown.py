"""Where a decode step's GPU time goes: torch.profiler over eager decode steps, kernels summed by name.

    python benchmarks/decode_breakdown.py --models-dir /tmp/models [--preset qwen3-4b] [--batch 8]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/decode_breakdown.py` too
from benchmarks.common import model_dir  # noqa: E402
from infertrace.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays instead of eager steps")
    args = ap.parse_args()
    llm = LLM(model_dir(args.models_dir, args.preset), cuda_graphs=args.graphs)
    eng = llm.engine
    rng = random.Random(0)
    for i in range(args.batch):
        eng.add_request(f"r{i}", [rng.randrange(1000, 3000) for _ in range(128)],
                        SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(260):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))


if __name__ == "__main__":
    main()
