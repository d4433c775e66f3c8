"""The aiohttp application: OpenAI routes, health and info, Prometheus metrics, profiler endpoints.

Requests are validated on the event loop against cheap bounds; short prompts are tokenized there, chat templates
and longer prompts rendered and tokenized on a small thread pool (`state.INLINE_TOKENIZE_CHARS`);
generation runs in the engine process (or thread) behind the handle in `engine_client`. Every error leaves as an OpenAI-style JSON body, never a
traceback. Bodies must be declared JSON and side effects take POST only, so a web page cannot trigger them with a
form or a plain-text fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from infertrace import __version__
from infertrace.engine.outputs import EngineDeadError
from infertrace.server.frontend import metrics
from infertrace.server.frontend.profiler import parse_profile_request
from infertrace.server.frontend.protocol import (
    ApiError,
    Endpoint,
    bad_request,
    brief,
    parse_generate_request,
    parse_json_body,
)
from infertrace.server.frontend.request_log import (
    READ_TIMEOUT_S,
    RequestStamps,
    check_read,
    client_request_id,
    read_args,
)
from infertrace.server.frontend.state import ServerState
from infertrace.server.frontend.stream import SSE_DONE, ResponseBuilder, new_request_id, sse, usage
from infertrace.server.frontend.trace import FrontendTrace
from infertrace.server.settings import ServerSettings

log = logging.getLogger("infertrace.server")
HEALTH_TIMEOUT_S = 10.0
# the request field to name in a 400 when the engine refuses a sampling field (a grammar comes from response_format)
REFUSED_FIELD_PARAM = {"grammar": "response_format"}


STATE = web.AppKey("state", ServerState)


def build_app(engine: Any, tokenizer: Any, settings: ServerSettings,
              frontend: dict[str, Any] | None = None) -> web.Application:
    """The application over a connected engine handle (`ProcessEngine` or `ThreadEngine`) and the model's
    tokenizer. The caller owns the engine's start and shutdown."""
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_mb * 1024 * 1024)
    app[STATE] = ServerState(engine, tokenizer, settings, frontend)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/request_log", _request_log)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)  # vLLM's route
    app.router.add_post("/flush_cache", _flush_cache)  # SGLang's
    app.router.add_post("/start_profile", _start_profile)
    app.router.add_post("/stop_profile", _stop_profile)
    if settings.otlp_traces_endpoint is not None:
        app.on_startup.append(_start_tracing)
        app.on_shutdown.append(_stop_tracing)
    app.on_cleanup.append(_release_state)
    return app


async def _start_tracing(app: web.Application) -> None:
    from infertrace.server.frontend.tracing import RequestTracer

    state = app[STATE]
    state.tracer = RequestTracer(state.settings.otlp_traces_endpoint, state.settings.served_model_name,
                                 state.frontend.get("index", 0))
    state.tracer_task = asyncio.get_running_loop().create_task(state.tracer.run(state))


async def _stop_tracing(app: web.Application) -> None:
    state = app[STATE]
    state.tracer_task.cancel()
    await asyncio.gather(state.tracer_task, return_exceptions=True)
    await state.tracer.close(state)


async def _release_state(app: web.Application) -> None:
    app[STATE].release()


# What a web page may POST cross-origin without asking first (CORS "simple" requests): never taken as a body.
FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


async def _json_body(request: web.Request, *, bare_ok: bool = False) -> dict | None:
    """The body as a JSON object; 415 unless it is declared JSON (`application/json`, any charset, or a `+json`
    type). With `bare_ok`, an empty body is None (vLLM's bare profiler POST), unless it came as a form."""
    declared = request.headers.get("Content-Type")
    media = request.content_type  # without parameters, lower-cased
    is_json = declared is not None and (media == "application/json" or media.endswith("+json"))
    if (declared is not None and media in FORM_TYPES) or not (is_json or bare_ok):
        raise ApiError(415, f"the request body must be JSON: send Content-Type: application/json, not "
                            f"{brief(declared or 'none')}", code="unsupported_media_type")
    raw = await request.read()
    if bare_ok and not raw.strip():
        return None
    if not is_json:
        raise ApiError(415, f"the request body must be JSON: send Content-Type: application/json, not "
                            f"{brief(declared or 'none')}", code="unsupported_media_type")
    return parse_json_body(raw)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except EngineDeadError as e:  # logged once where the engine's death was noticed, not once per request
        error = ApiError(503, f"the engine is not running: {e}", code="engine_dead")
        return web.json_response(error.body(), status=503)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = ApiError(e.status, e.reason if e.status != 413 else f"the request body is too large: {e.text}",
                         code=e.reason.lower().replace(" ", "_"))
        return web.json_response(error.body(), status=e.status)
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")
        return web.json_response(error.body(), status=500)


