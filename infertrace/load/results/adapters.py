"""Per-adapter figures of a --lora-modules run: each adapter's requests, throughput and latencies, computed by the
run's own metric code over that adapter's requests; throughputs are over the whole run's duration, so that the
adapters' figures add up to the run's."""

from __future__ import annotations

from rich.table import Table

from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def per_adapter(results: list[RequestResult], shares: dict[str, float]) -> dict[str, dict]:
    """Adapter name -> its figures, in --lora-modules' order (an adapter no request drew has zero requests)."""
    run = compute_metrics(results)
    total_share = sum(shares.values())
    out = {}
    for name, share in shares.items():
        mine = [r for r in results if r.adapter == name]
        m = compute_metrics(mine)

        def rate(x: float) -> float | None:
            return x / run.duration if run.duration > 0 else None

        figures = {
            "share": share / total_share, "requests": len(mine), "completed": m.completed, "failed": m.failed,
            "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
            "request_throughput": rate(m.completed), "output_throughput": rate(m.total_output_tokens),
        }
        for metric in LATENCIES:
            stats = getattr(m, metric)
            figures[f"median_{metric}_ms"], figures[f"p99_{metric}_ms"] = stats.median, stats.p99
        out[name] = figures
    return out


def gate_keys(figures: dict[str, dict]) -> dict[str, float | int | None]:
    """The per-adapter figures as top-level keys of the result, which `infertrace gate` reads by name:
    `adapter_<name>_<figure>`, e.g. adapter_sql_p99_ttft_ms."""
    return {f"adapter_{name}_{key}": value for name, f in figures.items() for key, value in f.items()
            if key != "share"}


def adapter_table(figures: dict[str, dict]) -> Table:
    t = Table(title="per LoRA adapter", title_justify="left")
    for column in ("adapter", "share", "requests (ok/failed)", "req/s", "output tok/s",
                   *(f"{m.upper()} median / p99 (ms)" for m in LATENCIES)):
        t.add_column(column, justify="left" if column == "adapter" else "right")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for name, f in figures.items():
        t.add_row(name, f"{f['share']:.0%}", f"{f['requests']} ({f['completed']}/{f['failed']})",
                  num(f["request_throughput"]), num(f["output_throughput"]),
                  *(f"{num(f[f'median_{m}_ms'])} / {num(f[f'p99_{m}_ms'])}" for m in LATENCIES))
    return t
