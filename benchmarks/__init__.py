"""Benchmark scripts of infertrace, run from the repository root as `python benchmarks/NAME.py` (README.md lists
them); `common` holds what they share. Nothing in infertrace/ imports them."""
