"""INFERTRACE_KERNEL_TUNING: tilings from a JSON file, ahead of the kernels' rules (engine/kernels/tuning.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infertrace.engine.kernels import tuning


def test_the_file_s_tilings_are_keyed_by_shape(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"skinny_gemm": {"2560,2048": [64, 128, 4, 4]}, "qkv_norm_rope": {"3072,2560": None}}))
    monkeypatch.setenv(tuning.ENV, str(path))
    assert tuning.load("skinny_gemm") == {(2560, 2048): (64, 128, 4, 4)}
    assert tuning.load("qkv_norm_rope") == {(3072, 2560): None}
    assert tuning.load("gate_up_silu") == {}


def test_unset_means_the_rules_alone(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert tuning.load("skinny_gemm") == {}


@pytest.mark.parametrize("text", ["not json", '{"skinny_gemm": {"2560": [1]}}', '["a list"]'])
def test_a_file_that_is_not_a_tiling_file_is_an_error_naming_it(tmp_path, monkeypatch, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    monkeypatch.setenv(tuning.ENV, str(path))
    with pytest.raises(ValueError, match=f"{tuning.ENV}={path}: not a tiling file"):
        tuning.load("skinny_gemm")


def test_the_benchmark_s_tp_tilings_parse(monkeypatch):
    path = Path(__file__).parents[2] / "benchmarks" / "tp_tilings.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    assert all(len(v) == 4 for v in tuning.load("skinny_gemm").values())
    assert all(len(v) == 4 for v in tuning.load("gate_up_silu").values())


def test_the_tp_shards_tilings_are_the_h200_s_and_other_gpus_keep_the_rules():
    pytest.importorskip("triton")
    from infertrace.engine.kernels import skinny_gemm

    h200 = skinny_gemm.device_shards("NVIDIA H200")
    assert h200[(5120, 4352)] == (32, 128, 2, 4)  # qwen3-14b's down projection at TP=4
    assert skinny_gemm.device_shards("NVIDIA H100 80GB HBM3") == {}
    assert skinny_gemm.rules_config(5120, 4352, True) == (64, 128, 1, 5)  # what an H100 runs


def test_the_early_kernel_takes_no_more_stages_than_shared_memory_holds(monkeypatch):
    """One program an SM raises the early kernel's stages to 6, as far as its tiles fit: (64, 256) tiles are 40 KB
    a stage, so five in an H100's or H200's 227 KB (six asked for 240 KB and did not launch: qwen3-0.6b at TP=2);
    (64, 128) tiles fit six."""
    pytest.importorskip("triton")
    from infertrace.engine.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "_shared_memory_per_program", lambda: 232448)
    monkeypatch.setattr(skinny_gemm, "_sm_count", lambda: 132)
    monkeypatch.setattr(skinny_gemm, "_early", True)
    monkeypatch.setattr(skinny_gemm, "TUNED", {})
    monkeypatch.setattr(skinny_gemm, "device_shards", lambda: {(1536, 1024): (64, 256, 1, 4),
                                                              (1792, 5120): (64, 128, 4, 5)})
    assert skinny_gemm.early_max_stages(64, 256) == 5 and skinny_gemm.early_max_stages(64, 128) == 11
    assert skinny_gemm.decode_config(1536, 1024) == (64, 256, 1, 5)
    assert skinny_gemm.decode_config(1792, 5120) == (64, 128, 4, 6)
    monkeypatch.setattr(skinny_gemm, "_early", False)
    assert skinny_gemm.decode_config(1536, 1024) == (64, 256, 1, 4)


def test_an_experiment_s_tilings_reach_the_table_the_kernel_reads_and_go_back_to_the_file_s(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"skinny_gemm": {"2560,2048": [64, 128, 4, 4]}}))
    monkeypatch.setenv(tuning.ENV, str(path))
    monkeypatch.setattr(tuning, "_TABLES", {})
    read_by_kernel = tuning.table("skinny_gemm")
    tuning.set_tilings("skinny_gemm", {(1024, 1024): (32, 128, 1, 3)})
    assert read_by_kernel == {(2560, 2048): (64, 128, 4, 4), (1024, 1024): (32, 128, 1, 3)}
    tuning.set_tilings("skinny_gemm", {})
    assert tuning.table("skinny_gemm") is read_by_kernel and read_by_kernel == {(2560, 2048): (64, 128, 4, 4)}
