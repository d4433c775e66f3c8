"""Server settings (not engine ones): declared once here; the CLI takes its defaults from this dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_body_mb < 1:
            raise ValueError(f"max_body_mb must be >= 1, got {self.max_body_mb}")
