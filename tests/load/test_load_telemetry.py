"""GPU telemetry: the real no-NVML path on this host, and the sampling logic against a fake NVML module."""

import time
import types

import pytest

from infertrace.load.clock import ScriptedClock
from infertrace.load.observe.telemetry import GpuSampler, load_nvml, throttle_names


def _nvml_works() -> bool:
    nvml = load_nvml()
    if nvml is None:
        return False
    try:
        nvml.nvmlInit()
    except Exception:
        return False
    nvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_works(), reason="NVML works on this host: the no-NVML path cannot be taken for real")
def test_without_nvml_it_is_skipped_with_one_note():
    sampler = GpuSampler(0.01)
    assert sampler.start() is False
    series = sampler.stop()
    assert len(series.notes) == 1 and "GPU telemetry skipped" in series.notes[0]
    assert series.times == [] and series.gpus == []
    assert series.to_json() == {"times_s": [], "gpus": [], "notes": series.notes}


def test_without_the_package_it_is_one_note():
    sampler = GpuSampler(0.01)
    sampler.nvml = None
    assert sampler.start() is False and sampler.series.notes == ["nvidia-ml-py is not installed: GPU telemetry skipped"]


class FakeNvml(types.SimpleNamespace):
    """Two GPUs whose SM clock falls and whose power reading fails on the second board."""

    NVML_CLOCK_SM = 1

    def __init__(self):
        super().__init__(calls=0, inits=0, shutdowns=0)

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"h{i}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, h):
        self.calls += 1
        return types.SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == "h1":
            raise RuntimeError("Not Supported")
        return 700_000  # milliwatts

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return 1980 if self.calls <= 2 else 1600

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 if self.calls > 2 else 0x1  # power cap once the clock falls; idle bit is not a throttle


def test_sampling_with_a_fake_nvml_on_a_scripted_clock():
    nvml, clock = FakeNvml(), ScriptedClock(start=100.0)
    sampler = GpuSampler(1.0, clock.now, nvml=nvml)
    assert sampler.open()
    for _ in range(2):
        sampler.sample()
        clock.advance(1.0)
    series = sampler.series
    assert series.times == [100.0, 101.0]
    g0, g1 = series.gpus
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.sm_util_pct == [97.0, 97.0]
    assert g0.mem_used_gib == [40.0, 40.0] and g0.power_w == [700.0, 700.0]
    assert g0.sm_clock_mhz == [1980.0, 1600.0] and g0.throttle == [[], ["power cap"]]
    assert g1.power_w == [None, None]  # an unsupported query is a gap, noted once
    assert len(series.notes) == 1 and "Not Supported" in series.notes[0]
    assert series.to_json(origin=100.0)["times_s"] == [0.0, 1.0]


def test_background_thread_samples_and_stops():
    nvml = FakeNvml()
    sampler = GpuSampler(0.01, nvml=nvml)
    assert sampler.start()
    time.sleep(0.1)
    series = sampler.stop()
    assert len(series.times) >= 3 and all(len(g.sm_clock_mhz) == len(series.times) for g in series.gpus)
    assert nvml.inits == 1 and nvml.shutdowns == 1


def test_older_bindings_with_only_the_throttle_name():
    nvml = FakeNvml()
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x40 | 0x4
    nvml.nvmlDeviceGetCurrentClocksEventReasons = None  # the newer call is absent
    sampler = GpuSampler(1.0, nvml=nvml)
    sampler.open()
    sampler.sample()
    assert sampler.series.gpus[0].throttle == [["power cap", "thermal (hardware)"]]


def test_throttle_names():
    assert throttle_names(0x1) == [] and throttle_names(0x24) == ["power cap", "thermal (software)"]


def test_energy_from_nvmls_counter_where_the_binding_has_it():
    """A stand-in pynvml with nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded): the window's energy
    is the counter's growth, not the power integral."""
    nvml, clock = FakeNvml(), ScriptedClock(start=10.0)
    readings = iter([5_000_000, 9_000_000, 5_000_500, 9_000_900, 5_002_100, 9_001_700])  # h0, h1, h0, h1, ...
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(readings)
    sampler = GpuSampler(1.0, clock.now, nvml=nvml)
    sampler.open()
    for _ in range(3):
        sampler.sample()
        clock.advance(1.0)
    g0, g1 = sampler.series.gpus
    assert g0.energy_j == [5000.0, 5000.5, 5002.1] and g1.energy_j == [9000.0, 9000.9, 9001.7]
    energy = sampler.series.energy()
    assert energy == {"joules": pytest.approx(2.1 + 1.7), "seconds": 2.0, "gpus": 2, "method": "NVML energy counter"}


def test_energy_integrates_power_without_the_counter():
    from infertrace.load.observe.telemetry import energy_per_token

    nvml, clock = FakeNvml(), ScriptedClock(start=0.0)
    power = iter([100_000, 300_000, 300_000])  # mW: h1 fails its power query, h0 reads these
    nvml.nvmlDeviceGetPowerUsage = lambda h: (_ for _ in ()).throw(RuntimeError("Not Supported")) if h == "h1" \
        else next(power)
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: (_ for _ in ()).throw(RuntimeError("Not Supported"))
    sampler = GpuSampler(1.0, clock.now, nvml=nvml)
    sampler.open()
    for step in (0.5, 1.5, 0.0):
        sampler.sample()
        clock.advance(step)
    # trapezoids: 0.5 s at (100+300)/2 W, then 1.5 s at 300 W = 100 + 450 J; the second GPU gave no reading
    energy = energy_per_token(sampler.series, output_tokens=1000)
    assert energy["joules"] == pytest.approx(550.0) and energy["gpus"] == 1
    assert energy["method"] == "NVML power integrated" and energy["joules_per_output_token"] == pytest.approx(0.55)
    assert energy_per_token(sampler.series, 0) is None and energy_per_token(None, 10) is None


def test_only_a_server_on_this_host_is_measured_by_this_hosts_gpus():
    from infertrace.load.observe.telemetry import url_is_local

    assert url_is_local(None) and url_is_local("http://127.0.0.1:8000") and url_is_local("http://localhost:1")
    assert not url_is_local("http://10.1.2.3:8000") and not url_is_local("https://api.example.com")
