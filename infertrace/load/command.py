"""The `infertrace bench` command."""

from infertrace.pending import pending_command

bench = pending_command("bench", "Load-test an OpenAI-compatible server or the bundled engine.")
