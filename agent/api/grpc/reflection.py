"""Server reflection under both names clients ask for: ``grpc.reflection.v1alpha`` (what
grpcio-reflection registers) and ``grpc.reflection.v1`` (what newer grpcurl and Postman try
first; grpcio-reflection ships no v1 module).

The two protocols are one: grpc's ``reflection/v1/reflection.proto`` is the v1alpha file under
another package, with the same messages, fields and numbers, so the library's own servicer
answers both and v1 requests and responses travel in the v1alpha classes, byte for byte
(tests/system/test_startup_safety.py checks it against an independent v1 client). The v1 file is
also
added to the descriptor pool, derived from the v1alpha one, so that ``describe`` works on it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

log = logging.getLogger(__name__)

V1ALPHA_SERVICE: Final = reflection.SERVICE_NAME
V1_PACKAGE: Final = "grpc.reflection.v1"
V1_SERVICE: Final = f"{V1_PACKAGE}.ServerReflection"
V1_FILE: Final = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PACKAGE: Final = reflection_pb2.DESCRIPTOR.package


def _register_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 reflection file to `pool` unless some module already defined its service."""
    try:
        pool.FindServiceByName(V1_SERVICE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    proto.ClearField("options")  # v1alpha's Java package names
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.AddSerializedFile(proto.SerializeToString())


def enable(server: grpc.aio.Server, services: Sequence[str]) -> None:
    """Serve reflection (v1alpha and v1) on `server`, listing `services` and both reflection
    services."""
    pool = descriptor_pool.Default()
    _register_v1_file(pool)
    names = (*services, V1ALPHA_SERVICE, V1_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),)
    )
