"""What the server asks of the engine besides generation, run where the engine runs: the profiler, the step-time
histograms and server counters behind /metrics, the engine's description for /server_info, and a ping for /health.

The engine process calls these between two steps; with --engine-in-process the engine thread does
(`AsyncEngine.call`). Either way the answer is plain data, so it crosses a process boundary as it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from infertrace.server.engine_link.request_log import write_capture_log
from infertrace.server.frontend import metrics
from infertrace.server.frontend.profiler import Profiler, ProfileRequest
from infertrace.server.frontend.protocol import ApiError

log = logging.getLogger("infertrace.server")


class EngineServices:
    def __init__(self, engine: Any, profile_dir: Path | None, engine_config: dict[str, Any]) -> None:
        self.engine = engine
        self.engine_config = engine_config
        self.metrics = metrics.ServerMetrics()
        self.metrics.time_gc()
        self.profiler = Profiler(engine, profile_dir)
        self._capture_started: float | None = None

    def on_step(self, stats: Any) -> None:
        """After every engine step."""
        try:
            self.metrics.observe_step(str(getattr(stats.kind, "value", stats.kind)), stats.duration_s)
            self.profiler.on_step(stats)
        except Exception:  # a metrics or capture failure must never stop the engine loop
            log.exception("step callback failed")

    def info(self) -> dict[str, Any]:
        """The engine's description, taken once at start-up: what /server_info and /v1/models report of it."""
        from infertrace.capture.manifest import device_info, runtime_versions

        engine = self.engine
        info = {"max_model_len": engine.max_model_len, "kv_blocks_total": engine.kv_blocks_total,
                "engine_config": self.engine_config, "decode_path": engine.decode_path(),
                "versions": runtime_versions(), "device": device_info(), "engine_pid": os.getpid()}
        return json.loads(json.dumps(info, default=str))  # plain data (torch's version is a str subclass)

    def stats(self) -> dict[str, Any]:
        """Running, waiting, KV blocks, counters and the last step: the engine's state now."""
        e = self.engine
        return {"running": e.num_running, "waiting": e.num_waiting, "kv_blocks_used": e.kv_blocks_used,
                "kv_blocks_total": e.kv_blocks_total, "counters": dict(e.counters),
                "spec_accepted_per_pos": list(e.spec_accepted_per_pos) if e.speculative is not None else None,
                "last_step": dataclasses.asdict(e.last_step) if e.last_step is not None else None}

    def command(self, name: str, args: dict[str, Any]) -> Any:
        """One command from a front end; ApiError is the answer to give the client."""
        if name == "ping":
            return None
        if name == "metrics":
            return {"stats": self.stats(), "server": self.metrics.snapshot()}
        if name == "count":
            self.metrics.count(args)
            return None
        if name == "start_profile":
            args = {k: v for k, v in args.items() if k != "frontend_trace"}  # the engine loop's to read
            started = self.profiler.start(ProfileRequest(**{**args, "activities": tuple(args["activities"])}))
            self._capture_started = time.perf_counter()
            return started
        if name == "reset_prefix_cache":
            return {"success": bool(self.engine.reset_prefix_cache())}
        if name == "stop_profile":
            return write_capture_log(self.engine.request_log, self.profiler.stop(), self._capture_started)
        if name == "request_log":
            log = self.engine.request_log
            return None if log is None else log.read(**args)
        if name == "embed":
            from infertrace.engine.pooling import embed

            try:
                return embed(self.engine, args["inputs"])
            except ValueError as e:
                raise ApiError(400, str(e), param="input", code="invalid_value") from None
        raise ApiError(500, f"unknown engine command {name!r}", code="internal_error")
