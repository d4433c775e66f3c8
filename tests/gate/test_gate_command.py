from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from infertrace.gate.command import gate

VLLM_SAMPLE = Path(__file__).parent / "data" / "vllm_result.json"


def run_gate(*args: object):
    return CliRunner().invoke(gate, [str(arg) for arg in args])


@pytest.fixture
def baseline(make_runs):
    return make_runs("base", "output_throughput", [100.0, 99.0, 101.0])


def test_within_bounds_exits_0_and_prints_the_table(make_runs, make_result):
    current = make_runs("cur", "output_throughput", [99.5, 100.5, 98.0])
    base = make_result("base.json", output_throughput=100.0)
    result = run_gate(*current, "--baseline", base, "--max-drop", "output_throughput=5%",
                      "--max-rise", "p99_ttft_ms=10%")
    assert result.exit_code == 0, result.output
    assert "output_throughput" in result.output and "p99_ttft_ms" in result.output
    assert result.output.count(" ok") >= 2 and "regression" not in result.output.split("\n", 1)[1]


def test_regression_exits_1(make_runs, baseline):
    current = make_runs("cur", "output_throughput", [80.0, 81.0, 79.0])
    result = run_gate(*current, "--baseline", baseline[0], "--max-drop", "output_throughput=5%")
    assert result.exit_code == 1
    assert "regression" in result.output


def test_breach_within_noise_passes_and_says_so(make_runs, baseline, tmp_path):
    current = make_runs("cur", "output_throughput", [93.0, 99.5, 92.0])
    base_file = tmp_path / "base_all.json"
    run_gate(*baseline, "--baseline", base_file, "--update-baseline")
    result = run_gate(*current, "--baseline", base_file, "--max-drop", "output_throughput=5%")
    assert result.exit_code == 0, result.output
    assert "within noise" in result.output


def test_absolute_bounds(make_runs, make_result):
    current = make_runs("cur", "p99_ttft_ms", [430.0, 425.0, 428.0])
    base = make_result("base.json", p99_ttft_ms=400.0)
    assert run_gate(*current, "--baseline", base, "--max-rise", "p99_ttft_ms=+20ms").exit_code == 1
    assert run_gate(*current, "--baseline", base, "--max-rise", "p99_ttft_ms=+0.05s").exit_code == 0
    assert run_gate(*current, "--max", "p99_ttft_ms=500ms", "--min", "output_throughput=100").exit_code == 0
    assert run_gate(*current, "--min", "output_throughput=200").exit_code == 1


def test_summary_appends_markdown(make_runs, baseline, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    current = make_runs("cur", "output_throughput", [80.0, 81.0, 79.0])
    result = run_gate(*current, "--baseline", baseline[0], "--max-drop", "output_throughput=5%",
                      "--summary", summary)
    assert result.exit_code == 1
    text = summary.read_text()
    assert text.startswith("earlier step\n### infertrace gate: regression")
    row = "| `output_throughput` | **regression** | -20.0% | [-22.0%, -18.0%] | ≥ -5% | 100.0 tok/s | 80.00 tok/s |"
    assert row in text
    assert "3 runs against 1 baseline run" in text


def test_update_baseline_writes_all_runs_and_exits_0(make_runs, tmp_path):
    current = make_runs("cur", "output_throughput", [99.0, 100.0, 101.0])
    target = tmp_path / "new" / "baseline.json"
    result = run_gate(*current, "--baseline", target, "--update-baseline", "--max-drop", "output_throughput=5%")
    assert result.exit_code == 0, result.output
    runs = json.loads(target.read_text())["runs"]
    assert [run["output_throughput"] for run in runs] == [99.0, 100.0, 101.0]
    again = run_gate(*current, "--baseline", target, "--max-drop", "output_throughput=5%")
    assert again.exit_code == 0 and "3 runs against 3 baseline runs" in again.output


def test_vllm_results_gate_against_each_other(tmp_path):
    slower = json.loads(VLLM_SAMPLE.read_text()) | {"output_throughput": 1000.0, "commit": "other"}
    path = tmp_path / "slower.json"
    path.write_text(json.dumps(slower))
    assert run_gate(VLLM_SAMPLE, "--baseline", VLLM_SAMPLE, "--max-drop", "output_throughput=5%").exit_code == 0
    assert run_gate(path, "--baseline", VLLM_SAMPLE, "--max-drop", "output_throughput=5%").exit_code == 1


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing file", "no such file"),
        ("bad json", "not valid JSON"),
        ("missing metric", "has no metric 'p99.9_ttft_ms'"),
        ("other workload", "different model or workload (config.input_len: 64"),
        ("other model", "config.model"),
        ("repeats disagree", "different model or workload"),
    ],
)
def test_unusable_input_exits_2(case, message, make_result, tmp_path):
    base = make_result("base.json")
    current = [make_result("cur.json")]
    bound = ["--max-drop", "output_throughput=5%"]
    if case == "missing file":
        current = [tmp_path / "absent.json"]
    elif case == "bad json":
        current[0].write_text("{")
    elif case == "missing metric":
        bound = ["--max-rise", "p99.9_ttft_ms=5%"]
    elif case == "other workload":
        current = [make_result("cur.json", config={"input_len": 256})]
    elif case == "other model":
        current = [make_result("cur.json", config={"model": "qwen3-0.6b"})]
    elif case == "repeats disagree":
        current.append(make_result("cur2.json", config={"concurrency": 16}))
    summary = tmp_path / "summary.md"
    result = run_gate(*current, "--baseline", base, *bound, "--summary", summary)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "unusable input" in summary.read_text()


