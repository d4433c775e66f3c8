"""The bundled engine in-process as a load target, and the built-in tiny model it runs by default."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from infertrace.engine.threads import cpu_threads
from infertrace.load.client.timing import TargetError
from infertrace.load.records import RequestSpec, StreamEvent
from infertrace.modelgen.cached import preset_model_dir

TINY_PRESET = "tiny"


def default_model_dir(on_build: Callable[[Path], None] | None = None, preset: str = TINY_PRESET) -> Path:
    """A preset's model in the cache (the built-in tiny model by default), written on first use."""
    return preset_model_dir(preset, on_build)


class EmbeddedTarget:
    """Runs each request through `AsyncEngine.generate`; every output carries its exact token ids. A `Target`
    (target.py)."""

    kind = "embedded"
    salt_tokens = 0  # --prompt-salt is for a server's cache: this engine starts with an empty one
    counts_with_own_tokenizer = False  # the engine's tokenizer is the one prompts are built with
    starts_with_empty_cache = True
    reads_server_metrics = False  # its request log (results/join.py) is the server's view
    asks_server_metrics = False

    def __init__(self, model_dir: str | Path, engine_overrides: dict | None = None, ignore_eos: bool = False,
                 temperature: float = 0.0) -> None:
        self.model_dir = Path(model_dir)
        self.engine_overrides = dict(engine_overrides or {})
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.engine = None
        self.aengine = None
        self.tokenizer = None
        self.torch_threads: int | None = None  # intra-op threads of an engine on the CPU (cpu_threads)
        self._ids = itertools.count()

    async def open(self) -> None:

        from infertrace.engine import AsyncEngine, Engine, EngineConfig

        try:
            config = EngineConfig.from_overrides(self.engine_overrides)
            self.engine = await asyncio.to_thread(Engine, str(self.model_dir), config)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise TargetError(f"cannot start the bundled engine on {self.model_dir}: {e}") from None
        self.tokenizer = self.engine.tokenizer
        if self.engine.runner.device.type == "cpu":
            self.torch_threads = cpu_threads()
        self.aengine = AsyncEngine(self.engine)
        await self.aengine.start()

    async def close(self) -> None:
        if self.aengine is not None:
            await self.aengine.shutdown(abort_running=True)
            self.aengine = None
        if self.engine is not None:  # tensor-parallel ranks are processes of their own: stop them now
            await asyncio.to_thread(self.engine.shutdown)

    @property
    def open_message(self) -> str:
        return f"loading {self.model_dir} into the bundled engine"

    async def preflight(self) -> None:
        return None

    async def reset_prefix_cache(self) -> str:
        """Nothing to empty: what the run is told instead."""
        return "the bundled engine in-process starts with an empty prefix cache"

    def cache_block_tokens(self) -> tuple[int, str] | None:
        return (self.engine.config.block_size, "engine config") if self.engine is not None else None

    def engine_counters(self) -> dict | None:
        if self.engine is None:
            return None
        per_position = {f"spec_decode_num_accepted_tokens_per_pos[{i}]": n
                        for i, n in enumerate(self.engine.spec_accepted_per_pos)}  # empty without drafting
        return {**self.engine.counters, **per_position}

    async def read_metrics(self) -> None:
        return None

    async def request_log_cursor(self) -> int | None:
        if (log := self._request_log()) is None:
            return None
        return await self.aengine.call(lambda: log.next_seq)

    async def fetch_request_log(self, since: int) -> dict | None:
        """The engine's own log, read between two steps on the engine's thread (a log this process wrote needs no
        bounds or checks beyond the join's)."""
        if (log := self._request_log()) is None:
            return None
        return await self.aengine.call(lambda: log.read(since=since))

    def _request_log(self):
        return self.engine.request_log if self.engine is not None else None

    async def start_profile(self, num_steps: int | None) -> Any:
        raise TargetError("--profile starts a server's profiler; the bundled engine in-process is profiled with "
                          "`infertrace profile`")

    async def stop_profile(self) -> tuple[int | None, Any]:
        return None, "the profiler was not started"

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.engine, "max_model_len", None)

    def new_request_id(self) -> str:
        return f"bench-{next(self._ids)}"

    async def stream(self, spec: RequestSpec) -> AsyncIterator[list[StreamEvent]]:
        from infertrace.engine import SamplingParams

        params = SamplingParams(max_tokens=spec.output_len, temperature=self.temperature, ignore_eos=self.ignore_eos)
        prompt = spec.prompt_ids if spec.prompt_ids is not None else spec.prompt
        if spec.messages is not None:  # a session's turn: the whole history through the model's chat template
            prompt = self.tokenizer.apply_chat_template(spec.messages, tokenize=False, add_generation_prompt=True)
        request_id = spec.request_id or self.new_request_id()
        now = time.perf_counter()  # the request log's front-end times: handed to the engine, first output, sent
        stamps = {"received": now, "tokenized": now}
        try:
            async for out in self.aengine.generate(request_id, prompt, params):
                stamps.setdefault("first_output", time.perf_counter())
                if out.finished and out.finish_reason == "abort":
                    yield [StreamEvent(error="aborted: the engine aborted the request")]
                    return
                yield [StreamEvent(text=out.new_text, output=True, num_tokens=len(out.new_token_ids),
                                   prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                   finish_reason=out.finish_reason if out.finished else None)]
        except ValueError as e:  # the engine refuses the request (too long for the context, ...)
            yield [StreamEvent(error=f"rejected: {e}")]
        except Exception as e:  # noqa: BLE001 - an engine fault fails this request, with its reason
            yield [StreamEvent(error=f"engine error: {type(e).__name__}: {e}")]
        finally:
            if self.engine.request_log is not None:
                self.engine.request_log.stamp(request_id, {**stamps, "sent": time.perf_counter()})

    def describe(self) -> dict:
        import dataclasses

        info = {"kind": self.kind, "model_dir": str(self.model_dir), "engine_overrides": self.engine_overrides}
        if self.engine is not None:
            config = getattr(self.engine, "config", None)
            if dataclasses.is_dataclass(config):
                info["engine_config"] = dataclasses.asdict(config)
            info |= self.engine.decode_path()
            info["device"] = str(self.engine.runner.device)
            info["torch_threads"] = self.torch_threads
            # prefix-cache, offload and preemption counters of the whole run (warm-up included)
            info["engine_counters"] = self.engine_counters()
        return info
