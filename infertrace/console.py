"""Shared rich consoles: data goes to stdout, chatter and errors to stderr; and an error, a usage error included,
is one line.

Off a terminal (a CI log, a pipe, a file) rich would cut every table to 80 columns with `…`; a log does not
wrap, so there the consoles are as wide as COLUMNS when it is set and else WIDE_OFF_TERMINAL, and a table takes
its natural width.
"""

from __future__ import annotations

import difflib
from typing import NoReturn

import click
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from infertrace.exits import BAD_INPUT

WIDE_OFF_TERMINAL = 1000  # columns; tables are sized to their content, so this only bounds them


class _Console(Console):
    """A rich Console whose width off a terminal is COLUMNS, else WIDE_OFF_TERMINAL (rich's default is 80)."""

    def _size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if self._width is None and not self.is_terminal:  # rich sets _width from COLUMNS, or width=
            return ConsoleDimensions(WIDE_OFF_TERMINAL, size.height)
        return size

    size = property(_size, Console.size.fset)


out_console = _Console()
err_console = _Console(stderr=True)


def fail(message: str, code: int = BAD_INPUT) -> NoReturn:
    """Print one red line to stderr and exit with `code` (infertrace/exits.py)."""
    # the message quotes what the user gave, which may hold [brackets] rich would read as markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


class UsageLine(click.ClickException):
    """A usage error as one line on stderr, `infertrace gate: error: <what> (see --help)`, where click prints the
    usage, a hint and the error on three or four."""

    exit_code = BAD_INPUT

    def __init__(self, error: click.UsageError) -> None:
        super().__init__(" ".join(error.format_message().split()))
        self.command_path = error.ctx.command_path if error.ctx is not None else "infertrace"

    def show(self, file=None) -> None:
        click.echo(f"{self.command_path}: error: {self.message} (see --help)", file=file, err=file is None)


class SuggestingGroup(click.Group):
    """A group that answers a mistyped subcommand with the closest one it has."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        names = self.list_commands(ctx)
        if name and not name.startswith("-") and name not in names and not ctx.resilient_parsing:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"commands: {', '.join(names)}"
            ctx.fail(f"no command {name!r}; {hint}")
        return super().resolve_command(ctx, args)
