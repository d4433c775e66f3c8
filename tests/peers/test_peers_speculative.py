"""Speculative decoding measured against the real vLLM running n-gram drafting: bench's drafts, draft tokens and
accepted tokens are the growth of the server's own counters over the run, its rates follow vLLM's definitions, the
per-request figures vLLM puts in each response add up to the run's, and the multi-token chunks a drafting server
streams give per-chunk and per-token ITL that add up. Runs last in the tier: it restarts the shared server with
drafting on (one start, a few small runs)."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from tests.peers.conftest import DEFAULT_ARGS, SERVED_NAME, run_infertrace_bench

pytestmark = pytest.mark.vllm

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# `detailed` adds each verify step's accepted and drafted counts to the response (vllm/config/observability.py)
# float32, the tiny model's own dtype, so that vLLM's greedy tokens are the bundled engine's (same weights)
ARGS = (*DEFAULT_ARGS, "--dtype", "float32", "--speculative-config", json.dumps(SPECULATIVE),
        "--per-request-spec-decode-metrics", "detailed")
N = 12  # small: the tier must stay fast
# the random model's greedy output soon repeats itself, and n-gram drafting proposes from the text so far: drafts
# get accepted without a prompt written for it
WORKLOAD = ("--num-prompts", str(N), "--concurrency", "4", "--input-len", "32", "--output-len", "48", "--warmup", "0")
COUNTERS = ("spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")


@pytest.fixture(scope="module")
def drafting_server(vllm_servers):
    return vllm_servers.get(ARGS)


def _run(server, tmp_path, name, *args):
    """bench against the server, with the server's counters read just before and just after it."""
    before = server.counters()
    jsonl = tmp_path / f"{name}.jsonl"
    result = run_infertrace_bench(server, tmp_path, name, *WORKLOAD, "--requests-jsonl", str(jsonl), *args)
    after = server.counters()
    server.check_alive()
    grown = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith("spec_decode")}
    requests = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return result, grown, [r for r in requests if r["phase"] == "measured"]


def test_acceptance_matches_the_servers_counters_and_the_responses(drafting_server, tmp_path):
    result, grown, requests = _run(drafting_server, tmp_path, "spec")
    block = result["speculative_decoding"]
    assert block["source"] == "counters"
    drafts, drafted, accepted = (grown[k] for k in COUNTERS)
    assert drafts > 0 and accepted > 0, f"n-gram drafting proposed nothing that was accepted: {grown}"
    # bench's figures are the growth of the server's counters over the run, as the test read them
    assert (block["drafts"], block["draft_tokens"], block["accepted_tokens"]) == (drafts, drafted, accepted)
    assert block["acceptance_rate"] == accepted / drafted
    assert block["mean_acceptance_length"] == 1 + accepted / drafts
    positions = sorted(k for k in grown if k.startswith("spec_decode_accepted_per_pos["))
    assert len(positions) == SPECULATIVE["num_speculative_tokens"]
    assert block["per_position_acceptance_rate"] == [grown[p] / drafts for p in positions]
    assert sum(grown[p] for p in positions) == accepted  # each accepted token was accepted at one position
    # vllm bench serve's keys, its units
    assert result["spec_decode_num_drafts"] == drafts and result["spec_decode_accepted_tokens"] == accepted
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / drafted, rel=1e-12)

    # each response's own figures, kept per request, add up to the run's
    assert len(requests) == N and all(r["success"] for r in requests)
    per_request = [r["server"]["speculative_decoding"] for r in requests]
    assert all(s is not None for s in per_request)
    assert sum(s["num_spec_steps"] for s in per_request) == drafts
    assert sum(s["num_draft_tokens"] for s in per_request) == drafted
    assert sum(s["num_accepted_draft_tokens"] for s in per_request) == accepted
    for s in per_request:
        assert sum(s["per_step_accepted"]) == s["num_accepted_draft_tokens"]
        assert len(s["per_step_drafted"]) == s["num_spec_steps"] == sum(s["acceptance_histogram"])
    summary = block["requests"]
    assert (summary["requests"], summary["spec_steps"], summary["accepted_tokens"]) == (N, drafts, accepted)
    assert summary["acceptance_rate"] == block["acceptance_rate"]


