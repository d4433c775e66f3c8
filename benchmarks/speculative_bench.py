"""Speculative decoding in the bundled engine: decode speed and acceptance per drafter, batch size and workload.
Run on the GPU machine (on CPU with `--preset tiny --draft tiny` it checks itself in seconds).

    python benchmarks/speculative_bench.py --models-dir /tmp/models [--preset qwen3-4b --draft qwen3-0.6b]

Two workloads, 256 prompt and 256 output tokens a request:
- repeating: each prompt repeats a random 16-token phrase and decoding is greedy. Greedy decoding of the small
  presets' random weights (tiny, qwen3-0.6b) falls into loops of a few tokens, so the output repeats what came
  before: prompt lookup's best case. qwen3-4b's does not (92 distinct tokens in 96 in bf16), so there this workload
  is only a second non-repeating one.
- random greedy: prompts of random tokens, greedy (`--workloads` adds it): the output repeats only once the model's
  own loop begins, as in `recipes/speculative.yaml` and `infertrace bench`'s random dataset.
- non-repeating: prompts of random tokens, sampled at temperature 1.0 (a seed per request). Random weights give a
  near-flat distribution over the vocabulary, so no output repeats and a draft is accepted with probability about
  1 / vocabulary: every drafter's worst case, which shows what drafting and verifying cost when nothing is won.

Drafters (--drafters): none, none with async scheduling off (which drafting needs), n-gram K=2 and K=4, the draft
preset with K=4, and the target as its own draft with K=4 (in float32 every greedy draft is accepted: the drafting
cost at full acceptance). One engine per drafter, both batch sizes and both workloads on it. Every figure printed goes into docs/benchmarks.md with the device, the date and this command.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run as `python benchmarks/speculative_bench.py` too
from benchmarks.common import model_dir, print_rows, row  # noqa: E402
from infertrace.engine import LLM, SamplingParams  # noqa: E402

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def workload(kind: str, batch: int, input_len: int, output_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    if kind == "repeating":
        prompts = []
        for _ in range(batch):
            phrase = [rng.randrange(1000, vocab) for _ in range(16)]
            prompts.append((phrase * (input_len // 16 + 1))[:input_len])
        return prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True) for _ in prompts]
    prompts = [[rng.randrange(1000, vocab) for _ in range(input_len)] for _ in range(batch)]
    if kind == "random-greedy":
        return prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True) for _ in prompts]
    return prompts, [SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, seed=seed + i)
                     for i in range(batch)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts, params) -> dict:
    """All requests at once through the step loop: each request's token arrival times and the engine's counters
    over the run."""
    eng = llm.engine
    before = {k: eng.counters[k] for k in SPEC_COUNTERS}
    ids = [f"s{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    arrivals: dict[str, list[tuple[float, int]]] = {i: [] for i in ids}
    sync()
    t0 = time.perf_counter()
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                arrivals[o.request_id].append((now, len(o.new_token_ids)))
    sync()
    wall = time.perf_counter() - t0
    tpots, decode_tokens, first, last = [], 0, [], []
    for events in arrivals.values():
        n = sum(k for _, k in events)
        first.append(events[0][0])
        last.append(events[-1][0])
        tpots.append((events[-1][0] - events[0][0]) / (n - events[0][1]))
        decode_tokens += n - events[0][1]
    # decode tokens over the time from the first request's first token to the last token
    return {"wall_s": wall, "tpot_s": statistics.mean(tpots), "decode_tok_s": decode_tokens / (max(last) - min(first)),
            **{k: eng.counters[k] - before[k] for k in SPEC_COUNTERS}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--draft", default="qwen3-0.6b", help="the draft model's preset")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--drafters", default="none,async-off,ngram2,ngram4,draft,self")
    ap.add_argument("--workloads", default="repeating,non-repeating", help="of repeating, random-greedy, non-repeating")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point; the median run's figures are printed")
    args = ap.parse_args()
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = model_dir(args.models_dir, args.preset, dtype=dtype, device=device)
    draft = model_dir(args.models_dir, args.draft, dtype=dtype, device=device)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    # (label, engine overrides) by the name --drafters takes; "async-off" is plain decoding without async
    # scheduling, which speculative decoding turns off: the share of a drafter's cost that is not its own
    drafters = {
        "none": ("none", {}),
        "async-off": ("none, async scheduling off", {"async_scheduling": "off"}),
        "ngram2": ("n-gram K=2", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}),
        "ngram4": ("n-gram K=4", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}),
        "draft": (f"{args.draft} K=4", {"speculative_config": {"method": "draft_model", "model": str(draft),
                                                               "num_speculative_tokens": 4}}),
        "self": ("self K=4", {"speculative_config": {"method": "draft_model", "model": str(target),
                                                     "num_speculative_tokens": 4}}),
    }
    chosen = args.drafters.split(",")
    if chosen[0] != "none" or not set(chosen) <= set(drafters):
        ap.error(f"--drafters: names from {', '.join(drafters)}, starting with none (the baseline)")
    batches = [int(b) for b in args.batch.split(",")]
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    plain: dict[tuple[int, str], float] = {}
    for key in chosen:
        name, overrides = drafters[key]
        spec = overrides.get("speculative_config")
        llm = LLM(target, max_num_seqs=max(batches), **overrides)
        warm = workload("repeating", max(batches), args.input_len, 16, vocab, seed=99)
        run(llm, *warm)
        for batch in batches:
            for kind in args.workloads.split(","):
                prompts, params = workload(kind, batch, args.input_len, args.output_len, vocab, seed=batch)
                runs = sorted((run(llm, prompts, params) for _ in range(args.repeats)), key=lambda r: r["decode_tok_s"])
                r = runs[len(runs) // 2]
                spread = f"{runs[0]['decode_tok_s']:.0f}..{runs[-1]['decode_tok_s']:.0f}"
                if key == "none":
                    plain[batch, kind] = r["decode_tok_s"]
                speedup = r["decode_tok_s"] / plain[batch, kind]
                if r["spec_decode_num_draft_tokens"]:
                    rate = r["spec_decode_num_accepted_tokens"] / r["spec_decode_num_draft_tokens"]
                    length = 1 + r["spec_decode_num_accepted_tokens"] / r["spec_decode_num_drafts"]
                    accept = f", accepted {100 * rate:.1f}% of {r['spec_decode_num_draft_tokens']} drafts, " \
                             f"mean acceptance length {length:.2f}"
                else:
                    accept = ", no drafts" if spec is not None else ""
                row(f"{args.preset} bs={batch} {kind}, {name}",
                    f"{r['decode_tok_s']:.0f} tok/s ({speedup:.2f}x), TPOT {1e3 * r['tpot_s']:.2f} ms{accept}",
                    f"{dtype}, {args.input_len} in / {args.output_len} out, median of {args.repeats} ({spread})")
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print_rows()


if __name__ == "__main__":
    main()
