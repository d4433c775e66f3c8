"""What a run's series show, stated with their evidence: each rule is a function over the run's plain data that
returns a `Finding` or None. Rules and thresholds are documented in docs/report.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
from rich.table import Table

from infertrace.analyze.phases import CPU_BOUND
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import TelemetrySeries
from infertrace.load.records import RequestResult

if TYPE_CHECKING:
    import pandas as pd

# the client's headroom: bench warns past these (PointRecord.headroom_warnings) and the client_bottleneck rule fires
CLIENT_CPU_WARN = 0.8  # share of one core used by the load generator's event-loop thread
CLIENT_LAG_WARN_S = 0.010  # p99 of send lateness that is the client's own (slot waits excluded)
COALESCED_SHARE_WARN = 0.10  # share of inter-token gaps of 0: events read in one go with the event before
MIN_GROUP = 5  # requests on each side of a comparison
QUEUE_TTFT_RATIO = 2.0  # TTFT p99 with requests waiting over that with none
KV_FULL = 0.95  # KV usage share counted as full
CLOCK_DROP = 0.10  # a fall of the SM clock's median by this share, between before and after a change point
BUSY_UTIL_PCT = 50.0  # samples where the GPU was this busy: an idle GPU's low clock is no fall
MIN_SEGMENT = 3  # samples on each side of the clock's change point


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the run shows: `what` in a sentence, `when_s` seconds after the run's start (None: the whole
    run), the figures that show it, and the rule that fired."""

    rule: str
    what: str
    when_s: float | None
    evidence: str

    def to_json(self) -> dict:
        return asdict(self)


def find_all(results: list[RequestResult], origin: float, scrape: ScrapeSeries | None = None,
             telemetry: TelemetrySeries | None = None, client_cpu: float | None = None,
             client_lag_p99_ms: float | None = None, phases: pd.DataFrame | None = None,
             profile_window: tuple[float, float] | None = None) -> list[Finding]:
    """Every rule over one run. `origin` is the run's start on the clock of the records and series; `phases` the
    profiled window's phase summary (`infertrace analyze`), `profile_window` its start and stop calls."""
    found = [queueing(results, scrape, origin), kv_pressure(scrape, origin),
             *clock_drops(telemetry, origin), client_bottleneck(results, origin, client_cpu, client_lag_p99_ms),
             coalesced_events(results, client_cpu),
             *cpu_bound_steps(phases, origin, profile_window)]
    return [f for f in found if f is not None]


def _value_at(times: list[float], values: list[float | None], t: float) -> float | None:
    """The last sample at or before `t` (the first one for a time before any sample)."""
    i = int(np.searchsorted(np.asarray(times), t, side="right")) - 1
    return values[max(i, 0)] if times else None


def queueing(results: list[RequestResult], scrape: ScrapeSeries | None, origin: float) -> Finding | None:
    """TTFT p99 of requests sent while the server had requests waiting is QUEUE_TTFT_RATIO x that of requests
    sent with none waiting."""
    waiting = scrape.gauges.get("waiting") if scrape else None
    if not waiting:
        return None
    queued, free = [], []
    for r in results:
        if r.success and r.ttft is not None:
            w = _value_at(scrape.times, waiting, r.t0)
            if w is not None:
                (queued if w > 0 else free).append(r.ttft)
    if len(queued) < MIN_GROUP or len(free) < MIN_GROUP:
        return None
    p_queued, p_free = np.percentile(queued, 99), np.percentile(free, 99)
    if p_queued < QUEUE_TTFT_RATIO * p_free:
        return None
    start = next(t for t, w in zip(scrape.times, waiting) if w is not None and w > 0) - origin
    peak = max(w for w in waiting if w is not None)
    return Finding("queueing", f"TTFT p99 rose with waiting requests > 0 from {start:.1f} s (queueing)", start,
                   f"TTFT p99 {_s(p_queued)} over {len(queued)} requests sent while requests waited, against "
                   f"{_s(p_free)} over {len(free)} sent with none waiting; up to {peak:.0f} waiting")