def test_multi_token_chunks_add_up_and_itl_is_split_over_them(drafting_server, tmp_path):
    result, grown, requests = _run(drafting_server, tmp_path, "chunks")
    chunks = [r["chunk_tokens"] for r in requests]
    assert all(sum(c) == r["output_tokens"] for c, r in zip(chunks, requests))  # usage on each chunk adds up
    assert max(max(c) for c in chunks) > 1, "no chunk carried more than one token: nothing was accepted"
    assert result["itl_per_token_requests"] == N
    # per-token ITL's mean is every gap over the tokens after each request's first chunk: TPOT's mean where every
    # request's first chunk is one token; per-chunk ITL has one sample a step, so it is larger
    gaps = sum(sum(r["itl_ms"]) for r in requests)
    tokens_after_first = sum(sum(c[1:]) for c in chunks)
    assert result["mean_itl_per_token_ms"] == pytest.approx(gaps / tokens_after_first, rel=1e-9)
    assert result["mean_itl_ms"] == pytest.approx(gaps / sum(len(c) - 1 for c in chunks), rel=1e-9)
    assert result["mean_itl_ms"] > result["mean_itl_per_token_ms"]


def test_without_usage_on_each_chunk_no_per_token_itl_is_claimed(drafting_server, tmp_path):
    result, grown, requests = _run(drafting_server, tmp_path, "no-usage", "--no-continuous-usage")
    assert all(r["success"] for r in requests)
    # usage only at the end: a request's chunks are known only when there are as many as its tokens (one each)
    known = [r for r in requests if None not in r["chunk_tokens"]]
    assert all(set(r["chunk_tokens"]) == {1} for r in known)
    assert all(set(r["chunk_tokens"]) == {None} and r["output_tokens"] > len(r["chunk_tokens"])
               for r in requests if r not in known)
    assert len(known) < N and result["itl_per_token_requests"] == len(known)
    if not known:
        assert result["mean_itl_per_token_ms"] is None
    assert result["mean_itl_ms"] is not None  # per chunk: the gaps are measured whatever the chunks hold
    assert result["speculative_decoding"]["drafts"] == grown["spec_decode_drafts"] > 0


def _complete(server, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0.0, "return_token_ids": True}).encode()
    request = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def test_the_bundled_engine_drafts_and_accepts_as_vllm_does(drafting_server):
    """The same prompts, greedy, n-gram K=3 with the same lookup bounds, through vLLM and the bundled engine on the
    same float32 weights: the same tokens, and verify step for verify step the same drafted and accepted counts,
    but for each request's last step. There vLLM drafts K whatever the request can still take (its scheduler caps
    drafts by the context, not max_tokens: vllm/v1/core/sched/scheduler.py and v1/spec_decode/ngram_proposer.py,
    0.32.0) and counts the accepted ones past max_tokens that its output then drops; the bundled engine drafts at
    most the tokens the request can still take after the bonus token."""
    from infertrace.engine.llm import LLM
    from infertrace.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(32)] for _ in range(6)]
    max_tokens = 48
    theirs = [_complete(drafting_server, p, max_tokens) for p in prompts]
    llm = LLM(drafting_server.model_dir, speculative_config=SPECULATIVE, dtype="float32")
    ours = [llm.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0] for p in prompts]
    logged = llm.engine.request_log.read(0)["requests"]
    assert len(logged) == len(prompts)
    capped = 0
    for answer, completion, record in zip(theirs, ours, logged):
        assert answer["choices"][0]["token_ids"] == list(completion.token_ids)
        spec = answer["metrics"]["speculative_decoding"]
        drafted, accepted = spec["per_step_drafted"], spec["per_step_accepted"]
        rows = record["drafts"]  # [step, drafted, accepted] per verify step with drafts
        assert len(rows) == len(drafted) == spec["num_spec_steps"]
        assert [r[1] for r in rows[:-1]] == drafted[:-1] and [r[2] for r in rows[:-1]] == accepted[:-1]
        if rows[-1][1:] == [drafted[-1], accepted[-1]]:
            continue
        # the last verify step ended the request: the engine drafted what it could still take after its bonus
        # token, vLLM drafted K
        capped += 1
        room = max_tokens - (len(completion.token_ids) - (rows[-1][2] + 1)) - 1
        assert rows[-1][1] == room < drafted[-1] and rows[-1][2] == min(accepted[-1], room)
    assert capped, "no request ended on a verify step: the difference in counting was not exercised"
