"""`infertrace bench` side by side with `vllm bench serve` (same install as the server) on one real vLLM server.

Each workload runs through both clients twice, alternating, with the server's own counters read around every run.
Token counts are checked exactly, against each other and against the server's `prompt_tokens`/`generation_tokens`.
The figures' definitions are checked exactly by recomputing vLLM's aggregates from its own per-request records with
infertrace's code. The measured latencies and throughputs of the two clients are compared within a bound made of
a base and the scatter each client showed between its two runs (the machine is shared; docs/peers.md gives the
figures).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics, vllm_keys
from tests.peers.conftest import run_infertrace_bench, run_vllm_bench

pytestmark = pytest.mark.vllm

# the first 16 lines of the Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
# FAST25-release/traces/conversation_trace.jsonl): timestamps in ms, 512-token block ids
MOONCAKE = Path(__file__).parent / "data" / "mooncake_first16.jsonl"
TRACE_TOKEN_SCALE = 1 / 32  # Mooncake's 512-token blocks become 16-token ones: prompts fit the tiny server
TRACE_TIME_SCALE = 0.5
TRACE_MAX_INPUT = 30000  # unscaled tokens: a longer line would exceed the server's --max-model-len
N = 16
INPUT_LEN, OUTPUT_LEN = 64, 16
RUNS = 3  # per client, alternating: two runs made too small a sample of a client's own scatter on trace replay

# the relative difference allowed between the two clients' measured figures: a base, plus the relative scatter
# each client showed between its own runs (a busy shared 2-core machine moved the same client's median TPOT
# by up to 3x between back-to-back runs; docs/peers.md)
BASE_TOLERANCE = 0.35
MEASURED = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms", "output_throughput")
# Trace replay once differed steadily (infertrace's TPOT lower in every run): its runs after the first found 78% of
# their prompt tokens cached while vLLM's timed_trace draws new prompts each run, and vLLM's client sampled at
# temperature 1 against infertrace's greedy. With the cache emptied before each run and both greedy, they agree
# within the machine's noise (docs/peers.md, "Trace replay").
DEFINED = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")) + (
    "completed", "total_input_tokens", "total_output_tokens")

def _sharegpt(path: Path) -> Path:
    words = "the quick brown fox jumps over a lazy dog while seven tired engineers profile an inference server".split()
    rows = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(words[(i + k) % len(words)] for k in range(12 + 5 * i))},
        {"from": "gpt", "value": " ".join(words[(3 * i + k) % len(words)] for k in range(20))}]} for i in range(N)]
    path.write_text(json.dumps(rows))
    return path


def _trace_lines() -> list[dict]:
    lines = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:N]]
    return [r for r in lines if r["input_length"] <= TRACE_MAX_INPUT]


def _scaled_trace(lines: list[dict]) -> list[dict]:
    """The trace as vLLM's timed_trace replays it: lengths scaled as infertrace's --token-scale scales them
    (rounded, at least 1), the block ids kept with 16-token blocks."""
    return [{**r, "input_length": max(1, round(r["input_length"] * TRACE_TOKEN_SCALE)),
             "output_length": max(1, round(r["output_length"] * TRACE_TOKEN_SCALE))} for r in lines]


def _workloads(root: Path) -> dict[str, tuple[list[str], list[str], dict]]:
    """name -> (infertrace bench args, vllm bench serve args, what was sent: prompts, input and output tokens
    where they are fixed by construction)."""
    sharegpt = _sharegpt(root / "sharegpt.json")
    lines = _trace_lines()
    original, scaled = root / "trace.jsonl", root / "trace-scaled.jsonl"
    original.write_text("".join(json.dumps(r) + "\n" for r in lines))
    scaled_lines = _scaled_trace(lines)
    scaled.write_text("".join(json.dumps(r) + "\n" for r in scaled_lines))
    random_ours = ["--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
    random_theirs = ["--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
                     str(OUTPUT_LEN), "--random-range-ratio", "0"]
    common_ours = ["--num-prompts", str(N), "--warmup", "0", "--ignore-eos", "--seed", "0"]
    # greedy, as infertrace bench samples by default: vllm bench serve 0.32 sends no temperature unless told, and the
    # server then samples at 1.0
    common_theirs = ["--num-prompts", str(N), "--ignore-eos", "--seed", "0", "--temperature", "0"]
    n_trace = len(lines)
    return {
        "closed loop, concurrency 4": (
            [*common_ours, *random_ours, "--concurrency", "4"],
            [*common_theirs, *random_theirs, "--max-concurrency", "4"],
            {"requests": N, "input_tokens": N * INPUT_LEN, "output_tokens": N * OUTPUT_LEN}),
        "open loop, 4 req/s": (
            [*common_ours, *random_ours, "--request-rate", "4"],
            [*common_theirs, *random_theirs, "--request-rate", "4"],
            {"requests": N, "input_tokens": N * INPUT_LEN, "output_tokens": N * OUTPUT_LEN}),
        "ShareGPT file, concurrency 4": (
            [*common_ours, "--dataset", "sharegpt", "--dataset-path", str(sharegpt), "--output-len",
             str(OUTPUT_LEN), "--concurrency", "4"],
            [*common_theirs, "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt),
             "--sharegpt-output-len", str(OUTPUT_LEN), "--max-concurrency", "4"],
            {"requests": N, "output_tokens": N * OUTPUT_LEN, "same_prompts": True}),
        "Mooncake trace replay": (
            ["--num-prompts", str(n_trace), "--warmup", "0", "--ignore-eos", "--dataset", "trace",
             "--dataset-path", str(original), "--token-scale", str(TRACE_TOKEN_SCALE), "--time-scale",
             str(TRACE_TIME_SCALE)],
            ["--num-prompts", str(n_trace), "--temperature", "0", "--dataset-name", "timed_trace", "--dataset-path",
             str(scaled),
             "--timed-trace-chunk-hash-size", "16", "--timed-trace-sec-multiplier", str(0.001 * TRACE_TIME_SCALE)],
            {"requests": n_trace, "input_tokens": sum(r["input_length"] for r in scaled_lines),
             "output_tokens": sum(r["output_length"] for r in scaled_lines)}),
    }


def _seeded(args: list[str], run: int) -> list[str]:
    """`args` with run `run`'s seed. The two clients draw their prompts and open-loop arrival times from generators
    of their own, so one seed for every run repeats one draw per client, and the draws differ: with seed 0,
    infertrace's 16 arrivals at 4 req/s span 3.55 s with 8 of them in 0.62 s. In one CI run its three runs gave a
    median TPOT of 22-24 ms against vLLM's 14.5-15 ms, a difference neither client's scatter showed. A seed a run
    puts the draw's variation into each client's scatter, which the bound counts."""
    return [str(run) if k and args[k - 1] == "--seed" else a for k, a in enumerate(args)]


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("prompt_tokens", "generation_tokens",
                                                                 "prefix_cache_queries", "prefix_cache_hits")}


@pytest.fixture(scope="module")
def side_by_side(vllm_server, tmp_path_factory):
    """name -> {"ours": [(result, server delta)...], "theirs": [...], "sent": {...}}, both clients run RUNS times
    each, alternating, one after the other on the same server."""
    root = tmp_path_factory.mktemp("side-by-side")
    # the server's first requests after its start are slower (its first shapes); neither client should pay for them
    run_infertrace_bench(vllm_server, root, "warm-up", "--num-prompts", "8", "--concurrency", "4", "--input-len",
                         str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--warmup", "0")
    out = {}
    for name, (ours_args, theirs_args, sent) in _workloads(root).items():
        runs = {"ours": [], "theirs": [], "sent": sent}
        for i in range(RUNS):
            for client in ("ours", "theirs"):
                tag = f"{len(out)}-{client}-{i}"
                # every run finds an empty prefix cache: infertrace sends the same prompts each run, vLLM's
                # timed_trace new ones (its token ids are seeded by Python's salted str hash)
                vllm_server.reset_prefix_cache()
                before = vllm_server.counters()
                result = run_infertrace_bench(vllm_server, root, tag, *_seeded(ours_args, i)) if client == "ours" \
                    else run_vllm_bench(vllm_server, root, tag, *_seeded(theirs_args, i))
                runs[client].append((result, _delta(before, vllm_server.counters())))
        out[name] = runs
    table = root / "side-by-side.json"
    table.write_text(json.dumps({name: {c: [r for r, _ in v[c]] for c in ("ours", "theirs")}
                                 for name, v in out.items()}, default=str))
    print(f"side-by-side results: {table}")
    return out


TRACE_REPLAY = "Mooncake trace replay"
OPEN_LOOP_RATES = {"open loop, 4 req/s": 4.0}
WORKLOAD_NAMES = ["closed loop, concurrency 4", "open loop, 4 req/s", "ShareGPT file, concurrency 4",
                  TRACE_REPLAY]


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_token_counts_agree_with_the_server(side_by_side, name):
    """Both clients' token totals are exactly what the server counted for their run, and what was sent."""
    runs = side_by_side[name]
    sent = runs["sent"]
    for client in ("ours", "theirs"):
        for result, delta in runs[client]:
            assert result["completed"] == sent["requests"] and result["failed"] == 0, (client, result["failed"])
            assert result["total_input_tokens"] == delta["prompt_tokens"], (client, result["total_input_tokens"],
                                                                            delta)
            assert result["total_output_tokens"] == delta["generation_tokens"] == sent["output_tokens"], \
                (client, result["total_output_tokens"], delta)
    ours = [r["total_input_tokens"] for r, _ in runs["ours"]]
    theirs = [r["total_input_tokens"] for r, _ in runs["theirs"]]
    if "input_tokens" in sent:
        # infertrace's random prompts are exactly --input-len tokens; vLLM's random prompts are decoded from random
        # ids and sent as text, which the server may tokenize a token or two longer (it counted what vLLM says)
        assert ours == [sent["input_tokens"]] * RUNS
        if "trace" in name:  # vLLM's timed_trace sends token ids: exact as well
            assert theirs == ours
        else:
            assert all(sent["input_tokens"] <= t <= sent["input_tokens"] * 1.05 for t in theirs), theirs
    if sent.get("same_prompts"):  # the same file's text, through the same tokenizer
        assert ours == theirs


