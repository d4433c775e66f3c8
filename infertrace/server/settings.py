"""Server settings (not engine ones): declared once here; the CLI takes its defaults from this dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

MAX_DRAIN_S = 86_400.0  # a day: a drain longer than that is a mistake, and inf or nan none at all
MAX_QUEUE = 1_000_000  # far beyond what a front end can hold in flight


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 1024  # requests accepted but not in the running batch; past it, 503 with Retry-After
    retry_after_s: int = 1
    profile_dir: Path | None = None  # None: the profiler endpoints answer 404, as vLLM's do when not configured
    drain_timeout_s: float = 30.0  # on SIGTERM, how long in-flight requests may finish before they are aborted
    max_body_mb: int = 32
    otlp_traces_endpoint: str | None = None  # None: no spans, and OpenTelemetry is never imported

    def __post_init__(self) -> None:
        if not 0 <= self.max_queue <= MAX_QUEUE:
            raise ValueError(f"--max-queue must be in 0..{MAX_QUEUE:,}, got {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if not (math.isfinite(self.drain_timeout_s) and 0 <= self.drain_timeout_s <= MAX_DRAIN_S):
            raise ValueError(f"--drain-timeout must be a number of seconds in 0..{MAX_DRAIN_S:g}, got "
                             f"{self.drain_timeout_s:g}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.strip():
            raise ValueError("--otlp-traces-endpoint must name an endpoint (host:port for grpc, a URL for "
                             "http/protobuf)")
        if self.max_body_mb < 1:
            raise ValueError(f"max_body_mb must be >= 1, got {self.max_body_mb}")
