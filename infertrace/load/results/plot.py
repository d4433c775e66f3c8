"""The PNG of a sweep: throughput and latency against the swept load."""

from __future__ import annotations

from pathlib import Path

from infertrace.load.results.point import PointRecord

INTEGER_PARAMS = ("concurrency",)  # loads counted in whole streams: their axis has whole ticks only


def plot_sweep(records: list[PointRecord], param: str, path: str | Path) -> Path:
    return save_figure(sweep_figure(records, param), path)


def sweep_figure(records: list[PointRecord], param: str):
    """Throughput, TTFT and TPOT/ITL against the swept load, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [getattr(r.config, param) for r in records]
    label = param.replace("_", "-")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [
        ("output throughput (tok/s)", [("output tok/s", [r.metrics.output_throughput for r in records])]),
        ("TTFT (ms)", [("p50", [r.metrics.ttft.median for r in records]),
                       ("p99", [r.metrics.ttft.p99 for r in records])]),
        ("TPOT and ITL (ms)", [("TPOT p50", [r.metrics.tpot.median for r in records]),
                               ("TPOT p99", [r.metrics.tpot.p99 for r in records]),
                               ("ITL p50", [r.metrics.itl.median for r in records])]),
    ]
    for ax, (title, lines) in zip(axes, series):
        for name, ys in lines:
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(title)
        ax.set_xlabel(label)
        _whole_ticks(ax, param)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def _whole_ticks(ax, param: str) -> None:
    if param in INTEGER_PARAMS:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG (creating its folder) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_capacity(cap, path: str | Path) -> Path:
    """One panel per run-level bound: its estimate and bootstrap interval at every load tried, the bound as a
    line, passing loads filled and failing ones hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(cap.slo)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for passed, style in ((True, {"color": "tab:green", "label": "pass"}),
                              (False, {"color": "tab:red", "mfc": "none", "label": "fail"})):
            pts = [(t.load, t.estimates[key]) for t in cap.trials if t.passed == passed and key in t.estimates
                   and t.estimates[key].value_ms is not None and t.estimates[key].value_ms < float("inf")]
            if pts:
                ys = [e.value_ms for _, e in pts]
                errs = [[e.value_ms - e.low_ms for _, e in pts],
                        [min(e.high_ms, 10 * e.value_ms) - e.value_ms for _, e in pts]]
                ax.errorbar([x for x, _ in pts], ys, yerr=errs, fmt="o", capsize=3, **style)
        ax.axhline(cap.slo[key], color="gray", linestyle="--", label=f"bound {cap.slo[key]:g} ms")
        if cap.max_load is not None:
            ax.axvline(cap.max_load, color="tab:green", alpha=0.4, label=f"max {cap.max_load:g}")
        ax.set_title(key)
        ax.set_xlabel(cap.param.replace("_", "-"))
        _whole_ticks(ax, cap.param)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)
