"""Presets by name where a model directory is taken: `bench --model tiny`, `serve --model qwen3-0.6b`."""

import shutil

import pytest
from click.testing import CliRunner

from infertrace.load.client.targets import make_target
from infertrace.load.client.timing import TargetError
from infertrace.load.config import BenchConfig
from infertrace.modelgen.cached import is_preset, preset_model_dir


@pytest.fixture
def cache_with_tiny(tmp_path, monkeypatch, tiny_model_dir):
    """A cache folder that already holds the tiny preset (copied, so nothing is built here)."""
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cache" / "models" / "tiny"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_a_preset_name_is_a_preset_unless_a_directory_has_that_name(tmp_path, monkeypatch):
    assert is_preset("tiny") and is_preset("qwen3-0.6b") and not is_preset("llama") and not is_preset(None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert not is_preset("tiny")  # ./tiny is a path the user meant


def test_a_cached_preset_is_found_without_building(cache_with_tiny):
    built = []
    assert preset_model_dir("tiny", built.append) == cache_with_tiny and built == []


def test_bench_model_takes_a_preset_name_for_the_bundled_engine(cache_with_tiny):
    target = make_target(BenchConfig(model="tiny"), print)
    assert target.kind == "embedded" and target.model_dir == cache_with_tiny
    with pytest.raises(TargetError, match="neither a model directory nor a preset"):
        make_target(BenchConfig(model="llama"), print)


def test_serve_model_takes_a_preset_name_served_under_that_name(cache_with_tiny, monkeypatch):
    import infertrace.server.command as serve_command

    seen = []
    monkeypatch.setattr(serve_command, "_serve", lambda settings, config, api_servers: seen.append(settings))
    result = CliRunner().invoke(serve_command.serve, ["--model", "tiny", "--port", "0"])
    assert result.exit_code == 0, result.output
    [settings] = seen
    assert settings.model_dir == str(cache_with_tiny) and settings.served_model_name == "tiny"
    missing = CliRunner().invoke(serve_command.serve, ["--model", "llama"])
    assert missing.exit_code == 2 and "'llama' is neither a model directory nor a preset name" in missing.output
