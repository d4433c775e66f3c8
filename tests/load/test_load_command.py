"""`infertrace bench` end to end against the stand-in server on loopback."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from infertrace.load.command import bench

VLLM_KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", "request_goodput", "goodput"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p90", "p95", "p99")]


# What `vllm bench serve --save-result` writes at the top level without --save-detailed, read from
# vllm/benchmarks/serve.py of vLLM 0.33.0 (main(): date ... max_concurrency; benchmark(): the `result` dict and
# process_one_metric's mean_/median_/std_/p99_ keys at the default --metric-percentiles 99), with the JSON types
# it writes. Left out: `label` and --metadata (free text), `rtfx` (audio), the per-request lists it deletes.
NUMBER = (int, float)
VLLM_RESULT_TYPES = {
    "date": str, "endpoint_type": str, "backend": str, "model_id": str, "tokenizer_id": str, "num_prompts": int,
    "request_rate": (float, int, str), "burstiness": NUMBER, "max_concurrency": (int, type(None)),
    "duration": NUMBER, "completed": int, "failed": int, "total_input_tokens": int, "total_output_tokens": int,
    "request_throughput": NUMBER, "request_goodput": (float, type(None)), "output_throughput": NUMBER,
    "total_token_throughput": NUMBER, "max_output_tokens_per_s": NUMBER, "max_concurrent_requests": int,
    **{f"{stat}_{name}_ms": NUMBER for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std",
                                                                                          "p99")},
}


def invoke(*args):
    return CliRunner().invoke(bench, [str(a) for a in args], catch_exceptions=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_result_json_and_requests_jsonl(standin, prompts_jsonl, tmp_path):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 6, "--concurrency", 2, "--warmup", 1, "--slo", "ttft_ms=10000,e2el_ms=10000",
                 "--result-json", out, "--requests-jsonl", reqs)
    assert res.exit_code == 0, res.output
    assert "successful requests" in res.stdout and "output token throughput" in res.stdout
    doc = json.loads(out.read_text())
    assert all(k in doc for k in VLLM_KEYS)
    assert (doc["completed"], doc["failed"]) == (6, 0)
    # max_tokens 4, 5, 6, 4, 5, 6; the stand-in generates exactly that and says so in usage
    assert doc["total_output_tokens"] == 30 == standin.usage_completion_tokens - 4  # minus the warmup's 4
    assert doc["total_input_tokens"] == 6 * 5
    assert doc["output_token_sources"] == {"usage": 6}
    assert doc["goodput"] == doc["request_throughput"] and doc["good_requests"] == 6
    assert doc["schema_version"] == 1 and doc["config"]["concurrency"] == 2 and doc["config"]["seed"] == 0
    assert doc["provenance"]["target"]["model"] == "stand-in"
    assert doc["provenance"]["target"]["server_info"]["body"]["engine"] == "stand-in"
    assert doc["schedule_lag_p99_ms"] is not None and doc["client_cpu_percent"] is not None
    assert doc["mean_itl_per_token_ms"] is not None  # continuous usage gives chunk token counts
    lines = [json.loads(line) for line in reqs.read_text().splitlines()]
    assert [line["phase"] for line in lines].count("warmup") == 1 and len(lines) == 7
    measured = [line for line in lines if line["phase"] == "measured"]
    assert sorted(line["output_tokens"] for line in measured) == [4, 4, 5, 5, 6, 6]
    assert all(len(line["itl_ms"]) == line["output_tokens"] - 1 for line in measured)


def test_unreachable_url_is_one_line_and_exit_2_before_any_load(tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", f"http://127.0.0.1:{free_port()}", "--result-json", out)
    assert res.exit_code == 2
    assert "cannot reach http://127.0.0.1:" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_http_500s_and_dropped_streams_are_counted_failures(standin, prompts_jsonl, tmp_path):
    standin.mode = lambda i: {1: "500", 3: "close"}.get(i, "ok")  # request 0 is the warmup
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = invoke("--base-url", standin.url, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path",
                 prompts_jsonl, "--num-prompts", 6, "--concurrency", 1, "--warmup", 1,
                 "--result-json", out, "--requests-jsonl", reqs)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (4, 2)
    assert doc["failures"] == {"HTTP 500": 1, "disconnect": 1}
    errors = sorted(line["error"] for line in map(json.loads, reqs.read_text().splitlines()) if line["error"])
    assert errors[0] == "HTTP 500: overloaded"  # the server's own message, not its JSON
    assert errors[1].startswith("disconnect: ")
    assert doc["failure_examples"]["HTTP 500"] == "overloaded"
    assert re.search(r"HTTP 500 \(first\)\s*│\s*overloaded", res.output)  # the table says what the server said


def test_profile_window_lies_outside_the_measured_requests(standin, prompts_jsonl, tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 4, "--concurrency", 2, "--warmup", 2, "--profile-steps", 5, "--result-json", out)
    assert res.exit_code == 0, res.output
    (start, t_start, body), (stop, t_stop, _) = standin.profile_calls
    assert (start, stop, body["num_steps"]) == ("start", "stop", 5)
    assert body["profile_id"].startswith("infertrace-")  # every capture is named
    warmup, measured = standin.streams[:2], standin.streams[2:]
    assert max(end for _, end in warmup) < t_start < min(arrived for arrived, _ in measured)
    assert t_stop > max(end for _, end in measured)
    doc = json.loads(out.read_text())
    assert doc["profile"]["trace_files"] == ["/p/a.pt.trace.json.gz"]
    assert doc["profile"]["num_steps"] == 5


def test_sweep_prints_one_table_and_writes_a_plot(standin, prompts_jsonl, tmp_path):
    out = tmp_path / "sweep.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 4, "--warmup", 0, "--sweep", "concurrency=1,2", "--result-json", out)
    assert res.exit_code == 0, res.output
    assert "sweep over concurrency" in res.stdout
    doc = json.loads(out.read_text())
    assert [run["max_concurrency"] for run in doc["runs"]] == [1, 2]
    assert all(run["completed"] == 4 for run in doc["runs"])
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_options_are_one_line_usage_errors():
    res = invoke("--range-ratio", "1.5")
    assert res.exit_code == 2 and "range_ratio must be in [0, 1)" in res.stderr
    res = invoke("--slo", "ttft=3")
    assert res.exit_code == 2 and "unknown SLO 'ttft'" in res.stderr
    res = invoke("--slo", "tpot_ms=inf")  # refused up front, not after the run when the result is written
    assert res.exit_code == 2 and "SLO tpot_ms must be a positive number" in res.stderr
    res = invoke("--sweep", "batch=1,2")
    assert res.exit_code == 2 and "expected concurrency=N" in res.output
    res = invoke("--profile")
    assert res.exit_code == 2 and "needs --base-url" in res.stderr


def test_ctrl_c_saves_partial_results_and_prints_the_summary(standin, prompts_jsonl, tmp_path):
    standin.token_delay = 0.05
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-c", "from infertrace.load.command import bench; bench()",
           "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl),
           "--output-len", "40", "--num-prompts", "50", "--concurrency", "2", "--warmup", "0",
           "--result-json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "120"})
    deadline = time.time() + 30
    while len(standin.streams) < 2 and time.time() < deadline:  # two requests finished: mid-run
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stdout and "successful requests" in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True
    assert doc["completed"] >= 2 and doc["failures"] == {"interrupted": 2}


def test_profile_seconds_bounds_the_sending_window(standin, prompts_jsonl, tmp_path):
    standin.token_delay = 0.02
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 200, "--concurrency", 2, "--warmup", 0, "--profile-seconds", 0.5,
                 "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert 2 <= doc["completed"] < 30 and doc["failed"] == 0  # ~0.1 s per request, two at a time, for 0.5 s
    (_, t_start, body), (_, t_stop, _) = standin.profile_calls
    assert list(body) == ["profile_id"]  # a named capture, no step limit
    assert t_start < min(a for a, _ in standin.streams) and t_stop > max(e for _, e in standin.streams)


def test_open_loop_follows_the_seeded_arrival_schedule(standin, prompts_jsonl, tmp_path):
    from infertrace.load.workloads.dataset import seeded_rng
    from infertrace.load.workloads.schedule import arrival_offsets

    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 8, "--request-rate", 20, "--burstiness", 0.5, "--seed", 3, "--warmup", 0,
                 "--result-json", out, "--requests-jsonl", reqs)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert (doc["request_rate"], doc["burstiness"], doc["max_concurrency"], doc["completed"]) == (20.0, 0.5, None, 8)
    lines = sorted(map(json.loads, reqs.read_text().splitlines()), key=lambda line: line["index"])
    scheduled = [line["scheduled_s"] - lines[0]["scheduled_s"] for line in lines]
    expected = arrival_offsets(20.0, 0.5, seeded_rng(3, "arrivals", 0), count=8)
    assert scheduled == [pytest.approx(e, abs=1e-9) for e in expected]
    assert all(line["schedule_lag_ms"] < 50 for line in lines)


@pytest.mark.parametrize("args, message", [
    (["--duration", "nan"], "duration must be a positive finite number of seconds, got nan"),
    (["--duration", "inf"], "duration must be a positive finite number of seconds, got inf"),
    (["--request-rate", "1e-300"], "request_rate must be at least 0.000277778 (one request an hour) or inf"),
    (["--request-rate", "nan"], "request_rate must be at least"),
    (["--request-timeout", "nan"], "request_timeout must be a positive finite number of seconds, got nan"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["--profile-seconds", "inf", "--base-url", "http://x"], "profile_seconds must be a positive finite number"),
    (["--sweep", "request-rate=1,nan"], "request_rate must be at least"),
    (["--extra-body", '{"stream": false}'], "--extra-body may not set 'stream': bench always streams"),
    (["--extra-body", '{"stream_options": {}}'], "--extra-body may not set 'stream_options'"),
    (["--extra-body", '{"max_tokens": 9}'], "--extra-body may not set 'max_tokens': use --output-len"),
])
def test_non_finite_and_out_of_range_flags_are_refused_before_any_request(args, message):
    res = invoke(*args)
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_request_rate_inf_keeps_meaning_all_at_once(standin, prompts_jsonl, tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 3, "--request-rate", "inf", "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["request_rate"] == "inf"


@pytest.mark.parametrize("flag", ["--result-json", "--requests-jsonl", "--plot"])
def test_an_unwritable_output_is_one_line_and_exit_2_before_any_request(standin, prompts_jsonl, tmp_path, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    extra = ["--sweep", "concurrency=1"] if flag == "--plot" else []
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--warmup", 0,
                 flag, blocker / "out", *extra)
    assert res.exit_code == 2
    assert f"cannot write {flag} {blocker / 'out'}: Not a directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert standin.count == 0  # checked before the first request
    res = invoke("--base-url", standin.url, "--result-json", tmp_path)
    assert res.exit_code == 2 and "is a directory" in res.stderr and standin.count == 0


def test_a_run_in_which_every_request_failed_exits_1(standin, prompts_jsonl, tmp_path):
    standin.mode = lambda i: "500"
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 3, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 1
    assert "every measured request failed" in res.stderr
    assert json.loads(out.read_text())["failed"] == 3  # the result is still saved


def test_a_nan_usage_from_the_server_is_a_counted_failure_and_the_run_is_saved(standin, prompts_jsonl, tmp_path):
    standin.mode = lambda i: "nan-usage" if i == 1 else "ok"
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 3, "--concurrency", 1, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"], doc["failures"]) == (2, 1, {"malformed stream": 1})


def test_api_key_and_headers_go_on_every_call_and_stay_out_of_the_result(standin, prompts_jsonl, tmp_path,
                                                                          monkeypatch):
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts",
                 2, "--warmup", 1, "--api-key", "sk-secret", "--header", "X-Team: infra", "--profile",
                 "--result-json", out)
    assert res.exit_code == 0, res.output
    paths = {path for path, _, _ in standin.calls}
    assert {"/v1/models", "/server_info", "/v1/completions", "/start_profile", "/stop_profile"} <= paths
    assert all(auth == "Bearer sk-secret" and team == "infra" for _, auth, team in standin.calls)
    text = out.read_text()
    assert "sk-secret" not in text and "infra" not in text
    doc = json.loads(text)
    assert doc["provenance"]["target"]["headers"] == {"Authorization": "<redacted>", "X-Team": "<redacted>"}
    assert "headers" not in doc["config"]  # how the server was reached does not define the workload

    standin.calls.clear()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts",
                 1, "--warmup", 0)
    assert res.exit_code == 0, res.output
    assert standin.calls and all(auth == "Bearer sk-env" for _, auth, _ in standin.calls)
    res = invoke("--header", "no-colon")
    assert res.exit_code == 2 and "is not KEY:VALUE" in res.output


def test_token_count_warnings_are_kept_apart_from_headroom_warnings(standin, prompts_jsonl, tmp_path):
    # no usage from the server and no tokenizer: output tokens are counted one per text event, a token-count
    # matter, not a sign that the client was short of headroom
    standin.no_usage = True
    standin.token_delay = 0.005  # one event a read: a stream written in one burst is read coalesced, a warning
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 3, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["headroom_warnings"] == []
    assert len(doc["token_count_warnings"]) == 1 and "one per text event" in doc["token_count_warnings"][0]


def test_the_table_says_where_output_tokens_came_from(standin, prompts_jsonl):
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 4, "--warmup", 0)
    assert res.exit_code == 0, res.output
    assert "from usage in 4 of 4 requests" in " ".join(res.stdout.split())


def test_the_result_carries_every_key_vllm_bench_serve_writes_with_its_type(standin, prompts_jsonl, tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path",
                 prompts_jsonl, "--num-prompts", 6, "--concurrency", 3, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    missing = sorted(set(VLLM_RESULT_TYPES) - set(doc))
    assert not missing
    wrong = {k: type(doc[k]).__name__ for k, kinds in VLLM_RESULT_TYPES.items() if not isinstance(doc[k], kinds)}
    assert not wrong
    assert doc["request_rate"] == "inf" and doc["max_concurrency"] == 3 and doc["burstiness"] == 1.0
    assert (doc["backend"], doc["endpoint_type"], doc["model_id"], doc["num_prompts"]) == (
        "openai-chat", "openai-chat", "stand-in", 6)
    assert re.fullmatch(r"\d{8}-\d{6}", doc["date"])
    # vLLM's definitions over one-second buckets: the whole run fits in the first, so every request was active
    # in it and every output event (one token each here) fell in it
    assert doc["max_concurrent_requests"] == 6
    assert doc["max_output_tokens_per_s"] == doc["total_output_tokens"]


@pytest.mark.slow
def test_a_random_weight_model_gets_one_token_count_warning_with_its_cause(served_tiny, tiny_model_dir, tmp_path):
    """`infertrace serve` on random weights: nearly every response's ids re-encode to other ids. A sweep of two
    points says so once, naming the cause (the prompts show the tokenizer is the server's), not once per point."""
    out = tmp_path / "r.json"
    res = invoke("--base-url", served_tiny, "--tokenizer", tiny_model_dir, "--input-len", 12, "--output-len", 8,
                 "--ignore-eos", "--num-prompts", 6, "--warmup", 0, "--sweep", "concurrency=2,3",
                 "--result-json", out, "--plot", tmp_path / "s.png")
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    token_lines = [x for x in lines if "output tokens" in x or "token disagreement" in x]
    assert len(token_lines) == 1, lines
    assert "do not round-trip" in token_lines[0] and "all 12 prompts counted alike" in token_lines[0]
    runs = json.loads(out.read_text())["runs"]
    assert all(r["output_token_disagreements"] > 0 and r["input_token_mismatches"] == 0 for r in runs)


def test_progress_is_printed_as_plain_lines_when_stderr_is_not_a_terminal(standin, prompts_jsonl):
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 4, "--warmup", 1, "--concurrency", 2)
    assert res.exit_code == 0, res.output
    assert "warmup: 1 request\n" in res.output and "warmup: 1/1 done, 0 failed" in res.output
    assert "measure: 4 requests" in res.output and "measure: 4/4 done, 0 failed" in res.output


