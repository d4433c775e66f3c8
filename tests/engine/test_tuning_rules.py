"""The tuning rules beside the kernels (all-reduce fusion, its kernel's spread, pull, payload and push, the early
GEMM) resolve per rank count and hidden size to the values the engine has always taken by default."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("triton")  # the rules sit beside the Triton kernels they tune

from infertrace.engine.allreduce import resolve_rules  # noqa: E402
from infertrace.engine.kernels import skinny_gemm, tuning  # noqa: E402
from infertrace.engine.kernels.allreduce_norm import PushBuffers  # noqa: E402

# (ranks, hidden) -> fusion, spread, pull, payload, push, early GEMM
PINNED = {
    (2, 2560): ("norm", 4, "each", "model", "off", True),
    (2, 5120): ("norm", 4, "each", "model", "off", True),
    (3, 5120): ("planes", 4, "each", "model", "off", True),
    (4, 1024): ("norm", 8, "all", "model", "on", True),
    (4, 5120): ("norm", 8, "all", "model", "on", True),
    (4, 8192): ("norm", 8, "all", "model", "on", True),
    (6, 5120): ("planes", 8, "each", "model", "on", True),
    (8, 2560): ("planes", 8, "all", "model", "on", True),
    (8, 5120): ("planes", 8, "each", "model", "on", True),
}


def resolved(ranks: int, hidden: int, overrides: dict | None = None) -> tuple:
    """What the engine takes on `ranks` ranks of a model of `hidden` (with the skinny GEMMs, whose sums the fusions
    take): the all-reduce's arguments as make_all_reduce resolves them, the pull as the kernel does it."""
    rules = resolve_rules(ranks, True, overrides or {})
    buffers = types.SimpleNamespace(world_size=ranks, hidden_size=hidden)
    pull = "all" if PushBuffers.pulls_all(buffers, rules["pull"]) else "each"
    early = {"on": True, "off": False}.get((overrides or {}).get("gemm_early_weights"), skinny_gemm.early_rule(ranks))
    return rules["fusion"], rules["spread"], pull, rules["payload"], rules["push"], early


@pytest.mark.parametrize(("ranks", "hidden"), list(PINNED))
def test_the_rules_resolve_to_the_engine_s_defaults(ranks, hidden, monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert resolved(ranks, hidden, tuning.rules()) == PINNED[ranks, hidden]


def test_an_experiment_overrides_a_rule_through_the_tuning_variable_inline_or_from_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV, json.dumps({"rules": {"all_reduce_fusion": "planes", "all_reduce_spread": 8,
                                                         "gemm_early_weights": "off"}}))
    assert resolved(2, 5120, tuning.rules()) == ("planes", 8, "each", "model", "off", False)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rules": {"all_reduce_push": "on", "all_reduce_pull": "all"}}))
    monkeypatch.setenv(tuning.ENV, str(path))
    assert resolved(2, 5120, tuning.rules()) == ("norm", 4, "all", "model", "on", True)


def test_without_the_skinny_gemms_no_fusion_takes_their_sums_whatever_the_override():
    assert resolve_rules(2, False, {"all_reduce_fusion": "norm"})["fusion"] == "off"


@pytest.mark.parametrize(("rules", "message"), [
    ({"all_reduce_fusoin": "norm"}, "no rule 'all_reduce_fusoin'"),
    ({"all_reduce_spread": 2}, "all_reduce_spread takes 4, 8; got 2"),
    ({"all_reduce_push": True}, "all_reduce_push takes on, off; got True"),
    ({"gemm_early_weights": "auto"}, "gemm_early_weights takes on, off; got 'auto'"),
    (["all_reduce_push"], "\"rules\" must be an object"),
])
def test_an_override_that_names_no_rule_or_a_value_it_cannot_take_is_one_error(monkeypatch, rules, message):
    monkeypatch.setenv(tuning.ENV, json.dumps({"rules": rules}))
    with pytest.raises(ValueError, match=f"{tuning.ENV}: .*{message}"):
        tuning.rules()


def test_an_inline_value_that_is_not_json_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(tuning.ENV, "{rules")
    with pytest.raises(ValueError, match=r"INFERTRACE_KERNEL_TUNING=\{rules: not a tiling file"):
        tuning.rules()


def test_with_rules_adds_rules_to_the_variable_s_tilings_for_an_engine_started_after(monkeypatch, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"skinny_gemm": {"2560,2048": [64, 128, 4, 4]}, "rules": {"all_reduce_push": "on"}}))
    monkeypatch.setenv(tuning.ENV, str(path))
    value = tuning.with_rules({"all_reduce_spread": "8", "all_reduce_fusion": "planes"})  # text from a command line
    monkeypatch.setenv(tuning.ENV, value)
    assert tuning.rules() == {"all_reduce_push": "on", "all_reduce_spread": 8, "all_reduce_fusion": "planes"}
    assert tuning.load("skinny_gemm") == {(2560, 2048): (64, 128, 4, 4)}
    with pytest.raises(ValueError, match="all_reduce_spread takes 4, 8; got 2"):
        tuning.with_rules({"all_reduce_spread": "2"})


def test_the_rules_overrides_are_read_in_one_place_and_no_setting_is_a_rule():
    """A rule's override is read once an engine start, by the model runner, which hands it on; and no engine setting
    shadows a rule (a rule that is also a flag would have two ways in)."""
    import ast
    import dataclasses
    from pathlib import Path

    from infertrace.engine.config import EngineConfig

    root = Path(__file__).resolve().parents[2] / "infertrace"
    readers = sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                     if any(isinstance(node, ast.Attribute) and node.attr == "rules"
                            and isinstance(node.value, ast.Name) and node.value.id == "tuning"
                            for node in ast.walk(ast.parse(path.read_text()))))
    assert readers == ["engine/model_runner.py"]
    assert not {f.name for f in dataclasses.fields(EngineConfig)} & set(tuning.RULES)