def kv_pressure(scrape: ScrapeSeries | None, origin: float) -> Finding | None:
    """KV usage reached KV_FULL, or the server preempted requests."""
    if scrape is None:
        return None
    usage = scrape.gauges.get("kv_usage", [])
    full = [t for t, u in zip(scrape.times, usage) if u is not None and u >= KV_FULL]
    preemptions = scrape.deltas()["preemptions"] or 0
    if not full and not preemptions:
        return None
    counts = scrape.counters.get("preemptions", [])
    first_preempt = next((t for t, a, b in zip(scrape.times[1:], counts, counts[1:])
                          if a is not None and b is not None and b > a), None)
    peak = max((u for u in usage if u is not None), default=None)
    evidence = []
    if peak is not None:
        evidence.append(f"KV usage peaked at {peak:.0%}, at or above {KV_FULL:.0%} in {len(full)} of "
                        f"{sum(u is not None for u in usage)} scrapes")
    evidence.append(f"{preemptions:.0f} preemptions by the server's count over the run")
    if full:
        when = full[0] - origin
        what = f"KV cache above {KV_FULL:.0%} from {when:.1f} s, {preemptions:.0f} preemptions"
    else:
        when = first_preempt - origin if first_preempt is not None else None
        what = f"{preemptions:.0f} preemptions" + (f" from {when:.1f} s" if when is not None else "") + \
            f" with KV usage below {KV_FULL:.0%}"
    return Finding("kv_pressure", what, when, "; ".join(evidence))


def clock_drops(telemetry: TelemetrySeries | None, origin: float) -> list[Finding | None]:
    """Per GPU: the SM clock of its busy samples falls by CLOCK_DROP at a change point, with the throttle
    reason NVML gave most often after it."""
    if telemetry is None:
        return []
    return [_clock_drop(telemetry.times, g, origin) for g in telemetry.gpus]


def _clock_drop(times: list[float], gpu, origin: float) -> Finding | None:
    busy = [(t, c, r) for t, u, c, r in zip(times, gpu.sm_util_pct, gpu.sm_clock_mhz, gpu.throttle)
            if u is not None and c is not None and u >= BUSY_UTIL_PCT]
    if len(busy) < 2 * MIN_SEGMENT:
        return None
    clocks = np.array([c for _, c, _ in busy], dtype=np.float64)
    split = _change_point(clocks)
    before, after = float(np.median(clocks[:split])), float(np.median(clocks[split:]))
    drop = 1.0 - after / before if before > 0 else 0.0
    if drop < CLOCK_DROP:
        return None
    reasons = [name for _, _, r in busy[split:] for name in (r or [])]
    cause = max(set(reasons), key=reasons.count) if reasons else None
    share = reasons.count(cause) / (len(busy) - split) if cause else 0.0
    when = busy[split][0] - origin
    what = f"GPU {gpu.index} clock fell {drop:.0%} after {when:.1f} s" + (f" ({cause})" if cause else "")
    evidence = f"SM clock median {before:.0f} MHz before, {after:.0f} MHz after, over busy samples " \
               f"(SM utilisation >= {BUSY_UTIL_PCT:.0f}%)"
    evidence += f"; NVML reported {cause} in {share:.0%} of them after" if cause else "; NVML gave no reason"
    return Finding("clock_drop", what, when, evidence)


def _change_point(x: np.ndarray) -> int:
    """The split that leaves the least squared error around each side's mean (each side MIN_SEGMENT long)."""
    n = len(x)
    c1, c2 = np.concatenate(([0.0], np.cumsum(x))), np.concatenate(([0.0], np.cumsum(x * x)))
    best, best_cost = MIN_SEGMENT, np.inf
    for i in range(MIN_SEGMENT, n - MIN_SEGMENT + 1):
        left = c2[i] - c1[i] ** 2 / i
        right = (c2[n] - c2[i]) - (c1[n] - c1[i]) ** 2 / (n - i)
        if left + right < best_cost:
            best, best_cost = i, left + right
    return best


