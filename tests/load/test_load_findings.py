"""Each finding rule fires on a series built to trigger it and stays silent on one built not to."""

import json

import pandas as pd
from rich.console import Console

from infertrace.load.observe.findings import (
    Finding,
    client_bottleneck,
    clock_drops,
    cpu_bound_steps,
    find_all,
    findings_table,
    kv_pressure,
    queueing,
)
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import GpuSeries, TelemetrySeries
from infertrace.load.records import RequestResult

ORIGIN = 1000.0


def _request(i, t0, ttft, lag=0.0):
    return RequestResult(index=i, scheduled=t0 - lag, t0=t0, end=t0 + ttft + 1.0, ttft=ttft, e2el=ttft + 1.0,
                         output_tokens=50)


def _scrape(waiting=None, kv=None, preemptions=None, n=60):
    s = ScrapeSeries("http://x/metrics", 1.0)
    for i in range(n):
        gauges, counters = {}, {}
        if waiting:
            gauges["waiting"] = waiting(i)
        if kv:
            gauges["kv_usage"] = kv(i)
        if preemptions:
            counters["preemptions"] = preemptions(i)
        s.add(ORIGIN + i, gauges, counters)
    return s


def test_queueing_fires_when_ttft_rises_with_waiting_requests():
    scrape = _scrape(waiting=lambda i: 0 if i < 12 else 8)
    results = [_request(i, ORIGIN + i * 0.5, 0.2 if i * 0.5 < 12 else 3.0) for i in range(100)]
    f = queueing(results, scrape, ORIGIN)
    assert f is not None and f.rule == "queueing" and f.when_s == 12.0
    assert f.what == "TTFT p99 rose with waiting requests > 0 from 12.0 s (queueing)"
    assert "3.00 s over 76 requests" in f.evidence and "200 ms over 24" in f.evidence


def test_queueing_silent_when_ttft_does_not_depend_on_waiting():
    scrape = _scrape(waiting=lambda i: 0 if i < 12 else 8)
    results = [_request(i, ORIGIN + i * 0.5, 0.2) for i in range(100)]
    assert queueing(results, scrape, ORIGIN) is None
    assert queueing(results, None, ORIGIN) is None  # no server series: nothing to say


def test_kv_pressure_fires_with_full_cache_and_preemptions():
    scrape = _scrape(kv=lambda i: 0.5 if i < 30 else 0.97, preemptions=lambda i: max(0, i - 30) * 2)
    f = kv_pressure(scrape, ORIGIN)
    assert f is not None and f.when_s == 30.0
    assert f.what == "KV cache above 95% from 30.0 s, 58 preemptions"
    assert "peaked at 97%" in f.evidence


def test_kv_pressure_fires_on_preemptions_alone():
    scrape = _scrape(kv=lambda i: 0.8, preemptions=lambda i: 0 if i < 40 else 5)
    f = kv_pressure(scrape, ORIGIN)
    assert f is not None and f.when_s == 40.0 and f.what.startswith("5 preemptions from 40.0 s")


def test_kv_pressure_silent_below_threshold_without_preemptions():
    assert kv_pressure(_scrape(kv=lambda i: 0.9, preemptions=lambda i: 3), ORIGIN) is None


def _telemetry(clock, util=lambda i: 95.0, reasons=lambda i: [], n=120):
    g = GpuSeries(0, "H100")
    for i in range(n):
        g.sm_util_pct.append(util(i))
        g.sm_clock_mhz.append(clock(i))
        g.mem_used_gib.append(60.0)
        g.power_w.append(690.0)
        g.throttle.append(reasons(i))
    return TelemetrySeries(times=[ORIGIN + i for i in range(n)], gpus=[g])


def test_clock_drop_fires_with_its_cause():
    tel = _telemetry(lambda i: 1980.0 if i < 90 else 1620.0,
                     reasons=lambda i: ["power cap"] if i >= 90 else [])
    [f] = clock_drops(tel, ORIGIN)
    assert f is not None and f.when_s == 90.0
    assert f.what == "GPU 0 clock fell 18% after 90.0 s (power cap)"
    assert "1980 MHz before, 1620 MHz after" in f.evidence and "power cap in 100%" in f.evidence


def test_clock_drop_silent_on_a_steady_clock_and_on_idle_dips():
    assert clock_drops(_telemetry(lambda i: 1980.0 - (i % 3) * 10), ORIGIN) == [None]
    # the clock is low only while the GPU is idle: not a fall
    idle = _telemetry(lambda i: 1980.0 if i < 60 else 800.0, util=lambda i: 95.0 if i < 60 else 0.0)
    assert clock_drops(idle, ORIGIN) == [None]


def test_client_bottleneck_fires_on_cpu_or_lateness():
    results = [_request(i, ORIGIN + i, 0.1, lag=0.05 if i >= 7 else 0.0) for i in range(10)]
    f = client_bottleneck(results, ORIGIN, client_cpu=0.95, client_lag_p99_ms=48.0)
    assert f is not None and f.when_s == 7.0 and f.rule == "client_bottleneck"
    assert "95% of a CPU core (limit 80%)" in f.evidence and "48.0 ms late at p99 (limit 10 ms)" in f.evidence
    cpu_only = client_bottleneck(results, ORIGIN, client_cpu=0.9, client_lag_p99_ms=1.0)
    assert cpu_only is not None and cpu_only.when_s is None


def test_client_bottleneck_silent_with_headroom():
    assert client_bottleneck([], ORIGIN, client_cpu=0.3, client_lag_p99_ms=2.0) is None
    assert client_bottleneck([], ORIGIN, client_cpu=None, client_lag_p99_ms=None) is None


