"""Gateways under test, served for real (uvicorn + grpc.aio) in a background event loop, in
front of a scripted router core reached both ways (the ``stack`` fixture runs every test twice):
``grpc``, over the real router servicer on a real gRPC port, and ``embedded``, in-process
(``--router embedded``). Tests talk to them with the official ``openai`` client and ``httpx``
from the test thread."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from pdserve.proto.v1 import router_pb2
from pdserve.server import Service, make_server
from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.embedded import EmbeddedRouter
from services.gateway.router_client import RouterApi
from services.gateway.server import GatewayServer
from services.router.servicer import RouterServicer
from tests.gateway.fake_router import FakeRouter

T = TypeVar("T")
KEY = "sk-test-key"
TEAM_KEY = "sk-team-key"


class Loop:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Stack:
    def __init__(self, loop: Loop, router: FakeRouter, router_svc: Service,
                 gateways: dict[str, GatewayServer]) -> None:
        self.loop, self.router, self.router_svc, self.gateways = loop, router, router_svc, gateways
        self.router_address = f"127.0.0.1:{router_svc.port}"

    def url(self, name: str = "auth") -> str:
        return f"http://127.0.0.1:{self.gateways[name].http_port}"

    def client(self, name: str = "auth", key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(name) + "/v1", api_key=key, max_retries=0,
                             timeout=10)

    def last(self, count: int = 1) -> list[router_pb2.GenerateRequest]:
        return self.router.requests[-count:]


async def _start_router(router: FakeRouter) -> Service:
    from pdserve.proto.v1 import router_pb2_grpc

    svc = make_server("127.0.0.1", 0, [(router_pb2_grpc.add_RouterServicer_to_server,
                                        RouterServicer(router),  # type: ignore[arg-type]
                                        "pdserve.v1.Router")])
    await svc.server.start()
    await svc.set_serving(True)
    return svc


async def _start_gateway(config: GatewayConfig, router: FakeRouter | None = None
                         ) -> GatewayServer:
    """``router``: embed that core (``--router embedded``), else reach ``config.router``."""
    api: RouterApi | None = None
    if router is not None:
        config = dataclasses.replace(config, router="embedded")
        api = EmbeddedRouter(router, config.request_timeout)
    server = GatewayServer(config, KeyStore.load(config.keys_file, config.api_keys), grace=1,
                           router=api)
    await server.start()
    return server


@pytest.fixture(scope="session", params=["grpc", "embedded"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys_file = Path(tmp_path_factory.mktemp("keys")) / "keys.txt"
    keys_file.write_text(f"# team keys\n{TEAM_KEY}, team-a\n\n")
    loop = Loop()
    router = FakeRouter()
    router_svc = loop.run(_start_router(router))
    address = f"127.0.0.1:{router_svc.port}"
    dead = f"127.0.0.1:{_dead_port()}"
    configs = {
        # Keys on: the openai client's default gateway.
        "auth": GatewayConfig(port=0, router=address, keys_file=str(keys_file), api_keys=(KEY,),
                              request_timeout=10, max_choices=8, max_body_bytes=64 * 1024),
        # No keys, a short deadline and a model alias.
        "open": GatewayConfig(port=0, router=address, request_timeout=0.5, model_name="alias"),
        # Its router is not there.
        "dead": GatewayConfig(port=0, router=dead, request_timeout=2),
    }
    embedded = router if request.param == "embedded" else None
    gateways = {name: loop.run(_start_gateway(c, None if name == "dead" else embedded))
                for name, c in configs.items()}
    yield Stack(loop, router, router_svc, gateways)
    for gw in gateways.values():
        loop.run(gw.stop())
    loop.run(router_svc.server.stop(0))
    loop.close()


def _dead_port() -> int:
    from tests.conftest import free_port

    return free_port()


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url(), timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client
