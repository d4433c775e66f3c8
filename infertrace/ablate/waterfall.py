"""The waterfall: each phase's figures and its change against the phase before it and against the first.

A change is measured against the nearest earlier phase that produced a throughput (a failed phase has none), and
"vs first" against the first phase that did; both are fractions (0.25 means +25%).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from infertrace.ablate.run import PhaseResult, PhaseStatus


@dataclass(slots=True)
class WaterfallRow:
    phase: str
    status: str
    output_throughput: float | None  # output tokens per second
    change_vs_previous: float | None
    change_vs_first: float | None
    median_ttft_ms: float | None
    median_itl_ms: float | None  # between a stream's chunks
    # each chunk's gap divided over its tokens: below the chunk ITL where a step gives a request several tokens
    # (speculative decoding)
    median_itl_per_token_ms: float | None
    kernels_per_decode_step: float | None
    launches_per_decode_step: float | None
    attention_kernels_per_decode_step: float | None
    cpu_ops_per_decode_step: float | None  # a CPU trace's stand-in for kernels
    gpu_idle_share: float | None
    # speculative decoding: accepted / draft tokens, and 1 + accepted / drafts (tokens per verify row, vLLM's)
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    detail: str | None  # the error of a failed phase; for one that ran, failed requests or a missing profile

    def to_json(self) -> dict:
        return asdict(self)


def waterfall(results: list[PhaseResult]) -> list[WaterfallRow]:
    rows = []
    first = previous = None
    for r in results:
        tput = r.output_throughput
        m = r.record.metrics if r.record is not None else None
        p = r.profile
        spec = r.spec_decode
        rows.append(WaterfallRow(
            phase=r.name, status=r.status.value, output_throughput=tput,
            change_vs_previous=_change(tput, previous), change_vs_first=_change(tput, first),
            median_ttft_ms=m.ttft.median if m else None, median_itl_ms=m.itl.median if m else None,
            median_itl_per_token_ms=m.itl_per_token.median if m else None,
            kernels_per_decode_step=p.kernels_per_decode_step if p else None,
            launches_per_decode_step=p.launches_per_decode_step if p else None,
            attention_kernels_per_decode_step=p.attention_kernels_per_decode_step if p else None,
            cpu_ops_per_decode_step=p.cpu_ops_per_decode_step if p else None,
            gpu_idle_share=p.gpu_idle_share if p else None,
            acceptance_rate=spec["num_accepted_tokens"] / spec["num_draft_tokens"] if spec else None,
            mean_acceptance_length=1 + spec["num_accepted_tokens"] / spec["num_drafts"] if spec else None,
            detail=r.error if r.status is not PhaseStatus.OK else _notes(r)))
        if tput is not None:
            first = tput if first is None else first
            previous = tput
    return rows


def _notes(r: PhaseResult) -> str | None:
    parts = [r.note, f"no profile: {r.profile_error}" if r.profile_error else None]
    return "; ".join(p for p in parts if p) or None


def _change(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference - 1.0
