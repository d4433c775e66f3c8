"""The small JSON manifest written beside each capture: what was captured, when, which steps and requests."""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_SCHEMA = "infertrace.capture/1"


@dataclass(slots=True)
class StepRecord:
    """One engine step seen inside the capture window."""

    index: int | None
    kind: str | None
    bs: int | None
    toks: int | None
    duration_ms: float | None


@dataclass(slots=True)
class CaptureManifest:
    label: str
    trace: str | None  # file name of the Kineto trace beside the manifest; None for nsys-only captures
    activities_requested: list[str]
    activities: list[str]  # what was really recorded (GPU is dropped without CUDA)
    record_shapes: bool
    with_stack: bool
    num_steps: int | None
    started_at: str  # ISO 8601 wall-clock time, UTC
    stopped_at: str
    duration_s: float
    steps: list[StepRecord] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nsys_output: str | None = None
    traces: list[str] = field(default_factory=list)  # every rank's trace (one with one rank), rank order
    versions: dict[str, str | None] = field(default_factory=dict)
    device: dict[str, object] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    schema: str = MANIFEST_SCHEMA

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def runtime_versions() -> dict[str, str | None]:
    import torch

    from infertrace import __version__

    return {
        "infertrace": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def device_info() -> dict[str, object]:
    import torch

    if not torch.cuda.is_available():
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count()}
    index = torch.cuda.current_device()
    return {"type": "cuda", "name": torch.cuda.get_device_name(index), "index": index,
            "count": torch.cuda.device_count()}
