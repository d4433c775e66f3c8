"""The `infertrace serve` command."""

from infertrace.pending import pending_command

serve = pending_command("serve", "Serve the bundled engine over an OpenAI-compatible HTTP API.")
