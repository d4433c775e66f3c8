"""The bundled inference engine: paged KV cache, prefix caching, continuous batching, Qwen3 models.

Names are imported on first use, so that `import infertrace.engine.config` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "infertrace.engine.config",
    "SamplingParams": "infertrace.engine.sampling_params",
    "RequestOutput": "infertrace.engine.outputs",
    "StepStats": "infertrace.engine.outputs",
    "Completion": "infertrace.engine.outputs",
    "Engine": "infertrace.engine.engine",
    "AsyncEngine": "infertrace.engine.async_engine",
    "LLM": "infertrace.engine.llm",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'infertrace.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
