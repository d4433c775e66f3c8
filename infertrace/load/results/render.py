"""Rich views of a run: the live progress bar, the final table, the sweep table."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from infertrace.load.observe.server_counters import run_speculative_decoding
from infertrace.load.records import RequestResult
from infertrace.load.results.point import PointRecord
from infertrace.load.stats import Stats


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


class LiveProgress:
    """One bar per phase (warmup, measure) with completed and failed counts."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                 console=console, disable=not enabled)
        self._task = None
        self._failed = 0

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def on_phase(self, name: str, total: int | None, seconds: float | None) -> None:
        if self._task is not None:
            self.progress.stop_task(self._task)
        self._failed = 0
        label = f"{name} ({seconds:g} s)" if total is None and seconds else name
        self._task = self.progress.add_task(label, total=total, failed=0)

    def on_result(self, r: RequestResult) -> None:
        self._failed += not r.success
        self.progress.update(self._task, advance=1, failed=self._failed)

    def on_info(self, message: str) -> None:
        self.progress.console.print(f"[dim]{message}[/]", highlight=False)


PLAIN_PROGRESS_S = 10.0  # where stderr is not a terminal: a progress line at most this often within a phase


class PlainProgress:
    """Progress as plain lines, for a stderr that is not a terminal (CI logs, `tee`, nohup), where rich's live bar
    shows nothing until the end: a line when a phase starts, at most one every PLAIN_PROGRESS_S seconds while it
    runs, and one when its last request is in."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic,
                 every_s: float = PLAIN_PROGRESS_S) -> None:
        self.console, self.clock, self.every_s = console, clock, every_s
        self._name, self._total, self._done, self._failed = "", None, 0, 0
        self._started = self._last = 0.0

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _line(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def on_phase(self, name: str, total: int | None, seconds: float | None) -> None:
        self._name, self._total, self._done, self._failed = name, total, 0, 0
        self._started = self._last = self.clock()
        size = plural(total, "request") if total is not None else f"{seconds:g} s" if seconds else "until stopped"
        self._line(f"{name}: {size}")

    def on_result(self, r: RequestResult) -> None:
        self._done += 1
        self._failed += not r.success
        now = self.clock()
        if self._done == self._total or now - self._last >= self.every_s:
            self._last = now
            of = f"/{self._total}" if self._total is not None else ""
            self._line(f"{self._name}: {self._done}{of} done, {self._failed} failed, {now - self._started:.1f} s")

    def on_info(self, message: str) -> None:
        self._line(message)


def slo_text(slo: dict[str, float]) -> str:
    """`{"ttft_ms": 500, "tpot_ms": 50}` -> "ttft_ms<=500, tpot_ms<=50", as --slo takes it."""
    return ", ".join(f"{key}<={limit:g}" for key, limit in slo.items())


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def progress_for(console: Console) -> LiveProgress | PlainProgress:
    """The live bar on a terminal, plain lines elsewhere."""
    return LiveProgress(console) if console.is_terminal else PlainProgress(console)


SOURCE_WORDS = {"usage": "usage", "tokenizer": "our tokenizer", "chunks": "one per text event"}


def token_sources(sources: dict[str, int], requests: int) -> str:
    """`{"usage": 60, "tokenizer": 4}` -> "from usage in 60, our tokenizer in 4 of 64 requests"."""
    if not sources:
        return "no successful request"
    parts = ", ".join(f"{SOURCE_WORDS.get(k, k)} in {v}" for k, v in sources.items())
    return f"from {parts} of {plural(requests, 'request')}"


def _steady(record: PointRecord) -> str:
    s = record.steady
    if s is None or s.output_throughput is None:
        return "-"
    origin = min(r.t0 for r in record.results)
    return f"{s.output_throughput:.2f}  (in flight >= {s.in_flight}, {s.start - origin:.2f}-{s.end - origin:.2f} s)"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def workload_rows(w: dict | None) -> list[tuple[str, str]]:
    """Trace replay's prefix reuse (implied and measured) and sessions' outcomes and per-turn figures."""
    if not w:
        return []
    rows = []
    if "trace" in w:
        t = w["trace"]
        rows.append(("trace", f"{t['format']}, {plural(t['requests'], 'request')} over {t['span_s']:.2f} s "
                              f"(time x{t['time_scale']:g}, tokens x{t['token_scale']:g})"))
        rows.append(("prefix reuse implied by the trace", _share(w["trace_implied_prefix_reuse"])))
        rows.append((f"  of it servable in {w['cache_block_tokens']}-token blocks",
                     _share(w["trace_servable_prefix_reuse"])))
    if "sessions" in w:
        rows.append(("sessions", f"{w['sessions']} ({w['sessions_completed']} completed, "
                                 f"{w['sessions_ended_by_failure']} ended by a failed turn; {w['turns_sent']} turns)"))
    for turn in w.get("per_turn", []):
        rows.append((f"  turn {turn['turn']}", f"TTFT median {_num(turn['median_ttft_ms'])} ms, "
                     f"input {_num(turn['mean_input_tokens'], '{:.0f}')} tok, {turn['completed']}/{turn['requests']} ok"))
    return rows


def summary_table(record: PointRecord) -> Table:
    """The figures of one run, in the order `vllm bench serve` prints them, plus the client's headroom."""
    m, cfg = record.metrics, record.config
    t = Table(title="infertrace bench" + (" (interrupted: partial)" if record.interrupted else ""),
              show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rate = f"{cfg.ramp_up_strategy} ramp {cfg.ramp_up_start_rps:g} -> {cfg.ramp_up_end_rps:g} req/s" \
        if cfg.ramp_up_strategy is not None else f"{cfg.request_rate or 0:g} req/s"
    shape = (f"open loop, {rate}, burstiness {cfg.burstiness:g}"
             + (f", cap {cfg.concurrency}" if cfg.concurrency else "")) if cfg.open_loop \
        else f"closed loop, concurrency {cfg.effective_concurrency}"
    if cfg.dataset == "trace":
        shape = "trace replay at the trace's times" + (f", cap {cfg.concurrency}" if cfg.concurrency else "")
    elif cfg.dataset == "agent-trace":
        shape = "agent-trace replay: sessions at the trace's times, calls after the traced tool time"
    elif cfg.dataset == "conversation":
        shape = shape.replace("concurrency", "users").replace("req/s", "sessions/s")
    rows = [
        ("load", shape),
        ("successful requests", str(m.completed)),
        ("failed requests", str(m.failed) + (f"  ({', '.join(f'{k}: {v}' for k, v in m.failures.items())})"
                                             if m.failures else "")),
        *((f"  {kind} (first)", message) for kind, message in record.failure_examples.items()),
        ("duration (s)", _num(m.duration)),
        ("total input tokens", str(m.total_input_tokens)),
        ("total output tokens", f"{m.total_output_tokens}  ({token_sources(m.output_token_sources, m.completed)})"),
        ("request throughput (req/s)", _num(m.request_throughput)),
        ("output token throughput (tok/s)", _num(m.output_throughput)),
        ("steady output throughput (tok/s)", _steady(record)),
        ("total token throughput (tok/s)", _num(m.total_token_throughput)),
    ]
    if m.total_input_sequences is not None:  # embeddings: no output; the inputs the requests carried instead
        rows = [row for row in rows if "output" not in row[0]]
        per_request = m.total_input_sequences / m.completed if m.completed else None
        rows.insert(rows.index(("duration (s)", _num(m.duration))) + 1,
                    ("total inputs", f"{m.total_input_sequences}  ({_num(per_request)} per request)"))
        rows.insert(rows.index(("request throughput (req/s)", _num(m.request_throughput))) + 1,
                    ("input throughput (inputs/s)", _num(m.input_sequence_throughput)))
    if m.goodput is not None:
        rows.append((f"goodput (req/s) {slo_text(cfg.request_slo)}", _num(m.goodput)))
    rows += workload_rows(record.workload)
    rows += prefix_cache_rows(record.prefix_cache)
    if record.energy is not None:
        rows.append(("energy per output token (J/tok)", energy_text(record.energy)))
    for r in rows:
        t.add_row(*r)
    t.add_section()
    latencies = [("TTFT (ms)", m.ttft)]
    if (ttfct := content_ttft(record.results)) is not None:  # a reasoning model: thinking came before the answer
        latencies.append(("TTFCT, to the answer (ms)", ttfct))
    latencies += [("TPOT (ms)", m.tpot), ("ITL per chunk (ms)", m.itl), ("ITL per token (ms)", m.itl_per_token)]
    if m.total_input_sequences is not None:
        t.add_row("TTFT, TPOT, ITL", "none: an embeddings answer comes whole, so only E2EL is measured")
        latencies = []
    for label, s in (*latencies, ("E2EL (ms)", m.e2el)):
        text = f"mean {_num(s.mean)}  median {_num(s.median)}  p99 {_num(s.p99)}"
        if s is m.itl_per_token:
            text = per_token_text(text, m.itl_per_token_requests, m.completed)
        t.add_row(label, text)
    if spec := speculative_rows(run_speculative_decoding(record)):
        t.add_section()
        for r in spec:
            t.add_row(*r)
    t.add_section()
    t.add_row("schedule lag p50 / p99 (ms)", f"{_num(m.schedule_lag.median, '{:.3f}')} / "
                                             f"{_num(m.schedule_lag.p99, '{:.3f}')}")
    workers = (record.workload or {}).get("workers") or 1
    t.add_row("client CPU (% of a core)" if workers == 1 else f"client CPU (% of a core, busiest of {workers} workers)",
              _num(None if record.client_cpu is None else 100 * record.client_cpu, "{:.1f}"))
    return t


def per_token_text(text: str, known: int, completed: int) -> str:
    """Per-token ITL claims only the requests whose every chunk's token count is known; the row says which."""
    if not completed or known == completed:
        return text
    if not known:
        return "- (tokens per chunk unknown: the server gave no usage on each chunk; see --continuous-usage)"
    return f"{text}  ({known} of {completed} requests: the others' tokens per chunk are unknown)"


def speculative_rows(spec: dict | None) -> list[tuple[str, str]]:
    """The run's speculative decoding: the server's counters over the run, then what the responses carried."""
    if spec is None:
        return []
    rows = []
    if spec["source"] is not None:
        source = "" if spec["source"] == "counters" else f"  ({spec['source']})"
        counts = (f"{_num(spec['drafts'], '{:,.0f}')} drafts, {_num(spec['draft_tokens'], '{:,.0f}')} draft "
                  f"tokens, {_num(spec['accepted_tokens'], '{:,.0f}')} accepted")
        rows += [("speculative decoding", counts + source),
                 ("  acceptance rate", _share(spec["acceptance_rate"])),
                 ("  mean acceptance length (tok/step)", _num(spec["mean_acceptance_length"]))]
        if spec["per_position_acceptance_rate"]:
            rows.append(("  acceptance by draft position", "  ".join(_share(v)
                                                                   for v in spec["per_position_acceptance_rate"])))
    if (req := spec["requests"]) is not None:
        rate, length = req["acceptance_rate_per_request"], req["acceptance_length_per_request"]
        rows += [("speculative decoding per request", f"{plural(req['requests'], 'request')} carried it "
                                                      f"({req['requests_drafted']} drafted)"),
                 ("  acceptance rate p50 / min / max", " / ".join(_share(rate[k]) for k in ("p50", "min", "max"))),
                 ("  acceptance length p50 / min / max", " / ".join(_num(length[k]) for k in ("p50", "min", "max")))]
    return rows


def prefix_cache_rows(figures: dict) -> list[tuple[str, str]]:
    """The server's prefix-cache hit rate over the run beside what the workload implies."""
    rate, implied = figures["server_prefix_cache_hit_rate"], figures["implied_prefix_cache_hit_rate"]
    if rate is None:
        return []
    source = figures["server_prefix_cache_source"]
    text = _share(rate) + (f"  ({source})" if source and source != "counters" else "")
    if implied is not None:
        text += f"  (the workload implies {_share(implied)})"
    return [("server prefix-cache hit rate", text)]


def energy_text(energy: dict) -> str:
    per_token = energy.get("joules_per_output_token")
    return (f"{_num(per_token, '{:.3f}')}  ({energy['joules']:.1f} J over {energy['seconds']:.1f} s on "
            f"{energy['gpus']} GPU(s), {energy['method']})")


def content_ttft(results: list[RequestResult]) -> Stats | None:
    """TTFCT (time to the first answer token, reasoning excluded) of the successful requests, as Stats in ms; None
    when no request streamed reasoning first (then it is TTFT)."""
    done = [r for r in results if r.success and r.ttfct is not None]
    if not any(r.ttft is not None and r.ttfct > r.ttft for r in done):
        return None
    return Stats.of([r.ttfct for r in done])


def sweep_table(records: list[PointRecord], param: str) -> Table:
    t = Table(title=f"infertrace bench sweep over {param.replace('_', '-')}", title_justify="left")
    for col in (param.replace("_", "-"), "ok", "failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                "TPOT p50", "TPOT p99", "ITL p50", "E2EL p50", "lag p99", "goodput"):
        t.add_column(col, justify="right")
    for r in records:
        m = r.metrics
        t.add_row(f"{getattr(r.config, param):g}", str(m.completed), str(m.failed), _num(m.request_throughput),
                  _num(m.output_throughput, "{:.1f}"), _num(m.ttft.median), _num(m.ttft.p99), _num(m.tpot.median),
                  _num(m.tpot.p99), _num(m.itl.median), _num(m.e2el.median),
                  _num(m.schedule_lag.p99, "{:.3f}"), _num(m.goodput))
    return t


def capacity_table(cap) -> Table:
    """Every load the --find-max search tried, in order, with each bound's estimate and interval, and the answer."""
    name = cap.param.replace("_", "-")
    best = "none (the first load already missed a bound)" if cap.max_load is None else f"{cap.max_load:g}"
    above = "" if cap.first_failing_load is None else f", {cap.first_failing_load:g} fails"
    t = Table(title=f"infertrace bench --find-max {name} {slo_text(cap.slo)}: max {name} {best}{above} (search ended: "
                    f"{cap.stopped})", title_justify="left")
    for col in (name, "verdict", "decided by", "runs", *(f"{k} [95% CI]" for k in cap.slo), "req/s", "out tok/s"):
        t.add_column(col, justify="right")
    for trial in cap.trials:
        last = trial.records[-1].metrics if hasattr(trial.records[-1], "metrics") else None
        cells = []
        for key in cap.slo:
            e = trial.estimates.get(key)
            cells.append("-" if e is None or e.value_ms is None else
                         f"{_num(e.value_ms, '{:.1f}')} [{_num(e.low_ms, '{:.1f}')}, {_num(e.high_ms, '{:.1f}')}]")
        t.add_row(f"{trial.load:g}", "pass" if trial.passed else "fail", trial.decided_by, str(len(trial.records)),
                  *cells, _num(last.request_throughput if last else None),
                  _num(last.output_throughput if last else None, "{:.1f}"))
    return t
