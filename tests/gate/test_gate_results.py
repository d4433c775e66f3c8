from __future__ import annotations

import json
from pathlib import Path

import pytest

from infertrace.gate.results import ResultError, config_differences, load_runs, write_baseline

VLLM_SAMPLE = Path(__file__).parent / "data" / "vllm_result.json"


def test_infertrace_result_identity_is_its_config_without_output_paths(make_result):
    (run,) = load_runs(make_result("r.json"))
    assert run.flavour == "infertrace"
    assert run.metric("output_throughput") == 128.0
    identity = run.identity()
    assert identity["config.input_len"] == 64 and identity["config.concurrency"] == 4
    assert "config.result_json" not in identity
    assert not any(key.startswith("provenance") for key in identity)
    other_output = load_runs(make_result("r2.json", config={"result_json": "elsewhere/run-2.json", "plot": "p.png"}))
    assert config_differences([run], other_output) == []


def test_local_model_paths_compare_by_name_hub_ids_in_full(make_result):
    here = load_runs(make_result("a.json", config={"model": "/home/dev/src/repo/models/tiny"}))
    there = load_runs(make_result("b.json", config={"model": "/home/runner/work/repo/models/tiny/"}))
    other = load_runs(make_result("c.json", config={"model": "/home/runner/work/repo/models/small"}))
    assert config_differences(here, there) == []
    assert config_differences(here, other) == [
        f'config.model: "tiny" in {here[0].source}, "small" in {other[0].source}'
    ]
    hub_a = load_runs(make_result("d.json", config={"model": "Qwen/Qwen3-8B"}))
    hub_b = load_runs(make_result("e.json", config={"model": "other/Qwen3-8B"}))
    assert len(config_differences(hub_a, hub_b)) == 1


def test_nested_settings_flatten_and_can_be_ignored_by_prefix(make_result):
    a = load_runs(make_result("a.json"))
    b = load_runs(make_result("b.json", config={"engine_overrides": {"attention": "looped"}}))
    (line,) = config_differences(a, b)
    assert line.startswith("config.engine_overrides.attention: (absent) in")
    assert config_differences(a, b, ignore=("engine_overrides",)) == []


def test_cpu_time_per_output_token_is_derived_when_absent(make_result):
    (run,) = load_runs(make_result("r.json"))
    assert run.metric("cpu_ms_per_output_token") == pytest.approx(0.92 * 4.0 * 1000 / 512)
    (given,) = load_runs(make_result("g.json", cpu_ms_per_output_token=3.0))
    assert given.metric("cpu_ms_per_output_token") == 3.0
    (vllm,) = load_runs(VLLM_SAMPLE)
    with pytest.raises(ResultError, match="has no metric 'process_cpu_percent'"):
        vllm.metric("cpu_ms_per_output_token")
    (empty,) = load_runs(make_result("z.json", total_output_tokens=0))
    with pytest.raises(ResultError, match="a divisor is 0"):
        empty.metric("cpu_ms_per_output_token")


def test_vllm_result_identity_keeps_workload_and_drops_metadata():
    (run,) = load_runs(VLLM_SAMPLE)
    assert run.flavour == "vllm"
    assert run.metric("p99_ttft_ms") == 161.7
    assert run.identity() == {
        "flavour": "vllm", "endpoint_type": "vllm", "backend": "vllm", "model_id": "Qwen/Qwen3-8B",
        "tokenizer_id": "Qwen/Qwen3-8B", "num_prompts": 200, "request_rate": "inf", "burstiness": 1.0,
        "max_concurrency": 16, "random_input_len": 1024, "random_output_len": 128,
    }


def test_json_lines_hold_several_runs(tmp_path, make_result):
    lines = [make_result(f"{i}.json", output_throughput=100.0 + i).read_text() for i in range(3)]
    path = tmp_path / "appended.json"
    path.write_text("\n".join(json.dumps(json.loads(line)) for line in lines) + "\n")
    runs = load_runs(path)
    assert [run.metric("output_throughput") for run in runs] == [100.0, 101.0, 102.0]
    assert runs[1].source == f"{path} (run 2)"


