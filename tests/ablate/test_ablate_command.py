"""`infertrace ablate` end to end on the tiny model: every shipped recipe, failing phases, profiles, outputs."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.ablate import run as ablate_run
from infertrace.ablate.command import ablate

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = ("attention_batched_vs_looped", "decode_path", "prefix_cache", "chunked_prefill", "cpu_offload",
           "tensor_parallel", "prefill_graphs", "decode_order")


def invoke(*args):
    return CliRunner().invoke(ablate, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_runs_quick_on_the_tiny_model(name, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    res = invoke(RECIPES / f"{name}.yaml", "--quick", "--model", tiny_model_dir, "--json", out)
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["model_dir"] == str(tiny_model_dir)
    assert doc["workload"]["num_prompts"] == 4 and doc["workload"]["concurrency"] == 2
    phases = doc["phases"]
    assert [p["name"] for p in phases] == [p["name"] for p in doc["recipe"]["phases"]]
    for phase, row in zip(phases, doc["waterfall"]):
        assert phase["name"].split()[0] in res.stdout  # names may wrap in an 80-column table
        if phase["status"] == "ok":
            assert phase["result"]["completed"] == 4 and phase["result"]["failed"] == 0
            spread = doc["workload"]["range_ratio"]  # lengths uniform in [L(1-r), L(1+r)]
            assert 4 * 8 * (1 - spread) <= phase["result"]["total_output_tokens"] <= 4 * 8 * (1 + spread)
            assert row["output_throughput"] > 0 and row["median_ttft_ms"] > 0 and row["median_itl_ms"] > 0
        elif phase["status"] == "not applicable":  # a CUDA-only switch, not measured on this CPU
            assert phase["error"].startswith("on cpu: ") and "CUDA GPUs only" in phase["error"]
            assert row["output_throughput"] is None and row["change_vs_previous"] is None
        else:  # on this machine only an offload this build does not have may fail, and it says why
            assert phase["status"] == "failed" and phase["config"].get("offload", "off") != "off"
            assert "offload" in phase["error"] and row["output_throughput"] is None
    failed = any(p["status"] == "failed" for p in phases)
    assert res.exit_code == (1 if failed else 0), res.output


def test_a_failing_phase_is_reported_in_its_row_and_the_others_still_run(write_recipe, tiny_model_dir, tmp_path):
    recipe = write_recipe("""
        name: failures
        workload: {num_prompts: 2, input_len: 8, output_len: 3, concurrency: 2, warmup: 0}
        phases:
          - name: baseline
          - name: typo phase
            overrides:
              atention: looped
          - name: engine refuses
            reset: true
            overrides:
              max_model_len: 100000000
          - name: looped
            reset: true
            overrides:
              attention: looped
        """)
    out = tmp_path / "r.json"
    res = invoke(recipe, "--model", tiny_model_dir, "--json", out)
    assert res.exit_code == 1
    doc = json.loads(out.read_text())
    status = {p["name"]: p["status"] for p in doc["phases"]}
    assert status == {"baseline": "ok", "typo phase": "failed", "engine refuses": "failed", "looped": "ok"}
    errors = {p["name"]: p["error"] for p in doc["phases"]}
    assert errors["typo phase"] == f"{recipe}:7: unknown engine config field 'atention' (did you mean 'attention'?)"
    assert "max_model_len=100000000" in errors["engine refuses"]
    assert doc["waterfall"][3]["change_vs_previous"] == pytest.approx(doc["waterfall"][3]["change_vs_first"])
    flat = " ".join(res.stdout.split())
    assert "failed: " in flat and "unknown engine config field" in flat
    assert "will fail" in res.stderr and "phase 2 'typo phase'" in res.stderr


def test_results_are_kept_when_a_later_phase_crashes(write_recipe, tiny_model_dir, tmp_path, monkeypatch):
    recipe = write_recipe("""
        workload: {num_prompts: 2, input_len: 8, output_len: 3, concurrency: 2, warmup: 0}
        phases: [{name: a}, {name: b}, {name: c}]
        """)
    real = ablate_run.run_phase

    async def crash_on_b(phase, *args, **kwargs):
        if phase.name == "b":
            raise RuntimeError("segfault-like surprise")
        return await real(phase, *args, **kwargs)

    monkeypatch.setattr(ablate_run, "run_phase", crash_on_b)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = invoke(recipe, "--model", tiny_model_dir, "--json", out, "--plot", png)
    assert res.exit_code == 1
    assert "the run stopped: RuntimeError: segfault-like surprise" in res.stderr
    doc = json.loads(out.read_text())
    assert [p["name"] for p in doc["phases"]] == ["a"] and not doc["complete"]
    assert doc["phases"][0]["status"] == "ok"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_counts_operators_per_decode_step_on_cpu(tiny_model_dir, tmp_path):
    out, traces = tmp_path / "r.json", tmp_path / "traces"
    res = invoke(RECIPES / "attention_batched_vs_looped.yaml", "--quick", "--profile", "--model", tiny_model_dir,
                 "--json", out, "--trace-dir", traces)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    looped, batched = (p["profile"] for p in doc["phases"])
    assert looped["decode_steps"] >= 1 and batched["decode_steps"] >= 1
    assert not looped["has_gpu"] and looped["kernels_per_decode_step"] is None
    # attention per request adds operators for every request in the batch, in every layer
    assert looped["cpu_ops_per_decode_step"] > batched["cpu_ops_per_decode_step"]
    assert [p.name for p in sorted(traces.iterdir())] == ["01-looped-attention", "02-batched-attention"]
    assert list((traces / "01-looped-attention").glob("*.pt.trace.json.gz"))
    assert "ops" in res.stdout and "CPU trace" in res.stderr


@pytest.mark.parametrize("args, words", [
    (["--check"], "{recipe}:3: unknown workload field 'num_promts' (did you mean 'num_prompts'?)"),
    (["--quick"], "{recipe}:3: unknown workload field 'num_promts'"),
])
def test_an_unusable_recipe_is_one_line_and_exit_2(write_recipe, args, words):
    recipe = write_recipe("phases: [{name: a}]\nworkload:\n  num_promts: 3\n")
    res = invoke(recipe, *args)
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and words.format(recipe=recipe) in " ".join(res.stderr.split())


def test_check_names_a_bad_phase_override(write_recipe):
    recipe = write_recipe("phases:\n  - name: a\n    overrides: {block_size: 0}\n")
    res = invoke(recipe, "--check")
    assert res.exit_code == 2 and "block_size must be at least 1" in res.stderr
    ok = invoke(RECIPES / "prefix_cache.yaml", "--check")
    assert ok.exit_code == 0 and "usable, 2 phase(s)" in ok.stdout


def test_model_and_preset_options(write_recipe, tmp_path):
    recipe = write_recipe("phases: [{name: a}]\n")
    res = invoke(recipe, "--model", tmp_path, "--preset", "tiny")
    assert res.exit_code == 2 and "not both" in res.stderr
    res = invoke(recipe, "--model", tmp_path / "missing")
    assert res.exit_code == 2 and "is not a model directory" in res.stderr
    res = invoke(recipe, "--preset", "qwen3-4b", "--concurrency", "8", "--check")
    assert res.exit_code == 0


def test_an_unwritable_output_is_refused_before_any_phase(write_recipe, tmp_path):
    recipe = write_recipe("phases: [{name: a}]\n")
    (tmp_path / "file").write_text("")
    res = invoke(recipe, "--json", tmp_path / "file" / "r.json")
    assert res.exit_code == 2 and "cannot write" in res.stderr and "phase" not in res.stderr


def test_check_finds_a_missing_model_directory(write_recipe, tmp_path):
    recipe = write_recipe("model: no_such_model\nphases: [{name: a}]\n")
    res = invoke(recipe, "--check")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.strip() == f"error: model {tmp_path / 'no_such_model'} is not a model directory (it does not " \
                                 "exist)"
    (tmp_path / "empty_model").mkdir()
    res = invoke(write_recipe("phases: [{name: a}]\n"), "--model", tmp_path / "empty_model", "--check")
    assert res.exit_code == 2 and "is not a model directory (no config.json)" in res.stderr


@pytest.mark.parametrize("dataset, make, words", [
    ("jsonl", lambda p: None, "dataset_path {p} does not exist"),
    ("jsonl", lambda p: p.mkdir(), "dataset_path {p} is not a regular file"),
    ("jsonl", lambda p: p.write_text("not json\n"), "jsonl dataset: {p}:1: not JSON"),
    ("jsonl", lambda p: p.write_text('{"text": "no prompt field"}\n'), "each line needs a string field 'prompt'"),
    ("sharegpt", lambda p: p.write_text('{"a": 1}'), "a ShareGPT file holds a JSON list of conversations"),
    ("sharegpt", lambda p: p.write_text("[{]"), "cannot read ShareGPT file"),
])
def test_check_reads_the_dataset(write_recipe, tmp_path, dataset, make, words):
    data = tmp_path / "data.file"
    make(data)
    recipe = write_recipe(f"phases: [{{name: a}}]\nworkload:\n  dataset: {dataset}\n  dataset_path: data.file\n")
    res = invoke(recipe, "--check")
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {recipe}:4: ") and words.format(p=data) in lines[0]


def test_check_refuses_a_device_as_dataset(write_recipe):
    # /dev/zero never ends: reading it as a dataset would take all memory
    recipe = write_recipe("phases: [{name: a}]\nworkload:\n  dataset: jsonl\n  dataset_path: /dev/zero\n")
    res = invoke(recipe, "--check")
    assert res.exit_code == 2 and "dataset_path /dev/zero is not a regular file" in res.stderr


def test_check_accepts_a_readable_dataset(write_recipe, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "world", "max_tokens": 3}\n')
    recipe = write_recipe("phases: [{name: a}]\nworkload:\n  dataset: jsonl\n  dataset_path: prompts.jsonl\n")
    res = invoke(recipe, "--check")
    assert res.exit_code == 0 and "usable, 1 phase(s)" in res.stdout


def test_tensor_parallel_profile_writes_one_trace_per_rank(tiny_model_dir, tmp_path):
    """Each rank records its own trace, tagged as a rank, and analyze reads them as two ranks."""
    import gzip

    out = tmp_path / "r.json"
    res = invoke(RECIPES / "tensor_parallel.yaml", "--quick", "--model", tiny_model_dir, "--profile",
                 "--trace-dir", tmp_path / "traces", "--json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    two = next(p for p in doc["phases"] if p["name"] == "two ranks")
    traces = sorted(Path(two["trace_dir"]).glob("*.pt.trace.json.gz"))
    assert [t.name.split(".")[-5] for t in traces] == ["rank0", "rank1"]
    for rank, trace in enumerate(traces):
        with gzip.open(trace, "rt") as f:
            info = json.load(f)["distributedInfo"]
        assert info["rank"] == rank and info["world_size"] == 2
    manifest = json.loads(next(Path(two["trace_dir"]).glob("*.manifest.json")).read_text())
    assert manifest["traces"] == [t.name for t in traces]


def test_a_deeply_nested_recipe_is_one_line_and_exit_2(tmp_path):
    recipe = tmp_path / "deep.yaml"
    recipe.write_text("phases: " + "[" * 20_000 + "]" * 20_000 + "\n")
    for args in ((), ("--check",)):
        res = invoke(recipe, *args)
        assert res.exit_code == 2 and res.stderr.strip() == f"error: {recipe}: not a recipe: nested too deeply"


TRACE_RECIPE = """\
phases: [{{name: a}}]
workload:
  dataset: trace
  dataset_path: {path}
  num_prompts: 3
{scales}"""


def test_a_trace_workload_is_checked_and_replayed(write_recipe, tiny_model_dir, tmp_path):
    """`dataset: trace` passed --check and then crashed every run where the table's label was made."""
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "0,ChatGPT,40,4,44,Conversation log\nnan,ChatGPT,30,4,34,Conversation log\n")
    res = invoke(write_recipe(TRACE_RECIPE.format(path=burst, scales="")), "--check")
    assert res.exit_code == 2 and f"{burst}:3: Timestamp must be a finite number" in res.stderr
    burst.write_text(burst.read_text().replace("nan,", "500,"))
    recipe = write_recipe(TRACE_RECIPE.format(path=burst, scales="  time_scale: 0.001\n  token_scale: 0.5\n"))
    assert invoke(recipe, "--check").exit_code == 0
    res = invoke(recipe, "--model", tiny_model_dir, "--json", tmp_path / "a.json")
    assert res.exit_code == 0, res.output
    label = "trace replay of burst.csv, its first 3 requests at most (time x0.001, tokens x0.5)"
    assert label in " ".join(res.stdout.split())
