"""A realistic synthetic run: records, server scrapes and GPU telemetry that show queueing, KV pressure and a
power-capped clock, on one clock."""

import numpy as np
import pandas as pd
import pytest

from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import GpuSeries, TelemetrySeries
from infertrace.load.records import RequestResult, TokenSource

ORIGIN = 5000.0  # perf_counter seconds at the run's start
DURATION_S = 180


def synthetic_run(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    waiting_at = lambda t: 0.0 if t < 60 else min(40.0, (t - 60) * 0.6)  # noqa: E731
    results = []
    t = 0.0
    i = 0
    while t < DURATION_S - 15:
        t += rng.exponential(1 / 4.0)
        ttft = 0.08 + rng.gamma(2.0, 0.02) + 0.25 * waiting_at(t)
        out = int(rng.integers(64, 256))
        itl = list(rng.gamma(8.0, 0.0035 if t < 120 else 0.0043, size=out - 1))
        start = ORIGIN + t
        e2el = ttft + sum(itl)
        results.append(RequestResult(
            index=i, scheduled=start, t0=start, end=start + e2el, ttft=ttft, e2el=e2el, itl=itl,
            chunk_tokens=[1] * out, output_tokens=out, output_source=TokenSource.USAGE, prompt_tokens=512))
        i += 1
    scrape = ScrapeSeries("http://127.0.0.1:8000/metrics", 1.0, server="vllm", scrapes=DURATION_S)
    preempt = 0.0
    for s in range(DURATION_S):
        kv = min(0.99, 0.35 + s * 0.0065)
        if kv >= 0.95 and rng.random() < 0.5:
            preempt += 1
        running = float(sum(1 for r in results if r.t0 <= ORIGIN + s < r.end))
        scrape.add(ORIGIN + s + 0.5, {"running": running, "waiting": waiting_at(s), "kv_usage": kv},
                   {"preemptions": preempt, "prefix_cache_hits": 200.0 * s, "prefix_cache_queries": 1000.0 * s,
                    "generation_tokens": 3000.0 * s, "prompt_tokens": 2000.0 * s})
    gpu = GpuSeries(0, "NVIDIA H100 80GB HBM3")
    times = []
    for k in range(DURATION_S * 2):
        s = k / 2
        times.append(ORIGIN + s)
        capped = s >= 120
        gpu.sm_util_pct.append(float(min(100, 80 + rng.normal(10, 4))))
        gpu.mem_used_gib.append(71.5 + 0.01 * s)
        gpu.power_w.append(float(700 if capped else 560 + s) + rng.normal(0, 5))
        gpu.sm_clock_mhz.append(float((1620 if capped else 1980) + rng.normal(0, 8)))
        gpu.throttle.append(["power cap"] if capped else [])
    telemetry = TelemetrySeries(times=times, gpus=[gpu])
    phases = pd.DataFrame([
        {"type": "DECODE", "steps": 412, "bs": 38.2, "toks": float("nan"), "step_mean (ms)": 21.4,
         "step_p50 (ms)": 20.9, "step_p99 (ms)": 27.3, "cpu_mean (ms)": 6.1, "spacing_p50 (ms)": 21.0,
         "gpu_busy_share": 0.91, "host_wait_share": 0.03, "kernels_per_step": 310.0, "verdict": "GPU-bound"},
        {"type": "MIXED", "steps": 57, "bs": 35.0, "toks": 2210.0, "step_mean (ms)": 64.2, "step_p50 (ms)": 61.0,
         "step_p99 (ms)": 88.5, "cpu_mean (ms)": 9.3, "spacing_p50 (ms)": 63.8, "gpu_busy_share": 0.95,
         "host_wait_share": 0.01, "kernels_per_step": 402.0, "verdict": "GPU-bound"},
    ])
    result = {"completed": len(results), "failed": 0, "duration": 165.2, "request_throughput": 4.02,
              "output_throughput": 640.3, "mean_ttft_ms": 1650.2, "p99_ttft_ms": 9800.5, "mean_tpot_ms": 28.1,
              "client_cpu_percent": 21.5, "client_lag_p99_ms": 0.8, "headroom_warnings": []}
    return {"results": results, "origin": ORIGIN, "scrape": scrape, "telemetry": telemetry,
            "profile_window": (ORIGIN + 30.0, ORIGIN + 40.0), "phases": phases, "result": result,
            "client_cpu": 0.215, "client_lag_p99_ms": 0.8}


@pytest.fixture
def run() -> dict:
    return synthetic_run()


def write_profiled_trace(path, start_us: float = 1_000_000.0) -> float:
    """A Kineto trace of an engine's profiled window: one GPU-bound PREFILL step, then DECODE steps whose 10 us
    kernels are launched 100 us apart (the GPU waits on the host: CPU-bound). Returns the trace's span in
    seconds, from its first event's start to its last event's end."""
    import json

    events, corr = [], 0

    def add(cat, name, ts, dur, args=None, gpu=False):
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu else 100, "tid": 7 if gpu else 100,
                       "ts": start_us + ts, "dur": dur, "args": args or {}})

    add("user_annotation", "step[PREFILL bs=2 toks=300]", 0, 400)
    for k in range(3):
        corr += 1
        add("cuda_runtime", "cudaLaunchKernel", 10 + 5 * k, 4, {"correlation": corr})
        add("kernel", f"gemm_{k}", 30 + 120 * k, 120, {"stream": 7, "correlation": corr}, gpu=True)
    for step in range(20):  # one DECODE step every 100 ms: the window spans about 1.9 s
        t0 = 100_000 * (step + 1)
        add("user_annotation", "step[DECODE bs=2]", t0, 300)
        for k in range(3):
            corr += 1
            add("cuda_runtime", "cudaLaunchKernel", t0 + 50 + 100 * k, 5, {"correlation": corr})
            add("kernel", f"gemv_{k}", t0 + 56 + 100 * k, 10, {"stream": 7, "correlation": corr}, gpu=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    last = max(e["ts"] + e["dur"] for e in events)
    return (last - min(e["ts"] for e in events)) / 1e6


@pytest.fixture
def profiled_trace():
    """`span_s = profiled_trace(path)` writes the trace of `write_profiled_trace`."""
    return write_profiled_trace


def pytest_configure(config):
    # HTA 0.5.0 trips pandas deprecation warnings when the profiled window is analysed; they are HTA's, not ours
    config.addinivalue_line("filterwarnings", "ignore::Warning:hta")
