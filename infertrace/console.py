"""Shared rich consoles: data goes to stdout, chatter and errors to stderr.

Off a terminal (a CI log, a pipe, a file) rich would cut every table to 80 columns with `…`; a log does not
wrap, so there the consoles are as wide as COLUMNS when it is set and else WIDE_OFF_TERMINAL, and a table takes
its natural width.
"""

from __future__ import annotations

from typing import NoReturn

from rich.console import Console, ConsoleDimensions

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
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise SystemExit(code)
