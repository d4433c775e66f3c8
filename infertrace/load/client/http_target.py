"""An OpenAI-compatible server as a load target: one shared aiohttp session, SSE decoded for completions and chat."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import msgspec

from infertrace.load.client import request_log
from infertrace.load.client.adapters import AdapterMix
from infertrace.load.client.sse import SSELineTooLong, SSEParser
from infertrace.load.client.timing import TargetError
from infertrace.load.client.trace_context import traceparent
from infertrace.load.records import RequestSpec, StreamEvent

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}
READ_BUFSIZE = 4 * 1024 * 1024  # aiohttp's 64 KiB default throttles long streamed lines and fast servers
PREFLIGHT_TIMEOUT_S = 10.0
RESET_PREFIX_CACHE_PATHS = ("/reset_prefix_cache", "/flush_cache")  # vLLM's, then SGLang's
# the first vLLM release seen to answer with per-request metrics (0.32.0); --server-metrics on asks an older one
VLLM_REQUEST_METRICS = (0, 32, 0)
PROFILE_TIMEOUT_S = 600.0  # stopping a profiler writes the trace, which takes a while on a busy server
MAX_ANSWER_BYTES = 64 << 20  # a JSON answer (models, server info, metrics, a page of the request log) larger than
# this is refused rather than read: a server must not be able to take the client's memory


class StreamResponse(Protocol):
    status: int

    async def text(self) -> str: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class Transport(Protocol):
    """HTTP underneath a target; tests replace it with a scripted one that opens no socket."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def request_json(self, method: str, path: str, body: Any = None, timeout_s: float = PREFLIGHT_TIMEOUT_S,
                           max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int, Any]: ...

    async def request_json_sized(self, method: str, path: str, timeout_s: float,
                                 max_bytes: int) -> tuple[int, Any, int]: ...  # and the body's size in bytes

    def stream(self, path: str, body: dict, headers: dict | None = None) -> Any: ...  # async context manager


