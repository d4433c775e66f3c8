"""The `infertrace profile` command."""

from infertrace.pending import pending_command

profile = pending_command("profile", "Start or stop profiler capture on a live server.")
