"""gRPC edge of the decode service: proto <-> dataclass conversion, then delegation."""

from __future__ import annotations

from typing import Any

from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from pdserve.server import unimplemented_servicer

_WHY = "not implemented yet in this build (issue 5)"


def servicers() -> list[tuple[Any, Any, str]]:
    """(add_fn, servicer, full service name) for every service this process serves."""
    out = []
    for name in ['Decode', 'Engine']:
        desc = engine_pb2.DESCRIPTOR.services_by_name[name]
        methods = [m.name for m in desc.methods]
        base = getattr(engine_pb2_grpc, f"{name}Servicer")
        add = getattr(engine_pb2_grpc, f"add_{name}Servicer_to_server")
        out.append((add, unimplemented_servicer(base, methods, _WHY), desc.full_name))
    return out
