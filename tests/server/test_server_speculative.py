"""`infertrace serve` with speculative decoding: vLLM's counters on /metrics, equal to the engine's own, and the
drafts in the request log."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT = [7, 8, 9, 10] * 12  # n-gram lookup finds drafts in it


def spec_samples(text: str) -> dict[tuple[str, str | None], float]:
    """(sample name, position label) -> value of the vllm:spec_decode_* families."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_"):
                out[(sample.name, sample.labels.get("position"))] = sample.value
    return out


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_metrics_expose_vllm_spec_decode_counters(serve_tiny, wait_metrics, engine_process):
    async with serve_tiny({"speculative_config": NGRAM}, engine_process=engine_process) as client:
        for _ in range(2):
            resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24,
                                                               "temperature": 0, "ignore_eos": True})
            assert resp.status == 200, await resp.text()
        await wait_metrics(client, lambda m: m.get("infertrace:generation_tokens_total") == 48)
        text = await (await client.get("/metrics")).text()
        got = spec_samples(text)
        drafts, draft_tokens, accepted = (got[(f"vllm:spec_decode_num_{k}_total", None)]
                                          for k in ("drafts", "draft_tokens", "accepted_tokens"))
        per_pos = [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
        assert 0 < drafts <= draft_tokens <= 3 * drafts and 0 < accepted <= draft_tokens
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        assert "infertrace:spec_decode_num_drafts_total" not in text  # one name for each figure
        # the request log, kept apart from the counters, gives the same figures
        log = await (await client.get("/v1/request_log")).json()
        rows = [d for r in log["requests"] for d in r["drafts"]]
        assert (len(rows), sum(d[1] for d in rows), sum(d[2] for d in rows)) == (drafts, draft_tokens, accepted)
        if client.engine is not None:  # the engine on a thread: its own counters
            c = client.engine.counters
            assert (c["spec_decode_num_drafts"], c["spec_decode_num_draft_tokens"],
                    c["spec_decode_num_accepted_tokens"]) == (drafts, draft_tokens, accepted)
            assert per_pos == client.engine.spec_accepted_per_pos


async def test_no_spec_decode_counters_without_speculative_decoding(serve_tiny):
    async with serve_tiny() as client:
        text = await (await client.get("/metrics")).text()
        assert not spec_samples(text)


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens must be an integer >= 1"),
])
def test_serve_refuses_a_bad_speculative_config_in_one_line(value, message, tiny_model_dir):
    from click.testing import CliRunner

    from infertrace.cli import main

    res = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--speculative-config", value])
    assert res.exit_code != 0
    assert message in res.output
    assert "Traceback" not in res.output
