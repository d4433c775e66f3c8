"""Structured output in the engine: rows with a grammar produce JSON that holds to it, greedy and sampled, beside
plain rows whose tokens do not change."""

from __future__ import annotations

import json

import pytest

from infertrace.engine import SamplingParams
from infertrace.engine.structured import grammar_from_response_format
from infertrace.load.workloads.structured import generated_schema, violation
from tests.engine.conftest import random_prompts, run_to_completion

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
          "required": ["ok", "size"], "additionalProperties": False}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def run_mixed(engine, prompts, plain: SamplingParams, constrained: SamplingParams):
    """Even rows constrained, odd rows plain, in one batch; each row's (tokens, finish reason, text)."""
    params = [constrained if i % 2 == 0 else plain for i in range(len(prompts))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    got = {f"r{i}": [[], None, ""] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            row = got[out.request_id]
            row[0] += out.new_token_ids
            row[2] += out.new_text
            if out.finished:
                row[1] = out.finish_reason
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("scheduling", ["off", "on"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_grammar_rows_hold_to_the_schema_and_plain_rows_are_unchanged(make_engine, sampling, scheduling):
    """With async scheduling on, a constrained row's next mask needs its last token: those steps wait for it."""
    schemas = [SCHEMA, generated_schema(1, seed=0)]
    prompts = random_prompts([5, 9, 7, 12])
    plain = SamplingParams(max_tokens=6, ignore_eos=True, **sampling)  # seeded when sampled: its own generator
    alone, _ = run_to_completion(make_engine(async_scheduling=scheduling), prompts[1::2], plain)
    for schema in schemas:
        engine = make_engine(async_scheduling=scheduling)
        constrained = SamplingParams(max_tokens=64, grammar=grammar_from_response_format(schema_format(schema)),
                                     **sampling)
        rows = run_mixed(engine, prompts, plain, constrained)
        for tokens, reason, text in rows[0::2]:
            assert reason == "stop", text
            assert violation(json.loads(text), schema) is None, text
        assert [r[0] for r in rows[1::2]] == alone


def test_json_object_gives_an_object_and_the_grammar_ends_it_under_ignore_eos(make_engine):
    # random weights write keys and numbers without end unless the draw closes the object early: seed 1 does
    grammar = grammar_from_response_format({"type": "json_object"})
    params = SamplingParams(max_tokens=60, grammar=grammar, ignore_eos=True, temperature=1.0, seed=1)
    [(tokens, reason, text)] = run_mixed(make_engine(), random_prompts([6], seed=1), params, params)
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_a_complete_schema_ends_the_output_under_ignore_eos(make_engine):
    params = SamplingParams(max_tokens=60, grammar=grammar_from_response_format(schema_format(SCHEMA)),
                            ignore_eos=True)
    [(tokens, reason, text)] = run_mixed(make_engine(), random_prompts([6]), params, params)
    assert reason == "stop" and len(tokens) < 60 and violation(json.loads(text), SCHEMA) is None, text


@pytest.mark.parametrize("response_format, message", [
    (schema_format({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "invalid JSON schema"),
    (schema_format("not a schema"), "must be a JSON schema"),
    ({"type": "yaml"}, "response_format.type must be"),
])
def test_a_bad_format_is_one_line_of_value_error(response_format, message):
    with pytest.raises(ValueError) as err:
        grammar_from_response_format(response_format)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_text_needs_no_grammar():
    assert grammar_from_response_format({"type": "text"}) is None


def test_speculative_decoding_refuses_a_grammar(make_engine):
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    params = SamplingParams(max_tokens=8, grammar=grammar_from_response_format({"type": "json_object"}))
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        engine.add_request("r", [1, 2, 3], params)
