"""Every ``PDSERVE_*`` environment variable, in one typed module.

Each service flag has an environment twin: ``--max-queued`` of the prefill service is
``PDSERVE_PREFILL_MAX_QUEUED``. A flag given on the command line wins over its variable, which
wins over the default. Nothing outside this module reads ``os.environ`` for configuration; each
service's ``config.py`` turns the parsed values into one frozen dataclass.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


@dataclass(frozen=True)
class Kind:
    """How to parse one value, and what to say when it is wrong."""

    parse: Callable[[str], Any]
    accepted: str


def int_kind(lo: int, hi: int | None = None) -> Kind:
    def parse(text: str) -> int:
        value = int(text)
        if value < lo or (hi is not None and value > hi):
            raise ValueError(text)
        return value

    return Kind(parse, f"an integer >= {lo}" if hi is None else f"an integer {lo}..{hi}")


def float_kind(lo: float = 0.0) -> Kind:
    def parse(text: str) -> float:
        value = float(text)
        if value < lo:
            raise ValueError(text)
        return value

    return Kind(parse, f"a number >= {lo:g}")


def choice_kind(*choices: str) -> Kind:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return Kind(parse, ", ".join(choices))


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def is_host_port(text: str) -> bool:
    """``host:port`` with a port in 1..65535 (the form of every address flag)."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


