"""The figures of a run, computed exactly as docs/bench.md defines them, from the requests' records alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from infertrace.load.records import TEXT_CHARS_PER_TOKEN, RequestResult, input_tokens
from infertrace.load.stats import Stats


@dataclass(slots=True)
class Metrics:
    completed: int
    failed: int
    duration: float  # seconds: first send to last completion of the measured requests
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    ttft: Stats
    tpot: Stats
    itl: Stats  # per chunk: every gap between consecutive text events
    itl_per_token: Stats  # each gap divided over the tokens of the chunk it ended, where every chunk's are known
    e2el: Stats
    good_requests: int | None  # None without an SLO
    goodput: float | None  # good requests per second
    schedule_lag: Stats  # t0 - scheduled time
    slot_wait: Stats  # open loop with a concurrency cap: waiting for a free slot
    failures: dict[str, int]  # reason (text before the first colon) -> count
    output_token_sources: dict[str, int]
    max_output_tokens_per_s: float = 0.0  # the busiest one-second bucket, as `vllm bench serve` counts it
    max_concurrent_requests: int = 0  # the most requests active in one one-second bucket, likewise
    itl_per_token_requests: int = 0  # successful requests whose every chunk's token count is known
    # /v1/embeddings (None for streamed generation): the inputs the successful requests carried, and per second
    total_input_sequences: int | None = None
    input_sequence_throughput: float | None = None


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """Every given bound holds. Failed requests miss; TPOT is vacuous for a one-token response."""
    if not r.success:
        return False
    if "ttft_ms" in slo and (r.ttft is None or r.ttft * 1000.0 > slo["ttft_ms"]):
        return False
    if "e2el_ms" in slo and (r.e2el is None or r.e2el * 1000.0 > slo["e2el_ms"]):
        return False
    tpot = r.tpot
    return not ("tpot_ms" in slo and tpot is not None and tpot * 1000.0 > slo["tpot_ms"])


def peak_per_second(results: list[RequestResult]) -> tuple[float, int]:
    """(max output events in a one-second bucket, max requests active in one), over successful requests.

    `vllm bench serve` 0.33's `max_output_tokens_per_s` and `max_concurrent_requests` (vllm/benchmarks/serve.py,
    calculate_metrics): buckets of one second from the first successful send; each output event (the first at
    t0 + TTFT, then one per ITL gap) counts as one token, and a request is active in every bucket from its send
    to its last output event.
    """
    done = [r for r in results if r.success and r.ttft is not None and r.e2el is not None]
    if not done:
        return 0.0, 0
    start = min(r.t0 for r in done)
    buckets = int(np.ceil(max(r.t0 + r.e2el for r in done) - start)) + 1
    tokens = np.zeros(buckets)
    active = np.zeros(buckets)
    for r in done:
        times = r.t0 - start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        np.add.at(tokens, np.clip(times.astype(int), 0, buckets - 1), 1)
        active[int(r.t0 - start):int(r.t0 + r.e2el - start) + 1] += 1
    return float(tokens.max()), int(active.max())


def compute_metrics(results: list[RequestResult], slo: dict[str, float] | None = None,
                    embeddings: bool = False) -> Metrics:
    """The run's figures; with `embeddings`, also the inputs sent (vLLM 0.32's calculate_metrics_for_embeddings in
    benchmarks/serve.py: inputs of the successful requests, and per second of the run)."""
    done = [r for r in results if r.success]
    duration = (max(r.end for r in results) - min(r.t0 for r in results)) if results else 0.0
    total_in = sum(input_tokens(r) for r in done)
    total_out = sum(r.output_tokens or 0 for r in done)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    good = sum(meets_slo(r, slo) for r in results) if slo else None
    peak = peak_per_second(results)
    # a request with one chunk of unknown size has no per-token figure at all: what it holds would be a sample of
    # its smaller chunks only (those of known size), which a speculating server's bursts leave out
    per_token = [r for r in done if r.chunk_tokens and None not in r.chunk_tokens]
    sequences = sum(r.num_inputs or 0 for r in done) if embeddings else None
    return Metrics(
        completed=len(done), failed=len(results) - len(done), duration=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=rate(len(done)), output_throughput=rate(total_out),
        total_token_throughput=rate(total_in + total_out),
        ttft=Stats.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Stats.of([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of([g for r in done for g in r.itl]),
        itl_per_token=Stats.of([g for r in per_token for g in r.itl_per_token()]),
        e2el=Stats.of([r.e2el for r in done if r.e2el is not None]),
        good_requests=good, goodput=rate(good) if good is not None else None,
        schedule_lag=Stats.of([r.schedule_lag for r in results]),
        slot_wait=Stats.of([r.slot_wait for r in results]),
        failures=dict(Counter(r.error.split(":", 1)[0] for r in results if r.error is not None)),
        output_token_sources=dict(Counter(r.output_source.value for r in done if r.output_source)),
        max_output_tokens_per_s=peak[0], max_concurrent_requests=peak[1], itl_per_token_requests=len(per_token),
        total_input_sequences=sequences, input_sequence_throughput=None if sequences is None else rate(sequences),
    )


def token_count_checks(results: list[RequestResult], compare_prompts: bool) -> dict[str, int]:
    """Disagreements worth flagging: the target's usage against our tokenizer's count of the output text, and
    (where the prompt is sent verbatim, not wrapped in a chat template) against the prompt's built length; with how
    many of each were compared, which is what tells the cause of a disagreement (`token_count_warnings`)."""
    done = [r for r in results if r.success]
    outputs = [r for r in done if r.tokenizer_output_tokens is not None]
    prompts = [r for r in done if compare_prompts and r.prompt_tokens is not None
               and r.expected_prompt_tokens is not None]
    return {
        "output_token_disagreements": sum(r.tokenizer_output_tokens != r.output_tokens for r in outputs),
        "output_tokens_compared": len(outputs),
        "input_token_mismatches": sum(r.prompt_tokens != r.expected_prompt_tokens for r in prompts),
        "input_tokens_compared": len(prompts),
        "output_texts_cut": sum(r.text_cut for r in done),
    }


def sum_token_checks(checks: list[dict[str, int]]) -> dict[str, int]:
    """The checks of several runs (sweep points, --find-max runs) as one run's."""
    out: dict[str, int] = {}
    for c in checks:
        for name, count in c.items():
            out[name] = out.get(name, 0) + count
    return out


