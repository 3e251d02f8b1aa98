"""The daemon's gRPC server: the kvstore.v1 services, health checking and reflection.

The daemon calls ``create_grpc_server`` on its event loop (the loop that owns the Node),
then ``await server.start()``; on shutdown ``await server.stop(grace)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.api.auth import BearerTokenInterceptor
from kvstore.api.servicers import AdminServicer, IndexServicer, StoreServicer
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError
from kvstore.node import Limits, Node
from kvstore.prefetch import Prefetcher
from kvstore.router import Router
from kvstore.transfers.service import TransferService

__all__ = ["create_grpc_server", "KVSTORE_SERVICES", "message_limit_bytes"]

KVSTORE_SERVICES: tuple[str, ...] = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())

_HEADROOM_BYTES = 16 * 1024 * 1024
_VARINT_UINT32_BYTES = 5
_HASH_FIELD_BYTES = 18  # 16 bytes plus tag and length


def message_limit_bytes(limits: Limits) -> int:
    """The largest message a request within ``limits`` (or its answer) can need."""
    largest = max(
        limits.max_inline_bytes,
        limits.max_tokens_per_request * _VARINT_UINT32_BYTES,
        limits.max_blocks_per_request * _HASH_FIELD_BYTES,
    )
    return largest + _HEADROOM_BYTES


class _Health(health.aio.HealthServicer):
    """The standard async health servicer, with kvstore's services SERVING from the start,
    and every service NOT_SERVING while the node names a problem (``Node.problems``)."""

    def __init__(self, services: tuple[str, ...], node: Node) -> None:
        super().__init__()
        self._node = node
        # the public setter is a coroutine and this is built synchronously; before the
        # server starts no Watch can be waiting, so filling the table is all `set` would do
        for service in services:
            self._server_status[service] = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if self._node.problems and request.service in self._server_status:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return await super().Check(request, context)


def _add_service(server: grpc.aio.Server, name: str, servicer: object) -> None:
    """Serve the kvstore.v1 service ``name`` by ``servicer``, as the generated
    ``add_<name>Servicer_to_server`` would, except that each method parses its request
    itself: a body that is not its message is INVALID_ARGUMENT with a sentence, where
    grpc's own deserializer would answer UNKNOWN and log a traceback for every one."""
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            _parsing(getattr(servicer, method.name), getattr(pb, method.input_type.name), f"{name}.{method.name}"),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _parsing(behavior: Callable[..., Awaitable[Message]], request_type: type[Message], rpc: str) -> Callable[..., Awaitable[Message]]:
    async def serve(body: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            request = request_type.FromString(body)
        except DecodeError:
            sentence = f"the {rpc} request does not parse as a {request_type.DESCRIPTOR.full_name} message; encode it from kvstore.proto."
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, sentence)
        return await behavior(request, context)

    return serve


def create_grpc_server(
    node: Node,
    router: Router,
    config: ServerConfig,
    transfers: TransferService | None = None,
    more_counters: Callable[[], dict[str, int]] = dict,
    prefetcher: Prefetcher | None = None,
) -> tuple[grpc.aio.Server, int]:
    """An aio server bound to ``config.grpc_address`` (port 0: a free port), not started;
    ``Admin.Stats`` adds ``more_counters()`` to the node's (the engines' subscriptions');
    ``Admin.Prefetch`` runs its prefetches in ``prefetcher`` (one of its own if None).

    Returns the server and the port it is bound to. Must be called on the event loop that
    owns ``node``: the servicers call it directly.
    """
    limit = message_limit_bytes(node.limits)
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    _add_service(server, "Store", StoreServicer(node))
    _add_service(server, "Index", IndexServicer(node, router))
    _add_service(server, "Admin", AdminServicer(node, router, transfers, more_counters, prefetcher, config.cache_value_half_life_s))
    health_pb2_grpc.add_HealthServicer_to_server(_Health(KVSTORE_SERVICES, node), server)
    reflection.enable_server_reflection((*KVSTORE_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(config.grpc_address)
    except RuntimeError as exc:
        raise KVStoreError(
            f"cannot listen for gRPC on {config.grpc_address}: {exc}; another process may hold the port "
            "(set server.grpc_port, or 0 for a free one)."
        ) from exc
    if port == 0:
        raise KVStoreError(
            f"cannot listen for gRPC on {config.grpc_address}; another process may hold the port "
            "(set server.grpc_port, or 0 for a free one)."
        )
    return server, port
