"""The `infertrace` command-line entry point: one click group, one module per subcommand."""

from __future__ import annotations

import click

from infertrace import __version__
from infertrace.ablate.command import ablate
from infertrace.analyze.command import analyze
from infertrace.capture.command import profile
from infertrace.gate.command import gate
from infertrace.load.command import bench
from infertrace.modelgen.command import model
from infertrace.server.command import serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="infertrace")
def main() -> None:
    """Benchmark, profile and explain LLM inference.

    Load-test any OpenAI-compatible server (vLLM, SGLang, TGI) or the bundled engine,
    capture profiles on live servers, analyze traces, ablate the engine phase by phase,
    and gate CI on throughput and latency.
    """


for command in (bench, serve, profile, analyze, ablate, gate, model):
    main.add_command(command)
