"""``pdserve bench compare``: the same seeded traffic against two stacks per comparison.

    pdserve bench compare                          # bench/configs/default.toml -> bench-results/
    pdserve bench compare --config bench/configs/gpu.toml --only routing --profile
    pdserve bench compare --config C --rates 1.5 --num-requests 80   # [run] overridden

For each comparison in the config file, each side's stack is started (``pdserve up <args>``
from its own TOML file), warmed up, driven at every rate, and stopped before the other side
starts, so the two never share the CPUs. Results: ``report.json``, ``report.md``, ``plots/``,
``runs/<comparison>/<stack>.json`` (every request), ``logs/`` (launcher output).

``--profile`` passes ``PDSERVE_PROFILE_DIR=<out>/profiles/<comparison>-<stack>`` to the stack
(the launcher has each service write cProfile files there) and summarises whatever ``.prof``
/ ``.pstats`` files land in it; with ``py-spy`` on PATH it also samples the whole process tree.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import pstats
import shlex
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from pdserve.env import PROFILE_DIR_VAR
from pdserve_bench.configs import BenchConfig, Comparison, ConfigError, StackConfig, load_config
from pdserve_bench.report import ComparisonResult, SideResult, write_report
from pdserve_bench.runner import RunResult, Target, run_load_async, write_json
from pdserve_bench.stack import StackError, StackProcess
from pdserve_bench.workload import PromptMaker, WorkloadSpec

DEFAULT_CONFIG = Path("bench/configs/default.toml")


def summarize_cprofile(directory: Path, top: int = 20) -> str:
    """Top functions by cumulative time over every cProfile file in ``directory``."""
    files = sorted(p for p in directory.glob("**/*") if p.suffix in (".prof", ".pstats"))
    if not files:
        return ""
    out = io.StringIO()
    stats = pstats.Stats(str(files[0]), stream=out)
    for f in files[1:]:
        stats.add(str(f))
    out.write(f"cProfile: {len(files)} file(s) in {directory}\n")
    stats.strip_dirs().sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def summarize_pyspy(raw: Path, top: int = 15) -> str:
    """py-spy ``--format raw`` (collapsed stacks ``a;b;c count``): top frames by self samples."""
    if not raw.is_file():
        return ""
    leaf: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            leaf[stack.split(";")[-1]] += int(count)
            total += int(count)
    if not total:
        return ""
    rows = [f"{n / total:6.1%}  {frame}" for frame, n in leaf.most_common(top)]
    return f"py-spy: {total} samples, top frames by self time\n" + "\n".join(rows) + "\n"


def _start_pyspy(pid: int, raw: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--format",
                             "raw", "--output", str(raw), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_pyspy(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def router_counters(address: str, credentials: tuple[tuple[str, str], ...] = ()
                           ) -> dict[str, float]:
    """Cumulative prefix-hit counters from ``Router.ClusterState``; {} when unavailable."""
    import grpc

    from pdserve.channel import insecure_channel
    from pdserve.proto.v1 import router_pb2, router_pb2_grpc

    async with insecure_channel(address, credentials=credentials) as channel:
        try:
            state = await router_pb2_grpc.RouterStub(channel).ClusterState(
                router_pb2.ClusterStateRequest(), timeout=10.0)
        except grpc.aio.AioRpcError:
            return {}
    return {"prefix_hit_blocks": float(state.num_prefix_hit_blocks),
            "prompt_blocks": float(state.num_prompt_blocks)}


def with_hit_rate(run: RunResult, before: dict[str, float], after: dict[str, float]
                   ) -> RunResult:
    if not before or not after:
        return run
    blocks = after["prompt_blocks"] - before["prompt_blocks"]
    hits = after["prefix_hit_blocks"] - before["prefix_hit_blocks"]
    if blocks <= 0:
        return run
    extra = {**run.summary.extra, "prefix_hit_rate": hits / blocks}
    return replace(run, summary=replace(run.summary, extra=extra))


async def _drive(target: Target, cfg: BenchConfig, cmp: Comparison, router: str | None,
                 maker: PromptMaker, progress: bool) -> list[RunResult]:
    creds = target.router_credentials
    """Warm up, then each rate of the sweep, snapshotting router counters around each."""
    load = cfg.run.load(cmp.workload, progress)
    runs: list[RunResult] = []
    for i, rate in enumerate(load.rates):
        # One rate at a time, to read the router's counters around it; warm up once.
        before = await router_counters(router, creds) if router else {}
        (run,) = await run_load_async(target, load, maker, rate_indices=[i], warmup=i == 0)
        after = await router_counters(router, creds) if router else {}
        runs.append(with_hit_rate(run, before, after))
        print(f"   {cmp.name} @ {rate:g} req/s: "
              f"{run.summary.num_ok}/{run.summary.num_requests} ok", file=sys.stderr, flush=True)
    return runs


def run_side(cfg: BenchConfig, cmp: Comparison, stack: StackConfig, out_dir: Path,
             maker: PromptMaker, *, profile: bool, progress: bool) -> SideResult:
    tag = f"{cmp.name}-{stack.name}"
    env = dict(stack.env)
    prof_dir = out_dir / "profiles" / tag
    if profile:
        prof_dir.mkdir(parents=True, exist_ok=True)
        env[PROFILE_DIR_VAR] = str(prof_dir.resolve())
    argv = [*cfg.run.launcher_argv(), *stack.args, *cfg.run.stack_args]
    print(f"== {cmp.name}: starting {stack.name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
    spy = None
    with StackProcess(tag, argv, env=env, log_path=out_dir / "logs" / f"{tag}.log",
                      ready_timeout_s=cfg.run.ready_timeout_s) as info:
        if profile:
            spy = _start_pyspy(info.pid, prof_dir / "py-spy.txt")
        try:
            target = Target(base_url=info.base_url, api=cfg.run.api, model=cfg.run.model,
                            continuous_usage=cfg.run.continuous_usage,
                            router_credentials=info.router_credentials)
            runs = asyncio.run(_drive(target, cfg, cmp, info.router, maker, progress))
        finally:
            _stop_pyspy(spy)
    summary = ""
    if profile:
        summary = summarize_pyspy(prof_dir / "py-spy.txt") + summarize_cprofile(prof_dir)
        (out_dir / "profiles" / f"{tag}.txt").write_text(summary or "(no profile files)\n")
    side = SideResult(stack.name, stack.description, stack.args, tuple(runs), summary)
    write_json(out_dir / "runs" / cmp.name / f"{stack.name}.json",
               {"stack": stack.name, "args": list(stack.args),
                "runs": [r.to_json() for r in runs]})
    return side


def _maker(cfg: BenchConfig) -> PromptMaker:
    if cfg.run.tokenizer_model:
        from pdserve_bench.serve import token_counter

        return PromptMaker(token_counter(cfg.run.tokenizer_model), cfg.run.tokens_per_word)
    return PromptMaker(None, cfg.run.tokens_per_word)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench compare", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help=f"comparisons to run (default {DEFAULT_CONFIG})")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    p.add_argument("--only", action="append", default=[], help="run only this comparison")
    p.add_argument("--profile", action="store_true",
                   help="profile each stack (PDSERVE_PROFILE_DIR; py-spy when installed)")
    p.add_argument("--rates", type=float, nargs="+", metavar="REQ_S",
                   help="these request rates instead of the config's [run] rates")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="N requests per rate instead of the config's [run] num_requests")
    p.add_argument("--no-progress", action="store_true")
    return p


def _override(cfg: BenchConfig, ns: argparse.Namespace) -> BenchConfig:
    """The config with the command line's --rates / --num-requests in its [run] table."""
    if ns.rates is None and ns.num_requests is None:
        return cfg
    rates = cfg.run.rates if ns.rates is None else tuple(ns.rates)
    num = cfg.run.num_requests if ns.num_requests is None else ns.num_requests
    try:
        return replace(cfg, run=replace(cfg.run, rates=rates, num_requests=num))
    except ConfigError as e:  # "[run] rates must be ...": the flag, not the file, said it
        raise ConfigError(str(e).replace("[run] ", "--rates/--num-requests: ", 1)) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = _override(load_config(ns.config, tuple(ns.only)), ns)
        maker = _maker(cfg)
    except (ConfigError, ValueError) as e:
        print(f"pdserve bench compare: error: {e}", file=sys.stderr)
        return 2
    command = shlex.join(["pdserve", "bench", "compare", *(sys.argv[3:] if argv is None
                                                             else argv)])
    results: list[ComparisonResult] = []
    try:
        # A stack already run on the same workload in this invocation is not run again: two
        # comparisons sharing a side (A vs C, B vs C) measure C once, in the same run.
        done: dict[tuple[WorkloadSpec, str], SideResult] = {}
        for cmp in cfg.comparisons:
            for name in (cmp.baseline, cmp.candidate):
                if (cmp.workload, name) not in done:
                    done[cmp.workload, name] = run_side(
                        cfg, cmp, cfg.stacks[name], ns.out_dir, maker, profile=ns.profile,
                        progress=not ns.no_progress)
            results.append(ComparisonResult(cmp, done[cmp.workload, cmp.baseline],
                                            done[cmp.workload, cmp.candidate]))
    except StackError as e:
        print(f"pdserve bench compare: error: {e}", file=sys.stderr)
        return 1
    json_path, md_path = write_report(results, cfg.run, command, ns.out_dir)
    print(md_path.read_text(encoding="utf-8"))
    print(f"wrote {json_path}, {md_path}, {ns.out_dir / 'plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