def token_count_warnings(checks: dict[str, int], chunk_counted: bool) -> list[str]:
    """What flagged token counts mean, one line per kind of flag, with its cause where the run shows it.

    Our tokenizer's count of a response's text differs from the server's usage when the generated ids do not
    round-trip: decoding them and encoding the text again gives other ids (BPE merges tokens across the ids'
    boundaries), which is what a model with random weights generates nearly every time. That is the cause, not a
    miscount, when the tokenizer is shown to be the server's: every prompt compared was counted alike by both.
    """
    out = []
    if chunk_counted:
        out.append("no usage and no tokenizer: output tokens were counted as one per text event; pass "
                   "--tokenizer DIR")
    disagree, compared = checks.get("output_token_disagreements", 0), checks.get("output_tokens_compared", 0)
    mismatched, prompts = checks.get("input_token_mismatches", 0), checks.get("input_tokens_compared", 0)
    of = f" of {compared}" if compared else ""
    if disagree and prompts and not mismatched:
        out.append(f"output tokens: the server's usage differs from our tokenizer's count of the text in {disagree}"
                   f"{of} request(s) because the generated ids do not round-trip (decoding them and encoding the "
                   f"text gives other ids, as a model with random weights generates); the tokenizer is the "
                   f"server's (all {prompts} prompts counted alike), so usage is right and the figures use it")
    elif disagree:
        out.append(f"output tokens: the server's usage differs from our tokenizer's count of the text in {disagree}"
                   f"{of} request(s); the figures use usage. Either the generated ids do not round-trip (random "
                   "weights), or --tokenizer is not the server's"
                   + (f" (prompts: {mismatched} of {prompts} counted differently)" if mismatched else "")
                   + " (see --requests-jsonl)")
    elif mismatched:
        out.append(f"input tokens: the server counted {mismatched} of {prompts} prompt(s) differently from their "
                   "built length: --tokenizer may not be the server's (see --requests-jsonl)")
    if cut := checks.get("output_texts_cut", 0):
        out.append(f"output text: {cut} response(s) streamed more text than their max_tokens could make ("
                   f"{TEXT_CHARS_PER_TOKEN} characters a token); only the start of each was kept, so a count of "
                   "their tokens by our tokenizer is a lower bound and is not compared with usage (text_cut in "
                   "--requests-jsonl)")
    return out


def vllm_keys(m: Metrics) -> dict:
    """The top-level keys of a `vllm bench serve` result file, with the same names and units."""
    if m.total_input_sequences is not None:
        return embeddings_keys(m)
    out = {
        "completed": m.completed, "failed": m.failed, "duration": m.duration,
        "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        s: Stats = getattr(m, name)
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            out[f"{stat}_{name}_ms"] = getattr(s, stat)
    out["request_goodput"] = out["goodput"] = m.goodput  # vLLM's name, and the name used throughout infertrace
    out["max_output_tokens_per_s"] = m.max_output_tokens_per_s
    out["max_concurrent_requests"] = m.max_concurrent_requests
    return out


def embeddings_keys(m: Metrics) -> dict:
    """An embeddings run's keys as `vllm bench serve` 0.32 writes them (benchmarks/serve.py, the result of
    calculate_metrics_for_embeddings): no output, TTFT, TPOT or ITL, since the answer comes whole; E2EL's
    statistics as for generation."""
    out = {
        "completed": m.completed, "failed": m.failed, "duration": m.duration,
        "total_input_tokens": m.total_input_tokens, "total_input_sequences": m.total_input_sequences,
        "request_throughput": m.request_throughput, "input_sequence_throughput": m.input_sequence_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for stat in ("mean", "median", "std", "p90", "p95", "p99"):
        out[f"{stat}_e2el_ms"] = getattr(m.e2el, stat)
    out["request_goodput"] = out["goodput"] = m.goodput
    return out


INTENDED_START_WARN = 0.10  # latency from the scheduled send against from the real send: relative gap to flag


def from_scheduled(results) -> tuple[Stats, Stats]:
    """TTFT and E2EL of the successful requests counted from when each was due (its scheduled time), not from
    when it was sent: the wait for a free slot under a concurrency cap, hidden from the measured figures
    (coordinated omission), is counted in."""
    ok = [r for r in results if r.error is None and r.ttft is not None]
    return (Stats.of([r.ttft + r.t0 - r.scheduled for r in ok]),
            Stats.of([r.e2el + r.t0 - r.scheduled for r in ok if r.e2el is not None]))
