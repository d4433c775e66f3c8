"""What a phase can do on a machine: settings a CPU ignores, what it cannot run, GPUs missing, memory needed."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.ablate.command import ablate
from infertrace.ablate.device import GiB, Machine, memory_need, model_shapes, not_applicable
from infertrace.ablate.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CPU = Machine(0, host_bytes=64 * GiB)
ONE_HOPPER = Machine(1, (9, 0), 80 * GiB, 64 * GiB)
ONE_AMPERE = Machine(1, (8, 0), 80 * GiB, 64 * GiB)
MACHINE_HERE = Machine.here  # read at import, before the tests' CPU stand-in (conftest.py) replaces it


def invoke(*args):
    return CliRunner().invoke(ablate, [str(a) for a in args], catch_exceptions=False)


def reasons(recipe: Path, machine: Machine) -> dict[str, str | None]:
    planned = load_recipe(recipe).plan()
    return {p.name: r for p, r in zip(planned, not_applicable(planned, machine))}


def test_decode_path_on_a_cpu_runs_only_the_phases_that_change_something():
    """decode_path --quick on a CPU showed "CUDA graphs -26.1%": a switch that does nothing there, measured."""
    found = reasons(RECIPES / "decode_path.yaml", CPU)
    assert found == {
        "looped attention": None, "batched attention": None, "buffers allocated once": None,
        "CUDA graphs": "on cpu: cuda_graphs takes effect on CUDA GPUs only",
        "fused norm": "on cpu: fused_norm takes effect on CUDA GPUs only",
        "weight-streaming GEMMs": "on cpu: skinny_gemm takes effect on CUDA GPUs only",
        "async scheduling": None,
        "programmatic dependent launch": "on cpu: pdl takes effect on CUDA GPUs only",
        "projections fused with the kernels after them": "on cpu: fused_projections takes effect on CUDA GPUs only",
    }
    assert set(reasons(RECIPES / "decode_path.yaml", ONE_HOPPER).values()) == {None}
    assert reasons(RECIPES / "decode_path.yaml", ONE_AMPERE)["programmatic dependent launch"] == (
        "on cuda: pdl takes effect on Hopper and later GPUs only")


def test_what_a_cpu_or_a_gpu_cannot_run_is_named(write_recipe):
    recipe = write_recipe("""
        engine: {tensor_parallel_size: 2}
        phases:
          - name: gloo ranks
          - name: NCCL all-reduce
            overrides: {all_reduce: nccl}
          - name: peer memory
            overrides: {all_reduce: custom}
          - name: one rank, Triton attention
            reset: true
            overrides: {tensor_parallel_size: 1, attention_backend: triton}
        """)
    assert reasons(recipe, CPU) == {
        "gloo ranks": None,
        "NCCL all-reduce": "on cpu: all_reduce=nccl needs CUDA GPUs (ranks on a CPU all-reduce over gloo)",
        "peer memory": "on cpu: all_reduce=custom needs CUDA GPUs that reach each other's memory",
        "one rank, Triton attention": "on cpu: attention_backend=triton needs a CUDA GPU",
    }
    on_one_gpu = reasons(recipe, ONE_HOPPER)
    assert on_one_gpu["gloo ranks"] == "on cuda: tensor_parallel_size=2 needs 2 GPUs; 1 visible"
    assert on_one_gpu["one rank, Triton attention"] is None
    assert reasons(RECIPES / "attention_backend.yaml", ONE_AMPERE)["FlashAttention-4"] == (
        "on cuda: attention_backend=flash needs a Hopper or later GPU (compute capability 9.0+)")


def test_check_of_a_gpu_only_recipe_on_a_cpu_is_one_line_and_exit_2():
    """attention_backend.yaml passed --check on a CPU and then failed every phase."""
    res = invoke(RECIPES / "attention_backend.yaml", "--check")
    assert res.exit_code == 2
    assert res.stdout == "" and len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith(f"error: {RECIPES / 'attention_backend.yaml'}: no phase can run on this machine: "
                                 "phase 1 'Triton paged attention' is not applicable on cpu: attention_backend=triton "
                                 "needs a CUDA GPU (and 1 more phase(s))")


def test_check_names_each_phase_that_will_not_run():
    res = invoke(RECIPES / "decode_path.yaml", "--check")
    assert res.exit_code == 0
    assert "usable, 9 phase(s), 5 of them not applicable here (not run)" in res.stdout
    assert ("note: phase 4 'CUDA graphs' will not run, not applicable on cpu: cuda_graphs takes effect on CUDA "
            "GPUs only") in res.stderr
    assert len(res.stderr.splitlines()) == 5


def test_a_run_marks_the_phase_and_attributes_it_no_change(write_recipe, tiny_model_dir, tmp_path):
    recipe = write_recipe("""
        workload: {num_prompts: 2, input_len: 8, output_len: 3, concurrency: 2, warmup: 0}
        phases:
          - name: eager
            overrides: {cuda_graphs: false}
          - name: CUDA graphs
            overrides: {cuda_graphs: true}
          - name: looped
            overrides: {attention: looped}
        """)
    out = tmp_path / "r.json"
    res = invoke(recipe, "--model", tiny_model_dir, "--json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [p["status"] for p in doc["phases"]] == ["ok", "not applicable", "ok"]
    skipped = doc["phases"][1]
    assert skipped["error"] == "on cpu: cuda_graphs takes effect on CUDA GPUs only" and skipped["result"] is None
    rows = doc["waterfall"]
    assert rows[1]["output_throughput"] is None and rows[1]["change_vs_previous"] is None
    first, last = rows[0]["output_throughput"], rows[2]["output_throughput"]
    assert rows[2]["change_vs_previous"] == pytest.approx(last / first - 1)  # against the last phase measured
    assert doc["complete"]
    assert "not applicable on cpu: cuda_graphs takes effect on CUDA GPUs only" in " ".join(res.stdout.split())


def test_memory_need_of_the_tiny_model_on_a_cpu():
    from infertrace.modelgen.presets import parameter_count

    shapes = model_shapes(load_recipe(RECIPES / "tensor_parallel.yaml"))
    config = {"tensor_parallel_size": 2, "dtype": "auto", "kv_cache_dtype": "auto", "kv_cache_tokens": None,
              "cpu_kv_cache_gb": 0.5, "offload": "off", "offload_host_gb": 4.0, "gpu_memory_utilization": 0.9}
    need = memory_need(config, shapes, CPU)
    assert need.weights == parameter_count(shapes) * 4  # the tiny preset is float32
    assert need.kv_cache == 2 * GiB // 2  # each CPU rank allocates its own cpu_kv_cache_gb
    per_token = 2 * shapes["num_hidden_layers"] * shapes["num_key_value_heads"] * shapes["head_dim"]
    gpu = memory_need(config | {"kv_cache_tokens": 4096, "kv_cache_dtype": "fp8"}, shapes, Machine(2, (9, 0), GiB))
    assert gpu.weights == need.weights // 2 and gpu.kv_cache == 4096 * per_token // 2
    assert gpu.available == int(GiB * 0.9)


@pytest.mark.parametrize("check", [True, False])
def test_a_workload_that_does_not_fit_is_refused_before_it_runs(write_recipe, cpu_machine, monkeypatch, check):
    """--check accepted a workload that then needed 7.45 GiB on a smaller machine."""
    from infertrace.ablate import device

    small = Machine(0, host_bytes=2 * GiB)
    monkeypatch.setattr(device.Machine, "here", classmethod(lambda cls: small))
    from infertrace.modelgen.presets import PRESETS, hf_config, parameter_count

    weights = parameter_count(hf_config(PRESETS["qwen3-4b"], "bfloat16")) * 2 / GiB
    recipe = write_recipe("phases: [{name: a}]\n")
    res = invoke(recipe, "--preset", "qwen3-4b", *(["--check"] if check else []))
    assert res.exit_code == 2
    [line] = res.stderr.splitlines()
    assert line.startswith(f"error: {recipe}: phase 1 'a' needs at least {weights + 0.5:.2f} GiB (weights "
                           f"{weights:.2f} GiB, KV cache 0.50 GiB) and this machine has 2.00 GiB available")


def test_the_machine_here_is_read_from_torch():
    import torch

    machine = MACHINE_HERE()
    assert machine.gpus == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert machine.host_bytes > 0


TWO_HOPPERS = Machine(2, (9, 0), 80 * GiB, 64 * GiB)


def test_allreduce_recipe_runs_every_phase_on_two_gpus_and_none_on_a_cpu():
    """Its first phase, "NCCL all-reduce", ran gloo on a CPU; the others failed."""
    assert set(reasons(RECIPES / "allreduce.yaml", TWO_HOPPERS).values()) == {None}
    on_cpu = reasons(RECIPES / "allreduce.yaml", CPU)
    assert on_cpu["NCCL all-reduce"] == "on cpu: all_reduce=nccl needs CUDA GPUs (ranks on a CPU all-reduce over gloo)"
    assert all(reason and reason.startswith("on cpu: all_reduce=") for reason in on_cpu.values())
    res = invoke(RECIPES / "allreduce.yaml", "--check")
    assert res.exit_code == 2 and "no phase can run on this machine" in res.stderr


def test_a_phase_changing_only_kernel_rules_is_not_applicable_where_they_do_nothing(write_recipe):
    recipe = write_recipe("""
        engine: {tensor_parallel_size: 2}
        phases:
          - name: base
          - name: planes
            tuning: {all_reduce_fusion: planes}
        """)
    assert reasons(recipe, CPU)["planes"] == (
        "on cpu: all_reduce_fusion takes effect on CUDA GPUs only (ranks on a CPU use gloo)")
    assert reasons(recipe, TWO_HOPPERS)["planes"] is None
