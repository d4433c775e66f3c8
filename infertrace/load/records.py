"""Typed records that flow through a benchmark: what to send, what came back, and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# Characters of a response's text kept per max_tokens (real text takes about 4 a token): the text is kept for
# the tokenizer's count after the run and a session's history, and a server that streams far more than max_tokens
# could make must not take the client's memory (ten 10 MB events tokenized whole took 7-12 GB).
TEXT_CHARS_PER_TOKEN = 32
MIN_TEXT_CHARS = 1 << 16


def text_cap(output_len: int) -> int:
    """The characters of a response's text kept, for a request of `output_len` max_tokens."""
    return max(MIN_TEXT_CHARS, TEXT_CHARS_PER_TOKEN * output_len)


class TokenSource(str, Enum):
    """Where a request's output-token count came from."""

    USAGE = "usage"  # the target's own count: the server's `usage`, or the bundled engine's token ids
    TOKENIZER = "tokenizer"  # our tokenizer's count of the streamed text (the target reported no usage)
    CHUNKS = "chunks"  # last resort without usage or tokenizer: one token per text event


@dataclass(slots=True)
class RequestSpec:
    """One request to send. `prompt_ids` is set when the prompt was built or measured with the target's tokenizer."""

    index: int
    prompt: str
    output_len: int
    prompt_ids: list[int] | None = None
    prompt_len: int | None = None
    messages: list[dict[str, str]] | None = None  # chat history ending with this turn (multi-turn sessions)
    session: int | None = None
    turn: int | None = None
    request_id: str | None = None  # sent as X-Request-Id; set per send by `measure` when the target names requests
    inputs: list | None = None  # /v1/embeddings: the batch of inputs one request carries (texts or token-id lists)


@dataclass(slots=True)
class StreamEvent:
    """One decoded event of a streamed response, whatever the target (SSE chunk or engine output)."""

    text: str = ""
    num_tokens: int | None = None  # tokens this event carries, when the target says so directly
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # cumulative, from usage
    finish_reason: str | None = None
    error: str | None = None  # the target reported a failure; ends the request
    done: bool = False  # the `[DONE]` sentinel
    usage_only: bool = False  # a chunk with no choices (the trailing usage chunk): never generated output
    output: bool = False  # carries a choice that stands for generated tokens, even if its text is empty
    reasoning_only: bool = False  # output of reasoning alone (`reasoning_content` / `reasoning`), no answer text
    server_metrics: dict | None = None  # the server's own figures for the request (vLLM's `metrics` object)
    embeddings: int | None = None  # a whole /v1/embeddings answer: how many vectors it held (it ends the request)
    tool_calls: list | None = None  # a chat delta's tool-call pieces, as streamed (index, function name, arguments)


