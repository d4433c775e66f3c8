"""config_fields: every setting's help beside its default, one parser for flags, overrides and recipe keys, and a
JSON form of a config that reads back."""

from __future__ import annotations

import dataclasses
import json
import math

import click
import pytest
from click.testing import CliRunner

from infertrace.ablate.recipe import load_recipe
from infertrace.config_fields import FieldError, FlagSet, from_json, parse_overrides, setting, to_json
from infertrace.engine.config import ENGINE_FLAGS, EngineConfig
from infertrace.load.config import BenchConfig
from infertrace.load.options import bench_config
from infertrace.server.command import serve


def test_every_engine_config_field_has_help():
    missing = [f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("help", "").strip()]
    assert missing == []
    help_text = CliRunner().invoke(serve, ["--help"], terminal_width=200).output
    assert "Engine setting" not in help_text and "engine config field static_buffers" not in help_text
    assert "Step inputs live in buffers allocated once" in help_text


def _bench_params(args: list[str]) -> dict:
    from infertrace.load.command import bench

    return bench.make_context("bench", args).params


def _serve_params(args: list[str], tmp_path) -> dict:
    return serve.make_context("serve", ["--model", str(tmp_path), *args]).params


def _recipe_config(tmp_path, overrides: str) -> dict:
    path = tmp_path / "r.yaml"
    path.write_text(f"phases:\n  - name: a\n    overrides: {{{overrides}}}\n")
    recipe = load_recipe(path)
    (phase,) = recipe.plan()
    assert phase.error is None
    return phase.config


