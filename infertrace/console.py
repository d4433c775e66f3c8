"""Shared rich consoles: data goes to stdout, chatter and errors to stderr."""

from __future__ import annotations

from typing import NoReturn

from rich.console import Console

out_console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one red line to stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise SystemExit(code)