def _phases(*rows):
    """analyze's phase summary: (type, steps, step mean ms, GPU busy share, host-wait share, kernels/step, verdict)."""
    return pd.DataFrame([{"type": t, "steps": n, "bs": 8.0, "toks": None, "step_mean (ms)": ms, "step_p50 (ms)": ms,
                          "step_p99 (ms)": 1.5 * ms, "cpu_mean (ms)": ms, "spacing_p50 (ms)": ms,
                          "gpu_busy_share": busy, "host_wait_share": host, "kernels_per_step": k, "verdict": v}
                         for t, n, ms, busy, host, k, v in rows])


WINDOW = (ORIGIN + 30.0, ORIGIN + 40.0)


def test_cpu_bound_fires_per_cpu_bound_step_type():
    phases = _phases(("DECODE", 400, 21.4, 0.91, 0.03, 310.0, "GPU-bound"),
                     ("PREFILL", 12, 40.2, 0.098, 0.89, 1210.0, "CPU-bound"),
                     ("MIXED", 57, 64.0, 0.30, 0.52, 402.0, "CPU-bound"))
    found = cpu_bound_steps(phases, ORIGIN, WINDOW)
    assert [f.rule for f in found] == ["cpu_bound", "cpu_bound"] and [f.when_s for f in found] == [30.0, 30.0]
    prefill = found[0]
    assert prefill.what == ("PREFILL steps were CPU-bound in the profiled window: the GPU waited for the host 89% "
                            "of their time")
    for part in ("GPU busy 9.8%", "host wait 89.0%", "step time 40.20 ms mean, 60.30 ms p99",
                 "1210.0 kernels per step", "over 12 steps", "host wait >= GPU busy"):
        assert part in prefill.evidence, part
    assert found[1].what.startswith("MIXED steps were CPU-bound")
    assert cpu_bound_steps(phases, ORIGIN, None)[0].when_s is None  # a window of unknown time


def test_cpu_bound_silent_on_gpu_bound_or_mixed_steps_and_without_phases():
    phases = _phases(("DECODE", 400, 21.4, 0.91, 0.03, 310.0, "GPU-bound"),
                     ("PREFILL", 12, 40.2, 0.55, 0.40, 1210.0, "mixed"),
                     ("IDLE", 3, 0.2, 0.0, 0.0, 0.0, "no GPU work"))
    assert cpu_bound_steps(phases, ORIGIN, WINDOW) == []
    assert cpu_bound_steps(None, ORIGIN, WINDOW) == [] and cpu_bound_steps(pd.DataFrame(), ORIGIN, WINDOW) == []


def test_find_all_and_the_same_record_in_json_and_table():
    scrape = _scrape(kv=lambda i: 0.99, preemptions=lambda i: i)
    found = find_all([], ORIGIN, scrape=scrape, client_cpu=0.1)
    assert [f.rule for f in found] == ["kv_pressure"]
    cpu = _phases(("PREFILL", 12, 40.2, 0.098, 0.89, 1210.0, "CPU-bound"))
    assert [f.rule for f in find_all([], ORIGIN, scrape=scrape, phases=cpu, profile_window=WINDOW)] == \
        ["kv_pressure", "cpu_bound"]
    doc = json.loads(json.dumps([f.to_json() for f in found]))
    assert doc == [{"rule": "kv_pressure", "what": found[0].what, "when_s": 0.0, "evidence": found[0].evidence}]
    console = Console(width=200, record=True)
    console.print(findings_table(found))
    text = console.export_text()
    assert found[0].what in text and "kv_pressure" in text


def test_finding_is_a_plain_record():
    f = Finding("r", "w", None, "e")
    assert f.to_json() == {"rule": "r", "what": "w", "when_s": None, "evidence": "e"}


def _streamed(i, gaps):
    return RequestResult(index=i, scheduled=ORIGIN + i, t0=ORIGIN + i, end=ORIGIN + i + 2.0, ttft=0.1, e2el=1.0,
                         itl=list(gaps), output_tokens=len(gaps) + 1)


def test_coalesced_events_fire_with_their_share_and_suggest_workers():
    """256 streams through one client: most events came in a read with the one before (ITL p50 0.0)."""
    from infertrace.load.observe.findings import coalesced_events, coalesced_gaps

    results = [_streamed(i, [0.0, 0.0, 0.004, 0.0]) for i in range(10)]
    assert coalesced_gaps(results) == (30, 40)
    busy = coalesced_events(results, client_cpu=0.8)
    assert busy.rule == "coalesced_events" and "--workers" in busy.what and "could not keep up" in busy.what
    assert busy.evidence.startswith("30 of 40 inter-token gaps were 0 ms (75%)") and "80% of a CPU core" in busy.evidence
    idle = coalesced_events(results, client_cpu=0.05)
    assert "--workers" not in idle.what and "server (or the network) sent them together" in idle.what
    assert [f.rule for f in find_all(results, ORIGIN, client_cpu=0.8)] == ["coalesced_events"]


def test_coalesced_events_silent_when_events_come_one_read_each():
    from infertrace.load.observe.findings import coalesced_events

    spread = [_streamed(i, [0.004] * 19 + [0.0]) for i in range(10)]  # a finish chunk read with the last token
    assert coalesced_events(spread, client_cpu=0.9) is None
    failed = [RequestResult(index=0, scheduled=0.0, t0=0.0, end=1.0, itl=[0.0] * 50, error="HTTP 500: x")]
    assert coalesced_events(failed, client_cpu=0.9) is None
