"""Recipes: the format, its checks (one line naming file and line), cumulative phases, command-line changes."""

import subprocess
import sys
from pathlib import Path

import pytest

from infertrace.ablate.recipe import QUICK_WORKLOAD, RecipeError, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = ("attention_batched_vs_looped", "decode_path", "prefix_cache", "chunked_prefill", "cpu_offload")

BASIC = """
name: demo
preset: tiny
engine:
  max_num_seqs: 4
workload:
  num_prompts: 16
  input_len: 64
  output_len: 32
  concurrency: 4
phases:
  - name: one
    overrides:
      attention: looped
      prefix_caching: false
  - name: two
    overrides:
      attention: batched
  - name: three
    reset: true
    overrides:
      block_size: 32
"""


def test_phases_are_cumulative_and_reset_starts_from_the_base(write_recipe):
    recipe = load_recipe(write_recipe(BASIC))
    plan = recipe.plan()
    assert [p.name for p in plan] == ["one", "two", "three"]
    assert plan[0].config == {"max_num_seqs": 4, "attention": "looped", "prefix_caching": False}
    assert plan[1].config == {"max_num_seqs": 4, "attention": "batched", "prefix_caching": False}
    assert plan[1].overrides == {"attention": "batched"}
    assert plan[2].config == {"max_num_seqs": 4, "block_size": 32}
    assert all(p.error is None for p in plan)


def test_workload_becomes_the_load_generators_config(write_recipe):
    cfg = load_recipe(write_recipe(BASIC)).bench_config()
    assert (cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.concurrency) == (16, 64, 32, 4)
    assert cfg.ignore_eos is True  # every phase generates the same number of tokens
    assert cfg.base_url is None and cfg.dataset == "random"


def test_defaults_without_model_or_workload(write_recipe):
    recipe = load_recipe(write_recipe("phases:\n  - name: only\n", name="plain.yaml"))
    assert recipe.name == "plain" and recipe.preset == "tiny" and recipe.model is None
    assert recipe.plan()[0].config == {} and not recipe.profile.enabled