def test_a_model_the_server_does_not_serve_is_one_line_before_any_request(standin, prompts_jsonl):
    res = invoke("--base-url", standin.url, "--model", "llama", "--dataset", "jsonl", "--dataset-path",
                 prompts_jsonl, "--num-prompts", 2)
    assert res.exit_code == 2 and "model 'llama' is not served at" in res.output and "'stand-in'" in res.output
    assert standin.count == 0


def test_a_url_without_a_scheme_is_one_line_naming_the_fix():
    res = invoke("--base-url", "localhost:8000", "--num-prompts", 2)
    assert res.exit_code == 2
    assert "--base-url 'localhost:8000' needs http:// or https://; did you mean http://localhost:8000?" in res.output
    assert "cannot reach" not in res.output and "Traceback" not in res.output


def test_reset_prefix_cache_on_a_server_without_the_route_stops_before_any_request(standin, prompts_jsonl):
    res = invoke("--url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 2,
                 "--reset-prefix-cache")
    assert res.exit_code == 2 and "reset no prefix cache: /reset_prefix_cache answered 404" in res.output
    assert standin.count == 0


def test_events_written_in_one_burst_are_reported_as_coalesced(standin, prompts_jsonl, tmp_path):
    """The stand-in writes a whole response in one call: the client reads its events together, and
    the ITL it shows is the client's read spacing; that is said, not left as ITL p50 0.0 ms."""
    standin.burst = True
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl,
                 "--num-prompts", 6, "--warmup", 0, "--output-len", 16, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    [warning] = [w for w in doc["headroom_warnings"] if "coalesced" in w]
    assert "inter-token gaps were 0 ms" in warning and "coalesced" in res.output


