"""The `infertrace ablate` command."""

from infertrace.pending import pending_command

ablate = pending_command("ablate", "Run phase-by-phase ablations of the bundled engine from a recipe.")
