"""Load generation for `infertrace bench`, in the order a run goes: workloads -> client -> run -> observe ->
results, with benchmark.py (one run), capacity.py (the SLO search) and options.py (the flags) on top, and the
vocabulary every stage shares (config, records, clock, stats) beside them. docs/architecture.md maps it."""
