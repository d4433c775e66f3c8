"""Offline batch generation: `LLM(model_dir, **config).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infertrace.engine.config import EngineConfig
from infertrace.engine.engine import Engine
from infertrace.engine.outputs import Completion
from infertrace.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model_dir: str | Path, **config_overrides: Any):
        self.engine = Engine(model_dir, EngineConfig.from_overrides(config_overrides))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (they also stop when the LLM is collected)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        """One Completion per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")

        engine = self.engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = f"llm-{next(self._ids)}"
                engine.add_request(request_id, prompt, p or SamplingParams())
                order[request_id] = i
        except Exception:
            for request_id in order:
                engine.abort(request_id)
            raise
        texts: list[list[str]] = [[] for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        results: list[Completion | None] = [None] * len(prompts)
        with _Progress(len(prompts), enabled=progress) as bar:
            while engine.has_unfinished():
                for out in engine.step():
                    i = order.get(out.request_id)
                    if i is None:
                        continue
                    texts[i].append(out.new_text)
                    tokens[i] += out.new_token_ids
                    if out.finished:
                        results[i] = Completion(
                            text="".join(texts[i]),
                            token_ids=tokens[i],
                            finish_reason=out.finish_reason,
                            num_prompt_tokens=out.num_prompt_tokens,
                            num_cached_tokens=out.num_cached_tokens,
                        )
                        bar.advance()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self._progress = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import Progress

            self._progress = Progress(console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("generating", total=self.total)
        return self

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
