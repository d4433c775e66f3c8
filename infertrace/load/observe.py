"""What the server and the GPU said while a run was measured: the server's /metrics scraped on the run's clock and
NVML samples of a local GPU, started around the measured window and kept with its figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from infertrace.load.clock import Clock
from infertrace.load.scrape import ScrapeSeries, Scraper, metrics_url
from infertrace.load.telemetry import GpuSampler, TelemetrySeries


@dataclass(slots=True)
class Observed:
    origin: float  # the measured window's start on the records' clock: every series time counts from here
    scrape: ScrapeSeries | None = None
    telemetry: TelemetrySeries | None = None
    profile_window: tuple[float, float] | None = None  # clock seconds of the profiler's start and stop
    notes: list[str] = field(default_factory=list)

    def to_json(self, start: float | None = None, end: float | None = None) -> dict:
        return {
            "server_metrics": self.scrape.to_json(self.origin, start, end) if self.scrape is not None else None,
            "gpu_telemetry": self.telemetry.to_json(self.origin) if self.telemetry is not None else None,
            "profile_window_s": None if self.profile_window is None else
            [t - self.origin for t in self.profile_window],
            "notes": self.notes + (self.scrape.notes if self.scrape else []) +
            (self.telemetry.notes if self.telemetry else []),
        }


class Observer:
    """`async with Observer(...) as observed:` (or start()/stop()) around a measured window."""

    def __init__(self, scrape_interval_s: float, metrics_at: str | None, base_url: str | None, headers: dict,
                 clock: Clock, telemetry: bool = True) -> None:
        self.clock = clock
        self.observed = Observed(origin=clock.now())
        self._scraper = None
        if base_url is None:
            self.observed.notes.append("the bundled engine runs in-process: no /metrics to scrape")
        elif scrape_interval_s > 0:
            self._scraper = Scraper(metrics_at or metrics_url(base_url), scrape_interval_s, clock.now, headers)
        self._sampler = GpuSampler(clock=clock.now) if telemetry else None

    async def start(self) -> Observed:
        if self._scraper is not None:
            await self._scraper.start()
        if self._sampler is not None:
            self._sampler.start()
        return self.observed

    async def stop(self) -> Observed:
        if self._scraper is not None:
            self.observed.scrape, self._scraper = await self._scraper.stop(), None
        if self._sampler is not None:
            self.observed.telemetry, self._sampler = self._sampler.stop(), None
        return self.observed

    async def __aenter__(self) -> Observed:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def run_findings(record) -> list:
    """What a measured run shows (docs/report.md's rules), from its records and what was observed beside them."""
    from infertrace.load.findings import find_all

    observed = record.observed
    if observed is None:
        return []
    return find_all(record.results, observed.origin, observed.scrape, observed.telemetry, record.client_cpu,
                    record.client_lag.p99)
