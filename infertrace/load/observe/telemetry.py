"""GPU telemetry alongside a load run, through NVML (`nvidia-ml-py`, imported as `pynvml`), on the run's clock.

Sampling runs on its own thread: an NVML call can take milliseconds and must never stall the load's event loop.
Without NVML (no driver, no GPU, a remote server's GPU) it is skipped with one note.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_TELEMETRY_INTERVAL_S = 0.5

# NVML's clock-event reason bits (nvml.h `nvmlClocksEventReason*`, formerly `nvmlClocksThrottleReason*`), by the
# name a reader knows them by; the idle bit is left out: an idle GPU is not a throttled one.
THROTTLE_REASONS = {
    0x2: "applications clocks setting", 0x4: "power cap", 0x8: "hardware slowdown", 0x10: "sync boost",
    0x20: "thermal (software)", 0x40: "thermal (hardware)", 0x80: "power brake", 0x100: "display clock",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


@dataclass(slots=True)
class GpuSeries:
    """One GPU's samples; each list is aligned with `TelemetrySeries.times` (None where a query failed)."""

    index: int
    name: str
    sm_util_pct: list[float | None] = field(default_factory=list)
    mem_used_gib: list[float | None] = field(default_factory=list)
    power_w: list[float | None] = field(default_factory=list)
    sm_clock_mhz: list[float | None] = field(default_factory=list)
    throttle: list[list[str] | None] = field(default_factory=list)
    energy_j: list[float | None] = field(default_factory=list)  # NVML's energy counter since the driver loaded

    def to_json(self) -> dict:
        return {"index": self.index, "name": self.name, "sm_util_pct": self.sm_util_pct,
                "mem_used_gib": self.mem_used_gib, "power_w": self.power_w, "sm_clock_mhz": self.sm_clock_mhz,
                "throttle": self.throttle, "energy_j": self.energy_j}

    def energy(self, times: list[float]) -> tuple[float, str] | None:
        """(joules over the samples, how): the growth of NVML's energy counter (Volta and later) between the
        first and last sample that read it, else the power samples integrated over time (trapezoids); None with
        fewer than two readings of either."""
        counter = [(t, e) for t, e in zip(times, self.energy_j) if e is not None]
        if len(counter) >= 2 and counter[-1][1] >= counter[0][1]:
            return counter[-1][1] - counter[0][1], "NVML energy counter"
        power = [(t, p) for t, p in zip(times, self.power_w) if p is not None]
        if len(power) < 2:
            return None
        joules = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(power, power[1:]))
        return joules, "NVML power integrated"


@dataclass(slots=True)
class TelemetrySeries:
    times: list[float] = field(default_factory=list)  # clock seconds
    gpus: list[GpuSeries] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self, origin: float = 0.0) -> dict:
        return {"times_s": [t - origin for t in self.times], "gpus": [g.to_json() for g in self.gpus],
                "notes": list(self.notes)}

    def energy(self) -> dict | None:
        """Joules used by every GPU sampled, over the samples' span; None when no GPU gave two readings."""
        parts = [e for g in self.gpus if (e := g.energy(self.times)) is not None]
        if not parts:
            return None
        methods = sorted({how for _, how in parts})
        return {"joules": sum(j for j, _ in parts), "seconds": self.times[-1] - self.times[0], "gpus": len(parts),
                "method": " and ".join(methods)}


def energy_per_token(telemetry: TelemetrySeries | None, output_tokens: int) -> dict | None:
    """The GPUs' energy over the measured window and per output token (vLLM reports J/token the same way: energy
    over the window / the tokens generated in it); None without telemetry or tokens."""
    energy = telemetry.energy() if telemetry is not None else None
    if energy is None or output_tokens <= 0:
        return None
    return {**energy, "joules_per_output_token": energy["joules"] / output_tokens}


def url_is_local(url: str | None) -> bool:
    """The server at `url` runs on this host (so NVML here sees its GPUs); None means the bundled engine."""
    if url is None:
        return True
    import socket
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    return host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127.") or \
        host in (socket.gethostname().lower(), socket.getfqdn().lower())


def load_nvml():
    """The `pynvml` module, or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuSampler:
    """Samples every GPU NVML sees each `interval_s` seconds on a background thread, times from `clock`.

    `nvml` is the module to query (`pynvml` by default; tests pass a fake). `start()` returns False, with a note
    in `series.notes`, when NVML cannot be used here."""

    def __init__(self, interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S, clock: Callable[[], float] = time.perf_counter,
                 nvml=None) -> None:
        if not interval_s > 0:
            raise ValueError(f"telemetry interval must be a positive number of seconds, not {interval_s}")
        self.interval_s = interval_s
        self.clock = clock
        self.nvml = nvml if nvml is not None else load_nvml()
        self.series = TelemetrySeries()
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> bool:
        """Initialises NVML and finds the GPUs; False (and one note) when there is no NVML or no GPU."""
        if self.nvml is None:
            self.series.notes.append("nvidia-ml-py is not installed: GPU telemetry skipped")
            return False
        try:
            self.nvml.nvmlInit()
            count = self.nvml.nvmlDeviceGetCount()
            for i in range(count):
                handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
                name = self.nvml.nvmlDeviceGetName(handle)
                self._handles.append(handle)
                self.series.gpus.append(GpuSeries(i, name.decode() if isinstance(name, bytes) else str(name)))
        except Exception as e:  # pynvml raises NVMLError subclasses, or OSError from the loader
            self.series.notes.append(f"NVML is not available here ({e}): GPU telemetry skipped")
            self._handles, self.series.gpus = [], []
            return False
        if not self._handles:
            self.series.notes.append("NVML sees no GPU: GPU telemetry skipped")
            self.nvml.nvmlShutdown()
            return False
        return True

    def sample(self) -> None:
        """One sample of every GPU, at the clock's time when it began."""
        self.series.times.append(self.clock())
        for handle, gpu in zip(self._handles, self.series.gpus):
            gpu.sm_util_pct.append(self._query(lambda: float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
            gpu.mem_used_gib.append(self._query(lambda: self.nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30))
            gpu.power_w.append(self._query(lambda: self.nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
            gpu.sm_clock_mhz.append(self._query(
                lambda: float(self.nvml.nvmlDeviceGetClockInfo(handle, self.nvml.NVML_CLOCK_SM))))
            gpu.throttle.append(self._query(lambda: throttle_names(self._reasons(handle))))
            gpu.energy_j.append(self._energy(handle))

    def _energy(self, handle) -> float | None:
        """Joules since the driver loaded (nvmlDeviceGetTotalEnergyConsumption, in mJ; Volta and later), or None
        where the binding or the GPU lacks it: then energy is integrated from the power samples, without a note."""
        query = getattr(self.nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
        if query is None:
            return None
        try:
            return query(handle) / 1000.0
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported on older GPUs
            return None

    def _reasons(self, handle) -> int:
        # renamed in NVML 12.2 (clock "events"); older bindings have only the throttle name
        query = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(query(handle))

    def _query(self, fn):
        try:
            return fn()
        except Exception as e:  # one query unsupported on this GPU (power on some boards): a gap, noted once
            note = f"an NVML query failed ({e}): gaps in GPU telemetry"
            if note not in self.series.notes:
                self.series.notes.append(note)
            return None

    def start(self) -> bool:
        if not self.open():
            return False
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            self.sample()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def stop(self) -> TelemetrySeries:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.nvml.nvmlShutdown()
        return self.series

    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
