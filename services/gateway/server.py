"""The gateway process's two servers in one asyncio loop: uvicorn (HTTP, the OpenAI API) and a
small ``grpc.aio`` server that answers ``grpc.health.v1`` and reflection like every pdserve
process. ``GatewayServer.start()`` binds both (port 0 = a free one) and starts the way to the
router (a gRPC channel, or with ``--router embedded`` the router's core in this loop);
``stop()`` drains both servers, then stops the router's.

``--http`` and ``--loop`` pick uvicorn's HTTP parser and the event loop (``pdserve bench
router`` measures them side by side); auto takes the C ones (httptools, uvloop) when installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
from collections.abc import Iterator

import uvicorn

from pdserve import auth, env
from pdserve.log import fields
from pdserve.server import Service, make_server
from services.gateway.app import FastPath, create_app
from services.gateway.auth import CacheSalter, KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.limits import with_header_timeout
from services.gateway.metrics import GatewayMetrics
from services.gateway.router_client import RouterApi, RouterClient
from services.gateway.servicer import Gateway

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's main owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def http_parser(config: GatewayConfig) -> str:
    """``--http``, auto resolved: httptools when installed, else h11."""
    if config.http != "auto":
        return config.http
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def router_api(config: GatewayConfig) -> RouterApi:
    """The way to the router ``config`` names (not started)."""
    if config.router == env.EMBEDDED:
        from services.gateway.embedded import EmbeddedRouter

        return EmbeddedRouter.from_flags(config.router_flags, config.request_timeout)
    return RouterClient(config.router, config.request_timeout, auth.metadata([auth.CLIENT]))


class GatewayServer:
    """``router``: the way to the router, else the one ``config`` names (tests pass theirs)."""

    def __init__(self, config: GatewayConfig, keys: KeyStore, grace: int = 5,
                 router: RouterApi | None = None) -> None:
        self.config = config
        self.keys = keys
        self.grace = grace
        self.http_port = 0
        self.grpc_port = 0
        self._task: asyncio.Task[None] | None = None
        self.client = router if router is not None else router_api(config)

    async def start(self) -> None:
        """Start the router's side, bind and start both servers; return once HTTP accepts
        connections."""
        config = self.config
        await self.client.start()
        self.gateway = Gateway(config, self.client, self.keys,
                               GatewayMetrics(with_process_registry=config.router == env.EMBEDDED),
                               CacheSalter(env.secret(env.CACHE_SALT_SECRET_VAR)))
        self._sock = _bind(config.host, config.port)
        self.http_port = int(self._sock.getsockname()[1])
        self._grpc: Service = make_server(config.host, config.grpc_port, [])
        self.grpc_port = self._grpc.port
        await self._grpc.server.start()
        app = FastPath(create_app(self.gateway), self.gateway)
        uv_config = uvicorn.Config(app, log_config=None, access_log=False,
                                   lifespan="off", timeout_graceful_shutdown=self.grace,
                                   server_header=False,
                                   http=with_header_timeout(config.header_timeout,
                                                            http_parser(config)))
        self._http = _Uvicorn(uv_config)
        self._task = asyncio.create_task(self._http.serve(sockets=[self._sock]))
        while not self._http.started:
            if self._task.done():  # failed to start: surface its error
                await self._task
                raise OSError("HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        await self._grpc.set_serving(True)
        if not self.keys.enabled:
            log.warning("no API keys configured: serving without authentication")
        instance = config.instance_id or f"{config.host}:{self.http_port}"
        log.info("serving", extra=fields(instance=instance, http_port=self.http_port,
                                         grpc_port=self.grpc_port, router=config.router,
                                         http=http_parser(config),
                                         loop=type(asyncio.get_running_loop()).__module__,
                                         keys=len(self.keys)))

    @property
    def ready_line(self) -> str:
        host = self.config.host
        return (f"pdserve gateway listening on {host}:{self.http_port} "
                f"(grpc health on {host}:{self.grpc_port})")

    async def stop(self) -> None:
        """Say NOT_SERVING, let in-flight requests finish (up to ``grace``), close everything."""
        await self._grpc.set_serving(False)
        self._http.should_exit = True
        if self._task is not None:
            await self._task
        await self._grpc.server.stop(self.grace)
        await self.client.close()
        self._sock.close()
