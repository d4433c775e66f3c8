"""What the engine hands out: per-request token deltas, per-step statistics, finished completions."""

from __future__ import annotations

from dataclasses import dataclass


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error (or its process exited); no more requests can run."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental text; stop strings already cut
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    num_cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class StepStats:
    index: int
    kind: str  # "prefill" | "decode" | "mixed"
    batch_size: int
    num_tokens: int
    duration_s: float
    prefix_cache_hits: int  # prompt tokens served from the prefix cache in this step
    preemptions: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0  # after the step
    num_waiting: int = 0
    kv_blocks_used: int = 0
    # KV offload (zero when off)
    cpu_prefix_cache_hits: int = 0  # prompt tokens loaded from the host tier in this step
    recomputed_tokens: int = 0  # prompt tokens admitted for computing again although computed once before
    offload_bytes_h2d: int = 0  # bytes queued host to device in this step
    offload_bytes_d2h: int = 0
    offload_transfer_s: float = 0.0  # copy time accounted in this step (copies finish asynchronously on CUDA)
    long_context: bool = False  # a step of a request whose KV lives in host memory


@dataclass(slots=True)
class Completion:
    """One prompt's result from LLM.generate."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