def client_bottleneck(results: list[RequestResult], origin: float, client_cpu: float | None,
                      client_lag_p99_ms: float | None) -> Finding | None:
    """The load generator's thread used more than CLIENT_CPU_WARN of a core, or sent requests more than
    CLIENT_LAG_WARN_S late at p99 (lateness of its own: slot waits excluded), the thresholds of bench's
    headroom warnings."""
    busy_cpu = client_cpu is not None and client_cpu > CLIENT_CPU_WARN
    late = client_lag_p99_ms is not None and client_lag_p99_ms > CLIENT_LAG_WARN_S * 1000
    if not (busy_cpu or late):
        return None
    first_late = min((r.t0 for r in results if r.schedule_lag - r.slot_wait > CLIENT_LAG_WARN_S), default=None)
    evidence = []
    if client_cpu is not None:
        evidence.append(f"load generator at {client_cpu:.0%} of a CPU core (limit {CLIENT_CPU_WARN:.0%})")
    if client_lag_p99_ms is not None:
        evidence.append(f"sends {client_lag_p99_ms:.1f} ms late at p99 (limit {CLIENT_LAG_WARN_S * 1000:.0f} ms)")
    when = first_late - origin if late and first_late is not None else None
    return Finding("client_bottleneck", "the client was the bottleneck: the server's figures understate it",
                   when, "; ".join(evidence))


def coalesced_gaps(results: list[RequestResult]) -> tuple[int, int]:
    """(gaps of 0, all gaps) between consecutive output events of the successful requests. Events that came in
    one network read share its arrival time, so a gap of 0 is an event the client read in one go with the one
    before: it had waited in the socket for the client."""
    gaps = [g for r in results if r.success for g in r.itl]
    return sum(g == 0.0 for g in gaps), len(gaps)


def coalesced_events(results: list[RequestResult], client_cpu: float | None) -> Finding | None:
    """At least COALESCED_SHARE_WARN of the inter-token gaps are 0: events arrived in bulk, so ITL (per chunk)
    shows the client's reads, not the server's steps. With the client's thread busy, the client could not keep
    up; with it idle, the server or the network sent the events together."""
    zero, total = coalesced_gaps(results)
    if total < MIN_GROUP or zero / total < COALESCED_SHARE_WARN:
        return None
    share = zero / total
    evidence = f"{zero} of {total} inter-token gaps were 0 ms ({share:.0%}): those events were read in one network " \
               f"read with the event before (limit {COALESCED_SHARE_WARN:.0%})"
    if client_cpu is not None:
        evidence += f"; load generator at {client_cpu:.0%} of a CPU core"
    if client_cpu is None or client_cpu > CLIENT_CPU_WARN / 2:
        what = (f"{share:.0%} of streamed events arrived coalesced: the client could not keep up, so ITL is the "
                "client's read spacing; spread the load over processes with --workers N")
    else:
        what = (f"{share:.0%} of streamed events arrived coalesced while the client had headroom: the server (or "
                "the network) sent them together, so ITL per chunk counts bursts")
    return Finding("coalesced_events", what, None, evidence)


def cpu_bound_steps(phases: pd.DataFrame | None, origin: float,
                    profile_window: tuple[float, float] | None) -> list[Finding]:
    """Per step type of the profiled window that `infertrace analyze` judged CPU-bound: host wait at least GPU
    busy. `when_s` is the profiler's start (None when the window's time is unknown)."""
    if phases is None or phases.empty or "verdict" not in phases:
        return []
    when = profile_window[0] - origin if profile_window is not None else None
    found = []
    for r in phases[phases["verdict"] == CPU_BOUND].to_dict("records"):
        busy, host = r["gpu_busy_share"], r["host_wait_share"]
        what = (f"{r['type']} steps were CPU-bound in the profiled window: the GPU waited for the host {host:.0%} "
                "of their time")
        evidence = (f"GPU busy {busy:.1%}, host wait {host:.1%} over {r['steps']} steps; step time "
                    f"{r['step_mean (ms)']:.2f} ms mean, {r['step_p99 (ms)']:.2f} ms p99; "
                    f"{r['kernels_per_step']:.1f} kernels per step (analyze's verdict: host wait >= GPU busy)")
        found.append(Finding("cpu_bound", what, when, evidence))
    return found


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def findings_table(findings: list[Finding]) -> Table:
    """The findings as a rich table, the same columns as the HTML and the JSON."""
    table = Table(title="findings", title_justify="left")
    for column in ("finding", "from (s)", "evidence", "rule"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f.what, "-" if f.when_s is None else f"{f.when_s:.1f}", f.evidence, f.rule)
    return table
