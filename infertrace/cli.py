"""The `infertrace` command-line entry point: one click group, one module per subcommand, each imported only
when it runs (or when `--help` lists them), so that `infertrace analyze` does not pay for bench's imports."""

from __future__ import annotations

import importlib

import click

from infertrace import __version__
from infertrace.console import SuggestingGroup, UsageLine
from infertrace.exits import INTERRUPTED

# name -> where the command is defined: every command lives at <package>/command.py
COMMANDS = {
    "bench": "infertrace.load.command:bench",
    "serve": "infertrace.server.command:serve",
    "profile": "infertrace.capture.command:profile",
    "analyze": "infertrace.analyze.command:analyze",
    "ablate": "infertrace.ablate.command:ablate",
    "gate": "infertrace.gate.command:gate",
    "model": "infertrace.modelgen.command:model",
}


class LazyGroup(SuggestingGroup):
    """A group whose commands are imported on first use (click's documented pattern for large CLIs), and where
    every usage error of every command, and Ctrl-C, end the way the README's exit codes say."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, _, attr = COMMANDS[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise UsageLine(exc) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:  # a subcommand's, raised while parsing its options or from its body
            raise UsageLine(exc) from None
        except KeyboardInterrupt:  # one a command did not handle itself (during a model load, an import...)
            click.echo("\ninterrupted", err=True)
            raise click.exceptions.Exit(INTERRUPTED) from None


@click.group("infertrace", cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="infertrace")
def main() -> None:
    """Benchmark, profile and explain LLM inference.

    Load-test any OpenAI-compatible server (vLLM, SGLang, TGI) or the bundled engine,
    capture profiles on live servers, analyze traces, ablate the engine phase by phase,
    and gate CI on throughput and latency.
    """
