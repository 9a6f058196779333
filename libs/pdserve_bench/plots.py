"""PNG plots of a comparison (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- the backend must be chosen first


def cdf_plot(path: Path, title: str, xlabel: str, series: Mapping[str, Sequence[float]]) -> Path:
    """One empirical CDF line per configuration (values in ms; log x when they span >100x)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    spread = [v for vs in series.values() for v in vs if v > 0]
    for label, values in series.items():
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
    if spread and max(spread) / min(spread) > 100:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def latency_vs_rate(path: Path, title: str,
                    series: Mapping[str, Mapping[str, Sequence[tuple[float, float | None]]]]
                    ) -> Path:
    """``series[metric][config] = [(rate, value_ms)]``: one panel per metric."""
    metrics = list(series)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, points in series[metric].items():
            pts = [(r, v) for r, v in points if v is not None]
            if pts:
                ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=label)
        ax.set(title=metric, xlabel="request rate (req/s)", ylabel="ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
