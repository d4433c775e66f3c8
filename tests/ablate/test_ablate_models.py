"""A recipe's model: a directory as given, or a preset written once into the shared model cache."""

import pytest

import infertrace.modelgen
from infertrace.ablate.models import preset_model_dir, recipe_model_dir
from infertrace.ablate.recipe import RecipeError, load_recipe


def test_a_preset_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))
    written = []

    def fake_init(preset, out, seed=0, dtype=None):
        written.append((preset, out.name))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
        return out

    monkeypatch.setattr(infertrace.modelgen, "init_model", fake_init)
    built = []
    path = preset_model_dir("qwen3-4b", built.append)
    assert path == tmp_path / "cache" / "models" / "qwen3-4b" and built == [path]
    assert written[0][0] == "qwen3-4b" and written[0][1].startswith(".qwen3-4b.building-")  # renamed into place
    assert preset_model_dir("qwen3-4b", built.append) == path and len(written) == 1 and len(built) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["qwen3-4b"]


def test_a_half_written_preset_is_not_taken_for_a_model(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))

    def dying_init(preset, out, seed=0, dtype=None):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(infertrace.modelgen, "init_model", dying_init)
    with pytest.raises(OSError):
        preset_model_dir("qwen3-0.6b")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_model_directory_must_hold_a_model(tmp_path, tiny_model_dir):
    (tmp_path / "r.yaml").write_text(f"model: {tiny_model_dir}\nphases: [{{name: a}}]\n")
    assert recipe_model_dir(load_recipe(tmp_path / "r.yaml")) == tiny_model_dir
    (tmp_path / "s.yaml").write_text("model: nowhere\nphases: [{name: a}]\n")
    with pytest.raises(RecipeError, match="is not a model directory"):
        recipe_model_dir(load_recipe(tmp_path / "s.yaml"))