def test_allow_config_change_compares_anyway(make_result):
    base = make_result("base.json")
    current = make_result("cur.json", config={"input_len": 256})
    result = run_gate(current, "--baseline", base, "--max-drop", "output_throughput=5%", "--allow-config-change")
    assert result.exit_code == 0
    assert "configuration differs: config.input_len" in " ".join(result.output.split())
    ignored = run_gate(current, "--baseline", base, "--max-drop", "output_throughput=5%",
                       "--ignore-config", "input_len")
    assert ignored.exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--max-drop", "output_throughput"],
        ["--min", "output_throughput=5%"],
        [],  # no bounds
        ["--max-drop", "output_throughput=5%", "--no-baseline-given"],
    ],
)
def test_usage_errors_exit_2(args, make_result):
    current = make_result("cur.json")
    args = [a for a in args if a != "--no-baseline-given"]
    assert run_gate(current, *args).exit_code == 2


def test_relative_bound_without_baseline_says_so(make_result):
    result = run_gate(make_result("cur.json"), "--max-drop", "output_throughput=5%")
    assert result.exit_code == 2 and "need --baseline" in result.output


def test_warns_about_a_bound_pointing_the_wrong_way(make_result):
    base = make_result("base.json")
    result = run_gate(make_result("cur.json"), "--baseline", base, "--max-drop", "p99_ttft_ms=5%")
    assert "did you mean --max-rise?" in " ".join(result.output.split())


def test_every_option_has_help():
    ctx = click.Context(gate)
    assert gate.get_short_help_str() and gate.help
    for param in gate.get_params(ctx):
        if isinstance(param, click.Option):
            assert param.help, param.name


def test_warns_when_the_baseline_ran_on_other_hardware(make_result, tmp_path):
    base = make_result("base.json")
    data = json.loads(base.read_text())
    data["provenance"]["gpu"] = "NVIDIA H100 80GB HBM3"
    current = tmp_path / "cur.json"
    current.write_text(json.dumps(data))
    result = run_gate(current, "--baseline", base, "--max-drop", "output_throughput=5%")
    assert result.exit_code == 0
    assert 'the baseline ran on other hardware (gpu: (absent) in' in " ".join(result.output.split())


