"""One engine service, composed by role: the role alone decides which servicers it serves.

    role        servicers
    prefill     Prefill, Engine
    decode      Decode, Engine
    colocated   Decode, Engine            (its Decode prefills the prompt itself)
    flex        Prefill, Decode, Engine   (it may switch among the three roles above; a call
                                           for a role it does not run now is refused with
                                           FAILED_PRECONDITION)

``python -m services.prefill`` and ``python -m services.decode`` are this service with their
own defaults (port, role, the roles they accept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve import auth
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from pdserve.roles import Role
from pdserve.server import Service, make_server, run_grpc_main
from services.decode.servicer import DecodeServicer
from services.engine import metrics
from services.engine.admin import EngineAdminServicer
from services.engine.config import EngineServiceConfig
from services.engine.instance import EngineInstance, create_instance
from services.prefill.servicer import PrefillServicer

_SERVICES = engine_pb2.DESCRIPTOR.services_by_name
_PREFILL = (engine_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer, "Prefill")
_DECODE = (engine_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer, "Decode")
_ADMIN = (engine_pb2_grpc.add_EngineServicer_to_server, EngineAdminServicer, "Engine")
# Admin calls need the admin credential (the router's); every other call the data one.
RULES: auth.Rules = [
    *((f"/pdserve.v1.Engine/{rpc}", auth.ADMIN) for rpc in ("Drain", "SetRole", "Abort",
                                                                 "LoadWeights")),
    *((f"/pdserve.v1.{service}/", auth.DATA) for service in ("Engine", "Prefill", "Decode")),
]
SERVICERS_BY_ROLE = {
    Role.PREFILL: (_PREFILL, _ADMIN),
    Role.DECODE: (_DECODE, _ADMIN),
    Role.COLOCATED: (_DECODE, _ADMIN),
    Role.FLEX: (_PREFILL, _DECODE, _ADMIN),
}


def servicers(instance: EngineInstance) -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this instance's role serves."""
    role = Role(instance.config.role)
    return [(add, cls(instance), _SERVICES[name].full_name)
            for add, cls, name in SERVICERS_BY_ROLE[role]]


async def create_server(config: EngineServiceConfig) -> Service:
    """Load the model, bind the port; the engine thread, kvd registration and the registry
    heartbeat start with the server (before the ready line) and stop after it."""
    instance = create_instance(config)
    svc = make_server(config.host, config.port, servicers(instance), RULES)

    async def start() -> None:
        await instance.start(svc.port)
        collector = metrics.bind(instance)  # its series are labelled with the bound address

        async def stop() -> None:
            collector.unregister()
            await instance.stop()

        svc.on_stop.append(stop)

    svc.on_start.append(start)
    return svc


def main_of(config_cls: type[EngineServiceConfig]) -> Callable[..., int]:
    """The ``main`` of an engine service whose defaults are ``config_cls``'s."""

    def main(argv: list[str] | None = None) -> int:
        return run_grpc_main(config_cls, create_server, argv)

    return main
