"""The PNG waterfall: the first phase's throughput as a bar from zero, then each phase's change as a floating bar."""

from __future__ import annotations

from pathlib import Path

from infertrace.ablate.waterfall import WaterfallRow
from infertrace.load.results.plot import save_figure

UP, DOWN, BASE, FAILED = "#2e7d32", "#c62828", "#546e7a", "#9e9e9e"


def plot_waterfall(title: str, rows: list[WaterfallRow], path: str | Path, subtitle: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2), 4.8))
    previous = previous_x = None
    top = max((r.output_throughput or 0.0 for r in rows), default=0.0) or 1.0
    for x, row in enumerate(rows):
        value = row.output_throughput
        if value is None:  # a failed phase: an empty slot that says why there is no bar
            ax.bar(x, top * 0.04, width=0.6, bottom=0, color="none", edgecolor=FAILED, hatch="//")
            ax.text(x, top * 0.06, row.status, ha="center", va="bottom", color=FAILED, fontsize=9, rotation=90)
            continue
        if previous is None:
            ax.bar(x, value, width=0.6, color=BASE)
        else:
            low, high = sorted((previous, value))
            ax.bar(x, max(high - low, top * 0.002), width=0.6, bottom=low, color=UP if value >= previous else DOWN)
            ax.plot([previous_x + 0.3, x - 0.3], [previous, previous], color="#455a64", linewidth=0.8, linestyle=":")
        change = "" if row.change_vs_previous is None else f"\n{row.change_vs_previous:+.0%}"
        above = max(value, previous) if previous is not None else value  # a falling bar's top is the previous
        ax.text(x, above + top * 0.01, f"{value:.0f}{change}", ha="center", va="bottom", fontsize=9)
        previous, previous_x = value, x
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r.phase for r in rows], rotation=20, ha="right")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_ylim(0, top * 1.18)
    ax.set_title(f"{title}\n{subtitle}" if subtitle else title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)
