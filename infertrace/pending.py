"""Placeholder for a subcommand that is not built yet: it says so and exits 2."""

from __future__ import annotations

import click

from infertrace.console import fail


def pending_command(name: str, summary: str) -> click.Command:
    @click.command(
        name=name,
        help=f"{summary} (not available in this build yet).",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    def command() -> None:
        fail(f"`infertrace {name}` is not available in this build yet", code=2)

    return command
