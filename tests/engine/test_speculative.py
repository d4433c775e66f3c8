"""Speculative decoding in the engine: its settings, greedy output identical to plain decoding with each drafter,
and the paged KV cache (rejected drafts' slots released, only committed tokens cached, preemption and abort)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tests.engine.conftest import VOCAB, prompt_waves, run_in_waves

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def self_draft(model_dir, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def repeating_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase (n-gram lookup finds drafts in them), of assorted lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))]
        prompts.append((phrase * 40)[: rng.randrange(3, 120)])
    return prompts


def greedy(max_tokens: int = 48):
    from infertrace.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


# ----- settings -----

@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model; got 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram"}', 'needs "method" and "num_speculative_tokens"'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 3}', "unknown speculative_config key 'k'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "1 <= prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "method 'draft_model' needs \"model\""),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 2}', "\"model\" is for method 'draft_model'"),
    ("{method: ngram}", "speculative_config is not valid JSON"),
    ("[4]", "speculative_config must be a JSON object"),
])
def test_bad_speculative_config_is_one_line(value, message):
    from infertrace.engine import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig.from_overrides({"speculative_config": value})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_speculative_config_from_json_text_or_a_mapping_is_one_setting():
    from infertrace.engine import EngineConfig

    text = EngineConfig.from_overrides({"speculative_config": json.dumps(NGRAM)})
    mapping = EngineConfig.from_overrides({"speculative_config": NGRAM})
    assert text.speculative_config == mapping.speculative_config == {**NGRAM, "prompt_lookup_min": 1,
                                                                     "prompt_lookup_max": 4}
    assert text.speculative.num_speculative_tokens == 4
    assert EngineConfig().speculative is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"async_scheduling": "on"}, "needs async_scheduling 'auto' or 'off'"),
    ({"offload": "prefix"}, "not supported with offload='prefix'"),
])
def test_speculative_decoding_refuses_what_it_cannot_run_with(overrides, message):
    from infertrace.engine import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_overrides({"speculative_config": NGRAM, **overrides})


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from infertrace.engine import Engine, EngineConfig

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 1}))
    with pytest.raises(ValueError, match="draft model's vocabulary .* differs from the target model's"):
        Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": self_draft(other)}))


def test_a_missing_draft_model_is_named(tiny_model_dir, tmp_path):
    from infertrace.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="speculative_config draft model: .*nowhere"):
        Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": self_draft(tmp_path / "nowhere")}))


def test_serve_takes_speculative_config_as_vllm_spells_it():
    from infertrace.engine.config import ENGINE_FLAGS

    flags = {opt for o in ENGINE_FLAGS.options() for opt in o.opts}
    assert "--speculative-config" in flags


# ----- drafting -----

def _lookup_by_definition(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last n tokens occur earlier with a token after them; the earliest such
    occurrence's following tokens."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def _lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    from infertrace.engine.ngram_proposer import TokenMirror, propose_ngram

    return propose_ngram(TokenMirror().of(tokens), lo, hi, k)


def test_ngram_lookup_matches_its_definition():
    rng = random.Random(0)
    for _ in range(5000):
        tokens = [rng.randrange(rng.randrange(1, 6)) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi, k = rng.randrange(lo, 6), rng.randrange(1, 5)
        assert _lookup(tokens, lo, hi, k) == _lookup_by_definition(tokens, lo, hi, k), (tokens, lo, hi, k)
    assert _lookup([1, 2, 3, 4, 1, 2], 1, 4, 3) == [3, 4, 1]
    assert _lookup([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 1) == [7]  # the earliest of equal matches
    assert _lookup([5, 6, 7], 1, 4, 2) == []


def test_a_request_mirrored_as_it_grows_looks_up_as_its_whole_copy_does():
    """A mirror updated token by token (and across its growth past 256 tokens) holds what a fresh copy holds, and a
    request found shorter than its mirror is copied again."""
    from infertrace.engine.ngram_proposer import TokenMirror, propose_ngram

    rng = random.Random(1)
    tokens, mirror = [], TokenMirror()
    for _ in range(700):
        tokens.append(rng.randrange(4))
        if rng.random() < 0.3:
            assert mirror.of(tokens).tolist() == tokens
            assert propose_ngram(mirror.of(tokens), 1, 3, 4) == _lookup_by_definition(tokens, 1, 3, 4)
    del tokens[100:]
    tokens.append(9)
    assert mirror.of(tokens).tolist() == tokens


# ----- greedy parity -----

def test_ngram_parity_over_many_prompts_in_mixed_batches(tiny_model_dir):
    """Prompts arrive in waves (prefills beside verify steps), some repeating a phrase (drafts accepted) and some
    random (few drafts): every request's tokens are plain greedy decoding's."""
    waves = [repeating_prompts(0, 6) + prompt_waves(5, [[30, 7]])[0], repeating_prompts(1, 5),
             repeating_prompts(2, 4) + prompt_waves(6, [[90]])[0]]
    plain, _, _, _ = run_in_waves(tiny_model_dir, waves, greedy())
    spec, kinds, _, engine = run_in_waves(tiny_model_dir, waves, greedy(), speculative_config=NGRAM)
    assert spec == plain
    assert "verify" in kinds and "mixed" in kinds
    c = engine.counters
    assert 0 < c["spec_decode_num_accepted_tokens"] < c["spec_decode_num_draft_tokens"]
    assert c["spec_decode_num_drafts"] <= c["spec_decode_num_draft_tokens"] <= 4 * c["spec_decode_num_drafts"]
    assert sum(engine.spec_accepted_per_pos) == c["spec_decode_num_accepted_tokens"]
    assert engine.spec_accepted_per_pos == sorted(engine.spec_accepted_per_pos, reverse=True)
    assert c["generation_tokens"] == sum(map(len, plain))
    assert len(kinds) < sum(map(len, plain)) // len(plain)  # fewer steps than tokens per request
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_model_as_its_own_draft_is_accepted_every_time(tiny_model_dir):
    waves = [repeating_prompts(3, 5) + prompt_waves(7, [[40, 3, 200]])[0], prompt_waves(8, [[12, 64]])[0]]
    plain, _, _, _ = run_in_waves(tiny_model_dir, waves, greedy(40))
    spec, kinds, _, engine = run_in_waves(tiny_model_dir, waves, greedy(40),
                                          speculative_config=self_draft(tiny_model_dir))
    assert spec == plain
    c = engine.counters
    assert c["spec_decode_num_draft_tokens"] > 0
    assert c["spec_decode_num_accepted_tokens"] == c["spec_decode_num_draft_tokens"]
    assert "verify" in kinds


def test_drafts_stop_at_max_tokens_and_at_a_stop_token(tiny_model_dir):
    """A request's last verify step drafts no more than it may still emit, and a stop token inside the accepted
    drafts ends it there, as plain decoding would."""
    from infertrace.engine import Engine, EngineConfig
    from infertrace.engine.sampling_params import SamplingParams

    prompt = repeating_prompts(4, 1)[0]
    plain = _generate(Engine(tiny_model_dir), prompt, greedy(40))
    stop = plain[9]
    for max_tokens in (1, 2, 7):
        engine = Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": NGRAM}))
        assert _generate(engine, prompt, greedy(max_tokens)) == plain[:max_tokens]
    engine = Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": NGRAM}))
    got = _generate(engine, prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop]))
    assert got == plain[: plain.index(stop) + 1]


def _generate(engine, prompt, params) -> list[int]:
    engine.add_request("r", prompt, params)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


# ----- paged KV -----

def _step_checked(engine, tokens: dict[str, list[int]]) -> None:
    """One step, then the block manager's invariants, and every running request's table no longer than its KV."""
    bm = engine.block_manager
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    running = list(engine.scheduler.running)
    bm.check_consistency(running)
    for seq in running:
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens) or \
            seq.num_computed_tokens < len(seq) - 1, seq


def test_rejected_drafts_give_their_blocks_back(tiny_model_dir):
    """block_size 2, 4 drafts: a rejection leaves blocks written only for drafts, which are freed at once."""
    from infertrace.engine import Engine, EngineConfig

    prompts = repeating_prompts(9, 6) + prompt_waves(10, [[20, 33]])[0]
    engine = Engine(tiny_model_dir, EngineConfig.from_overrides(
        {"speculative_config": NGRAM, "block_size": 2, "kv_cache_tokens": 4096}))
    tokens = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(40))
        tokens[str(i)] = []
    bm = engine.block_manager
    released = []
    truncate = bm.truncate

    def spy(seq, num_tokens):
        kept = bm.blocks_needed(num_tokens)
        tail = seq.block_table[kept:]
        truncate(seq, num_tokens)
        assert len(seq.block_table) == kept and all(bm.blocks[b].ref_count == 0 for b in tail)
        released.extend(tail)

    bm.truncate = spy
    while engine.has_unfinished():
        _step_checked(engine, tokens)
    released = len(released)
    assert released > 0
    assert engine.counters["spec_decode_num_accepted_tokens"] < engine.counters["spec_decode_num_draft_tokens"]
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_holds_only_committed_tokens(tiny_model_dir):
    """Every cached block's hash is the chain hash of a request's committed tokens (never of a rejected draft),
    and the same prompts again hit the cache and give the same tokens."""
    from infertrace.engine import Engine, EngineConfig
    from infertrace.engine.sequence import Sequence

    prompts = repeating_prompts(11, 8)
    engine = Engine(tiny_model_dir, EngineConfig.from_overrides(
        {"speculative_config": NGRAM, "block_size": 4, "kv_cache_tokens": 8192}))
    first = _run(engine, prompts, greedy(40))
    bm = engine.block_manager
    committed = set()
    for prompt, out in zip(prompts, first):
        seq = Sequence("x", prompt + out, greedy())
        committed.update(seq.block_hash(i, 4) for i in range(len(seq) // 4))
    assert bm.hash_to_block and set(bm.hash_to_block) <= committed
    hits = engine.counters["prefix_cache_hits"]
    assert _run(engine, prompts, greedy(40)) == first
    assert engine.counters["prefix_cache_hits"] > hits


def test_preemption_with_drafts_recomputes_and_matches_plain(tiny_model_dir):
    waves = [repeating_prompts(12, 6), repeating_prompts(13, 4)]
    overrides = {"kv_cache_tokens": 384, "block_size": 8, "max_num_batched_tokens": 256}
    plain, _, _, _ = run_in_waves(tiny_model_dir, waves, greedy(48), **overrides)
    spec, _, _, engine = run_in_waves(tiny_model_dir, waves, greedy(48), speculative_config=NGRAM, **overrides)
    assert spec == plain
    assert engine.counters["preemptions"] > 0
    assert engine.counters["spec_decode_num_drafts"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_mid_run_frees_every_block(tiny_model_dir):
    from infertrace.engine import Engine, EngineConfig

    engine = Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": self_draft(tiny_model_dir)}))
    for i, p in enumerate(repeating_prompts(14, 4)):
        engine.add_request(str(i), p, greedy(40))
    for _ in range(4):
        engine.step()
    assert engine.counters["spec_decode_num_drafts"] > 0
    for rid in engine.unfinished_request_ids():
        engine.abort(rid)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()
    bm.check_consistency([])


def _run(engine, prompts, params) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    base = len(engine.counters) and engine.counters["requests_added"]
    for i, p in enumerate(prompts):
        out[f"{base}-{i}"] = []
        engine.add_request(f"{base}-{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def test_drafts_that_do_not_fit_are_dropped_rather_than_preempt():
    """Two running requests, no free block: the first one's drafts would need a new block, so it decodes its one
    token without them, and the second keeps its KV."""
    from infertrace.engine.block_manager import BlockManager
    from infertrace.engine.config import EngineConfig
    from infertrace.engine.scheduler import Scheduler, StepKind
    from infertrace.engine.sequence import Sequence

    bm = BlockManager(4, 4)
    sched = Scheduler(EngineConfig.from_overrides({"block_size": 4, "speculative_config": NGRAM}), bm)
    a, b = Sequence("a", list(range(6)), greedy()), Sequence("b", list(range(10, 16)), greedy())
    for seq in (a, b):
        sched.add(seq)
    sched.update_computed(sched.schedule())  # both prompts' KV: two blocks each, their last two slots free
    for seq in (a, b):
        seq.append_token(99)
    assert bm.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]
    plan = sched.plan()
    assert not plan.preempted and plan.kind is StepKind.DECODE
    assert [(s.seq.request_id, s.num_new_tokens, s.num_draft_tokens) for s in plan.scheduled] == [("a", 1, 0),
                                                                                                 ("b", 1, 0)]
    a.spec_token_ids = [1]  # one draft fits the block's last slot
    assert [s.num_draft_tokens for s in sched.plan().scheduled] == [1, 0]


# ----- the request log -----

def test_request_log_records_drafted_and_accepted_per_step_per_request(tiny_model_dir):
    prompts = repeating_prompts(15, 4)
    _, _, _, engine = run_in_waves(tiny_model_dir, [prompts], greedy(30), speculative_config=NGRAM)
    log = engine.request_log.read()
    verify_steps = [s for s in log["steps"] if s["kind"] == "verify"]
    assert verify_steps
    drafted = sum(d[1] for r in log["requests"] for d in r["drafts"])
    accepted = sum(d[2] for r in log["requests"] for d in r["drafts"])
    c = engine.counters
    assert drafted == c["spec_decode_num_draft_tokens"] == sum(s["drafted_tokens"] for s in log["steps"])
    assert accepted == c["spec_decode_num_accepted_tokens"] == sum(s["accepted_tokens"] for s in log["steps"])
    assert sum(len(r["drafts"]) for r in log["requests"]) == c["spec_decode_num_drafts"]
    by_step = {s["step"]: s for s in log["steps"]}
    for r in log["requests"]:
        rows = {row[0]: row for row in r["steps"]}
        for step, n, kept in r["drafts"]:
            assert 0 <= kept <= n and rows[step][1] == n + 1 and by_step[step]["kind"] == "verify"


# ----- profiles -----

def test_analyze_tells_draft_steps_from_verify_steps(tiny_model_dir, tmp_path):
    """A profile of a draft-model run: the draft engine's steps read as DRAFT (without the request log's step
    numbers, which belong to the target's steps), the target's verify steps as VERIFY."""
    from infertrace.analyze.capture import load_capture
    from infertrace.analyze.phases import find_steps
    from infertrace.engine import Engine, EngineConfig

    engine = Engine(tiny_model_dir, EngineConfig.from_overrides({"speculative_config": self_draft(tiny_model_dir)}))
    for i, p in enumerate(repeating_prompts(16, 2)):
        engine.add_request(str(i), p, greedy(12))
    engine.start_profile(tmp_path, activities=("CPU",))
    while engine.has_unfinished():
        engine.step()
    engine.stop_profile()
    steps = find_steps(load_capture(tmp_path).ranks[0].events)
    types = steps["type"].value_counts().to_dict()
    assert types.get("VERIFY", 0) > 0 and types.get("DRAFT", 0) > 0
    assert not steps.loc[steps["type"] == "DRAFT", "label"].str.contains("#").any()
    assert steps.loc[steps["type"] == "VERIFY", "label"].str.contains("#").all()
