"""Fixtures for server tests: the real server over a fresh engine on the tiny model, on a real 127.0.0.1 port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

# A small KV pool keeps engine start-up cheap; tests that need other settings pass their own.
TEST_ENGINE = {"kv_cache_tokens": 16384}
MODEL_NAME = "tiny"


@pytest.fixture
def serve_tiny(tiny_model_dir):
    """`async with serve_tiny(engine_overrides, engine_process=False, **settings) as client:` a TestClient on a
    live server over the tiny model: the engine on a thread (cheap to start), or with `engine_process=True` in a
    process of its own, as `infertrace serve` runs it.

    `client.state` is the app's ServerState; `client.engine` the Engine on the thread (None with a process),
    `client.engine_proc` the engine process (None on a thread).
    """
    from infertrace.engine import Engine, EngineConfig
    from infertrace.server.engine_link.client import ProcessEngine, ThreadEngine
    from infertrace.server.engine_link.process import EngineSpec, describe_exit, start_engine_process
    from infertrace.server.engine_link.runner import _reap
    from infertrace.server.frontend.app import STATE, build_app
    from infertrace.server.frontend.tokenizer import FrontendTokenizer
    from infertrace.server.settings import ServerSettings

    @contextlib.asynccontextmanager
    async def start(engine_overrides: dict | None = None, engine_process: bool = False, **settings):
        config = EngineConfig.from_overrides({**TEST_ENGINE, **(engine_overrides or {})})
        server_settings = ServerSettings(model_dir=str(tiny_model_dir), served_model_name=MODEL_NAME, **settings)
        proc = engine = None
        if engine_process:
            spec = EngineSpec(str(tiny_model_dir), dataclasses.asdict(config),
                              str(server_settings.profile_dir) if server_settings.profile_dir else None)
            proc, [sock] = start_engine_process(spec)
            handle = ProcessEngine(sock, describe_exit=lambda: describe_exit(proc))
        else:
            engine = Engine(tiny_model_dir, config)
            handle = ThreadEngine(engine, server_settings.profile_dir, {"kv_cache_tokens": config.kv_cache_tokens})
        try:
            await handle.connect()
            app = build_app(handle, FrontendTokenizer(tiny_model_dir), server_settings,
                            {"index": 0, "count": 1, "engine_in_process": not engine_process})
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                client.state = app[STATE]
                client.engine = engine
                client.engine_proc = proc
                yield client
        finally:
            await handle.close()
            if proc is not None:
                await _reap(proc)

    return start


async def _read_sse(resp) -> list:
    """The data payloads of an SSE response: dicts, and the string "[DONE]"."""
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} with the model_name label dropped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        key = key.replace(f'model_name="{MODEL_NAME}",', "").replace(f'{{model_name="{MODEL_NAME}"}}', "")
        out[key] = float(value)
    return out


async def _metrics_of(client) -> dict[str, float]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return _parse_metrics(await resp.text())


async def _wait_metrics(client, predicate, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll /metrics until `predicate(metrics)` holds (the engine's stats snapshot trails its outputs a little)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        metrics = await _metrics_of(client)
        if predicate(metrics) or loop.time() > deadline:
            return metrics
        await asyncio.sleep(0.02)


@pytest.fixture
def wait_metrics():
    return _wait_metrics


@pytest.fixture
def read_sse():
    return _read_sse


@pytest.fixture
def parse_metrics():
    return _parse_metrics


@pytest.fixture
def metrics_of():
    return _metrics_of
