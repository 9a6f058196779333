"""What every pdserve gRPC service shares: a ``grpc.aio`` server with health checking and
reflection, the ready line, metrics, and a graceful stop on SIGTERM/SIGINT.

Each service's ``__main__`` does: flags -> config -> ``create_server(config)`` -> ``serve()``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve import env
from pdserve.log import setup_logging
from pdserve.telemetry import init_tracing

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


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


def make_server(host: str, port: int, services: Sequence[tuple[Any, Any, str]]) -> Service:
    """Build (not start) a server for ``(add_fn, servicer, full_service_name)`` triples.

    Binds only ``host``: internal ports never listen on all interfaces unless told to.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    names = []
    for add_fn, servicer, name in services:
        add_fn(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{_bracket(host)}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return Service(server, bound, health_servicer, names)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


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


def run_main(name: str, build: Callable[[list[str] | None], Any],
             create: Callable[[Any], Awaitable[Service]], argv: list[str] | None) -> int:
    """The shared ``main``: flags -> config (one-line error on bad input) -> serve."""
    try:
        config = build(argv)
    except ValueError as exc:
        sys.stderr.write(f"pdserve {name}: error: {exc}\n")
        return 2
    setup_logging(name)
    init_tracing(name, env.otel_endpoint())

    async def _run() -> None:
        svc = await create(config)
        await serve(name, config.host, svc, metrics_port=config.metrics_port)

    try:
        _profiled(name, lambda: asyncio.run(_run()))
    except OSError as exc:
        sys.stderr.write(f"pdserve {name}: error: {exc}\n")
        return 1
    return 0


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


def config_from_flags(cls: Any, service: str, argv: list[str] | None) -> Any:
    """Build a service's frozen config dataclass from its flags and environment."""
    return cls(**env.parse_flags(service, argv))


def unimplemented_servicer(base: type, methods: Sequence[str], why: str) -> Any:
    """A servicer whose every rpc answers UNIMPLEMENTED with ``why`` (never a fake success)."""

    def make(method: str) -> Callable[..., Awaitable[None]]:
        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method}: {why}")

        return handler

    cls = type(f"Unimplemented{base.__name__}", (base,), {m: make(m) for m in methods})
    return cls()
