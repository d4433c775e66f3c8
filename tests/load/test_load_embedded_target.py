"""The bundled engine as an in-process target: same records, exact token counts from the engine."""

import json

from click.testing import CliRunner

from infertrace.load.client.embedded_target import default_model_dir
from infertrace.load.command import bench


def test_embedded_run_counts_tokens_exactly(tiny_model_dir, tmp_path):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, ["--model", str(tiny_model_dir), "--num-prompts", "4", "--concurrency", "2",
                                     "--input-len", "16", "--output-len", "6", "--ignore-eos", "--warmup", "1",
                                     "--result-json", str(out), "--requests-jsonl", str(reqs)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    # off a terminal: the model's load and each phase as plain lines, not a silent wait until the table
    assert f"loading {tiny_model_dir} into the bundled engine ..." in res.output and "engine ready in" in res.output
    assert "measure: 4/4 done, 0 failed" in res.output
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (4, 0)
    assert doc["total_input_tokens"] == 4 * 16  # the engine's prompt count equals the built length
    assert doc["total_output_tokens"] == 4 * 6
    assert doc["output_token_sources"] == {"usage": 4}
    target = doc["provenance"]["target"]
    assert target["kind"] == "embedded"
    assert target["attention_backend"] == "torch (batched)" and target["device"] == "cpu"
    assert (target["cuda_graphs_captured"], target["async_scheduling"], target["skinny_gemm"]) == (False, False, False)
    assert target["engine_counters"]["generation_tokens"] >= 4 * 6
    for line in map(json.loads, reqs.read_text().splitlines()):
        assert sum(line["chunk_tokens"]) == line["output_tokens"] == 6
        assert len(line["itl_ms"]) == len(line["chunk_tokens"]) - 1
        assert line["ttft_ms"] > 0 and line["e2el_ms"] >= line["ttft_ms"]


def test_builtin_model_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))
    built = []
    path = default_model_dir(built.append)
    assert path == tmp_path / "cache" / "models" / "tiny" and built == [path]
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(built.append) == path and len(built) == 1
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no leftover build directory


def test_a_sharded_preset_in_the_cache_is_not_written_again(tmp_path, monkeypatch):
    import infertrace.modelgen

    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path))
    out = tmp_path / "models" / "qwen3-4b"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors.index.json").write_text("{}")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached sharded model was written again")

    monkeypatch.setattr(infertrace.modelgen, "init_model", must_not_run)
    assert default_model_dir(preset="qwen3-4b") == out
