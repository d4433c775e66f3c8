"""Load generation for `infertrace bench`: datasets, arrival schedules, one streaming timing loop, metrics."""