class _AiohttpResponse:
    __slots__ = ("_resp", "status")

    def __init__(self, resp) -> None:
        self._resp = resp
        self.status = resp.status

    async def text(self) -> str:
        return await self._resp.text(errors="replace")

    def chunks(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()  # whatever has arrived, without splitting into lines first

    async def finish(self, timeout_s: float = 1.0) -> None:
        """Read what is left of a finished stream (the end of its chunked body): an unread response cannot go
        back to the connection pool, so the next request would open a new connection."""
        try:
            await asyncio.wait_for(self._resp.read(), timeout_s)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
            pass


class AiohttpTransport:
    """One ClientSession for the whole run. Its connection pool keeps connections alive for reuse but has no cap
    of its own (limit 0): caps on requests in flight are the runner's (closed-loop workers, open-loop slots), which
    record any wait as schedule lag before the send time is taken, so no request ever queues for a connection
    inside aiohttp, where the wait would be counted as TTFT. Every load, whatever its concurrency, fits it."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})  # --api-key and --header: on the session, so on every call
        self._session = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            read_bufsize=READ_BUFSIZE, headers=self.headers, auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request_json(self, method: str, path: str, body: Any = None, timeout_s: float = PREFLIGHT_TIMEOUT_S,
                           max_bytes: int = MAX_ANSWER_BYTES) -> tuple[int, Any]:
        """The answer's status and its JSON (its text where it is not JSON); TargetError when the server cannot be
        reached or the answer's body is over `max_bytes` (read no further than that)."""
        status, answer, _ = await self.request_json_sized(method, path, timeout_s, max_bytes, body)
        return status, answer

    async def request_json_sized(self, method: str, path: str, timeout_s: float, max_bytes: int,
                                 body: Any = None) -> tuple[int, Any, int]:
        """request_json, with the size of the answer's body in bytes."""
        try:
            async with self._session.request(method, self.base_url + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                data = await _read_capped(resp, max_bytes)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise TargetError(f"cannot reach {self.base_url}: {self._reason(e)}") from None
        if data is None:
            raise TargetError(f"{method} {path} answered more than {_size(max_bytes)}; not read")
        raw = data.decode("utf-8", errors="replace")  # JSON is UTF-8 (RFC 8259)
        try:
            return resp.status, json.loads(raw), len(data)
        except ValueError:
            return resp.status, raw, len(data)

    def _reason(self, e: BaseException) -> str:
        if isinstance(e, asyncio.TimeoutError):
            return "timed out"
        text = str(e) or type(e).__name__
        if self.base_url.startswith("https://") and "WRONG_VERSION_NUMBER" in text:  # a TLS hello answered in HTTP
            plain = "http://" + self.base_url.removeprefix("https://")
            return f"the server speaks plain HTTP, not HTTPS: try --base-url {plain}"
        return text

    @asynccontextmanager
    async def stream(self, path: str, body: dict, headers: dict | None = None):
        async with self._session.post(self.base_url + path, json=body, headers=headers) as resp:
            yield _AiohttpResponse(resp)


async def _read_capped(resp, max_bytes: int) -> bytes | None:
    """The body, or None as soon as it passes `max_bytes` (by its Content-Length, or while read)."""
    if resp.content_length is not None and resp.content_length > max_bytes:
        return None
    data = bytearray()
    async for chunk in resp.content.iter_any():
        data += chunk
        if len(data) > max_bytes:
            return None
    return bytes(data)


async def _embeddings_event(resp: StreamResponse, sent: int) -> StreamEvent:
    """The whole answer to a /v1/embeddings request, read up to MAX_ANSWER_BYTES, as one event."""
    from infertrace.load.client.embeddings import decode_embeddings

    data = bytearray()
    async for chunk in resp.chunks():
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            return StreamEvent(error=f"malformed response: the answer is larger than {_size(MAX_ANSWER_BYTES)}")
    return decode_embeddings(bytes(data), sent)


def _size(n: int) -> str:
    return f"{n / (1 << 20):.4g} MiB" if n >= 1 << 20 else f"{n:,} bytes"


_scan_json = json.JSONDecoder().scan_once  # the C scanner without json.loads' wrappers: this runs per event


# The fast path: one msgspec decode straight into the few fields `_decode` reads, typed as `_decode` accepts them
# (msgspec, like `_field`, takes no bool for an int). Anything it refuses or does not settle (a type error, a
# negative count, an error object, JSON that only Python's parser takes) goes to the checked path below, which
# gives the same answer for what both take and names the field for what it refuses.
class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: Any = None
    function_call: Any = None
    role: Any = msgspec.UNSET  # only its presence counts (the opening chunk carries it)


class _Choice(msgspec.Struct):
    finish_reason: str | None = None
    delta: _Delta | None | msgspec.UnsetType = msgspec.UNSET
    text: str | None | msgspec.UnsetType = msgspec.UNSET


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None
    object: Any = None
    metrics: Any = None  # vLLM's per-request metrics, on the usage chunk after the last choice (response_metrics.py)


_decode_chunk_fast = msgspec.json.Decoder(_Chunk).decode
_DONE = "[DONE]"


def _fast(data: str) -> StreamEvent | None:
    """StreamEvent of a well-formed chunk, or None where the checked path must decide."""
    try:
        chunk = _decode_chunk_fast(data)
    except msgspec.DecodeError:  # ValidationError included
        return None
    usage = chunk.usage
    prompt_tokens = completion_tokens = None
    if usage is not None:
        prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
        if (prompt_tokens is not None and prompt_tokens < 0) or (completion_tokens is not None and completion_tokens < 0):
            return None
    choices = chunk.choices
    if choices:
        choice = choices[0]
        delta = choice.delta
        if delta is not msgspec.UNSET or choice.text is msgspec.UNSET:
            if delta is None or delta is msgspec.UNSET:
                return StreamEvent(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                   finish_reason=choice.finish_reason)
            text = delta.content or ""
            if reasoning := delta.reasoning_content or delta.reasoning:
                text = reasoning + text
            answer = bool(delta.content or delta.tool_calls or delta.function_call)
            output = bool(text or delta.tool_calls or delta.function_call) or (
                delta.content == "" and delta.role is msgspec.UNSET)
            return StreamEvent(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               finish_reason=choice.finish_reason, output=output,
                               reasoning_only=bool(reasoning) and not answer,
                               tool_calls=delta.tool_calls if isinstance(delta.tool_calls, list) else None)
        return StreamEvent(text=choice.text or "", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           finish_reason=choice.finish_reason, output=True)
    if chunk.error is not None or chunk.object == "error":
        return None
    metrics = chunk.metrics  # vLLM sends it on this chunk alone: the token chunks pay nothing for it
    return StreamEvent(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, usage_only=True,
                       server_metrics=metrics if isinstance(metrics, dict) else None)


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "an integer"}


class Malformed(ValueError):
    """A streamed chunk that is valid JSON but breaks the OpenAI schema; the message names the field."""


def _field(obj: dict, key: str, kinds: tuple[type, ...], where: str):
    """obj[key] when absent/null or of one of `kinds` (bool never counts as a number), else Malformed."""
    value = obj.get(key)
    if value is None or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return value
    raise Malformed(f"{where}{key} is {json.dumps(value)[:40]}, expected "
                    f"{' or '.join(_JSON_KINDS[k] for k in kinds)}")


def _count(usage: dict, key: str) -> int | None:
    """A usage token count: a non-negative integer (NaN, infinity, negatives and fractions are malformed)."""
    value = _field(usage, key, (int,), "usage.")
    if value is not None and value < 0:
        raise Malformed(f"usage.{key} is negative ({value})")
    return value


def _chat_has_output(delta: dict, text: str) -> bool:
    """A chat delta stands for generated tokens when it carries text or a tool call, or empty `content` without
    the role (a token that decodes to nothing); the opening chunk carries the role and is no output."""
    if text or delta.get("tool_calls") or delta.get("function_call"):
        return True
    return delta.get("content") == "" and "role" not in delta


def decode_chunk(obj: Any) -> StreamEvent:
    """One streamed JSON object of either endpoint -> StreamEvent (completions `text`, chat `delta.content`).

    Every completions choice is output, whatever its text (tokens can decode to nothing); a chat choice is
    output as `_chat_has_output` says. A chunk that breaks the schema fails the request as a malformed stream.
    """
    if not isinstance(obj, dict):
        return StreamEvent(error=f"malformed stream: expected a JSON object, got {type(obj).__name__}")
    try:
        return _decode(obj)
    except Malformed as e:
        return StreamEvent(error=f"malformed stream: {e}")


def _decode(obj: dict) -> StreamEvent:
    choices = _field(obj, "choices", (list,), "")
    usage = _field(obj, "usage", (dict,), "")
    prompt_tokens = completion_tokens = None
    if usage:
        prompt_tokens, completion_tokens = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    if choices:
        choice = choices[0]
        if not isinstance(choice, dict):
            raise Malformed(f"choices[0] is {json.dumps(choice)[:40]}, expected an object")
        finish_reason = _field(choice, "finish_reason", (str,), "choices[0].")
        if "delta" in choice or "text" not in choice:
            delta = _field(choice, "delta", (dict,), "choices[0].") or {}
            content = _field(delta, "content", (str,), "choices[0].delta.") or ""
            text, reasoning_only = content, False
            for key in ("reasoning_content", "reasoning"):  # reasoning tokens are generated output too
                if reasoning := _field(delta, key, (str,), "choices[0].delta."):
                    text = reasoning + text
                    reasoning_only = not (content or delta.get("tool_calls") or delta.get("function_call"))
                    break
            output = _chat_has_output(delta, text)
            calls = delta.get("tool_calls")
            return StreamEvent(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               finish_reason=finish_reason, output=output, reasoning_only=reasoning_only,
                               tool_calls=calls if isinstance(calls, list) else None)
        else:
            text = _field(choice, "text", (str,), "choices[0].") or ""
            output, reasoning_only = True, False
        return StreamEvent(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           finish_reason=finish_reason, output=output, reasoning_only=reasoning_only)
    err = obj.get("error")
    if err is not None or obj.get("object") == "error":
        message = err.get("message", err) if isinstance(err, dict) else (err or obj.get("message"))
        return StreamEvent(error=f"stream error: {message}")
    # evidence beside the response, never a reason to fail it: a `metrics` that is no object is not kept
    metrics = obj.get("metrics")
    return StreamEvent(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, usage_only=True,
                       server_metrics=metrics if isinstance(metrics, dict) else None)


def decode_data(data: str) -> StreamEvent:
    if data == _DONE:
        return StreamEvent(done=True)
    if (event := _fast(data)) is not None:
        return event
    if data[:1].isspace():
        data = data.lstrip()
    try:
        obj, end = _scan_json(data, 0)
    except (StopIteration, ValueError):
        obj, end = None, -1
    if end != len(data) and (end < 0 or data[end:].strip()):
        return StreamEvent(error=f"malformed stream: {data[:120]!r}")
    return decode_chunk(obj)


def _release(version) -> tuple[int, int, int] | None:
    """`0.32.0`, `0.33.1rc1.dev5+g...` -> its release numbers; None for anything else."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version) if isinstance(version, str) else None
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def _names_by_rid(server_info: dict | None) -> bool:
    """SGLang 0.5.23: its OpenAI routes take a request's id from the body's `rid` (sglang/srt/entrypoints/openai/
    serving_base.py), and its /server_info holds `internal_states` (sglang/srt/entrypoints/http_server.py)."""
    info = (server_info or {}).get("body")
    return isinstance(info, dict) and "internal_states" in info


def _count_tokens(tokenizer_dir: Path, text: str) -> int:
    """Tokens of `text` in the directory's tokenizer.json (the fast tokenizer transformers would load), without
    special tokens; 0 when there is none to read."""
    from tokenizers import Tokenizer

    try:
        return len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - no tokenizer.json, or one tokenizers cannot read: counts stay unadjusted
        return 0


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def error_message(body: str) -> str:
    """The server's own words from an error body: OpenAI's {"error": {"message"}}, vLLM's older
    {"object": "error", "message"}, FastAPI's {"detail"}, or the text itself, on one line."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    message = None
    if isinstance(obj, dict):
        err = obj.get("error")
        message = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
        message = message or obj.get("message") or obj.get("detail")
    text = message if isinstance(message, str) else body if message is None else json.dumps(message)
    return " ".join(text.split())[:300]


class HttpTarget:
    """Streams requests to `base_url`; `preflight()` checks the server answers before any load is sent. A
    `Target` (target.py)."""

    kind = "http"
    counts_with_own_tokenizer = True
    starts_with_empty_cache = False
    open_message = None

    def __init__(self, base_url: str, endpoint: str, model: str | None, transport: Transport,
                 model_is_path: bool = False, ignore_eos: bool = False, temperature: float = 0.0,
                 continuous_usage: bool = True, extra_body: dict | None = None, tokenizer=None,
                 prompt_salt: str | None = None, tokenizer_dir: str | Path | None = None,
                 server_metrics: str = "auto") -> None:
        self.base_url = normalize_base_url(base_url)
        self.endpoint = endpoint
        self.path = ENDPOINT_PATHS[endpoint]
        self.model = model
        self.model_is_path = model_is_path  # a local directory: the server may list its model by another name
        self.transport = transport
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.continuous_usage = continuous_usage
        self.extra_body = extra_body or {}
        self.server_metrics = server_metrics  # --server-metrics
        self.reads_server_metrics = server_metrics != "off"
        self.asks_server_metrics = server_metrics == "on"  # auto: settled by preflight()
        self.tokenizer = tokenizer
        self.server_info: dict | None = None
        self.max_model_len: int | None = None  # the served model's context length, when /v1/models gives it
        self.adapters: AdapterMix | None = None  # --lora-modules: each request names an adapter as its model
        self.structured = None  # --structured: a StructuredPlan, which constrains some requests' output
        self.images = None  # --images: an ImagePlan, whose images each chat request carries before its text
        self.prompt_salt = prompt_salt  # --prompt-salt: a line before every prompt, so no earlier run's cache fits
        self._salt_tokens: int | None = None
        self.tokenizer_dir = tokenizer_dir  # where a load worker, which loads no tokenizer, counts the salt's tokens
        self._profiler = None  # the ProfilerClient of a capture in progress
        self._capture = None
        # X-Request-Id of every send: unique to this target, so the server's request log joins back to the run
        self._request_ids = map(f"{uuid.uuid4().hex[:12]}-{{}}".format, itertools.count())

    async def open(self) -> None:
        await self.transport.open()
        if self.prompt_salt and self.tokenizer is None and self.tokenizer_dir is not None:
            self._salt_tokens = await asyncio.to_thread(_count_tokens, Path(self.tokenizer_dir), self.salt_line)

    async def close(self) -> None:
        await self.transport.close()

    async def preflight(self) -> None:
        """Fail with one line before any load when the server is unreachable or names no model."""
        status, models = await self.transport.request_json("GET", "/v1/models")
        data = models.get("data") if status == 200 and isinstance(models, dict) else None
        listed = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if self.model is None or (self.model_is_path and listed and self.model not in listed):
            if not listed:
                raise TargetError(f"{self.base_url}/v1/models answered {status} with no model; "
                                  "pass --served-model-name NAME")
            self.model = listed[0]
        elif listed and self.model not in listed:  # every request would be refused (vLLM: 404)
            shown = ", ".join(repr(m) for m in listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
            raise TargetError(f"model {self.model!r} is not served at {self.base_url}: /v1/models lists {shown}; "
                              "pass one of them as --model or --served-model-name")
        if self.adapters is not None and listed and (missing := [n for n in self.adapters.names if n not in listed]):
            raise TargetError(f"the server refuses LoRA adapter {', '.join(map(repr, missing))}: {self.base_url}"
                              f"/v1/models lists {', '.join(map(repr, listed[:5]))}; serve it (vLLM: --enable-lora "
                              "--lora-modules NAME=DIR; infertrace serve serves no adapters)")
        card = next((m for m in data if isinstance(m, dict) and m.get("id") == self.model), None) if listed else None
        length = card.get("max_model_len") if card else None  # vLLM's and SGLang's model card carry it
        self.max_model_len = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 \
            else None
        for path in ("/server_info", "/version"):
            status, info = await self.transport.request_json("GET", path)
            if status == 200:
                self.server_info = {"endpoint": path, "body": info}
                break
        if self.server_metrics == "auto":
            self.asks_server_metrics = await self._has_request_metrics(card)

    async def _has_request_metrics(self, card: dict | None) -> bool:
        """Whether the server is a vLLM that has per-request metrics: its model card says `owned_by: vllm` and its
        /version is at least VLLM_REQUEST_METRICS. Another server is never asked: a strict one refuses a body key
        it does not know."""
        if not card or card.get("owned_by") != "vllm":
            return False
        info = (self.server_info or {}).get("body") if (self.server_info or {}).get("endpoint") == "/version" \
            else None
        if info is None:
            status, info = await self.transport.request_json("GET", "/version")
            info = info if status == 200 else None
        version = _release(info.get("version") if isinstance(info, dict) else None)
        return version is not None and version >= VLLM_REQUEST_METRICS

    @property
    def salt_line(self) -> str:
        """What --prompt-salt puts before each prompt: the salt and a newline, so that the prompt's own tokens
        stay as they were (a byte-level BPE merges nothing across a newline into a word)."""
        return f"{self.prompt_salt}\n" if self.prompt_salt else ""

    @property
    def salt_tokens(self) -> int:
        """The salt line's tokens in our tokenizer (0 without a salt or a tokenizer): added to each prompt's
        built length, so that the server's count still agrees with ours."""
        if self._salt_tokens is None and (not self.prompt_salt or self.tokenizer is None):
            return 0
        if self._salt_tokens is None:
            self._salt_tokens = len(self.tokenizer.encode(self.salt_line, add_special_tokens=False))
        return self._salt_tokens

    async def reset_prefix_cache(self) -> str:
        """Empty the server's prefix cache, so that a run finds none of an earlier run's prompts cached; the
        route that did it. vLLM 0.33 offers POST /reset_prefix_cache (only when started with
        VLLM_SERVER_DEV_MODE=1; it answers {"success": false} while blocks are held), SGLang 0.5.23 POST
        /flush_cache (400 while requests run); each route is tried in turn. TargetError when none did."""
        tried = []
        for path in RESET_PREFIX_CACHE_PATHS:
            status, answer = await self.transport.request_json("POST", path)
            refused = isinstance(answer, dict) and answer.get("success") is False
            if status == 200 and not refused:
                return path
            why = "success false: blocks are still held" if refused else \
                error_message(answer if isinstance(answer, str) else json.dumps(answer))
            tried.append(f"{path} answered {status}" + (f" ({why})" if why else ""))
        raise TargetError(f"--reset-prefix-cache: {self.base_url} reset no prefix cache: {'; '.join(tried)} "
                          "(vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1)")

    def body(self, spec: RequestSpec) -> dict:
        if self.endpoint == "embeddings":
            return self.embeddings_body(spec)
        stream_options = {"include_usage": True}
        if self.continuous_usage:  # left out, not sent as false: some servers reject the key itself
            stream_options["continuous_usage_stats"] = True
        body: dict[str, Any] = {"model": self.model_of(spec), "max_tokens": spec.output_len,
                                "temperature": self.temperature, "stream": True, "stream_options": stream_options}
        if self.endpoint == "chat":
            messages = spec.messages or [{"role": "user", "content": spec.prompt}]
            if self.prompt_salt and isinstance(messages[0].get("content"), str):  # the first: a session's every turn
                messages = [{**messages[0], "content": self.salt_line + messages[0]["content"]}, *messages[1:]]
            body["messages"] = self.images.messages(messages, spec.index) if self.images is not None else messages
        elif spec.prompt or spec.prompt_ids is None:
            body["prompt"] = self.salt_line + spec.prompt if self.prompt_salt else spec.prompt
        else:  # a prompt built as token ids without a tokenizer goes as ids (no text was made)
            body["prompt"] = spec.prompt_ids
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.asks_server_metrics:
            # vLLM 0.32 and 0.33 send the metrics whenever started with --enable-per-request-metrics and let this
            # key pass (their request models allow extra keys); it states the ask for servers that gate on it
            body["include_metrics"] = True
        if spec.request_id is not None and _names_by_rid(self.server_info):
            body["rid"] = spec.request_id  # SGLang names a request by the body's rid, not X-Request-Id
        if self.structured is not None:
            body.update(self.structured.body(spec.index))
        body.update(self.extra_body)
        return body

    def embeddings_body(self, spec: RequestSpec) -> dict:
        """/v1/embeddings: the batch of inputs (a built prompt without a tokenizer goes as its token ids), not
        streamed; --prompt-salt's line goes before each text input."""
        inputs = spec.inputs if spec.inputs is not None else [spec.prompt if spec.prompt or spec.prompt_ids is None
                                                              else spec.prompt_ids]
        if self.prompt_salt:
            inputs = [self.salt_line + x if isinstance(x, str) else x for x in inputs]
        return {"model": self.model_of(spec), "input": inputs, **self.extra_body}

    def model_of(self, spec: RequestSpec) -> str | None:
        """The model a request names: its LoRA adapter under --lora-modules, else the served model."""
        return self.adapters.pick(spec.index) if self.adapters is not None else self.model

    def new_request_id(self) -> str:
        return next(self._request_ids)

    def cache_block_tokens(self) -> tuple[int, str] | None:
        """The block size the server's /server_info gives in its engine config (infertrace serve's does)."""
        body = (self.server_info or {}).get("body")
        block = (body.get("engine_config") or {}).get("block_size") if isinstance(body, dict) else None
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:
            return block, "server_info"
        return None

    def engine_counters(self) -> None:
        return None

    async def read_metrics(self) -> str | None:
        try:
            status, body = await self.transport.request_json("GET", "/metrics")
        except Exception:  # noqa: BLE001 - a server without metrics costs a figure, never the run
            return None
        return body if status == 200 and isinstance(body, str) else None

    async def request_log_cursor(self) -> int | None:
        return await request_log.read_cursor(self.transport)

    async def fetch_request_log(self, since: int) -> dict | None:
        return await request_log.read_since(self.transport, since)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[list[StreamEvent]]:
        """The events of each network read, together: they arrived at the same moment."""
        headers = None
        if spec.request_id is not None:  # the server's records of it, and its spans under bench's, join by these
            headers = {"X-Request-Id": spec.request_id, "traceparent": traceparent(spec.request_id)}
        try:
            async with self.transport.stream(self.path, self.body(spec), headers) as resp:
                if resp.status != 200:
                    yield [StreamEvent(error=f"HTTP {resp.status}: {error_message(await resp.text())}")]
                    return
                if self.endpoint == "embeddings":
                    yield [await _embeddings_event(resp, 1 if spec.inputs is None else len(spec.inputs))]
                    return
                parser, done = SSEParser(), False
                try:
                    async for chunk in resp.chunks():
                        if events := parser.feed(chunk):
                            batch = [decode_data(data) for data in events]
                            done = done or any(ev.done for ev in batch)
                            yield batch
                    if events := parser.close():
                        yield [decode_data(data) for data in events]
                finally:
                    if done:  # read the body's last bytes, so the connection goes back to the pool for reuse
                        await resp.finish()
        except SSELineTooLong as e:
            yield [StreamEvent(error=f"malformed stream: {e}")]
        except asyncio.TimeoutError:
            yield [StreamEvent(error="timeout: no complete response within --request-timeout")]
        except (aiohttp.ClientError, OSError) as e:
            yield [StreamEvent(error=f"disconnect: {type(e).__name__}: {e}")]

    async def start_profile(self, num_steps: int | None) -> Any:
        """Start the server's profiler the way its flavour takes it (capture/client.py): vLLM 0.32 on gets
        max_iterations, SGLang and infertrace num_steps; a server of no known flavour gets SGLang's body."""
        from infertrace.capture.client import ProfilerClient, ProfilerError
        from infertrace.capture.peers import (
            Flavour,
            ProfileOptions,
            default_capture_name,
        )
        from infertrace.capture.session import ServerCapture

        headers = getattr(self.transport, "headers", None) or {}
        client = ProfilerClient(self.base_url, None, PROFILE_TIMEOUT_S, headers, fallback=Flavour.INFERTRACE)
        await client.__aenter__()
        try:
            flavour = await client.flavour()
            started = await client.start(ProfileOptions(name=default_capture_name(), num_steps=num_steps))
        except ProfilerError as e:
            await client.__aexit__(None, None, None)
            raise TargetError(str(e)) from None
        except BaseException:
            await client.__aexit__(None, None, None)
            raise
        self._profiler = client
        sent = started.body or {}
        limited = sent.get("max_iterations") or sent.get("num_steps")
        self._capture = ServerCapture.begin(self.base_url, flavour, sent.get("profile_prefix") or sent.get("profile_id"),
                                            started.options.output_dir, client.local, num_steps if limited else None,
                                            started.body)
        return {"flavour": flavour.value, "sent": started.body, "message": started.message,
                "notes": client.notes + started.notes, "writes_to": self._capture.where()}

    async def stop_profile(self) -> tuple[int, Any]:
        """(200, what the stop said and which files were written); a capture that already ended by itself
        after its step limit (SGLang) is the normal end, and its files are awaited when the server is local."""
        from infertrace.capture.client import ProfilerError

        client, capture = self._profiler, self._capture
        if client is None:
            return None, "the profiler was not started"
        try:
            result = await client.stop(self_stopping=capture.num_steps is not None)
        except ProfilerError as e:
            return None, str(e)
        finally:
            await client.__aexit__(None, None, None)
            self._profiler = None
        files = list(result.traces)
        if not files:
            files = await asyncio.to_thread(capture.written)
        capture.files = files
        if capture.local:  # beside the traces, whoever listed them, when they are on this host
            await asyncio.to_thread(capture.write_manifest)
        return 200, {"message": result.message, "already_stopped": result.already_stopped,
                     "trace_files": files, "writes_to": capture.where()}

    def describe(self) -> dict:
        headers = getattr(self.transport, "headers", None) or {}
        return {"kind": self.kind, "base_url": self.base_url, "endpoint": self.endpoint, "model": self.model,
                "max_model_len": self.max_model_len, "prompt_salt": self.prompt_salt,
                "headers": {key: "<redacted>" for key in headers},  # keys and tokens stay out of result files
                "server_info": self.server_info,
                "server_metrics": {"mode": self.server_metrics, "asked": self.asks_server_metrics}}
