"""recipes/speculative.yaml on the tiny model with --quick: every phase runs, and the waterfall shows acceptance
beside tok/s and ITL."""

import json
from pathlib import Path

from click.testing import CliRunner

from infertrace.ablate.command import ablate

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "speculative.yaml"


def test_speculative_recipe_runs_quick_with_acceptance_columns(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(ablate, [str(RECIPE), "--quick", "--profile", "--model", str(tiny_model_dir),
                                      "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["complete"]
    rows = {row["phase"]: row for row in doc["waterfall"]}
    phases = {p["name"]: p for p in doc["phases"]}
    assert [p["status"] for p in doc["phases"]] == ["ok"] * 4
    assert rows["off"]["acceptance_rate"] is None and phases["off"]["spec_decode"] is None
    # several tokens a chunk with every draft accepted: less time per token than per chunk
    assert rows["off"]["median_itl_per_token_ms"] <= rows["off"]["median_itl_ms"]
    drafted = rows["draft model K=4"]
    assert drafted["median_itl_per_token_ms"] < drafted["median_itl_ms"]
    for name, k in (("n-gram K=2", 2), ("n-gram K=4", 4), ("draft model K=4", 4)):
        row, spec = rows[name], phases[name]["spec_decode"]
        assert row["output_throughput"] > 0 and row["median_itl_ms"] > 0
        assert row["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
        assert row["mean_acceptance_length"] == 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
        assert 1 <= row["mean_acceptance_length"] <= 1 + k
        assert phases[name]["engine_config"]["speculative_config"]["num_speculative_tokens"] == k
    # the tiny preset drafting for the tiny model is the model itself: every draft is accepted
    assert rows["draft model K=4"]["acceptance_rate"] == 1.0
    assert "draft" in res.stdout and "accepted" in res.stdout
    # each phase's profile: verify steps count as decode steps; the draft model's steps are a type of their own
    for name, phase in phases.items():
        types = {p["type"] for p in phase["profile"]["phases"]}
        assert phase["profile"]["decode_steps"] > 0 and rows[name]["cpu_ops_per_decode_step"] > 0, name
        assert ("VERIFY" in types) == (name != "off") and ("DRAFT" in types) == name.startswith("draft"), types