STR = Kind(str, "any text")
BOOL = Kind(_parse_bool, "true, false, 1, 0, yes, no, on, off")
LIST = Kind(_parse_list, "a comma-separated list")
PORT = int_kind(0, 65535)
LOG_FORMAT = choice_kind("text", "json")
LOG_LEVEL = choice_kind("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Flag:
    """One command-line flag and its ``PDSERVE_*`` twin."""

    name: str  # "max-queued" (no dashes in front)
    kind: Kind
    default: Any
    help: str
    env: str = ""  # set by ``_section``; a shared variable (REDIS_URL) may be given explicitly

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


def _section(service: str, *flags: Flag) -> tuple[Flag, ...]:
    prefix = f"PDSERVE_{service.upper()}_"
    return tuple(
        f if f.env else Flag(f.name, f.kind, f.default, f.help, prefix + f.dest.upper())
        for f in flags
    )


# Variables every process reads.
LOG_FORMAT_VAR = "PDSERVE_LOG_FORMAT"  # text | json
LOG_LEVEL_VAR = "PDSERVE_LOG_LEVEL"  # debug | info | warning | error
OTEL_ENDPOINT_VAR = "PDSERVE_OTEL_ENDPOINT"  # OTLP/gRPC collector; unset = traces stay local
PROFILE_DIR_VAR = "PDSERVE_PROFILE_DIR"  # write a cProfile file per process here on exit
REDIS_URL_VAR = "REDIS_URL"  # the prefix index and registry; PDSERVE_REDIS_URL also accepted

COMMON_VARS: dict[str, Kind] = {
    LOG_FORMAT_VAR: LOG_FORMAT,
    LOG_LEVEL_VAR: LOG_LEVEL,
    OTEL_ENDPOINT_VAR: STR,
    PROFILE_DIR_VAR: STR,
}


def _common(default_port: int) -> tuple[Flag, ...]:
    return (
        Flag("host", STR, "127.0.0.1", "address to bind (never all interfaces by default)"),
        Flag("port", PORT, default_port, "gRPC port; 0 picks a free one"),
        Flag("metrics-port", int_kind(-1, 65535), -1,
             "Prometheus /metrics port; -1 = off, 0 = a free one"),
        Flag("instance-id", STR, "", "id in logs, traces and the registry (default: host:port)"),
    )


def _redis_flag() -> Flag:
    return Flag("redis-url", STR, "", "Redis URL of the prefix index and registry; empty = none",
                REDIS_URL_VAR)


def _engine_flags(role_default: str) -> tuple[Flag, ...]:
    return (
        Flag("model", STR, "tiny",
             "built-in model name (tiny, tiny-moe, bench-50m) or HF directory"),
        Flag("dtype", choice_kind("auto", "float32", "bfloat16", "float16"), "auto",
             "weights dtype"),
        Flag("role", choice_kind("prefill", "decode", "colocated", "flex"), role_default,
             "engine role; flex instances may switch between prefill and decode"),
        Flag("kvd", STR, "", "this node's kvd gRPC address host:port; empty = no kvd"),
        Flag("block-size", int_kind(1, 1024), 16, "tokens per KV block"),
        Flag("num-blocks", int_kind(0), 0, "KV blocks in the engine cache; 0 = from memory"),
        Flag("max-num-seqs", int_kind(1), 64, "most sequences in one running batch"),
        Flag("max-num-batched-tokens", int_kind(1), 512,
             "token budget of one step (chunked prefill)"),
        Flag("max-queued", int_kind(1), 256, "most queued requests before RESOURCE_EXHAUSTED"),
        Flag("max-prompt-tokens", int_kind(0), 0, "longest accepted prompt; 0 = model context"),
        Flag("attention-backend", choice_kind("auto", "torch", "flashinfer"), "auto",
             "attention kernels"),
        Flag("threads", int_kind(0), 0, "torch CPU threads; 0 = torch's default"),
        _redis_flag(),
        Flag("advertise", STR, "", "address others reach this instance at (default host:port)"),
        Flag("max-model-len", int_kind(0), 0, "longest sequence (prompt + output); 0 = model's"),
        Flag("default-max-tokens", int_kind(1), 256, "max_tokens when a request leaves it 0"),
        Flag("kvd-secret", STR, "", "shared secret the kvd expects from local clients"),
        Flag("kvd-timeout", float_kind(0.01), 30.0,
             "seconds a kvd call may take (a decode's own RPC deadline wins when shorter)"),
        Flag("registry-prefix", STR, "pdserve:", "key prefix of the instance registry in Redis"),
        Flag("registry-ttl", float_kind(0.5), 10.0,
             "seconds the registry entry lives without a heartbeat (beats every ttl/3)"),
        Flag("stats-window", float_kind(0.1), 10.0, "seconds of the recent tokens/s window"),
    )


SERVICE_FLAGS: dict[str, tuple[Flag, ...]] = {
    "gateway": _section(
        "gateway",
        Flag("host", STR, "127.0.0.1", "HTTP address to bind"),
        Flag("port", PORT, 8000, "HTTP port; 0 picks a free one"),
        Flag("grpc-port", PORT, 0, "gRPC health and reflection port; 0 picks a free one"),
        Flag("router", STR, "127.0.0.1:50051", "router gRPC address host:port"),
        Flag("keys-file", STR, "", "API keys file (one 'key[,tenant]' a line); empty = no auth"),
        Flag("api-keys", LIST, (), "API keys, comma-separated (added to the keys file's)"),
        Flag("model-name", STR, "", "model id to expose (default: the router's)"),
        Flag("max-body-bytes", int_kind(1024), 4 * 1024 * 1024, "largest request body"),
        Flag("request-timeout", float_kind(0.1), 600.0, "seconds before a request is abandoned"),
        Flag("max-choices", int_kind(1), 64, "most choices (n x prompts) in one request"),
        Flag("instance-id", STR, "", "id in logs and traces"),
    ),
    "router": _section(
        "router",
        *_common(50051),
        _redis_flag(),
        Flag("model", STR, "tiny", "model (tokenizer, chat template) the cluster serves"),
        Flag("policy", choice_kind("cache_aware", "least_load", "round_robin"), "cache_aware",
             "routing policy"),
        Flag("prefill", LIST, (), "static prefill instances host:port (besides the registry)"),
        Flag("decode", LIST, (), "static decode (or colocated) instances host:port"),
        Flag("block-size", int_kind(1, 1024), 16, "tokens per KV block (as the engines)"),
        Flag("max-prompt-tokens", int_kind(1), 32768, "longest accepted prompt"),
        Flag("max-tokens", int_kind(1), 4096, "largest accepted max_tokens"),
        Flag("max-concurrent", int_kind(1), 1024, "most requests in flight"),
        Flag("quotas-file", STR, "", "per-tenant quotas file (JSON); empty = no quotas"),
        Flag("max-retries", int_kind(0), 2, "extra attempts on another instance"),
        Flag("poll-interval", float_kind(0.05), 1.0, "seconds between instance health/stats polls"),
        Flag("registry-prefix", STR, "pdserve:", "key prefix of the instance registry in Redis"),
        Flag("index-prefix", STR, "pdserve:", "key prefix of the prefix index (as the kvds)"),
        Flag("index-timeout", float_kind(0.001), 0.05,
             "seconds one index lookup may take before routing by load only"),
    ),
    "prefill": _section("prefill", *_common(50061), *_engine_flags("prefill")),
    "decode": _section("decode", *_common(50071), *_engine_flags("decode")),
    "kvd": _section(
        "kvd",
        *_common(50081),
        _redis_flag(),
        Flag("node-id", STR, "", "node id in the index (default: host:port)"),
        Flag("capacity-mib", int_kind(1), 1024, "shared-memory pool size in MiB"),
        Flag("ucx-host", STR, "127.0.0.1",
             "address whose network interface UCX may use (empty or 0.0.0.0 = every one)"),
        Flag("ucx-tls", STR, "^cma",
             "UCX_TLS transports; default: every one but CMA (shared memory and TCP on a host, "
             "RDMA between hosts); empty = UCX's own default"),
        Flag("ucx-error-handling", BOOL, False,
             "UCX peer-failure handling on endpoints (disables shared memory on a host)"),
        Flag("secret", STR, "", "shared secret peers and local clients must present"),
        Flag("lease-ms", int_kind(100), 30000, "default lease of a pin, milliseconds"),
        Flag("index-ttl", int_kind(1), 300, "seconds an index entry lives without refresh"),
        Flag("index-prefix", STR, "pdserve:", "key prefix of the prefix index in Redis"),
        Flag("heartbeat", float_kind(0.1), 2.0, "seconds between registry heartbeats"),
        Flag("max-batch-blocks", int_kind(1), 4096, "most blocks in one call"),
        Flag("transfer-timeout", float_kind(0.1), 30.0,
             "seconds a transfer may go without progress before it is abandoned"),
        Flag("max-message-kib", int_kind(4), 8192, "largest UCX message (runs of blocks)"),
        Flag("fault-corrupt-every", int_kind(0), 0,
             "TEST HOOK: flip a byte of every Nth block sent; 0 = off"),
        Flag("fault-send-delay-ms", int_kind(0), 0,
             "TEST HOOK: sleep before sending each transfer's bytes; 0 = off"),
    ),
}


def env_vars() -> dict[str, str]:
    """Every variable pdserve reads, with what it accepts (``pdserve env`` prints this)."""
    out = {name: kind.accepted for name, kind in COMMON_VARS.items()}
    for flags in SERVICE_FLAGS.values():
        for f in flags:
            out.setdefault(f.env, f.kind.accepted)
    return out


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def parse_flags(
    service: str, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Parse ``argv`` and the environment for ``service``; exit 2 with one line on a bad value."""
    environ = os.environ if environ is None else environ
    prog = f"pdserve {service}"
    flags = SERVICE_FLAGS[service]
    parser = _OneLineParser(prog=prog, description=f"pdserve {service} service")
    for f in flags:
        parser.add_argument(f"--{f.name}", dest=f.dest, default=None, metavar=f.dest.upper(),
                            help=f"{f.help} [env {f.env}; default {f.default!r}]")
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for f in flags:
        raw, origin = args[f.dest], f"--{f.name}"
        if raw is None:
            raw = environ.get(f.env)
            if raw is None and f.env == REDIS_URL_VAR:
                raw = environ.get("PDSERVE_REDIS_URL")
            origin = f.env
        if raw is None:
            values[f.dest] = f.default
            continue
        try:
            values[f.dest] = f.kind.parse(raw)
        except ValueError:
            _fail(prog, f"{origin}: invalid value {raw!r} (accepted: {f.kind.accepted})")
    check_common_env(prog, environ)
    return values


def check_common_env(prog: str, environ: Mapping[str, str]) -> None:
    for name, kind in COMMON_VARS.items():
        raw = environ.get(name)
        if raw is not None:
            try:
                kind.parse(raw)
            except ValueError:
                _fail(prog, f"{name}: invalid value {raw!r} (accepted: {kind.accepted})")


def log_format(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(LOG_FORMAT_VAR, "text")


def log_level(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(LOG_LEVEL_VAR, "info")


def otel_endpoint(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(OTEL_ENDPOINT_VAR, "")


def profile_dir(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get(PROFILE_DIR_VAR, "")
