"""Fixtures for the trace-analysis tests: the shared real traces, and writers of small synthetic traces."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def pytest_collection_modifyitems(config, items):
    if not TRACES.exists():
        skip = pytest.mark.skip(reason=f"the shared traces are not at {TRACES}")
        for item in items:
            if "traces" in item.fixturenames:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def traces() -> Path:
    return TRACES


def pytest_configure(config):
    # HTA (traceinsight 0.6.1) trips pandas deprecation warnings on every call; they are HTA's, not ours
    config.addinivalue_line("filterwarnings", "ignore::Warning:hta")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """`analyze` caches decoded traces; each test gets an empty cache of its own, never the user's."""
    monkeypatch.setenv("INFERTRACE_CACHE_DIR", str(tmp_path_factory.mktemp("analyze-cache")))


@pytest.fixture(scope="session", autouse=True)
def _quiet_hta():
    logging.getLogger("hta").setLevel(logging.ERROR)


def kineto_events(spec: list[tuple]) -> list[dict]:
    """Complete events from compact tuples: (cat, name, ts_us, dur_us, tid, args)."""
    events = []
    for cat, name, ts, dur, tid, args in spec:
        gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset")
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu else 100, "tid": tid, "ts": ts,
                       "dur": dur, "args": args})
    return events


def write_kineto(path: Path, events: list[dict], rank: int | None = None, extra: dict | None = None) -> Path:
    doc: dict = {"schemaVersion": 1}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
    doc["traceEvents"] = events
    doc.update(extra or {})
    text = json.dumps(doc, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def engine_trace_events() -> list[dict]:
    """A small GPU trace annotated the way infertrace's engine annotates its steps.

    - step[PREFILL bs=2 toks=300]: three kernels back to back (attention, GEMM, norm): GPU-bound
    - step[DECODE bs=2]: three 10 us kernels launched 100 us apart: the GPU waits on the host, CPU-bound
    - step[DECODE bs=2]: one cudaGraphLaunch of four kernels (GEMM, SiLU, custom all-reduce, memcpy)
    - step[MIXED bs=3 toks=40]: one cuLaunchKernel (elementwise), with a `forward` range inside and a vLLM-style
      `execute_context_..` range around it (a wrapper, so not a step of its own)
    - a kernel launched outside any step, which belongs to none."""
    launch = "cuda_runtime"
    spec = [
        ("user_annotation", "step[PREFILL bs=2 toks=300]", 1000, 370, 100, {}),
        (launch, "cudaLaunchKernel", 1010, 5, 100, {"correlation": 1}),
        (launch, "cudaLaunchKernel", 1020, 5, 100, {"correlation": 2}),
        (launch, "cudaLaunchKernel", 1030, 5, 100, {"correlation": 3}),
        ("kernel", "void flash_fwd_kernel<Flash_fwd_kernel_traits<64> >(Flash_fwd_params)", 1040, 100, 7,
         {"stream": 7, "correlation": 1}),
        ("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_execute_kernel", 1140, 200, 7,
         {"stream": 7, "correlation": 2}),
        ("kernel", "void vllm::rms_norm_kernel<c10::BFloat16, 8, 2>(c10::BFloat16*, long)", 1340, 20, 7,
         {"stream": 7, "correlation": 3}),
        ("user_annotation", "step[DECODE bs=2]", 2000, 300, 100, {}),
        (launch, "cudaLaunchKernel", 2050, 5, 100, {"correlation": 4}),
        (launch, "cudaLaunchKernel", 2150, 5, 100, {"correlation": 5}),
        (launch, "cudaLaunchKernel", 2250, 5, 100, {"correlation": 6}),
        ("kernel", "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)",
         2056, 10, 7, {"stream": 7, "correlation": 4}),
        ("kernel", "gemv_kernel", 2156, 10, 7, {"stream": 7, "correlation": 5}),
        ("kernel", ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel("
                    "at::TensorIteratorBase&)::{lambda()#1}>(int)"), 2256, 10, 7, {"stream": 7, "correlation": 6}),
        ("user_annotation", "step[DECODE bs=2]", 3000, 200, 100, {}),
        (launch, "cudaGraphLaunch", 3010, 8, 100, {"correlation": 10}),
        ("kernel", "nvjet_tst_64x8_64x16_2x1_v_bz_TNT", 3020, 40, 7, {"stream": 7, "correlation": 10}),
        ("kernel", "void vllm::act_and_mul_kernel<c10::BFloat16>(c10::BFloat16*)", 3060, 40, 7,
         {"stream": 7, "correlation": 10}),
        ("kernel", "void vllm::cross_device_reduce_1stage<c10::BFloat16, 8>(vllm::RankData*)", 3100, 50, 7,
         {"stream": 7, "correlation": 10}),
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 3150, 40, 7, {"stream": 7, "correlation": 10}),
        ("user_annotation", "execute_context_1(38)_generation_2(2)", 3995, 110, 100, {}),
        ("user_annotation", "step[MIXED bs=3 toks=40]", 4000, 100, 100, {}),
        ("user_annotation", "forward", 4005, 60, 100, {}),
        ("cuda_driver", "cuLaunchKernel", 4010, 5, 100, {"correlation": 20}),
        ("kernel", "triton_poi_fused_add_mul_0", 4020, 30, 7, {"stream": 7, "correlation": 20}),
        (launch, "cudaLaunchKernel", 5000, 5, 100, {"correlation": 30}),
        ("kernel", "void at::native::reduce_kernel<512, 1>(int)", 5010, 10, 7, {"stream": 7, "correlation": 30}),
    ]
    return kineto_events(spec)


@pytest.fixture()
def engine_trace(tmp_path) -> Path:
    return write_kineto(tmp_path / "engine" / "infertrace.1.pt.trace.json.gz", engine_trace_events(), rank=0)


@pytest.fixture()
def make_trace():
    """`make_trace(path, events, rank=None, extra=None)` writes a Kineto trace (gzipped for a .gz name)."""
    return write_kineto


@pytest.fixture()
def make_events():
    """`make_events([(cat, name, ts_us, dur_us, tid, args), ...])` builds complete events."""
    return kineto_events


@pytest.fixture()
def run_python():
    """`run_python(args, timeout)`: run_with_deadline."""
    return run_with_deadline


def run_with_deadline(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `python args...` in a child process, so that a reader that loops forever fails the test instead of
    hanging the suite."""
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "COLUMNS": "200"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"`python {' '.join(args)}` did not finish within {timeout:g} s")
