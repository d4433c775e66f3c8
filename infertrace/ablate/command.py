"""The `infertrace ablate` command: a recipe in, its phases run one by one, a waterfall table, JSON and PNG out."""

from __future__ import annotations

from pathlib import Path

import click

from infertrace.config_fields import key_values
from infertrace.modelgen.presets import PRESETS

EXIT_CODES = """\b
Exit codes:
  0    every phase ran, or was not applicable on this machine (a CUDA-only switch on a CPU: not run)
  1    one or more phases failed (each failure is in its row and in --json; the other phases ran)
  2    the recipe or an option is not usable (one line names the file and line at fault), no phase of it
       can run on this machine, or a phase's weights and KV cache do not fit its memory
  130  interrupted with Ctrl-C (the phases done so far are printed and saved)"""


def _key_values(ctx, param, values):
    try:
        return key_values(values, "--engine-opt")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("ablate", help=f"""Run phase-by-phase ablations of the bundled engine from a recipe.

RECIPE is a YAML file (see docs/ablate.md and recipes/): a model or preset, one workload, and an ordered list of
phases, each a set of engine config overrides applied on top of the previous phase's. Every phase runs on a
fresh engine with the same workload and the table shows the waterfall: tok/s, the change against the previous
and the first phase, TTFT and ITL medians, and, with --profile, kernels launched per decode step and the GPU's
idle share from a capture of each phase.

\b
  infertrace ablate recipes/decode_path.yaml --preset qwen3-4b --concurrency 8 --profile \\
      --json decode_path.json --plot decode_path.png
  infertrace ablate recipes/prefix_cache.yaml --quick

{EXIT_CODES}
""")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--profile/--no-profile", "profile", default=None,
              help="Capture and analyze a window of engine steps in each phase (after its measured run, so the "
              "profiler does not touch the figures). [default: the recipe's profile.enabled]")
@click.option("--profile-steps", type=int, help="Engine steps captured per phase, from the first decode step of "
              "a full batch (implies --profile). [default: the recipe's profile.steps, else 16]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every phase's figures, errors, engine config and profile to this file (rewritten after "
              "each phase).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the waterfall chart as a PNG.")
@click.option("--trace-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where --profile writes each phase's trace (one directory per phase). [default: "
              "ablate-traces/<recipe>-<time>]")
@click.option("--model", metavar="DIR", help="Run the recipe on this model directory instead of its own model.")
@click.option("--preset", type=click.Choice(list(PRESETS)), help="Run the recipe on this preset (written once "
              "into $INFERTRACE_CACHE/models, default ~/.cache/infertrace) instead of its own model.")
@click.option("--concurrency", type=int, help="Requests in flight, replacing the recipe's.")
@click.option("--num-prompts", type=int, help="Measured requests per phase, replacing the recipe's.")
@click.option("--input-len", type=int, help="Prompt tokens, replacing the recipe's.")
@click.option("--output-len", type=int, help="Generated tokens per request, replacing the recipe's.")
@click.option("--warmup", type=int, help="Warmup requests per phase (excluded from the figures), replacing the "
              "recipe's.")
@click.option("--quick", is_flag=True, help="Shrink the workload to a smoke test (at most 4 prompts of 32 tokens, "
              "8 output tokens, concurrency 2, 4 profiled steps); options above still win.")
@click.option("--engine-opt", "engine_opts", multiple=True, metavar="KEY=VALUE", callback=_key_values,
              help="An engine config field for every phase, on top of the recipe's base (repeatable), e.g. "
              "--engine-opt kv_cache_tokens=65536.")
@click.option("--check", is_flag=True, help="Only check the recipe, every phase's overrides included, what each "
              "phase can do on this machine and the memory it needs, and exit (0: usable, 2: the first problem, as "
              "one line).")
def ablate(recipe: Path, profile: bool | None, profile_steps: int | None, json_path: Path | None,
           plot_path: Path | None, trace_dir: Path | None, model: str | None, preset: str | None,
           concurrency: int | None, num_prompts: int | None, input_len: int | None, output_len: int | None,
           warmup: int | None, quick: bool, engine_opts: dict, check: bool) -> None:
    from infertrace.ablate.execute import AblateOptions, check_recipe, execute

    options = AblateOptions(
        recipe=recipe, profile=profile, profile_steps=profile_steps, json_path=json_path, plot_path=plot_path,
        trace_dir=trace_dir, model=model, preset=preset, quick=quick, engine=engine_opts,
        workload={k: v for k, v in (("concurrency", concurrency), ("num_prompts", num_prompts),
                                    ("input_len", input_len), ("output_len", output_len), ("warmup", warmup))
                  if v is not None})
    raise SystemExit(check_recipe(options) if check else execute(options))