def _records(theirs: dict) -> list[RequestResult]:
    """vLLM's per-request records (`--save-detailed`) as infertrace's."""
    out = []
    for i, (start, ttft, itl, latency, n_in, n_out, error) in enumerate(zip(
            theirs["start_times"], theirs["ttfts"], theirs["itls"], theirs["latencies"], theirs["input_lens"],
            theirs["output_lens"], theirs["errors"])):
        out.append(RequestResult(index=i, scheduled=start, t0=start, end=start + latency, ttft=ttft, e2el=latency,
                                 itl=list(itl), output_tokens=n_out, prompt_tokens=n_in, error=error or None))
    return out


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_definitions_match_vllm_bench_serve(side_by_side, name):
    """infertrace's metric code, fed vLLM's own per-request records, gives vLLM's aggregates: the figures are
    defined alike. Duration is the one figure defined differently: infertrace's runs from the first send to the
    last completion, vLLM's from before its first send to after its gather, so it is a little longer. In an open
    loop vLLM's also holds the wait before its first request: `get_request` (vllm/benchmarks/serve.py, 0.32.0)
    rescales the drawn gaps so that the last request is due N/rate after its start, and the first is due after
    its own gap; so its start is the last send less N/rate."""
    for theirs, _ in side_by_side[name]["theirs"]:
        ours = vllm_keys(compute_metrics(_records(theirs)))
        for key in DEFINED:
            if theirs.get(key) is not None:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-9), key
        sends = theirs["start_times"]
        first_wait = min(sends) - (max(sends) - len(sends) / OPEN_LOOP_RATES[name]) if name in OPEN_LOOP_RATES else 0
        assert ours["duration"] <= theirs["duration"]
        assert ours["duration"] == pytest.approx(theirs["duration"] - first_wait, rel=0.05, abs=0.05)


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values) if min(values) > 0 else float("inf")


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_measured_figures_agree(side_by_side, name):
    """The two clients' measured medians and throughput on the same server agree within the base tolerance plus
    the scatter each showed between its own runs."""
    _assert_agree(side_by_side[name], MEASURED)


def _assert_agree(runs: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        ours = [r[key] for r, _ in runs["ours"]]
        theirs = [r[key] for r, _ in runs["theirs"]]
        allowed = BASE_TOLERANCE + _spread(ours) + _spread(theirs)
        a, b = statistics.fmean(ours), statistics.fmean(theirs)
        assert abs(a - b) / b <= allowed, f"{key}: ours {ours}, theirs {theirs}, allowed {allowed:.2f}"