# ----- generation -----
async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.COMPLETIONS)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.CHAT)


async def _embeddings(request: web.Request) -> web.Response:
    from infertrace.server.frontend.embeddings import answer

    return await answer(request.app[STATE], await _json_body(request), request.headers)


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    stamps = RequestStamps()  # the request log's front-end times, from now
    state = request.app[STATE]
    req = parse_generate_request(await _json_body(request), endpoint, state.sampling_defaults, state.limits)
    model = state.check_model(req.model)
    request_id = client_request_id(request.headers, state.in_flight) or new_request_id(endpoint)
    builder = ResponseBuilder(endpoint, model, request_id, req.stream_options)
    with state.admitted(request_id):  # from here on it counts against --max-queue, tokenizing included
        prompt_ids = await state.prompt_ids(req)
        params = state.sampling_params(req, len(prompt_ids))
        stamps.mark("tokenized")
        outputs = state.engine.generate(request_id, prompt_ids, params)
        async with contextlib.aclosing(outputs):  # closing it early (client gone, error) aborts the request
            try:
                first = await anext(outputs, None)
            except ValueError as e:  # the engine refused the request (token ids out of range, ...)
                raise bad_request(str(e), REFUSED_FIELD_PARAM.get(getattr(e, "field", None), req.prompt_param)) from None
            except asyncio.CancelledError:
                state.count(client_disconnects=1)
                raise
            stamps.mark("first_output")
            try:
                if req.stream:
                    return await _stream(request, state, builder, outputs, first, len(prompt_ids))
                return await _complete(state, builder, outputs, first, len(prompt_ids))
            finally:
                stamps.send(state.engine, request_id)
                if state.tracer is not None:
                    state.tracer.ended(request_id, stamps.times, request.headers)


async def _complete(state: ServerState, builder: ResponseBuilder, outputs, first,
                    num_prompt_tokens: int) -> web.Response:
    texts, last = [], None
    out = first
    try:
        while out is not None:
            texts.append(out.new_text)
            last = out
            if out.finished:
                break
            out = await anext(outputs, None)
    except asyncio.CancelledError:
        state.count(client_disconnects=1)
        raise
    reason = last.finish_reason if last is not None and last.finished else "abort"
    state.count(**{f"finished:{reason}": 1})
    final_usage = (usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) if last
                   else usage(num_prompt_tokens, 0))
    return web.json_response(builder.full("".join(texts), reason, final_usage))


async def _stream(request: web.Request, state: ServerState, builder: ResponseBuilder, outputs, first,
                  num_prompt_tokens: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": builder.request_id})
    try:
        await response.prepare(request)
        chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"  # set by prepare() on 1.1
        direct = _DirectWrites(state.engine, builder.request_id, request.transport, chunked, builder)
        reason = await _write_events(response, builder, outputs, first, num_prompt_tokens, direct)
    except ConnectionResetError:  # the client went away; leaving the `aclosing` block aborts the request
        state.count(client_disconnects=1)
        return response
    except asyncio.CancelledError:  # the same, noticed by aiohttp's handler cancellation
        state.count(client_disconnects=1)
        raise
    state.count(**{f"finished:{reason}": 1})
    return response


async def _write_events(response: web.StreamResponse, builder: ResponseBuilder, outputs, first,
                        num_prompt_tokens: int, direct: _DirectWrites | None = None) -> str:
    """Write the SSE events of one request; returns its finish reason. While waiting for the next output, `direct`
    writes the ones in between as they arrive (the handler wakes for the last one, or when the client falls
    behind or is gone)."""
    if builder.endpoint is Endpoint.CHAT:
        await response.write(sse(builder.role_chunk(usage(num_prompt_tokens, 0))))
    out, last = first, None
    try:
        while out is not None:
            await response.write(_chunk(builder, out))
            last = out
            if out.finished:
                break
            if direct is not None:
                direct.attach()
            out = await anext(outputs, None)
            if direct is not None:
                direct.detach()
                last = direct.last or last
    except ConnectionResetError:
        raise
    except Exception as e:  # the engine failed mid-stream: say so in-band, then end the stream
        if not isinstance(e, EngineDeadError):  # a death is logged once, where it was noticed
            log.exception("generation failed for %s", builder.request_id)
        await response.write(sse(builder.error_chunk(f"{type(e).__name__}: {e}")))
        await response.write(SSE_DONE)
        return "error"
    if last is None or not last.finished:  # the engine stopped without finishing it
        await response.write(sse(builder.chunk("", "abort", None)))
        reason = "abort"
    else:
        reason = last.finish_reason
    if builder.stream_options.include_usage:
        final = (usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) if last
                 else usage(num_prompt_tokens, 0))
        await response.write(sse(builder.usage_chunk(final)))
    await response.write(SSE_DONE)
    return reason


