"""What a run produced: metrics, steady state, the result file and per-request lines, tables and plots."""
