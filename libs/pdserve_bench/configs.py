"""The TOML files of ``pdserve bench compare`` (``bench/configs/``).

``default.toml`` says what to run::

    [run]                        # traffic and objectives, shared by every comparison
    launcher = ["pdserve", "up"] # how a stack starts; "{python}" = this interpreter
    rates = [0.5, 1, 2]
    num_requests = 60
    ...
    [[comparison]]               # two stacks, one workload, one target
    name = "disaggregation"
    workload = "mixed"
    baseline = "colocated"       # -> colocated.toml in the same directory
    candidate = "disaggregated"
    metric = "itl_p99_ms"
    min_reduction = 0.5          # candidate at least 50% lower
    [workloads.mixed]            # optional length overrides (WorkloadSpec fields)
    rag_input = [256, 512]

and each stack file (``colocated.toml``) how to start one configuration::

    description = "2 colocated engines x 1 core"
    args = ["--model", "bench-50m", "--port", "0", "--colocated", "--decode", "2"]
    [env]                        # optional extra environment
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pdserve_bench.runner import LoadSettings
from pdserve_bench.workload import WORKLOADS, WorkloadSpec

# Latencies a comparison's target can be stated on (keys of ``Summary.flat``).
METRICS = (
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms")


class ConfigError(ValueError):
    """A bad configuration file; the message names the file and the field."""


@dataclass(frozen=True)
class RunConfig:
    launcher: tuple[str, ...] = ("pdserve", "up")
    stack_args: tuple[str, ...] = ()  # appended to every stack's args (later flags win)
    api: str = "chat"
    model: str | None = None
    seed: int = 0
    rates: tuple[float, ...] = (1.0,)
    num_requests: int = 50
    request_timeout_s: float = 120.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    slo_attainment: float = 0.9  # a stack "meets" an SLO when this share of requests does
    warmup_requests: int = 2
    ready_timeout_s: float = 600.0
    tokenizer_model: str | None = None
    tokens_per_word: float = 1.0
    # Ask for cumulative usage in every chunk (vLLM's stream_options.continuous_usage_stats):
    # exact tokens per chunk where supported, ignored elsewhere.
    continuous_usage: bool = True

    def __post_init__(self) -> None:
        if not self.launcher:
            raise ConfigError("[run] launcher must be a non-empty list of strings")
        if not 0 < self.slo_attainment <= 1:
            raise ConfigError(f"[run] slo_attainment must be in (0, 1], got {self.slo_attainment}")
        if self.ready_timeout_s <= 0:
            raise ConfigError(f"[run] ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        try:  # the traffic fields are checked where they are used
            self.load(WorkloadSpec())
        except ValueError as e:
            raise ConfigError(f"[run] {e}") from None

    def launcher_argv(self) -> list[str]:
        argv = [sys.executable if part == "{python}" else part for part in self.launcher]
        if argv[0] == "pdserve":  # this environment's script, even when it is not on PATH
            argv[0] = shutil.which("pdserve", path=str(Path(sys.executable).parent)) or argv[0]
        return argv

    def load(self, workload: WorkloadSpec, progress: bool = True) -> LoadSettings:
        return LoadSettings(workload=workload, rates=self.rates, seed=self.seed,
                            num_requests=self.num_requests,
                            request_timeout_s=self.request_timeout_s,
                            slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms,
                            warmup_requests=self.warmup_requests, progress=progress)


@dataclass(frozen=True)
class Comparison:
    name: str
    workload: WorkloadSpec
    baseline: str
    candidate: str
    metric: str = "itl_p99_ms"
    min_reduction: float = 0.5  # target: candidate <= (1 - min_reduction) x baseline

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"comparison {self.name!r}: metric must be one of "
                              f"{', '.join(METRICS)}, got {self.metric!r}")
        if not 0 <= self.min_reduction < 1:
            raise ConfigError(f"comparison {self.name!r}: min_reduction must be in [0, 1), "
                              f"got {self.min_reduction}")
        if self.baseline == self.candidate:
            raise ConfigError(f"comparison {self.name!r}: baseline and candidate are the same")


@dataclass(frozen=True)
class StackConfig:
    name: str
    args: tuple[str, ...]
    description: str = ""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchConfig:
    path: Path
    run: RunConfig
    comparisons: tuple[Comparison, ...]
    stacks: dict[str, StackConfig]


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)} "
                          f"(accepted: {sorted(known)})")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def load_stack(directory: Path, name: str) -> StackConfig:
    path = directory / f"{name}.toml"
    table = _read(path)
    if not isinstance(table.get("args"), list) or not all(isinstance(a, str)
                                                           for a in table["args"]):
        raise ConfigError(f"{path}: 'args' must be a list of strings (the `pdserve up` flags)")
    env = table.get("env", {})
    if not isinstance(env, dict):
        raise ConfigError(f"{path}: [env] must be a table of strings")
    extra = set(table) - {"args", "env", "description"}
    if extra:
        raise ConfigError(f"{path}: unknown field(s) {sorted(extra)} "
                          "(accepted: args, description, env)")
    return StackConfig(name, tuple(table["args"]), str(table.get("description", "")),
                       {str(k): str(v) for k, v in env.items()})


def load_config(path: Path, only: tuple[str, ...] = ()) -> BenchConfig:
    """The comparisons of ``path`` (all, or those named in ``only``) and their stack files."""
    table = _read(path)
    run = _build(RunConfig, table.get("run", {}), f"{path} [run]")
    overrides = table.get("workloads", {})
    comparisons = []
    for i, item in enumerate(table.get("comparison", [])):
        where = f"{path} [[comparison]] #{i + 1}"
        item = dict(item)
        name = item.get("workload", "mixed")
        if name not in WORKLOADS:
            raise ConfigError(f"{where}: workload must be one of {', '.join(WORKLOADS)}, "
                              f"got {name!r}")
        try:
            item["workload"] = WorkloadSpec.from_mapping(name, overrides.get(name, {}))
        except ValueError as e:
            raise ConfigError(f"{path} [workloads.{name}]: {e}") from None
        comparisons.append(_build(Comparison, item, where))
    if only:
        missing = set(only) - {c.name for c in comparisons}
        if missing:
            raise ConfigError(f"--only: no comparison named {sorted(missing)} in {path}")
        comparisons = [c for c in comparisons if c.name in only]
    if not comparisons:
        raise ConfigError(f"{path}: no [[comparison]] to run")
    names = {n for c in comparisons for n in (c.baseline, c.candidate)}
    stacks = {n: load_stack(path.parent, n) for n in sorted(names)}
    return BenchConfig(path, run, tuple(comparisons), stacks)