def test_the_salt_is_counted_as_cached_only_in_whole_blocks(standin, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    res = invoke("--base-url", standin.url, "--tokenizer", tiny_model_dir, "--input-len", 24, "--output-len", 2,
                 "--num-prompts", 4, "--warmup", 0, "--prompt-salt", "random", "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    salt = doc["prompt_salt_tokens"]
    assert 0 < salt < 16 and doc["prompt_salt_cached_tokens"] == 0  # "run " and 12 hex digits: under a block


def test_a_missing_tokenizer_folder_is_said_so(standin, tmp_path):
    res = invoke("--base-url", standin.url, "--tokenizer", tmp_path / "no-such-model", "--num-prompts", 1)
    assert res.exit_code == 2
    assert "no-such-model: no such folder" in res.stderr and "Repo id" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_https_against_plain_http_says_to_try_http(standin):
    url = standin.url.replace("http://", "https://")
    res = invoke("--base-url", url, "--num-prompts", 1)
    assert res.exit_code == 2
    assert f"the server speaks plain HTTP, not HTTPS: try --base-url {standin.url}" in res.stderr
    assert "WRONG_VERSION_NUMBER" not in res.stderr


def test_help_gives_examples_that_parse_and_the_exit_codes():
    import shlex

    from infertrace.load.options import bench_config

    res = invoke("--help")
    assert res.exit_code == 0
    assert "a preset (tiny, qwen3-0.6b" in " ".join(res.stdout.split())
    examples = [line.strip() for line in res.stdout.splitlines() if line.strip().startswith("infertrace bench ")]
    assert len(examples) == 3
    for line in examples:
        ctx = bench.make_context("bench", shlex.split(line)[2:])
        bench_config(ctx.params)  # each example is a valid run
    codes = " ".join(res.stdout.split("Exit codes:")[1].split())
    for code in ("0 the run finished", "1 every measured request failed", "2 a bad option", "130 Ctrl-C"):
        assert code in codes


def test_one_request_is_singular_and_the_goodput_label_shows_the_slo_as_given(standin, prompts_jsonl):
    res = invoke("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 1,
                 "--warmup", 0, "--slo", "ttft_ms=10000,e2el_ms=20000")
    assert res.exit_code == 0, res.output
    shown = " ".join((res.stdout + res.stderr).split())
    assert "1 requests" not in shown and "measure: 1 request" in shown and "of 1 request)" in shown
    assert "goodput (req/s) ttft_ms<=10000, e2el_ms<=20000" in shown and "{" not in res.stdout
