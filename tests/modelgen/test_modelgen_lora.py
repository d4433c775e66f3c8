import json

import pytest
from click.testing import CliRunner

from infertrace.cli import main
from infertrace.exits import BAD_INPUT
from infertrace.modelgen.lora import TARGET_MODULES, init_adapters


def test_adapters_fit_the_models_projections(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    paths = init_adapters(tiny_model_dir, 2, 4, seed=3, out_dir=tmp_path)
    assert [p.name for p in paths] == ["lora-1", "lora-2"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    modules = dict(model.named_modules())
    cfg = json.loads((paths[0] / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["target_modules"]) == ("LORA", 4, list(TARGET_MODULES))
    a, b = (load_file(str(p / "adapter_model.safetensors")) for p in paths)
    assert a.keys() == b.keys() and len(a) == 2 * len(TARGET_MODULES) * model.config.num_hidden_layers
    for name, tensor in a.items():
        module_name, matrix = name.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        linear = modules[module_name]
        expected = (4, linear.in_features) if matrix == "lora_A" else (linear.out_features, 4)
        assert tuple(tensor.shape) == expected, name
        assert not torch.equal(tensor, b[name])  # each adapter its own weights
    again = load_file(str(init_adapters(tiny_model_dir, 1, 4, seed=3, out_dir=tmp_path / "again")[0]
                          / "adapter_model.safetensors"))
    assert all(torch.equal(again[k], a[k]) for k in a)  # seeded


def test_model_init_writes_adapters_and_refuses_bad_counts(tmp_path, tiny_model_dir):
    bad = CliRunner().invoke(main, ["model", "init", "--preset", "tiny", "--out", str(tmp_path / "m"),
                                    "--lora", "1", "--lora-rank", "0"])
    assert bad.exit_code == BAD_INPUT and "--lora-rank" in bad.output
    with pytest.raises(ValueError, match="config.json"):
        init_adapters(tmp_path / "nothing", 1, 8)
    with pytest.raises(ValueError, match="--lora must be between"):
        init_adapters(tiny_model_dir, 0, 8)
