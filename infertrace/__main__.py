"""`python -m infertrace`: the same entry point as the `infertrace` command."""

from infertrace.cli import main

if __name__ == "__main__":
    main(prog_name="infertrace")
