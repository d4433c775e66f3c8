"""What the request handlers share: the engine handle, admission to it, and draining."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from infertrace.server.frontend.protocol import (
    ApiError,
    ContextLimits,
    Endpoint,
    GenerateRequest,
    bad_request,
    context_exceeded,
    load_sampling_defaults,
)
from infertrace.server.settings import ServerSettings

log = logging.getLogger("infertrace.server")
# Chat-template rendering and the tokenizing of longer prompts run on these threads, never on the event loop: the
# Rust tokenizer releases the GIL in encode_batch, and jinja yields it at the interpreter's switch interval.
TOKENIZER_WORKERS = 2
# A completions prompt of at most this many characters is tokenized on the event loop, as SGLang 0.5.23 tokenizes
# every prompt by default (sglang/srt/managers/tokenizer_manager.py, `_tokenize_texts`). Under load the trip to a
# tokenizer thread and back is not free: on an H100 host at 60 req/s, a 512-token prompt (about 2,200 characters)
# went from body to token ids 0.17-0.74 ms sooner on the loop (docs/benchmarks.md). At the limit the loop is held
# for about 1-2 ms. Longer prompts and chat templates go to the threads.
INLINE_TOKENIZE_CHARS = 4096
# A text longer than this is encoded in pieces at once (FrontendTokenizer), shorter ones whole. On an H100 host a
# 512-token prompt took 0.42 ms in four pieces instead of 0.99 whole, and `serve` at 60 req/s spent 1.1 ms more
# CPU a request; at 256 streams each of the three servers with pieces (and first tokens first) ran below both
# servers beside it without them, 4.5% fewer tok/s in the mean. At 2,048 and 8,192 tokens the pieces save 1.7 and
# 7.1 ms (docs/benchmarks-history.md, "The host-time changes measured on an H100").
PIECES_FROM_CHARS = INLINE_TOKENIZE_CHARS
IN_FLIGHT_TIMEOUT_S = 2.0
LORA_DIR = "loras"  # where `infertrace model init --lora N` writes a model's adapters (infertrace/modelgen/lora.py)


class ServerState:
    """What the handlers share: the engine handle (`ProcessEngine` or `ThreadEngine`), the tokenizer, the admission
    count of this front end, and draining. `frontend` describes this front end for /server_info."""

    def __init__(self, engine: Any, tokenizer: Any, settings: ServerSettings,
                 frontend: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_model_len: int = engine.info["max_model_len"]
        self.limits = ContextLimits(self.max_model_len, self.max_model_len * longest_token_chars(tokenizer))
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_WORKERS,
                                                                   thread_name_prefix="infertrace-tokenize")
        self.settings = settings
        self.frontend = frontend or {}
        self.sampling_defaults = load_sampling_defaults(settings.model_dir)
        self.lora_adapters = lora_adapters(settings.model_dir)  # read once: answered with a 400, never served
        self.started = int(time.time())
        self.in_flight: set[str] = set()
        self.draining = False
        self.frontend_trace: Any = None  # a FrontendTrace while /start_profile asked for one
        self.log_reads = asyncio.Lock()  # one request-log read at a time goes to the engine (read_request_log),
        self.next_log_read = 0.0  # not before this time of the event loop's clock
        self.tracer: Any = None  # a RequestTracer with --otlp-traces-endpoint
        self.tracer_task: asyncio.Task | None = None
        if hasattr(engine, "on_trace_stop"):  # the engine process's client: a stop may land on another front end
            engine.on_trace_stop = self._trace_stopped
        self._idle = asyncio.Event()
        self._idle.set()

    def release(self) -> None:
        """The app has ended: stop the tokenizer threads and let go of the engine handle and the tokenizer.
        Something may keep the app itself alive after its end (aiohttp caches each app's middleware chain in a
        module-level LRU of 1,024 entries), and it must not keep an engine with it."""
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.engine = self.tokenizer = self.frontend_trace = None

    async def read_request_log(self, args: dict[str, int]) -> dict | None:
        """One page of the engine's request log (None when the log is off). The engine builds each answer between
        two steps, so this front end sends it one read at a time and, after each, waits as long as that read took
        before it sends the next: however many readers come (HTTP clients, the span exporter), they take at most
        about half of the engine's time from the streams."""
        loop = asyncio.get_running_loop()
        async with self.log_reads:
            await asyncio.sleep(self.next_log_read - loop.time())
            sent = loop.time()
            answer = await self.engine.command("request_log", args)
            self.next_log_read = 2 * loop.time() - sent
        return answer

    def _trace_stopped(self, output_dir: str | None) -> None:
        """Another front end stopped the capture this one traces itself in: stop the profile hook and write the
        trace into the capture's folder."""
        trace, self.frontend_trace = self.frontend_trace, None
        if trace is None:
            return
        trace.stop()
        if output_dir:
            written = asyncio.get_running_loop().run_in_executor(None, trace.write, Path(output_dir))
            written.add_done_callback(lambda f: f.exception() and log.error("cannot write the front-end trace: %s",
                                                                             f.exception()))

    def count(self, **deltas: int) -> None:
        """Add to the server counters behind /metrics ("finished:stop", "rejected:queue_full", ...)."""
        try:
            self.engine.count(deltas)
        except Exception as e:  # a dead engine: nothing left to count for
            log.debug("not counted (%s): %s", e, deltas)

    # ----- admission -----
    @contextlib.contextmanager
    def admitted(self, request_id: str):
        """Count a request in flight, or refuse it with 503 when draining or when the queue is full."""
        if self.draining:
            self.count(**{"rejected:draining": 1})
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        # Accepted requests not in the running batch: the engine's queue plus those on their way to it.
        waiting = len(self.in_flight) - self.engine.stats()["running"]
        if waiting >= self.settings.max_queue:
            self.count(**{"rejected:queue_full": 1})
            raise ApiError(503, f"the server is overloaded: {waiting} requests are waiting "
                                f"(--max-queue {self.settings.max_queue}); retry later",
                           code="queue_full", headers={"Retry-After": str(self.settings.retry_after_s)})
        self.in_flight.add(request_id)
        self._idle.clear()
        self.count(in_flight=1)
        try:
            yield
        finally:
            self.in_flight.discard(request_id)
            self.count(in_flight=-1)
            if not self.in_flight:
                self._idle.set()

    async def in_flight_everywhere(self) -> int:
        """Requests in flight on every front end, as the server counters in the engine add them up; this front
        end's own when the engine does not answer within IN_FLIGHT_TIMEOUT_S."""
        try:
            now = await asyncio.wait_for(self.engine.command("metrics"), IN_FLIGHT_TIMEOUT_S)
            counted = int(now["server"]["counts"].get("in_flight", 0))
        except Exception as e:  # a dead or stuck engine: what this front end knows is all there is
            log.debug("in-flight count of this front end only: %s", e)
            counted = 0
        return max(counted, len(self.in_flight))

    async def drain(self, grace_s: float, abort_now: asyncio.Event | None = None) -> int:
        """Refuse new requests, let in-flight ones finish for up to `grace_s`, then abort the rest.
        Returns how many were aborted."""
        self.draining = True
        waiters = [asyncio.ensure_future(self._idle.wait())]
        if abort_now is not None:
            waiters.append(asyncio.ensure_future(abort_now.wait()))
        _, pending = await asyncio.wait(waiters, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        leftover = list(self.in_flight)
        # every abort is sent before any answer is awaited: one trip to the engine for them all, not one each
        results = await asyncio.gather(*(self.engine.abort(request_id) for request_id in leftover),
                                       return_exceptions=True)
        for request_id, result in zip(leftover, results):
            if isinstance(result, Exception):  # a dead engine has nothing left to abort; shutting down must go on
                log.warning("could not abort %s: %s", request_id, result)
        if leftover:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)  # handlers send their final chunks
        return len(leftover)

    # ----- requests -----
    def check_model(self, model: str | None) -> str:
        """The served model's name for a request's `model`. Another name is vLLM 0.33's 404
        (vllm/entrypoints/serve/engine/serving.py, `_check_model`), except an adapter written beside the model:
        vLLM would serve that one with --enable-lora, so its refusal says what does."""
        name = self.settings.served_model_name
        if model is not None and model != name:
            if model in self.lora_adapters:
                raise ApiError(400, f"the model {model!r} is a LoRA adapter of {name!r} ({LORA_DIR}/{model} beside "
                               "it), and this server serves no LoRA adapters: vllm serve --enable-lora "
                               f"--lora-modules {model}=DIR does", param="model", code="lora_not_supported")
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        return name

    async def prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids: a short completions prompt tokenized here, on the event loop; anything else
        rendered and tokenized on the tokenizer threads."""
        if isinstance(req.prompt, list):
            return req.prompt
        if isinstance(req.prompt, str) and len(req.prompt) <= INLINE_TOKENIZE_CHARS:
            return self._render_and_encode(req)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, self._render_and_encode, req)

    def _render_and_encode(self, req: GenerateRequest) -> list[int]:
        if req.endpoint is Endpoint.CHAT:
            # the template is the model directory's own; request kwargs were allow-listed by the protocol
            kwargs = {"add_generation_prompt": True, **req.chat_template_kwargs}
            try:
                text = self.tokenizer.apply_chat_template(req.messages, tokenize=False, **kwargs)
            except Exception as e:  # a template error is the request's fault (roles, kwargs)
                raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
            return self._encode(text, add_special_tokens=False)  # the template carries any BOS itself
        return self._encode(req.prompt, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                     pieces=len(text) > PIECES_FROM_CHARS)

    def sampling_params(self, req: GenerateRequest, num_prompt_tokens: int) -> Any:
        from infertrace.engine.sampling_params import SamplingParams, SamplingParamsError

        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise context_exceeded(num_prompt_tokens, limit, req.prompt_param)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = limit - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > limit:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                              f"{num_prompt_tokens + max_tokens} tokens exceed the maximum context of {limit} "
                              "tokens", "max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(max_tokens=max_tokens, **req.sampling)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.field) from None

    def server_info(self) -> dict:
        info = self.engine.info
        versions = dict(info.get("versions") or {})
        for name in ("aiohttp", "tokenizers", "msgspec"):
            with contextlib.suppress(ImportError):
                versions[name] = __import__(name).__version__
        settings = dataclasses.asdict(self.settings)
        settings["profile_dir"] = None if self.settings.profile_dir is None else str(self.settings.profile_dir)
        return {"model": self.settings.served_model_name, "model_dir": self.settings.model_dir,
                "max_model_len": self.max_model_len, "engine_config": info.get("engine_config"),
                "sampling_defaults": self.sampling_defaults, "server": settings, "versions": versions,
                "device": info.get("device"), "platform": platform.platform(),
                "engine_pid": info.get("engine_pid"), "gc_frozen_objects": info.get("gc_frozen_objects"),
                "torch_threads": info.get("torch_threads"),
                "frontend": {"pid": os.getpid(), **self.frontend},
                **(info.get("decode_path") or {})}


def longest_token_chars(tokenizer: Any) -> int:
    """The most prompt characters one token can cover: the longest vocabulary entry. For a byte-level BPE an entry
    has one character per byte and a prompt character is at least one byte, so a prompt of more than
    max_model_len times this many characters cannot fit, whatever it holds."""
    vocab = tokenizer.get_vocab()
    return max(map(len, vocab), default=1) or 1


def lora_adapters(model_dir: str | Path) -> frozenset[str]:
    """The names of the LoRA adapters beside a model: the folders of MODEL_DIR/loras that hold an
    adapter_config.json, as `infertrace model init --lora N` writes them."""
    try:
        return frozenset(p.name for p in (Path(model_dir) / LORA_DIR).iterdir()
                         if (p / "adapter_config.json").is_file())
    except OSError:  # no loras folder (or one that cannot be read): no adapters to name
        return frozenset()