def _chunk(builder: ResponseBuilder, out: Any) -> bytes:
    continuous = builder.stream_options.continuous_usage_stats
    now = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens) if continuous else None
    return sse(builder.chunk(out.new_text, out.finish_reason if out.finished else None, now))


class _DirectWrites:
    """Writes a request's intermediate outputs to its socket from the engine client's dispatch, as a step's
    message is read, instead of waking the request's handler once per token: at a few hundred streams that
    wake-up is most of the front end's CPU per token. Only while the socket keeps up: past HIGH_WATER bytes
    unsent, or once the client is gone, an output is left for the handler, which writes it the ordinary way
    (aiohttp's flow control) or sees the disconnect. The last output always goes to the handler.
    Bytes are those of `response.write`: the same SSE chunk, framed for chunked transfer encoding when the
    response uses it."""

    HIGH_WATER = 1 << 20
    __slots__ = ("attach_sink", "request_id", "transport", "chunked", "builder", "last")

    def __init__(self, engine: Any, request_id: str, transport: Any, chunked: bool, builder: ResponseBuilder):
        self.attach_sink = getattr(engine, "attach_sink", None)  # the engine process's client offers it
        self.request_id = request_id
        self.transport = transport
        self.chunked = chunked
        self.builder = builder
        self.last = None  # the latest output written here

    def attach(self) -> None:
        if self.attach_sink is not None and self.transport is not None:
            self.attach_sink(self.request_id, self.take)

    def detach(self) -> None:
        if self.attach_sink is not None:
            self.attach_sink(self.request_id, None)

    def take(self, out: Any) -> bool:
        transport = self.transport
        if out.finished or transport.is_closing() or transport.get_write_buffer_size() > self.HIGH_WATER:
            return False
        data = _chunk(self.builder, out)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        self.last = out
        return True


