"""Per-instance capacity, calibrated from measurements by least squares (no baked-in constants).

Two linear laws, each fitted from (x, seconds) points:

    prefill   seconds(batch of T prompt tokens) = prefill_overhead_s + T / prefill_tokens_per_s
    decode    seconds(one step of a batch of b)  = decode_base_s + decode_per_seq_s · b

Points come from ``pdserve bench engine --json`` lines (prefill and decode tokens/s at each
concurrency: ``from_bench_lines``) or from monitored engine ``Stats`` (``from_stats``: busy
decode samples give (running, running / decode tokens/s), busy prefill samples their rate).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from pdserve.controller.monitor import Sample

# The shipped starting point: `pdserve bench engine --json` on the 2-core reference machine
# (bench-50m, --prompt-len 128; docs/benchmarks.md).
CALIBRATION_FILE = Path(__file__).with_name("calibration-2core.jsonl")
# The bench's default --prompt-len (rows without their own) and the router's batch bound.
BENCH_PROMPT_LEN, MAX_BATCH = 128, 64


class CalibrationError(ValueError):
    """The measurements cannot determine the model (too few or inconsistent points)."""


@dataclass(frozen=True)
class CapacityModel:
    prefill_overhead_s: float
    prefill_tokens_per_s: float
    decode_base_s: float
    decode_per_seq_s: float
    max_batch: int = 64  # the engines' --max-num-seqs (a config value, not a fit)
    # The measured (batch, step seconds) points, ascending, when the model came from them:
    # ``step_time`` interpolates between them (a decode step's cost is not linear in the
    # batch on a CPU: e.g. 20, 38, 49, 55 ms at 1, 4, 8, 32 sequences) and follows the fitted
    # line outside their range. The optimizer's closed forms use the line.
    decode_points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_base_s <= 0:
            raise CalibrationError(
                f"capacity: prefill tokens/s ({self.prefill_tokens_per_s:.3g}) and decode base "
                f"step time ({self.decode_base_s:.3g} s) must be > 0")
        if self.prefill_overhead_s < 0 or self.decode_per_seq_s < 0 or self.max_batch < 1:
            raise CalibrationError("capacity: overhead and per-sequence time must be >= 0 and "
                                   "max_batch >= 1")

    def prefill_time(self, num_tokens: float) -> float:
        return self.prefill_overhead_s + num_tokens / self.prefill_tokens_per_s

    def step_time(self, batch: float) -> float:
        if isinstance(batch, int) and 0 <= batch <= self.max_batch:
            return self._steps[batch]  # the simulator asks millions of times
        return self._step_time(batch)

    def _step_time(self, batch: float) -> float:
        pts = self.decode_points
        if len(pts) >= 2 and pts[0][0] <= batch <= pts[-1][0]:
            return float(np.interp(batch, [b for b, _ in pts], [t for _, t in pts]))
        return self.decode_base_s + self.decode_per_seq_s * batch

    @cached_property
    def _steps(self) -> tuple[float, ...]:
        return tuple(self._step_time(b) for b in range(self.max_batch + 1))


def fit_line(points: Sequence[tuple[float, float]], what: str) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope·x; intercept and slope are
    clamped at 0 (a negative cost is noise). Needs two distinct x values."""
    if len({x for x, _ in points}) < 2:
        raise CalibrationError(f"{what}: need points at two or more distinct sizes to fit, got "
                               f"{len(points)} point(s)")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    (intercept, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    if slope <= 0 and intercept <= 0:
        raise CalibrationError(f"{what}: the measured times do not grow with size; check the "
                               "measurements")
    return max(0.0, float(intercept)), max(0.0, float(slope))


def fit(prefill: Sequence[tuple[float, float]], decode: Sequence[tuple[float, float]],
        max_batch: int) -> CapacityModel:
    """``prefill``: (prompt tokens in a batch, seconds); ``decode``: (batch, step seconds)."""
    overhead, per_token = fit_line(prefill, "prefill")
    if per_token <= 0:
        raise CalibrationError("prefill: the fitted time per token is 0; measure larger batches")
    base, per_seq = fit_line(decode, "decode")
    if base <= 0:
        raise CalibrationError("decode: the fitted base step time is 0; measure batch size 1")
    return CapacityModel(overhead, 1.0 / per_token, base, per_seq, max_batch)


def _measured(decode: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The step time at each measured batch (the mean of repeats), ascending."""
    by_batch: dict[float, list[float]] = {}
    for b, t in decode:
        by_batch.setdefault(b, []).append(t)
    return tuple((b, float(np.mean(ts))) for b, ts in sorted(by_batch.items()))


def from_bench_lines(lines: Iterable[str], prompt_len: int, max_batch: int) -> CapacityModel:
    """Fit from ``pdserve bench engine --json`` output (one JSON object per concurrency).
    A row's own ``prompt_len`` wins; ``prompt_len`` stands for rows without one (the bench's
    ``--prompt-len``, older runs). Rows of several dtypes or models are refused: one engine
    runs one of each."""
    prefill, decode = [], []
    kinds: set[tuple[str, str]] = set()
    for number, raw in enumerate(lines, 1):
        if not raw.strip().startswith("{"):
            continue  # the bench's table and banner lines
        try:
            row = json.loads(raw)
            n, p_tps, d_tps = row["num_seqs"], row["pdserve_prefill_tps"], row["pdserve_decode_tps"]
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"line {number}: not JSON ({exc.msg})") from None
        except KeyError as exc:
            raise CalibrationError(f"line {number} lacks {exc.args[0]!r}: expected the output "
                                   "of `pdserve bench engine --json`") from None
        kinds.add((str(row.get("dtype", "float32")), str(row.get("model", "bench-50m"))))
        tokens = n * row.get("prompt_len", prompt_len)
        prefill.append((tokens, tokens / p_tps))
        decode.append((n, n / d_tps))
    if len(kinds) > 1:
        raise CalibrationError("rows of several dtypes or models "
                               f"({', '.join(sorted(f'{d} {m}' for d, m in kinds))}): give "
                               "the rows of the one the engines run")
    return replace(fit(prefill, decode, max_batch), decode_points=_measured(decode))


def read_calibration(path: Path, prompt_len: int, max_batch: int) -> CapacityModel:
    """``from_bench_lines`` of a file; an unreadable file is a CalibrationError too."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CalibrationError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    return from_bench_lines(text.splitlines(), prompt_len, max_batch)


def from_stats(samples: Iterable[Sample], max_batch: int) -> CapacityModel:
    """Fit from monitored Stats: decode samples with a running batch give (batch, step time);
    prefill samples with a queue (the engine was busy all window) give its throughput, whose
    batch overhead Stats cannot separate (fitted as 0)."""
    decode: list[tuple[float, float]] = []
    rates: list[float] = []
    for s in samples:
        if s.role == "decode" and s.num_running > 0 and s.decode_tokens_per_s > 0:
            decode.append((s.num_running, s.num_running / s.decode_tokens_per_s))
        elif s.role == "prefill" and s.queue_depth > 0 and s.prefill_tokens_per_s > 0:
            rates.append(s.prefill_tokens_per_s)
    if not rates:
        raise CalibrationError("prefill: no busy prefill sample (queue_depth > 0) to fit from")
    return _from_rates(rates, decode, max_batch)


def _from_rates(rates: Sequence[float], decode: Sequence[tuple[float, float]],
                max_batch: int) -> CapacityModel:
    """The mean of some prefill rates (no separate batch overhead) and a line through the
    (batch, step seconds) points; ``rates`` is not empty."""
    base, per_seq = fit_line(decode, "decode")
    if base <= 0:
        raise CalibrationError("decode: the fitted base step time is 0; need small batches too")
    return CapacityModel(0.0, float(np.mean(rates)), base, per_seq, max_batch)


def from_measured(prefill_rates: Sequence[float], decode_steps: Sequence[tuple[float, float]],
                  max_batch: int) -> CapacityModel:
    """Fit from what engines measured of themselves at start (``engine/calibrate.py``, in their
    Stats): each one's prefill rate (averaged over the engines; a step that only prefills has
    no separate overhead in it) and every (batch, step seconds) point."""
    rates = [r for r in prefill_rates if r > 0]
    if not rates:
        raise CalibrationError("prefill: no engine measured its prefill rate")
    return replace(_from_rates(rates, decode_steps, max_batch),
                   decode_points=_measured(decode_steps))


def starting_model(path: str = "") -> CapacityModel:
    """The model a controller starts from: the ``pdserve bench engine --json`` run at
    ``path`` (the operator's, for their model, dtype and threads per engine), else the
    shipped one."""
    return read_calibration(Path(path) if path else CALIBRATION_FILE, BENCH_PROMPT_LEN,
                            MAX_BATCH)
