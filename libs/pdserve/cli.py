"""The ``pdserve`` command: one subcommand per job, each implemented where its code lives.

    pdserve up         the local stack (Redis, kvd, engines, router, gateway)
    pdserve reload     a rolling reload of a running stack's weights (--model DIR)
    pdserve generate   offline generation with the built-in or a local model
    pdserve bench X    benchmarks: engine, transfer, router, serve, compare, detok, cluster,
                       faults, reload, burst, kvquant, wirecodec, all
    pdserve sim        the P:D controller on a simulated cluster (the bench extra)
    pdserve <service>  one service: gateway, router, prefill, decode, kvd
    pdserve env        every PDSERVE_* variable and what it accepts
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

# subcommand -> "module:function" taking argv and returning an exit code
COMMANDS: dict[str, str] = {
    "up": "services.launcher:main",
    "reload": "services.reload:main",
    "generate": "pdserve.engine.cli:generate_main",
    "gateway": "services.gateway.__main__:main",
    "router": "services.router.__main__:main",
    "prefill": "services.prefill.__main__:main",
    "decode": "services.decode.__main__:main",
    "kvd": "services.kvd.__main__:main",
    "sim": "pdserve_bench.sim.cli:main",
}
# The optional ``bench`` extra (``pip install 'pdserve[bench]'``): these must all import.
BENCH_EXTRA = ("pdserve_bench", "matplotlib", "httpx")
BENCHMARKS: dict[str, str] = {
    "engine": "pdserve_bench.engine:main",
    "transfer": "pdserve_bench.transfer:main",
    "router": "pdserve_bench.router:main",
    "serve": "pdserve_bench.serve:main",
    "compare": "pdserve_bench.compare:main",
    "detok": "pdserve_bench.detok:main",
    "cluster": "pdserve_bench.cluster_bench:main",
    "faults": "pdserve_bench.faults:main",
    "reload": "pdserve_bench.reload:main",
    "burst": "pdserve_bench.burst:main",
    "kvquant": "pdserve_bench.kvquant:main",
    "wirecodec": "pdserve_bench.wirecodec:main",
}
# Whose settings ``pdserve env`` lists.
CONFIGS = ("services.gateway.config:GatewayConfig", "services.router.config:RouterConfig",
           "services.prefill.config:PrefillConfig", "services.decode.config:DecodeConfig",
           "services.kvd.config:KvdConfig")


def _load(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _missing_bench_extra() -> list[str]:
    return [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]


def _usage() -> str:
    names = ", ".join([*COMMANDS, "bench", "env"])
    return f"usage: pdserve <command> [args]  (commands: {names}; `pdserve <command> --help`)"


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: pdserve bench <{'|'.join([*BENCHMARKS, 'all'])}> [args]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    missing = _missing_bench_extra()
    if missing:
        sys.stderr.write(f"pdserve bench: error: the benchmarks are an optional extra and "
                         f"{', '.join(missing)} cannot be imported; install it with "
                         "pip install 'pdserve[bench]' (in a checkout: "
                         "pip install -e '.[bench]')\n")
        return 2
    if name == "all":
        # `make bench`: every benchmark, each printing its table and JSON.
        args = {"compare": rest, "cluster": ["--json", "--skip-unavailable"]}
        for bench in ("engine", "transfer", "router", "compare", "cluster"):
            print(f"== pdserve bench {bench}", flush=True)
            code = _load(BENCHMARKS[bench])(args.get(bench, ["--json"]))
            if code != 0:
                return code
        return 0
    if name not in BENCHMARKS:
        sys.stderr.write(f"pdserve bench: error: unknown benchmark {name!r} "
                         f"(accepted: {', '.join([*BENCHMARKS, 'all'])})\n")
        return 2
    return _load(BENCHMARKS[name])(rest)


def env_vars() -> dict[str, str]:
    """Every variable of every service, with what it accepts."""
    from pdserve import env

    return env.env_vars([_load(c) for c in CONFIGS])


def _env() -> int:
    for name, accepted in sorted(env_vars().items()):
        print(f"{name}\t{accepted}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return _bench(rest)
    if cmd == "env":
        return _env()
    if cmd not in COMMANDS:
        sys.stderr.write(f"pdserve: error: unknown command {cmd!r}\n{_usage()}\n")
        return 2
    return _load(COMMANDS[cmd])(rest)


if __name__ == "__main__":
    sys.exit(main())