@pytest.mark.parametrize("text, where, words", [
    ("nmae: x\nphases: [{name: a}]\n", 1, "unknown recipe field 'nmae' (did you mean 'name'?)"),
    ("phases: [{name: a}]\nworkload:\n  num_prompts: 4\n  inputlen: 3\n", 4, "unknown workload field 'inputlen'"),
    ("phases: [{name: a}]\nworkload:\n  num_prompts: many\n", 3, "num_prompts must be an integer, got 'many'"),
    ("phases: [{name: a}]\nworkload:\n  num_prompts: 0\n", 3, "num_prompts must be at least 1"),
    ("phases: [{name: a}]\nworkload:\n  dataset: sharegtp\n", 3, "dataset must be one of"),
    ("phases: [{name: a}]\nengine:\n  max_num_seq: 4\n", 3,
     "unknown engine config field 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ("phases: [{name: a}]\nengine:\n  block_size: 0\n", 3, "block_size must be at least 1"),
    ("phases:\n  - name: a\n    overides: {}\n", 3, "unknown phase field 'overides' (did you mean 'overrides'?)"),
    ("phases:\n  - name: a\n  - name: a\n", 3, "two phases are named 'a'"),
    ("phases:\n  - overrides: {}\n", 2, "phase 1 needs a name"),
    ("phases:\n  - name: off\n", 2, "a phase name is text, got False; YAML reads off, on, no and yes as"),
    ("phases: []\n", 1, "phases must be a non-empty list"),
    ("preset: tiny\nmodel: /m\nphases: [{name: a}]\n", 1, "give model or preset, not both"),
    ("preset: qwen9\nphases: [{name: a}]\n", 1, "preset must be one of tiny"),
    ("phases: [{name: a}]\nprofile:\n  steps: -1\n", 3, "steps must be a positive integer"),
    ("phases: [{name: a}]\nprofile: {activities: [TPU]}\n", 2, "activities must be a list of CPU"),
    ("phases: [{name: a}]\nworkload:\n  seed: 1\n  seed: 2\n", 4, "'seed' is given twice"),
    ("phases: [{name: a}\n", 2, "not valid YAML"),
    ("- just\n- a list\n", None, "a recipe is a YAML mapping"),
])
def test_a_bad_recipe_is_one_line_naming_file_and_line(write_recipe, text, where, words):
    path = write_recipe(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{where}: " if where else f"{path}: "), message
    assert words in message


def test_missing_file_and_empty_file(tmp_path, write_recipe):
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(write_recipe("# nothing\n"))


def test_a_bad_phase_override_fails_that_phase_and_what_inherits_it(write_recipe):
    path = write_recipe("""
        phases:
          - name: base
          - name: typo
            overrides:
              atention: looped
          - name: after typo
            overrides:
              block_size: 32
          - name: fresh
            reset: true
            overrides:
              attention: sideways
        """)
    plan = load_recipe(path).plan()  # loading succeeds: the other phases can still run
    assert plan[0].error is None
    assert plan[1].error == f"{path}:5: unknown engine config field 'atention' (did you mean 'attention'?)"
    assert plan[2].error == (f"{path}:5: unknown engine config field 'atention' (did you mean 'attention'?) "
                             "(set in phase 'typo')")
    assert plan[3].error.startswith(f"{path}:12: attention must be one of batched, looped")


def test_a_bare_off_is_explained(write_recipe):
    path = write_recipe("phases:\n  - name: a\n    overrides:\n      offload: off\n")
    assert "quote the word" in load_recipe(path).plan()[0].error


def test_quick_caps_the_workload_and_options_win(write_recipe):
    recipe = load_recipe(write_recipe(BASIC))
    quick = recipe.with_changes(quick=True)
    cfg = quick.bench_config()
    assert cfg.num_prompts == QUICK_WORKLOAD["num_prompts"] and cfg.input_len == QUICK_WORKLOAD["input_len"]
    assert cfg.output_len == QUICK_WORKLOAD["output_len"] and cfg.concurrency == QUICK_WORKLOAD["concurrency"]
    assert quick.profile.steps <= 4
    changed = recipe.with_changes(quick=True, workload={"concurrency": 3}, preset="qwen3-4b")
    assert changed.bench_config().concurrency == 3 and changed.preset == "qwen3-4b" and changed.model is None
    assert recipe.bench_config().num_prompts == 16  # the original is untouched


def test_command_line_changes_are_checked(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(BASIC))
    with pytest.raises(RecipeError, match=r"^--concurrency: workload: concurrency must be at least 1"):
        recipe.with_changes(workload={"concurrency": 0})
    with pytest.raises(RecipeError, match=r"^--engine-opt block_sise: unknown engine config field 'block_sise' "
                                          r"\(did you mean 'block_size'\?\)$"):
        recipe.with_changes(engine={"block_sise": "8"})
    with pytest.raises(RecipeError, match=r"^--engine-opt block_size: block_size must be int, got 'x'$"):
        recipe.with_changes(engine={"block_size": "x"})
    with pytest.raises(RecipeError, match="not both"):
        recipe.with_changes(model=str(tmp_path), preset="tiny")
    more = recipe.with_changes(engine={"kv_cache_tokens": "4096"}, model=str(tmp_path))
    assert more.plan()[0].config["kv_cache_tokens"] == "4096" and more.model == str(tmp_path)
    assert more.plan()[0].error is None


def test_model_path_is_relative_to_the_recipe(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe("model: models/x\nphases: [{name: a}]\n"))
    assert recipe.model == str(tmp_path / "models" / "x") and recipe.preset is None


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    assert recipe.phases and recipe.preset == "tiny"
    assert recipe.bench_config().effective_concurrency == 8


def test_decode_path_recipe_is_the_published_sequence():
    plan = load_recipe(RECIPES / "decode_path.yaml").plan()
    assert [p.name for p in plan] == ["looped attention", "batched attention", "buffers allocated once",
                                      "CUDA graphs", "fused norm", "weight-streaming GEMMs", "async scheduling",
                                      "programmatic dependent launch", "projections fused with the kernels after them"]
    off = {"cuda_graphs": False, "static_buffers": False, "fused_norm": False, "skinny_gemm": False,
           "fused_projections": False, "async_scheduling": "off", "pdl": False}
    assert plan[0].config == {"max_num_seqs": 8, "attention": "looped", **off}
    assert plan[1].config == {"max_num_seqs": 8, "attention": "batched", **off}
    assert plan[2].config == {"max_num_seqs": 8, "attention": "batched", **off, "static_buffers": True}
    assert plan[3].config == {"max_num_seqs": 8, "attention": "batched", **off, "cuda_graphs": True,
                              "static_buffers": True}
    assert plan[4].config == {**plan[3].config, "fused_norm": True}
    assert plan[5].config == {**plan[4].config, "skinny_gemm": True}
    assert plan[6].config == {**plan[5].config, "async_scheduling": "on"}
    assert plan[7].config == {**plan[6].config, "pdl": True}
    assert plan[8].config == {**plan[7].config, "fused_projections": True}


def test_a_bad_value_is_pinned_to_its_own_line_not_a_field_with_a_longer_name(write_recipe):
    path = write_recipe("""
        phases:
          - name: a
            overrides:
              offload: "off"
              offload_host_gb: -1
        """)
    assert load_recipe(path).plan()[0].error.startswith(f"{path}:5: offload_host_gb must be positive")



BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
phases: [{name: x, overrides: {lol: *i}}]
"""

# the recipe is loaded in a child with 1 GB of address space and a deadline, so that expanding 9**9 "lol"s
# fails this test instead of taking the machine's memory
_LOAD_IN_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from infertrace.ablate.recipe import RecipeError, load_recipe
try:
    load_recipe(sys.argv[1])
except RecipeError as exc:
    print(exc)
"""


def test_a_billion_laughs_recipe_is_refused_at_its_first_anchor(write_recipe):
    path = write_recipe(BILLION_LAUGHS)
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD_IN_CHILD, str(path)], capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a billion-laughs recipe did not finish within 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (f"{path}:1: YAML anchors and aliases (&name, *name) are not allowed in a "
                                   "recipe; write the values out")


@pytest.mark.parametrize("text, line", [
    ("engine: &base {max_num_seqs: 4}\nphases: [{name: a, overrides: *base}]\n", 1),
    ("base: {max_num_seqs: 4}\nphases:\n  - name: a\n    overrides: {<<: *base, block_size: 16}\n", 4),
])
def test_yaml_anchors_and_aliases_are_refused(write_recipe, text, line):
    path = write_recipe(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == (f"{path}:{line}: YAML anchors and aliases (&name, *name) are not allowed in a "
                               "recipe; write the values out")


def test_unreadable_recipe_files_are_one_line(tmp_path):
    import os

    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 20_000 + "]" * 20_000 + "\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\nphases: [{name: a}]\n")
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    for path, words in ((deep, f"{deep}: not a recipe: nested too deeply"),
                        (latin, f"cannot read recipe {latin}: not UTF-8 text (byte 9)"),
                        (zero, f"cannot read recipe {zero}: not a regular file"),
                        (fifo, f"cannot read recipe {fifo}: not a regular file"),
                        (big, f"cannot read recipe {big}: 1.907 MiB, above the 1 MiB such a file may hold")):
        with pytest.raises(RecipeError) as caught:
            load_recipe(path)
        assert str(caught.value) == words


def test_tuning_rules_are_checked_and_carried_on_like_overrides(write_recipe):
    recipe = load_recipe(write_recipe("""
        phases:
          - name: a
            tuning: {all_reduce_fusion: planes, all_reduce_spread: 4}
          - name: b
            tuning: {all_reduce_fusion: norm}
          - name: c
            reset: true
        """))
    assert [p.tuning for p in recipe.plan()] == [
        {"all_reduce_fusion": "planes", "all_reduce_spread": 4}, {"all_reduce_fusion": "norm", "all_reduce_spread": 4},
        {}]


@pytest.mark.parametrize("tuning, words", [
    ("{all_reduce_fusoin: planes}", "r.yaml:3: unknown tuning rule field 'all_reduce_fusoin' (did you mean "
                                    "'all_reduce_fusion'?)"),
    ("{all_reduce_fusion: fast}", "r.yaml:3: all_reduce_fusion takes planes, norm, off, got 'fast'"),
    ("{all_reduce_push: off}", "all_reduce_push takes on, off, got False; YAML reads off, on, no and yes as "
                               "true/false: quote the word ('off')"),
    ("[planes]", "tuning must be a mapping of rule: value"),
])
def test_a_bad_tuning_rule_is_one_line_naming_the_line(write_recipe, tuning, words):
    path = write_recipe(f"phases:\n  - name: a\n    tuning: {tuning}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert words in str(exc.value)
