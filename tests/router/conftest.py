"""Router test fixtures: fake engines on loopback and a real router server in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from pdserve.proto.v1 import router_pb2, router_pb2_grpc
from services.router.__main__ import create_server
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.model import ModelSpec, load_model_spec
from tests.router.fakes import FakeEngine


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return load_model_spec("tiny")


@dataclass
class Cluster:
    spec: ModelSpec
    engines: list[FakeEngine] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)

    async def engine(self, name: str, role: str, **kwargs: Any) -> FakeEngine:
        e = await FakeEngine(name, role, **kwargs).start()
        self.engines.append(e)
        return e

    async def router(self, prefill: Sequence[FakeEngine] = (), decode: Sequence[FakeEngine] = (),
                     index: Any = None, **config: Any) -> tuple[Router, RouterClient]:
        config.setdefault("poll_interval", 30.0)  # tests poll by hand: deterministic
        cfg = RouterConfig(port=0, prefill=tuple(e.address for e in prefill),
                           decode=tuple(e.address for e in decode), **config)
        svc = await create_server(cfg, model=self.spec, index=index)
        await svc.server.start()
        for hook in svc.on_start:
            await hook()
        router: Router = svc.on_start[0].__self__  # type: ignore[attr-defined]
        # A check waits for a connection (wait_for_ready) up to max(2 s, poll_interval): with
        # the 30 s above a stopped engine's check took 30 s. Judge it in 2 s, as at the
        # default 1 s poll interval.
        router.pool.check_timeout = 2.0
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}")

        async def close() -> None:
            await channel.close()
            await svc.server.stop(0)
            for hook in svc.on_stop:
                await hook()

        self.closers.append(close)
        return router, RouterClient(router_pb2_grpc.RouterStub(channel))


@dataclass
class RouterClient:
    stub: router_pb2_grpc.RouterStub

    async def generate(self, prompt: str = "", ids: Sequence[int] = (), max_tokens: int = 8,
                       timeout: float | None = 10.0, metadata: Any = None,
                       **meta: Any) -> list[router_pb2.GenerateResponse]:
        call = self.stub.Generate(request(prompt, ids, max_tokens, **meta), timeout=timeout,
                                  metadata=metadata)
        return [m async for m in call]


def request(prompt: str = "", ids: Sequence[int] = (), max_tokens: int = 8,
            **meta: Any) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(model="tiny")
    if ids:
        req.prompt_token_ids.ids.extend(ids)
    else:
        req.prompt = prompt
    req.sampling.max_tokens = max_tokens
    for key, value in meta.items():
        setattr(req.meta, key, value)
    return req


@pytest.fixture
async def cluster(tiny_spec: ModelSpec) -> AsyncIterator[Cluster]:
    c = Cluster(tiny_spec)
    yield c
    for close in reversed(c.closers):
        await close()
    for e in c.engines:
        await e.stop()
