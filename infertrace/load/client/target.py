"""What a run asks of whatever it sends to. Two targets implement it: an OpenAI-compatible server over HTTP
(`http_target.py`) and the bundled engine in this process (`embedded_target.py`); the run calls these members and
never asks which target it has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from infertrace.load.records import RequestSpec, StreamEvent


@runtime_checkable
class Target(Protocol):
    """A load target. The members with a value or a body are what a target without that capability answers (a
    test's scripted target may subclass Target to take them); the two real targets define every member."""

    kind: str  # "http" or "embedded": how describe() and the result file name it
    tokenizer: Any = None  # builds prompts of exact length; None until one is loaded (a server's comes from flags)
    max_model_len: int | None = None  # the context length, when the target says
    salt_tokens: int = 0  # tokens --prompt-salt's line adds before every prompt
    # the target counts tokens with a tokenizer of its own (a server's), so its counts are checked against ours
    counts_with_own_tokenizer: bool = False
    starts_with_empty_cache: bool = False  # made fresh for the run: no earlier run's prompts are cached
    open_message: str | None = None  # what open() does, when it takes long enough to say so
    reads_server_metrics: bool = False  # keeps the server's per-request figures a response carries (vLLM's)
    asks_server_metrics: bool = False  # asks the server for them in every request body

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def preflight(self) -> None:
        """Fail with one line (TargetError) before any load when the target cannot serve it."""

    def stream(self, spec: RequestSpec) -> AsyncIterator[list[StreamEvent]]:
        """Sends the request; yields the events that arrived together (one network read, one engine output)."""

    def new_request_id(self) -> str | None:
        """The id of the next send, the one the target's request log will use; None: the target names none."""
        return None

    async def reset_prefix_cache(self) -> str:
        """Empty the prefix cache before a run; what did it (TargetError when nothing could)."""

    def cache_block_tokens(self) -> tuple[int, str] | None:
        """The prefix cache's block in tokens and where that figure comes from; None when the target does not
        say."""
        return None

    def engine_counters(self) -> dict | None:
        """The in-process engine's counters now (prefix cache, offload, preemption); None for a server, whose
        counters are in its /metrics."""
        return None

    async def read_metrics(self) -> str | None:
        """The server's /metrics text now; None where there is no server, or it does not answer with one."""
        return None

    async def request_log_cursor(self) -> int | None:
        """Where the target's request log stands now; None when it keeps none."""
        return None

    async def fetch_request_log(self, since: int) -> dict | None:
        """Every request logged from `since` on with the steps they rode (the records results/join.py reads);
        None when the log cannot be read."""
        return None

    async def start_profile(self, num_steps: int | None) -> Any: ...

    async def stop_profile(self) -> tuple[int | None, Any]: ...

    def describe(self) -> dict:
        """What the result file keeps of the target."""
        return {"kind": self.kind}
