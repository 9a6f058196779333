"""Server reflection under both protocol versions: ``grpc.reflection.v1`` (asked first by
current grpcurl, grpcui and Postman) and ``grpc.reflection.v1alpha`` (older tools).

grpcio-reflection ships only v1alpha. v1 is the same protocol under a new package name (the
messages are field for field the same), so its descriptor is v1alpha's renamed, added to the
default pool (``describe grpc.reflection.v1.ServerReflection`` works), and one servicer answers
both names.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_OLD, _NEW = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto, renamed to v1 (file, package and type references)."""
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(_OLD, _NEW)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_OLD, _NEW)
            method.output_type = method.output_type.replace(_OLD, _NEW)
    return fdp


def _ensure_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)  # a later grpcio-reflection may ship it
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection (v1 and v1alpha) on ``server`` for ``service_names`` (full names),
    themselves included in the listing."""
    _ensure_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer([*service_names, V1, V1ALPHA])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, handlers),))
