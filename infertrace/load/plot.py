"""The PNG of a sweep: throughput and latency against the swept load."""

from __future__ import annotations

from pathlib import Path

from infertrace.load.benchmark import PointRecord


def plot_sweep(records: list[PointRecord], param: str, path: str | Path) -> Path:
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
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG (creating its folder) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
