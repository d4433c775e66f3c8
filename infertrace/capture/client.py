"""Start and stop the profiler of a live server: vLLM, SGLang or `infertrace serve`.

vLLM takes a bare `POST /start_profile` / `POST /stop_profile` (capture options are fixed when the server
is launched); SGLang and infertrace take a JSON body shaped like SGLang's ProfileReqInput.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum

SERVER_ACTIVITIES = ("CPU", "GPU", "MEM", "RPD", "CUDA_PROFILER")

VLLM_NO_PROFILER = (
    "vLLM answered 404 for {path}: the server was started without a profiler configuration; relaunch it "
    "with --profiler-config '{{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/path/to/traces\"}}' "
    "(vLLM before 0.13: set VLLM_TORCH_PROFILER_DIR=/path/to/traces)"
)


class Flavour(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    INFERTRACE = "infertrace"


class ProfilerError(Exception):
    """A failure to report to the user in one line."""


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """What to capture; None leaves the server's own default."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None

    def __post_init__(self):
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {self.num_steps}")
        unknown = [a for a in self.activities or () if a not in SERVER_ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown activity {unknown[0]!r}; choose from {', '.join(SERVER_ACTIVITIES)}")

    def body(self) -> dict:
        """The ProfileReqInput-style JSON body (only the fields that were set)."""
        body: dict = {}
        if self.output_dir is not None:
            body["output_dir"] = self.output_dir
        if self.num_steps is not None:
            body["num_steps"] = self.num_steps
        if self.activities is not None:
            body["activities"] = list(self.activities)
        if self.with_stack is not None:
            body["with_stack"] = self.with_stack
        if self.record_shapes is not None:
            body["record_shapes"] = self.record_shapes
        return body


@dataclass(slots=True)
class StopResult:
    message: str
    traces: list[str] = field(default_factory=list)  # listed by the server (infertrace does)


@dataclass(slots=True)
class _Reply:
    status: int
    text: str

    def json(self):
        try:
            return json.loads(self.text)
        except ValueError:
            return None


class ProfilerClient:
    """`async with ProfilerClient(url) as c: await c.start(ProfileOptions(...)); await c.stop()`."""

    def __init__(self, base_url: str, flavour: Flavour | str | None = None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._flavour = Flavour(flavour) if flavour else None
        self.timeout_s = timeout_s
        self._session = None

    async def __aenter__(self) -> "ProfilerClient":
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(10.0, self.timeout_s))
        self._session = aiohttp.ClientSession(timeout=timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def flavour(self) -> Flavour:
        if self._flavour is None:
            self._flavour = await self._detect()
        return self._flavour

    async def start(self, options: ProfileOptions = ProfileOptions()) -> str:
        flavour = await self.flavour()
        if flavour is Flavour.VLLM:
            given = [name for name, value in _option_names(options) if value is not None]
            if given:
                raise ValueError(f"vLLM takes no capture options over HTTP ({', '.join(given)}); set them in "
                                 "the server's --profiler-config, or use --seconds for a time window")
            reply = await self._request("POST", "/start_profile")
        else:
            reply = await self._request("POST", "/start_profile", body=options.body())
        self._raise_for(reply, "/start_profile")
        return _message(reply) or "profiling started"

    async def stop(self) -> StopResult:
        await self.flavour()
        reply = await self._request("POST", "/stop_profile")
        self._raise_for(reply, "/stop_profile")
        data = reply.json()
        traces = _trace_list(data) if isinstance(data, dict) else []
        return StopResult(message=_message(reply) or "profiling stopped", traces=traces)

    async def _detect(self) -> Flavour:
        info = await self._get_json("/server_info")
        if isinstance(info, dict):
            if _is_infertrace(info):
                return Flavour.INFERTRACE
            if "vllm_config" in info:
                return Flavour.VLLM
            if "model_path" in info or "tp_size" in info:
                return Flavour.SGLANG
        if isinstance(await self._get_json("/get_server_info"), dict):
            return Flavour.SGLANG
        version = await self._get_json("/version")
        if isinstance(version, dict) and "version" in version:
            return Flavour.VLLM
        raise ProfilerError(f"cannot tell which server runs at {self.base_url} (no usable /server_info, "
                            "/get_server_info or /version); pass --server vllm|sglang|infertrace")

    async def _get_json(self, path: str):
        reply = await self._request("GET", path)
        return reply.json() if 200 <= reply.status < 300 else None

    async def _request(self, method: str, path: str, body: dict | None = None) -> _Reply:
        import asyncio

        import aiohttp

        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body) as response:
                return _Reply(response.status, await response.text())
        except aiohttp.InvalidURL as exc:
            raise ProfilerError(f"invalid server URL {self.base_url!r}") from exc
        except aiohttp.ClientConnectorError as exc:
            errno = getattr(exc.os_error, "errno", None)
            reason = os.strerror(errno) if errno else str(exc.os_error or exc)
            raise ProfilerError(f"cannot reach the server at {self.base_url}: {reason}") from exc
        except asyncio.TimeoutError as exc:
            raise ProfilerError(f"{method} {url} got no answer within {self.timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise ProfilerError(f"{method} {url} failed: {exc or type(exc).__name__}") from exc

    def _raise_for(self, reply: _Reply, path: str) -> None:
        if 200 <= reply.status < 300:
            return
        if reply.status == 404 and self._flavour is Flavour.VLLM:
            raise ProfilerError(VLLM_NO_PROFILER.format(path=path))
        detail = _message(reply) or "no detail"
        raise ProfilerError(f"{self._flavour.value} server refused POST {path} (HTTP {reply.status}): {detail}")


def _option_names(options: ProfileOptions):
    return [("output_dir", options.output_dir), ("num_steps", options.num_steps),
            ("activities", options.activities), ("with_stack", options.with_stack),
            ("record_shapes", options.record_shapes)]


def _is_infertrace(info: dict) -> bool:
    return info.get("engine") == "infertrace" or info.get("name") == "infertrace" or "engine_config" in info


def _trace_list(data: dict) -> list[str]:
    for key in ("traces", "files", "trace_files", "paths"):  # infertrace's "files" holds the manifests too
        value = data.get(key)
        if isinstance(value, list):
            return [str(v) for v in value]
    return []


def _message(reply: _Reply) -> str:
    """The server's own one-line explanation, from an OpenAI/FastAPI-style JSON body or plain text."""
    data = reply.json()
    text = reply.text
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            error = error.get("message")
        text = error or data.get("message") or data.get("detail")
        if not text and data.get("status"):
            text = str(data["status"]) + (f" ({data['output_dir']})" if data.get("output_dir") else "")
        text = text or ""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
