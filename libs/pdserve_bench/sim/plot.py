"""The controller's decision trace as a PNG: planned prefill/decode instances over time above
the observed and forecast arrival rate, phase boundaries marked (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- the backend must be chosen first

from pdserve_bench.sim.control import TracePoint  # noqa: E402
from pdserve_bench.sim.workload import Phase  # noqa: E402


def trace_plot(path: Path, trace: list[TracePoint], phases: list[Phase], title: str) -> Path:
    ts = [p.t for p in trace]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 5.0))
    top.step(ts, [p.num_prefill for p in trace], where="post", label="prefill")
    top.step(ts, [p.num_decode for p in trace], where="post", label="decode")
    top.set(ylabel="instances", title=title)
    bottom.plot(ts, [p.observed_rate for p in trace], label="observed (window mean)")
    bottom.plot(ts, [p.forecast_rate for p in trace], label="forecast (Holt)", linestyle="--")
    bottom.set(ylabel="requests/s", xlabel="seconds")
    start = 0.0
    for phase in phases:
        for ax in (top, bottom):
            ax.axvline(start, color="grey", alpha=0.4)
        top.text(start + 2, 0.5, phase.name, color="grey")
        start += phase.duration_s
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