def _one_error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("content, words", [
    ("[]", "holds no benchmark results"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested more than 64 levels deep"),
    ('{"output_throughput": 1, "config": ' + '{"a": ' * 200 + "1" + "}" * 200 + "}", "nested more than 64 levels"),
])
@pytest.mark.parametrize("role", ["results", "baseline"])
def test_empty_or_deeply_nested_files_exit_2(make_result, tmp_path, content, words, role):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = make_result("good.json")
    current, base = (bad, good) if role == "results" else (good, bad)
    result = run_gate(current, "--baseline", base, "--max-drop", "output_throughput=5%")
    assert result.exit_code == 2
    assert words in _one_error_line(result)


@pytest.mark.parametrize("option", ["--summary", "--baseline"])
def test_an_unwritable_output_exits_2_before_any_work(make_result, tmp_path, option):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = [make_result("cur.json"), option, blocker / "out.md"]
    args += ["--update-baseline"] if option == "--baseline" else ["--min", "output_throughput=1"]
    result = run_gate(*args)
    assert result.exit_code == 2
    assert _one_error_line(result).startswith(f"error: cannot write the {option[2:]} {blocker / 'out.md'}: ")
    # checked first: an unusable result behind an unwritable output still names the output
    result = run_gate(tmp_path / "absent.json", *args[1:])
    assert result.exit_code == 2 and "cannot write" in result.output


def test_summary_into_a_missing_folder_creates_it(make_result, tmp_path):
    summary = tmp_path / "ci" / "step" / "summary.md"
    result = run_gate(make_result("cur.json"), "--min", "output_throughput=1", "--summary", summary)
    assert result.exit_code == 0, result.output
    assert "output_throughput" in summary.read_text()


@pytest.mark.parametrize("resamples", ["99", "1000001", "10000000000"])
def test_resamples_out_of_bounds_exit_2_before_any_work(make_result, resamples):
    result = run_gate(make_result("cur.json"), "--min", "output_throughput=1", "--resamples", resamples)
    assert result.exit_code == 2
    assert "is not in the range 100<=x<=1000000" in " ".join(result.output.split())


def test_a_number_too_long_to_read_is_one_line_naming_the_file(make_result, tmp_path):
    huge = tmp_path / "huge.json"
    huge.write_text(make_result("cur.json").read_text().replace('"output_throughput"',
                                                                  '"output_throughput": ' + "9" * 5000 + ', "x"', 1))
    result = run_gate(huge, "--min", "output_throughput=1")
    assert result.exit_code == 2
    assert _one_error_line(result).startswith(f"error: {huge}: a number too long to read")


def test_a_mistyped_metric_gets_the_closest_one(make_result):
    result = run_gate(make_result("cur.json"), "--min", "output_througput=1")
    assert result.exit_code == 2
    [error] = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert error.endswith("has no metric 'output_througput' (did you mean 'output_throughput'?)")


def test_update_baseline_refuses_a_figure_that_is_not_finite(make_result, tmp_path):
    current = make_result("cur.json", median_itl_ms=float("nan"))
    base = tmp_path / "base.json"
    result = run_gate(current, "--baseline", base, "--update-baseline")
    assert result.exit_code == 2
    assert _one_error_line(result) == f"error: {current}: 'median_itl_ms' is NaN: a baseline records finite figures only"
    assert not base.exists()


def test_update_baseline_writes_through_a_symlink_and_refuses_special_files(make_runs, tmp_path):
    import os

    current = make_runs("cur", "output_throughput", [99.0, 100.0, 101.0])
    real = tmp_path / "store" / "baseline.json"
    real.parent.mkdir()
    real.write_text("{}")
    link = tmp_path / "baseline.json"
    link.symlink_to(real)
    result = run_gate(*current, "--baseline", link, "--update-baseline")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link
    assert json.loads(real.read_text())["kind"] == "infertrace-gate-baseline"

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    result = run_gate(*current, "--baseline", fifo, "--update-baseline")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "not a regular file" in result.output
    assert fifo.exists() and not fifo.is_file()  # not replaced


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_baseline_that_is_a_device_or_a_pipe_is_one_line_and_exit_2(make_runs, tmp_path, special):
    import os

    current = make_runs("cur", "output_throughput", [99.0, 100.0, 101.0])
    base = tmp_path / "base.json"
    if special == "fifo":
        os.mkfifo(base)  # opened for reading, it waited for a writer for ever
    else:
        base.symlink_to(special)  # read until memory ran out
    result = run_gate(*current, "--baseline", base, "--max-drop", "output_throughput=5%")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "not a regular file" in result.output
