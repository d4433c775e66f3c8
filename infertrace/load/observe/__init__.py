"""What the server and the GPU said meanwhile: Prometheus scrapes, NVML telemetry, the server's counters, the
profiled window, and the findings they support."""
