"""What every pdserve gRPC service shares: a ``grpc.aio`` server with health checking and
reflection, the ready line, metrics, and a graceful stop on SIGTERM/SIGINT.

Each service's ``__main__`` does: flags -> config -> ``create_server(config)`` -> ``serve()``.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import auth, env, reflection
from pdserve.channel import GRPC_OPTIONS
from pdserve.env import (
    NAME,
    STR,
    ConfigError,
    ServiceConfig,
    int_kind,
    port_setting,
    setting,
)
from pdserve.log import setup_logging
from pdserve.telemetry import init_tracing

log = logging.getLogger(__name__)
# Metrics are on by default, on a documented port: the gRPC port + 1000 (router 51051, prefill
# 51061, decode 51071, kvd 51081).
METRICS_AUTO, METRICS_OFFSET = -2, 1000
C = TypeVar("C", bound=ServiceConfig)
G = TypeVar("G", bound="GrpcServiceConfig")



@dataclass(frozen=True)
class GrpcServiceConfig(ServiceConfig):
    """The settings every gRPC service has; a service sets its own default port."""

    host: str = setting("127.0.0.1", NAME, "address to bind (never all interfaces by default)")
    port: int = port_setting(0)
    metrics_port: int = setting(
        METRICS_AUTO, int_kind(METRICS_AUTO, 65535),
        f"Prometheus /metrics port; {METRICS_AUTO} = the gRPC port + {METRICS_OFFSET} (a free "
        "one when the gRPC port is 0), -1 = off, 0 = a free one")
    instance_id: str = setting("", STR,
                               "id in logs, traces and the registry (default: host:port)")


@dataclass
class Service:
    """A gRPC server plus what must run beside it and what must be closed after it."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]
    on_start: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            await self.health.set(name, status)


def make_server(host: str, port: int, services: Sequence[tuple[Any, Any, str]],
                rules: auth.Rules = ()) -> Service:
    """Build (not start) a server for ``(add_fn, servicer, full_service_name)`` triples;
    every call is checked against ``rules`` (method prefix -> credential, ``auth.Guard``)
    with the credentials this process was given.

    Binds only ``host``: internal ports never listen on all interfaces unless told to, and a
    plane whose credential is not set refuses a non-loopback address (ConfigError).
    """
    held = auth.secrets()
    what = ", ".join(name.removeprefix("pdserve.v1.") for _, _, name in services)
    auth.check_exposure(host, rules, held, f"the {what or 'health'} service")
    guard = auth.Guard(rules, held)
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[guard] if guard.rules else [])
    names = []
    for add_fn, servicer, name in services:
        add_fn(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(server, [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
    try:  # grpcio >= 1.6x raises where older ones returned 0
        bound = server.add_insecure_port(f"{_bracket(host)}:{port}")
    except RuntimeError as exc:
        raise OSError(f"cannot bind {host}:{port} (in use, or not an address of this "
                      "host)") from exc
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use, or not an address of this host)")
    return Service(server, bound, health_servicer, names)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def metrics_port(setting: int, grpc_port: int) -> int:
    """The port ``--metrics-port`` means (``METRICS_AUTO`` resolved)."""
    if setting != METRICS_AUTO:
        return setting
    return grpc_port + METRICS_OFFSET if 0 < grpc_port <= 65535 - METRICS_OFFSET else 0


def start_metrics(host: str, port: int) -> int | None:
    """Serve Prometheus /metrics when ``port`` >= 0; return the bound port."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    http_server, _ = start_http_server(port, addr=host)
    return int(http_server.server_port)


async def serve(name: str, host: str, svc: Service, grace: float = 5.0,
                metrics_port: int = -1) -> None:
    """Start, print the ready line, wait for SIGTERM/SIGINT, stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await svc.server.start()
    for hook in svc.on_start:
        await hook()
    await svc.set_serving(True)
    bound_metrics = start_metrics(host, metrics_port)
    extra = f" (metrics on {host}:{bound_metrics})" if bound_metrics is not None else ""
    print(f"pdserve {name} listening on {host}:{svc.port}{extra}", flush=True)
    log.info("serving", extra={"fields": {"port": svc.port}})
    await stop.wait()
    log.info("shutting down")
    await svc.set_serving(False)
    await svc.server.stop(grace)
    for hook in svc.on_stop:
        await hook()


def run_main(config_cls: type[C], run: Callable[[C], Coroutine[Any, Any, None]],
             argv: list[str] | None,
             loop_factory: Callable[[C], Callable[[], asyncio.AbstractEventLoop] | None]
             = lambda _: None) -> int:
    """The shared ``main``: flags -> config -> ``run(config)`` under logging, tracing and the
    optional profiler. A bad setting (also one found while starting: a file it names) exits 2
    with one line; a port that cannot be bound exits 1. ``loop_factory(config)`` picks the
    event loop (None: asyncio's own)."""
    name = config_cls.SERVICE
    try:
        config = config_cls.from_argv(argv)
    except ValueError as exc:
        sys.stderr.write(f"pdserve {name}: error: {exc}\n")
        return 2
    setup_logging(name)
    init_tracing(name, env.otel_endpoint())
    try:
        factory = loop_factory(config)  # None: asyncio's own loop

        def main() -> None:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(run(config))

        _profiled(name, main)
        # Served and stopped: the interpreter's last collection at exit would walk the whole
        # heap of a process that is ending anyway (~0.55 s of an engine's 0.77 s from SIGTERM
        # to exit; 0.21 s with the heap frozen). Exit handlers still run.
        gc.freeze()
    except ConfigError as exc:
        sys.stderr.write(f"pdserve {name}: error: {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"pdserve {name}: error: {exc}\n")
        return 1
    return 0


def run_grpc_main(config_cls: type[G], create: Callable[[G], Awaitable[Service]],
                  argv: list[str] | None,
                  loop_factory: Callable[[G], Callable[[], asyncio.AbstractEventLoop] | None]
                  = lambda config: None) -> int:
    """``run_main`` for a gRPC service: ``create(config)`` builds it, ``serve`` runs it."""

    async def run(config: G) -> None:
        svc = await create(config)
        await serve(config.SERVICE, config.host, svc,
                    metrics_port=metrics_port(config.metrics_port, config.port))

    return run_main(config_cls, run, argv, loop_factory)


LOOPS = ("auto", "asyncio", "uvloop")


def event_loop(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A ``--loop`` choice (``LOOPS``) resolved: uvloop's loop, or None for asyncio's own
    (``auto``: uvloop when installed, ``pip install 'pdserve[fast]'``)."""
    if choice == "asyncio" or (choice == "auto" and not importlib.util.find_spec("uvloop")):
        return None
    import uvloop

    return uvloop.new_event_loop


def _profiled(name: str, fn: Callable[[], None]) -> None:
    """Run ``fn``, under cProfile when ``PDSERVE_PROFILE_DIR`` is set (``bench compare
    --profile``): one ``<service>-<pid>.prof`` file per process, written on exit."""
    directory = env.profile_dir()
    if not directory:
        fn()
        return
    import cProfile
    import os

    profiler = cProfile.Profile()
    try:
        profiler.runcall(fn)
    finally:
        os.makedirs(directory, exist_ok=True)
        profiler.dump_stats(os.path.join(directory, f"{name}-{os.getpid()}.prof"))