def test_baseline_round_trip_drops_per_request_lists(tmp_path):
    runs = load_runs(VLLM_SAMPLE) * 2
    write_baseline(runs, tmp_path / "base" / "gate.json")
    document = json.loads((tmp_path / "base" / "gate.json").read_text())
    assert document["kind"] == "infertrace-gate-baseline" and len(document["runs"]) == 2
    assert "ttfts" not in document["runs"][0] and "model_id" in document["runs"][0]
    again = load_runs(tmp_path / "base" / "gate.json")
    assert [run.metric("output_throughput") for run in again] == [1196.3, 1196.3]
    assert again[0].identity() == runs[0].identity()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"a": 1}\n{oops\n', "line 2"),
        ('{"hello": "world"}', "is not a benchmark result"),
        ('{"kind": "infertrace-gate-baseline", "runs": []}', "baseline holds no runs"),
        ("[1, 2]", "is not a benchmark result"),
        ("5", "is not a benchmark result"),
        ('{"sweep": {"param": "concurrency"}, "runs": [{}, {}]}', "is a sweep \\(2 points\\)"),
    ],
)
def test_unusable_files_say_why(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ResultError, match=message):
        load_runs(path)


def test_interrupted_run_is_unusable(make_result):
    with pytest.raises(ResultError, match="interrupted run"):
        load_runs(make_result("r.json", interrupted=True))


def test_missing_file(tmp_path):
    with pytest.raises(ResultError, match="no such file"):
        load_runs(tmp_path / "absent.json")


def test_metric_that_is_not_a_number(make_result):
    (run,) = load_runs(make_result("r.json", goodput=None))
    with pytest.raises(ResultError, match="'goodput' is null, not a finite number"):
        run.metric("goodput")


def test_config_differences_name_the_setting(make_result):
    a = load_runs(make_result("a.json"))
    b = load_runs(make_result("b.json", config={"input_len": 256}))
    (line,) = config_differences(a, b)
    assert line.startswith("config.input_len: 64 in ") and "256 in" in line
    assert config_differences(a, b, ignore=("input_len",)) == []
    assert config_differences(a, b, ignore=("config.input_len",)) == []
    assert config_differences(a, load_runs(make_result("c.json", output_throughput=1.0))) == []


def test_flavours_do_not_compare(make_result):
    vllm = load_runs(VLLM_SAMPLE)
    lines = config_differences(load_runs(make_result("a.json")), vllm)
    assert any(line.startswith('flavour: "infertrace"') for line in lines)


def test_a_setting_added_since_the_baseline_compares_at_its_default(make_result):
    """A baseline written before a bench setting existed ran as that setting's default does."""
    older = load_runs(make_result("old.json"))  # the sample result predates prefix_len (default 256)
    assert "prefix_len" not in older[0].data["config"]
    assert config_differences(older, load_runs(make_result("same.json", config={"prefix_len": 256}))) == []
    (line,) = config_differences(older, load_runs(make_result("other.json", config={"prefix_len": 512})))
    assert line.startswith("config.prefix_len: (absent) in ") and "512 in" in line


def test_cpu_per_token_of_a_base_url_run_is_refused_as_the_load_generators(make_result):
    from infertrace.gate.results import ResultError, load_runs

    embedded = load_runs(make_result("embedded.json"))[0]
    assert embedded.metric("cpu_ms_per_output_token") > 0  # the engine ran in the benchmark process
    remote = load_runs(make_result("remote.json", config={"base_url": "http://127.0.0.1:8000"}))[0]
    with pytest.raises(ResultError, match="load generator's CPU, not the server's"):
        remote.metric("cpu_ms_per_output_token")
    assert remote.metric("output_throughput") > 0


@pytest.mark.parametrize("kind", ["fifo", "dir", "dev_zero"])
def test_a_result_that_is_not_a_regular_file_is_refused_not_read(tmp_path, kind):
    import os

    from infertrace.gate.results import ResultError, load_runs

    path = tmp_path / "base.json"
    if kind == "fifo":
        os.mkfifo(path)  # opened blocking, it waited for a writer for ever
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # read until memory ran out
    with pytest.raises(ResultError, match="not a regular file"):
        load_runs(path)
