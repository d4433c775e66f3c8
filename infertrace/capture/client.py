"""Start and stop the profiler of a live server: vLLM, SGLang or `infertrace serve`, each sent exactly what it
accepts (see peers.py for what each one takes, answers and writes).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from infertrace.capture.peers import (
    SERVER_ACTIVITIES,
    Flavour,
    ProfileOptions,
    likely_cause,
    sglang_body,
    vllm_body,
    vllm_ignored_keys,
)

__all__ = ["SERVER_ACTIVITIES", "Flavour", "ProfileOptions", "ProfilerClient", "ProfilerError", "StartResult",
           "StopResult", "UnreachableError", "is_local_url"]

VLLM_NO_PROFILER = (
    "vLLM answered 404 for {path}: the server was started without a profiler configuration; relaunch it "
    "with --profiler-config '{{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/path/to/traces\"}}' "
    "(vLLM before 0.13: set VLLM_TORCH_PROFILER_DIR=/path/to/traces)"
)


# the command-line option behind each key of vLLM's StartProfileRequest (profiler_kwargs holds several)
_VLLM_OPTION = {"profile_prefix": "--name", "delay_iterations": "--delay-steps", "max_iterations": "--num-steps"}


def _vllm_options(body: dict, keys: list[str]) -> list[str]:
    options = []
    for key in keys:
        if key == "profiler_kwargs":
            options += [f"--{'' if on else 'no-'}{kwarg.replace('_', '-')}" for kwarg, on in body[key].items()]
        else:
            options.append(_VLLM_OPTION.get(key, key))
    return options


class ProfilerError(Exception):
    """A failure to report to the user in one line."""


class UnreachableError(ProfilerError):
    """No server answers at the URL (exit 2, as for `bench`: an unreachable target is unusable input)."""


@dataclass(slots=True)
class StartResult:
    message: str
    options: ProfileOptions  # what was asked for, output_dir made absolute where it was relative
    body: dict | None  # what was sent (None: a bare POST)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StopResult:
    message: str
    traces: list[str] = field(default_factory=list)  # trace files listed by the server (infertrace does)
    files: list[str] = field(default_factory=list)  # everything it wrote, manifests included
    already_stopped: bool = False  # the capture had ended by itself (SGLang after num_steps)


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
    """`async with ProfilerClient(url) as c: await c.start(ProfileOptions(...)); await c.stop()`.

    `headers` (an API key's Authorization among them) go with every call, flavour detection included."""

    def __init__(self, base_url: str, flavour: Flavour | str | None = None, timeout_s: float = 600.0,
                 headers: dict[str, str] | None = None, fallback: Flavour | None = None):
        self.base_url = base_url.rstrip("/")
        self._flavour = Flavour(flavour) if flavour else None
        self.fallback = fallback  # taken, with a note, when detection finds no known flavour
        self.notes: list[str] = []
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.server_version: str | None = None
        self.server_info: dict | None = None
        self._session = None

    async def __aenter__(self) -> "ProfilerClient":
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(10.0, self.timeout_s))
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    @property
    def local(self) -> bool:
        return is_local_url(self.base_url)

    async def flavour(self) -> Flavour:
        if self._flavour is None:
            self._flavour = await self._detect()
        return self._flavour

    async def start(self, options: ProfileOptions = ProfileOptions()) -> StartResult:
        flavour = await self.flavour()
        notes: list[str] = []
        if flavour is Flavour.VLLM:
            body = vllm_body(options) or None
            if body is not None:
                ignored = vllm_ignored_keys(body, await self._version())
                if ignored:
                    notes.append(f"vLLM {self.server_version}'s /start_profile ignores {', '.join(ignored)}: "
                                 f"{', '.join(_vllm_options(body, ignored))} not applied")
                    body = {k: v for k, v in body.items() if k not in ignored} or None
            reply = await self._request("POST", "/start_profile", body=body)
            if reply.status == 422 and body is not None:
                # a server whose route validates a body it does not know: start it bare rather than not at all
                notes.append(f"the server refused the capture options (HTTP 422: {_message(reply) or 'no detail'}); "
                             f"started without them: {', '.join(body)} not applied")
                body = None
                reply = await self._request("POST", "/start_profile")
        else:
            if flavour is Flavour.SGLANG:
                if options.frontend:
                    raise ProfilerError("--frontend is infertrace serve's: SGLang has no front-end trace to ask for")
                options = await self._sglang_safe(options)
            body = sglang_body(options, flavour)
            if options.frontend:
                body["frontend"] = True
            reply = await self._request("POST", "/start_profile", body=body)
        self._raise_for(reply, "/start_profile")
        return StartResult(_message(reply) or "profiling started", options, body, notes)

    async def stop(self, self_stopping: bool = False) -> StopResult:
        """Stop the capture. `self_stopping`: it was started with a step limit, so a server that answers that
        nothing runs (SGLang's 500) means it ended by itself: the normal end, not a failure."""
        flavour = await self.flavour()
        reply = await self._request("POST", "/stop_profile")
        if flavour is Flavour.SGLANG and reply.status == 500 and self_stopping:
            return StopResult(message=likely_cause(flavour, "/stop_profile", 500, "", True), already_stopped=True)
        self._raise_for(reply, "/stop_profile")
        data = reply.json()
        traces = _listed(data, ("trace_files", "traces", "paths")) if isinstance(data, dict) else []
        files = _listed(data, ("files",)) if isinstance(data, dict) else []
        return StopResult(message=_message(reply) or "profiling stopped", traces=traces, files=files or traces)

    async def _sglang_safe(self, options: ProfileOptions) -> ProfileOptions:
        """Refuse what takes an SGLang server down (its scheduler raises and the process exits)."""
        import dataclasses

        if options.activities and "RPD" in options.activities and not self._is_rocm():
            raise ProfilerError("RPD is a ROCm profiler: SGLang on a CUDA build raises inside its scheduler and the "
                                "server goes down; use CPU,GPU")
        out = options.output_dir
        if out is not None:
            if not os.path.isabs(os.path.expanduser(out)):
                if not self.local:
                    raise ProfilerError(f"--output-dir {out!r} is relative and the server is not on this host: "
                                        "give the absolute path on the server's machine")
                out = os.path.abspath(out)
            if self.local:
                _check_creatable(os.path.expanduser(out))
            options = dataclasses.replace(options, output_dir=out)
        return options

    def _is_rocm(self) -> bool:
        info = self.server_info or {}
        text = json.dumps({k: info.get(k) for k in ("device", "version", "attention_backend")}).lower()
        return "rocm" in text or "hip" in text

    async def _version(self) -> str | None:
        if self.server_version is None:
            data = await self._get_json("/version")
            if isinstance(data, dict) and isinstance(data.get("version"), str):
                self.server_version = data["version"]
        return self.server_version

    async def _detect(self) -> Flavour:
        info = await self._get_json("/server_info")
        if isinstance(info, dict):
            self.server_info = info
            if _is_infertrace(info):
                return Flavour.INFERTRACE
            if "vllm_config" in info:
                return Flavour.VLLM
            if "model_path" in info or "tp_size" in info:
                return Flavour.SGLANG
        info = await self._get_json("/get_server_info")
        if isinstance(info, dict):
            self.server_info = info
            return Flavour.SGLANG
        if await self._version() is not None:
            return Flavour.VLLM
        if self.fallback is not None:
            self.notes.append(f"no known server flavour at {self.base_url}; profiler calls shaped as "
                              f"{self.fallback.value}'s")
            return self.fallback
        raise ProfilerError(f"cannot tell which server runs at {self.base_url} (no usable /server_info, "
                            "/get_server_info or /version); pass --server vllm|sglang|infertrace")

    async def _get_json(self, path: str):
        reply = await self._request("GET", path)
        if reply.status in (401, 403):
            cause = likely_cause(self._flavour, path, reply.status, "")
            raise ProfilerError(f"GET {path} answered {reply.status}: {cause}")
        return reply.json() if 200 <= reply.status < 300 else None

    async def _request(self, method: str, path: str, body: dict | None = None) -> _Reply:
        import asyncio

        import aiohttp

        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body) as response:
                return _Reply(response.status, await response.text())
        except aiohttp.InvalidURL as exc:
            raise UnreachableError(f"invalid server URL {self.base_url!r}") from exc
        except aiohttp.ClientConnectorError as exc:
            errno = getattr(exc.os_error, "errno", None)
            reason = os.strerror(errno) if errno else str(exc.os_error or exc)
            raise UnreachableError(f"cannot reach the server at {self.base_url}: {reason}") from exc
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
        cause = likely_cause(self._flavour, path, reply.status, detail)
        said = f"{detail}; {cause}" if cause else detail
        raise ProfilerError(f"{self._flavour.value} server refused POST {path} (HTTP {reply.status}): {said}")


def is_local_url(url: str) -> bool:
    """Whether the server at `url` runs on this host (a loopback address, or one of this host's names)."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_creatable(path: str) -> None:
    """Refuse an output directory the (local) server could not create or write: SGLang would crash on it. The
    nearest existing ancestor is probed by making and removing a directory in it (permission bits say nothing
    to root, nor about /proc)."""
    import tempfile

    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".infertrace-probe-", dir=probe))
    except OSError as exc:
        raise ProfilerError(f"--output-dir {path!r} cannot be created or written on this host ({probe}: "
                            f"{exc.strerror}); SGLang would fail at stop and lose the capture") from exc


def _is_infertrace(info: dict) -> bool:
    return info.get("engine") == "infertrace" or info.get("name") == "infertrace" or "engine_config" in info


def _listed(data: dict, keys: tuple[str, ...]) -> list[str]:
    for key in keys:
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