@pytest.mark.parametrize(
    ("name", "flag", "override", "recipe", "expected"),
    [
        ("max_num_batched_tokens", ["--max-num-batched-tokens", "512"], "max_num_batched_tokens=512",
         "max_num_batched_tokens: 512", 512),
        ("prefix_caching", ["--no-prefix-caching"], "prefix-caching=off", "prefix_caching: false", False),
        ("cuda_graph_batch_sizes", ["--cuda-graph-batch-sizes", "4,1,2"], "cuda_graph_batch_sizes=4 1 2",
         "cuda_graph_batch_sizes: [2, 4, 1]", (1, 2, 4)),
        ("gpu_memory_utilization", ["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization=0.5",
         "gpu_memory_utilization: 0.5", 0.5),
        ("attention", ["--attention", "looped"], "attention=looped", "attention: looped", "looped"),
    ],
)
def test_a_flag_an_override_and_a_recipe_key_give_the_same_value(tmp_path, name, flag, override, recipe,
                                                                   expected):
    spellings = {
        "serve flag": ENGINE_FLAGS.values(_serve_params(flag, tmp_path)),
        "serve --engine-opt": ENGINE_FLAGS.values(_serve_params(["--engine-opt", override], tmp_path)),
        "bench flag": bench_config(_bench_params(flag)).engine_overrides,
        "bench --engine-opt": bench_config(_bench_params(["--engine-opt", override])).engine_overrides,
        "recipe key": _recipe_config(tmp_path, recipe),
    }
    for spelling, overrides in spellings.items():
        value = getattr(EngineConfig.from_overrides(overrides), name)
        assert value == expected and type(value) is type(expected), spelling
    # bench's config holds the typed value however it was spelled, so results of the two spellings compare
    assert spellings["bench flag"] == spellings["bench --engine-opt"]


def test_bench_engine_flags_are_checked_before_the_run():
    with pytest.raises(FieldError, match="max_num_seqs must be int, got 'many'"):
        bench_config(_bench_params(["--engine-opt", "max_num_seqs=many"]))
    with pytest.raises(FieldError, match=r"unknown engine config field 'max_num_seq' \(did you mean 'max_num_seqs'"):
        bench_config(_bench_params(["--engine-opt", "max_num_seq=4"]))
    result = CliRunner().invoke(click.Group(commands={"bench": _bench()}), ["bench", "--engine-opt", "block_size=x"])
    assert result.exit_code == 2 and "block_size must be int, got 'x'" in result.output
    # bench's own --seed stays bench's; the engine's is reached by name
    params = _bench_params(["--seed", "3", "--engine-opt", "seed=5"])
    cfg = bench_config(params)
    assert cfg.seed == 3 and cfg.engine_overrides == {"seed": 5}


def _bench():
    from infertrace.load.command import bench

    return bench


def test_a_new_field_is_a_flag_an_override_and_json_without_more_code():
    @dataclasses.dataclass
    class Knobs:
        all_reduce: str = setting("auto", "How ranks sum their partial results.")
        chunk_kb: int | None = setting(None, "Chunk size; unset: chosen.")
        rate: float = setting(1.0, "A rate.")
        on: bool = setting(True, "A switch.", aliases=("enable-it",))

    flags = FlagSet(Knobs, prefix="k__", what="knob", overrides_flag="--knob")

    @click.command()
    def cmd(**params):
        click.echo(json.dumps(flags.values(params)))

    cmd.params.extend(flags.options())
    run = CliRunner().invoke(cmd, ["--all-reduce", "one_shot", "--knob", "chunk_kb=64", "--no-enable-it",
                                   "--knob", "rate=inf"])
    assert run.exit_code == 0, run.output
    values = json.loads(run.output)
    assert values == {"all_reduce": "one_shot", "chunk_kb": 64, "on": False, "rate": math.inf}
    assert "How ranks sum their partial results.  [default: auto]" in CliRunner().invoke(cmd, ["--help"], terminal_width=200).output
    knobs = Knobs(**values)
    assert Knobs(**from_json(Knobs, json.loads(json.dumps(to_json(knobs), allow_nan=False)))) == knobs
    with pytest.raises(FieldError, match="unknown knob field 'speed'; known: all_reduce, chunk_kb, on, rate"):
        parse_overrides(Knobs, {"speed": "1"}, "knob")
    with pytest.raises(FieldError, match="on must be true or false, got 'maybe'") as caught:
        parse_overrides(Knobs, {"on": "maybe"}, "knob")
    assert caught.value.name == "on"
    with pytest.raises(FieldError, match="chunk_kb must be int or None, got True"):
        parse_overrides(Knobs, {"chunk_kb": True}, "knob")


def test_bench_config_json_round_trip_keeps_inf():
    cfg = BenchConfig(base_url="http://127.0.0.1:9", request_rate=math.inf, concurrency=4, workers=2,
                      engine_overrides={"max_num_seqs": 4}, slo={"ttft_ms": 500.0}, extra_body={"top_k": 5},
                      headers={"Authorization": "Bearer x"}, profile_steps=3, result_json="r.json", warmup=1)
    text = json.dumps(cfg.to_json(), allow_nan=False)  # strict JSON: no Infinity
    assert json.loads(text)["request_rate"] == "inf"
    back = BenchConfig.from_json(json.loads(text) | {"headers": cfg.headers})
    assert back == cfg and back.request_rate == math.inf

    sweep = BenchConfig(sweep_param="request_rate", sweep_values=(1.0, 2.5, math.inf), num_prompts=8)
    data = json.loads(json.dumps(sweep.to_json(), allow_nan=False))
    assert data["sweep_values"] == [1.0, 2.5, "inf"]
    back = BenchConfig.from_json(data)
    assert back.sweep_values == (1.0, 2.5, math.inf) and back.warmup == sweep.effective_warmup
    assert dataclasses.replace(back, warmup=None) == sweep

    closed = BenchConfig(sweep_param="concurrency", sweep_values=(1, 2, 4))
    back = BenchConfig.from_json(json.loads(json.dumps(closed.to_json())))
    assert back.sweep_values == (1, 2, 4) and all(type(v) is int for v in back.sweep_values)
    assert [p.concurrency for p in back.points()] == [1, 2, 4]


def test_from_json_checks_as_flags_do():
    with pytest.raises(ValueError, match="request_rate must be float or None, got 'fast'"):
        BenchConfig.from_json({"request_rate": "fast"})
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        BenchConfig.from_json({"concurrency": 0})
    assert BenchConfig.from_json({"no_such_key": 1}) == BenchConfig()  # a result written by another version
