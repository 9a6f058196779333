"""The ``pdserve`` command: one subcommand per job, each implemented where its code lives.

    pdserve up         the local stack (Redis, kvd, engines, router, gateway)
    pdserve generate   offline generation with the built-in or a local model
    pdserve bench X    benchmarks: engine, transfer, router, serve, compare, all
    pdserve <service>  one service: gateway, router, prefill, decode, kvd
    pdserve env        every PDSERVE_* variable and what it accepts
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# subcommand -> "module:function" taking argv and returning an exit code
COMMANDS: dict[str, str] = {
    "up": "pdserve.launcher:main",
    "generate": "pdserve.engine.cli:generate_main",
    "gateway": "services.gateway.__main__:main",
    "router": "services.router.__main__:main",
    "prefill": "services.prefill.__main__:main",
    "decode": "services.decode.__main__:main",
    "kvd": "services.kvd.__main__:main",
}
BENCHMARKS: dict[str, str] = {
    "engine": "pdserve.bench.engine:main",
    "transfer": "pdserve.bench.transfer:main",
    "router": "pdserve.bench.router:main",
    "serve": "pdserve.bench.serve:main",
    "compare": "pdserve.bench.compare:main",
}


def _load(target: str) -> Callable[[list[str]], int]:
    module, func = target.split(":")
    fn: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return fn


def _usage() -> str:
    names = ", ".join([*COMMANDS, "bench", "env"])
    return f"usage: pdserve <command> [args]  (commands: {names}; `pdserve <command> --help`)"


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: pdserve bench <{'|'.join([*BENCHMARKS, 'all'])}> [args]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        # `make bench`: every benchmark, each printing its table and JSON.
        for bench in ("engine", "transfer", "router", "compare"):
            print(f"== pdserve bench {bench}", flush=True)
            code = _load(BENCHMARKS[bench])(rest if bench == "compare" else ["--json"])
            if code != 0:
                return code
        return 0
    if name not in BENCHMARKS:
        sys.stderr.write(f"pdserve bench: error: unknown benchmark {name!r} "
                         f"(accepted: {', '.join([*BENCHMARKS, 'all'])})\n")
        return 2
    return _load(BENCHMARKS[name])(rest)


def _env() -> int:
    from pdserve import env

    for name, accepted in sorted(env.env_vars().items()):
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