@dataclass(slots=True)
class RequestResult:
    """The outcome of one request. Times are clock seconds; latencies are seconds relative to `t0`."""

    index: int
    scheduled: float  # when the request was due to be sent (open loop: its arrival; closed loop: its worker freed)
    t0: float  # when it was sent
    end: float  # when its stream closed or it failed
    slot_wait: float = 0.0  # open loop capped by --concurrency: time spent waiting for a free slot
    ttft: float | None = None
    ttfct: float | None = None  # to the first event with answer content (not reasoning): TTFT without thinking
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between consecutive text events
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens per text event (None: unknown)
    output_tokens: int | None = None
    output_source: TokenSource | None = None
    tokenizer_output_tokens: int | None = None  # our tokenizer's count, kept to flag disagreement with usage
    prompt_tokens: int | None = None
    expected_prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    text_cut: bool = False  # the streamed text was longer than its max_tokens could make: only its start is kept
    session: int | None = None  # multi-turn sessions: which session, and which turn of it
    turn: int | None = None
    request_id: str | None = None  # the id it was sent with (X-Request-Id), by which the server's log names it
    # its life on the server: joined from the server's log (load/results/join.py) or read from the response
    # (load/results/response_metrics.py)
    server: dict | None = None
    # the W3C trace context it was sent with (load/client/trace_context.py), where it went over HTTP
    trace_id: str | None = None
    span_id: str | None = None
    num_inputs: int | None = None  # /v1/embeddings: the inputs the request carried and got a vector for
    adapter: str | None = None  # --lora-modules: the LoRA adapter it named as its model
    tool_calls: list[dict] | None = None  # the tool calls streamed, each {"name", "arguments"} put together
    structured_violation: str | None = None  # --structured: "" when the output holds to its schema, else why not
    images: int | None = None  # --images: the images it carried
    image_tokens: int | None = None  # of its prompt tokens, those the server counted for its images (None: unknown)

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def schedule_lag(self) -> float:
        return self.t0 - self.scheduled

    @property
    def tpot(self) -> float | None:
        if self.error is not None or self.ttft is None or self.e2el is None or not self.output_tokens \
                or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def itl_per_token(self) -> list[float]:
        """Each gap split evenly over the tokens of the chunk that ended it, one sample per token."""
        out: list[float] = []
        for gap, n in zip(self.itl, self.chunk_tokens[1:]):
            if n is not None and n > 0:
                out.extend([gap / n] * n)
        return out

    def to_json(self, origin: float = 0.0) -> dict:
        """One line of --requests-jsonl: times in seconds after `origin`, latencies in milliseconds, no text."""
        def ms(v: float | None) -> float | None:
            return None if v is None else v * 1000.0

        tpot = self.tpot
        return {
            "index": self.index, "success": self.success, "error": self.error,
            "scheduled_s": self.scheduled - origin, "t0_s": self.t0 - origin, "end_s": self.end - origin,
            "schedule_lag_ms": ms(self.schedule_lag), "slot_wait_ms": ms(self.slot_wait),
            "ttft_ms": ms(self.ttft), "ttfct_ms": ms(self.ttfct), "tpot_ms": ms(tpot), "e2el_ms": ms(self.e2el),
            "itl_ms": [g * 1000.0 for g in self.itl], "chunk_tokens": self.chunk_tokens,
            "prompt_tokens": self.prompt_tokens, "expected_prompt_tokens": self.expected_prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_source": self.output_source.value if self.output_source else None,
            "tokenizer_output_tokens": self.tokenizer_output_tokens, "finish_reason": self.finish_reason,
            **({"session": self.session, "turn": self.turn} if self.session is not None else {}),
            **({"text_cut": True} if self.text_cut else {}),
            **({"num_inputs": self.num_inputs} if self.num_inputs is not None else {}),
            **({"adapter": self.adapter} if self.adapter is not None else {}),
            **({"tool_calls": self.tool_calls} if self.tool_calls is not None else {}),
            **({"structured_valid": not self.structured_violation, "structured_violation":
                self.structured_violation or None} if self.structured_violation is not None else {}),
            **({"images": self.images, "image_tokens": self.image_tokens} if self.images is not None else {}),
            "request_id": self.request_id,
            **({"trace_id": self.trace_id, "span_id": self.span_id} if self.trace_id is not None else {}),
            **_server_json(self.server),
        }


def _server_json(server: dict | None) -> dict:
    """The joined server view as --requests-jsonl keys: `server` (its times and queue), `ttft_parts`, `itl_steps`."""
    if server is None:
        return {}
    rest = {k: v for k, v in server.items() if k not in ("ttft_parts", "itl_steps")}
    return {"server": rest, "ttft_parts": server.get("ttft_parts"), "itl_steps": server.get("itl_steps")}


def input_tokens(r: RequestResult) -> int:
    """The target's count when it reported one, else the prompt's length in our tokenizer (0 if unknown)."""
    if r.prompt_tokens is not None:
        return r.prompt_tokens
    return r.expected_prompt_tokens or 0
