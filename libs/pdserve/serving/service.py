"""Build an engine service (prefill or decode): model, engine thread, servicers, hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.server import Service, make_server
from pdserve.serving.config import EngineServiceConfig
from pdserve.serving.instance import Instance, create_instance

Servicers = Callable[[Instance], list[tuple[Any, Any, str]]]


async def create_engine_service(config: EngineServiceConfig,
                                servicers: Servicers) -> tuple[Service, Instance]:
    """Load the model, bind the port; the engine thread, kvd registration and the registry
    heartbeat start with the server (before the ready line) and stop after it."""
    instance = create_instance(config)
    svc = make_server(config.host, config.port, servicers(instance))

    async def start() -> None:
        await instance.start(svc.port)

    svc.on_start.append(start)
    svc.on_stop.append(instance.stop)
    return svc, instance