# ----- info -----
async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.settings.served_model_name, "object": "model", "created": state.started,
            "owned_by": "infertrace", "root": state.settings.model_dir, "max_model_len": state.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    """200 when the engine answers between two steps; 503 when draining, dead or stuck."""
    state = request.app[STATE]
    if state.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    try:
        await asyncio.wait_for(state.engine.command("ping"), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the engine did not answer within {HEALTH_TIMEOUT_S:g}s", code="engine_stuck") from None
    except Exception as e:
        raise ApiError(503, f"the engine is not running: {e}", code="engine_dead") from None
    return web.json_response({"status": "ok"})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def _server_info(request: web.Request) -> web.Response:
    info = request.app[STATE].server_info()
    return web.json_response(json.loads(json.dumps(info, default=str)))


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        now = await asyncio.wait_for(state.engine.command("metrics"), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the engine did not answer within {HEALTH_TIMEOUT_S:g}s", code="engine_stuck") from None
    except EngineDeadError as e:
        raise ApiError(503, f"the engine is not running: {e}", code="engine_dead") from None
    body = metrics.render(state.settings.served_model_name, now["stats"], now["server"])
    return web.Response(body=body.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})


async def _request_log(request: web.Request) -> web.Response:
    """Each request's life on the server's clock (docs/serve.md, "The request log"), one page at a time.

    `GET /v1/request_log?since=N&limit=M` answers the requests numbered N and later (`seq`), oldest first, each
    with the steps it rode, the steps from the first one's arrival to the last one's end, and `next`: the number
    after the last request given (the log's end when none is; `?limit=0` reads just that cursor). A page holds at
    most MAX_PAGE_REQUESTS (1,000) requests and stops before the one that would take its JSON past MAX_PAGE_BYTES
    (1 MiB); it holds at least one, so only a request whose own steps pass that bound makes a larger page. A
    reader follows `next` until a page is empty. Reads are paced (`ServerState.read_request_log`)."""
    state = request.app[STATE]
    args = read_args(request.query)
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            answer = await state.read_request_log(args)
    except TimeoutError:
        raise ApiError(503, f"the engine did not answer within {READ_TIMEOUT_S:g}s", code="engine_stuck") from None
    except EngineDeadError as e:
        raise ApiError(503, f"the engine is not running: {e}", code="engine_dead") from None
    return web.json_response(check_read(answer))


# ----- prefix cache -----
FLUSH_POLL_S = 0.05


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM 0.33's POST /reset_prefix_cache: {"success": false} while requests hold blocks (retry later). Its
    reset_running_requests=true, which would preempt them, is not offered; there is no external cache to reset."""
    await _json_body(request, bare_ok=True)
    if _query_flag(request, "reset_running_requests"):
        raise ApiError(400, "reset_running_requests is not supported: reset once the running requests end",
                       param="reset_running_requests")
    _query_flag(request, "reset_external")
    return web.json_response(await request.app[STATE].engine.command("reset_prefix_cache"))


async def _flush_cache(request: web.Request) -> web.Response:
    """SGLang 0.5.23's /flush_cache: plain text, 200 once flushed, 400 while requests are running or waiting;
    `timeout` (seconds) waits that long for them to end. POST only here: a GET with a side effect could be sent
    by any web page."""
    await _json_body(request, bare_ok=True)
    try:
        timeout = float(request.query.get("timeout", "0"))
    except ValueError:
        timeout = -1.0
    if not 0 <= timeout < float("inf"):
        raise ApiError(400, f"timeout must be a number of seconds >= 0, not {brief(request.query['timeout'])}",
                       param="timeout")
    engine = request.app[STATE].engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (await engine.command("reset_prefix_cache"))["success"]:
        if loop.time() >= deadline:
            return web.Response(status=400, text="Cache not flushed: requests are running or waiting; retry "
                                                 "once they end, or pass ?timeout=SECONDS to wait for them.\n")
        await asyncio.sleep(FLUSH_POLL_S)
    return web.Response(text="Cache flushed.\n")


def _query_flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{name} must be true or false, not {brief(value)}", param=name)
    return value in ("true", "1")


# ----- profiler -----
async def _start_profile(request: web.Request) -> web.Response:
    """The capture runs in the engine process; with "frontend": true this front end traces its own Python too."""
    state = request.app[STATE]
    req = parse_profile_request(await _json_body(request, bare_ok=True))
    args = {f: getattr(req, f) for f in req.__dataclass_fields__ if f != "frontend"}
    args["frontend_trace"] = req.frontend  # so that a stop on another front end ends this one's trace too
    result = await state.engine.command("start_profile", args)
    if req.frontend:
        state.frontend_trace = FrontendTrace(state.frontend.get("index", 0))
        state.frontend_trace.start()
        result["frontend"] = True
    return web.json_response(result)


async def _stop_profile(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await _json_body(request, bare_ok=True)  # a body, if any, is ignored, but only a JSON one is taken
    trace, state.frontend_trace = state.frontend_trace, None
    if trace is not None:
        trace.stop()
    result = await state.engine.command("stop_profile")
    if trace is not None:
        path = await asyncio.to_thread(trace.write, Path(result["output_dir"]))
        result["files"] = [*result["files"], str(path)]
        result["frontend_trace"] = str(path)
    elif (pid := result.pop("frontend_trace_pid", None)) is not None:  # another front end traced itself
        path = await _written_by(Path(result["output_dir"]), pid)
        if path is None:
            result["frontend_trace_error"] = (f"front end pid {pid} did not write its trace within "
                                              f"{FRONTEND_TRACE_WAIT_S:g}s")
        else:
            result["files"] = [*result["files"], str(path)]
            result["frontend_trace"] = str(path)
    return web.json_response(result)


FRONTEND_TRACE_WAIT_S = 10.0


async def _written_by(out_dir: Path, pid: int) -> Path | None:
    """The front-end trace that front end `pid` writes into `out_dir` once told the capture stopped (it writes
    to a temporary name and renames, so a file found here is whole); None if it has not within the wait."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FRONTEND_TRACE_WAIT_S
    while loop.time() < deadline:
        found = sorted(out_dir.glob(f"frontend*-{pid}.trace.json"))
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    return None
