"""The exit codes of every command, in one place (README.md, "Exit codes", lists them for users).

A command that ran and found a failure exits FAILURE; one that could not do its work, because of what it was given
or where it was told to write, exits BAD_INPUT before measuring anything where it can; Ctrl-C exits INTERRUPTED
after saving what was measured.
"""

from __future__ import annotations

OK = 0
# it ran, and what it checked failed: a regression (gate), every request failed (bench), a phase failed (ablate);
# or a server or a capture stopped on an error of its own (serve, profile)
FAILURE = 1
# a bad option or value, an input that cannot be used, an unreachable target, an output that cannot be written
# (click's own usage errors exit 2 too)
BAD_INPUT = 2
INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
