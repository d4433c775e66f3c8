"""The `infertrace analyze` command."""

from infertrace.pending import pending_command

analyze = pending_command("analyze", "Explain profiler traces: HTA breakdowns plus inference phases.")
