"""EngineConfig: defaults once, overrides by name (also as strings), one clear error for each bad value."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from infertrace.engine import Engine, EngineConfig


def test_defaults_are_json_serialisable():
    cfg = EngineConfig()
    data = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert data["block_size"] == 16 and data["attention"] == "batched" and data["offload"] == "off"
    assert EngineConfig(**{**data, "cuda_graph_batch_sizes": tuple(data["cuda_graph_batch_sizes"])}) == cfg


def test_overrides_by_name_and_from_strings():
    cfg = EngineConfig.from_overrides(
        {"attention": "looped", "block_size": "32", "prefix_caching": "off", "kv_cache_tokens": "none",
         "gpu_memory_utilization": "0.5", "cuda_graph_batch_sizes": "1,2,4", "cuda_graph_token_sizes": "64,16,64",
         "prefill_cuda_graphs": "off"}
    )
    assert cfg.cuda_graph_token_sizes == (16, 64) and cfg.prefill_cuda_graphs is False
    assert (cfg.attention, cfg.block_size, cfg.prefix_caching, cfg.kv_cache_tokens) == ("looped", 32, False, None)
    assert cfg.gpu_memory_utilization == 0.5 and cfg.cuda_graph_batch_sizes == (1, 2, 4)
    base = EngineConfig(block_size=8)
    assert EngineConfig.from_overrides({"max_num_seqs": 4}, base=base).block_size == 8


TUNING_RULES = ("all_reduce_fusion", "all_reduce_spread", "all_reduce_pull", "all_reduce_payload", "all_reduce_push",
                "gemm_early_weights", "flash_prefill_from")


def test_serve_lists_only_choices_a_user_makes_not_the_kernels_tuning_rules():
    from click.testing import CliRunner

    from infertrace.engine.kernels import tuning
    from infertrace.server.command import serve

    help_text = CliRunner().invoke(serve, ["--help"], terminal_width=200).output
    assert "--max-num-seqs" in help_text and "--all-reduce " in help_text  # a choice: NCCL or peer memory
    for name in (*TUNING_RULES, "scheduling_policy"):
        assert f"--{name.replace('_', '-')}" not in help_text, name
    assert set(TUNING_RULES) == set(tuning.RULES)  # each is a rule an experiment overrides instead
    for name in TUNING_RULES:
        with pytest.raises(ValueError, match=f"unknown engine config field.*{name}"):
            EngineConfig.from_overrides({name: "on"})


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="unknown engine config field.*attn_mode"):
        EngineConfig.from_overrides({"attn_mode": "looped"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"kv_cache_tokens": 8, "block_size": 16}, "smaller than one KV block"),
        ({"attention": "fused"}, "attention must be one of batched, looped"),
        ({"attention_backend": "cudnn"}, "attention_backend must be one of"),
        ({"offload": "disk"}, "offload must be one of off, prefix, long"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"device": "tpu"}, "device must be"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
        ({"kv_cache_dtype": "fp8", "offload": "prefix"}, "kv_cache_dtype='fp8' is not supported with offload"),
        ({"block_size": "16"}, "block_size must be int"),
        ({"prefix_caching": 1}, "prefix_caching must be bool"),
        ({"cuda_graph_batch_sizes": (0, 1)}, "cuda_graph_batch_sizes"),
        ({"cuda_graph_token_sizes": ()}, "cuda_graph_token_sizes"),
        ({"cuda_graph_token_sizes": (16, True)}, "cuda_graph_token_sizes must be integers"),
    ],
)
def test_bad_values_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_bad_string_override():
    with pytest.raises(ValueError, match="block_size must be int"):
        EngineConfig.from_overrides({"block_size": "big"})
    with pytest.raises(ValueError, match="chunked_prefill must be true or false"):
        EngineConfig.from_overrides({"chunked_prefill": "maybe"})


def test_model_directory_problems(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(tmp_path / "nowhere", EngineConfig(kv_cache_tokens=1024))
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tiny_model_dir / "config.json", partial)
    with pytest.raises(FileNotFoundError, match=r"missing \*\.safetensors weights, tokenizer\.json, tokenizer_config\.json"):
        Engine(partial, EngineConfig(kv_cache_tokens=1024))


def test_engine_level_config_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, max_model_len=10_000))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, max_model_len=2048))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, attention_backend="triton", device="cpu"))
    with pytest.raises(ValueError, match="attention_backend='flash' needs a CUDA device"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024, attention_backend="flash", device="cpu"))


def test_flash_backend_without_flash_attn_says_how_to_install(monkeypatch):
    """Where flash-attn-4 does not import, the flash backend's error names the package and the extra."""
    import sys

    from infertrace.engine.attention import load_flash_attn

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=r"needs flash-attn-4.*pip install 'infertrace\[flash\]'"):
        load_flash_attn()
