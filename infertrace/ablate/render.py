"""Rich views of an ablation: the progress bars over phases and requests, and the waterfall table."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from infertrace.ablate.recipe import PlannedPhase
from infertrace.ablate.run import PhaseResult, PhaseStatus
from infertrace.ablate.waterfall import WaterfallRow
from infertrace.load.records import RequestResult

CPU_OPS_NOTE = ("CPU trace: no GPU kernels, so the kernel column counts CPU operators per decode step ('ops': "
                "leaf aten ops, each of which would be a kernel on a GPU) and GPU idle is '-'")
NO_PROFILE_NOTE = "kernels per decode step and GPU idle come from a profile of each phase: run with --profile"


class PhaseProgress:
    """A bar over the phases, and under it a bar over the current stage's requests."""

    def __init__(self, console: Console, total: int, enabled: bool = True) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                                 console=console, disable=not enabled)
        self._phases = self.progress.add_task("phases", total=total, detail="")
        self._stage = None
        self._failed = 0

    def __enter__(self) -> PhaseProgress:  # noqa: PYI034
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def on_phase_start(self, phase: PlannedPhase) -> None:
        self.progress.update(self._phases, detail=f"[bold]{phase.name}[/]")

    def on_phase_done(self, result: PhaseResult) -> None:
        self.progress.advance(self._phases)
        if self._stage is not None:
            self.progress.remove_task(self._stage)
            self._stage = None
        tput = result.output_throughput
        figure = f"{tput:.1f} tok/s" if tput is not None else ""
        status = escape(status_text(result.status.value, result.error))
        self.progress.console.print(f"[dim]phase {result.index + 1} {escape(repr(result.name))}: {status}"
                                    f"{', ' + figure if figure else ''}[/]", highlight=False)

    def on_stage(self, name: str, total: int | None, seconds: float | None) -> None:
        if self._stage is not None:
            self.progress.remove_task(self._stage)
        self._failed = 0
        self._stage = self.progress.add_task(f"  {name}", total=total, detail="")

    def on_result(self, r: RequestResult) -> None:
        self._failed += not r.success
        if self._stage is not None:
            self.progress.update(self._stage, advance=1, detail=f"{self._failed} failed" if self._failed else "")

    def on_info(self, message: str) -> None:
        self.progress.console.print(f"[dim]{message}[/]", highlight=False)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _change(value: float | None) -> Text:
    if value is None:
        return Text("-")
    return Text(f"{value:+.1%}", style="green" if value > 0 else "red" if value < 0 else "")


def _kernels(row: WaterfallRow) -> Text:
    if row.kernels_per_decode_step is not None:
        cell = Text(f"{row.kernels_per_decode_step:.0f}")
        launches = row.launches_per_decode_step
        if launches is not None and round(launches) != round(row.kernels_per_decode_step):
            cell.append(f"\n{launches:.0f} launch{'es' if round(launches) != 1 else ''}", style="dim")  # graphs
        if row.attention_kernels_per_decode_step is not None:
            cell.append(f"\n{row.attention_kernels_per_decode_step:.0f} attention", style="dim")
        return cell
    if row.cpu_ops_per_decode_step is not None:
        return Text(f"{row.cpu_ops_per_decode_step:.0f} ops")
    return Text("-")


def status_text(status: str, reason: str | None) -> str:
    """`failed: why`; a phase not applicable reads `not applicable on cpu: why` (its reason names the device)."""
    if not reason:
        return status
    return f"{status} {reason}" if status == PhaseStatus.NOT_APPLICABLE.value else f"{status}: {reason}"


def _phase(row: WaterfallRow) -> Text:
    """The phase's name; under it, when it did not simply run, its status and the reason."""
    cell = Text(row.phase)
    if row.status != "ok":
        failed = row.status == "failed"
        cell.append(f"\n{status_text(row.status, row.detail)}", style="red" if failed else "yellow")
    elif row.detail:
        cell.append(f"\n{row.detail}", style="yellow")
    return cell


def waterfall_table(title: str, rows: list[WaterfallRow]) -> Table:
    """One row per phase; a failed phase keeps its row, with dashes for figures and the reason under its name."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("phase", min_width=12, max_width=44, overflow="fold")
    drafted = any(r.acceptance_rate is not None for r in rows)  # a recipe of speculative decoding
    headers = ["tok/s", "vs\nprev", "vs\nfirst", "TTFT\np50 ms", "ITL\np50 ms"]
    headers += ["draft\naccepted"] if drafted else []
    for header in (*headers, "kernels/\ndecode step", "GPU\nidle"):
        t.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        cells = [_num(row.median_ttft_ms, "{:.1f}"), _itl(row)]
        cells += [_acceptance(row)] if drafted else []
        t.add_row(_phase(row), _num(row.output_throughput, "{:.1f}"), _change(row.change_vs_previous),
                  _change(row.change_vs_first), *cells, _kernels(row), _num(row.gpu_idle_share, "{:.0%}"))
    return t


def _itl(row: WaterfallRow) -> Text:
    """The ITL between chunks; under it, where chunks carry several tokens (speculative decoding), per token."""
    cell = Text(_num(row.median_itl_ms, "{:.2f}"))
    chunk, token = row.median_itl_ms, row.median_itl_per_token_ms
    if chunk is not None and token is not None and abs(token - chunk) > 0.01 * chunk:
        cell.append(f"\n{token:.2f}/tok", style="dim")
    return cell


def _acceptance(row: WaterfallRow) -> Text:
    """The share of draft tokens accepted; under it the mean acceptance length (tokens per verify row)."""
    if row.acceptance_rate is None:
        return Text("-")
    cell = Text(f"{row.acceptance_rate:.0%}")
    cell.append(f"\n{row.mean_acceptance_length:.2f} len", style="dim")
    return cell


def table_notes(rows: list[WaterfallRow], profiled: bool) -> list[str]:
    notes = []
    if not profiled:
        notes.append(NO_PROFILE_NOTE)
    elif any(r.cpu_ops_per_decode_step is not None and r.kernels_per_decode_step is None for r in rows):
        notes.append(CPU_OPS_NOTE)
    return notes
