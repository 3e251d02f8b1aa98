"""Optional bearer-token authentication for the gRPC server.

With ``server.auth_token`` set, every call must carry ``authorization: Bearer <token>``;
health checks and reflection stay open so that load balancers and tools such as
grpcurl can probe a daemon without holding its secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

__all__ = ["BearerTokenInterceptor", "OPEN_SERVICE_PREFIXES", "bearer_metadata"]

OPEN_SERVICE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_SCHEME = "bearer "


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client attaches to be let in."""
    return (("authorization", f"Bearer {token}"),)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("a bearer-token interceptor needs a non-empty token.")
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_SERVICE_PREFIXES):
            return handler
        problem = self._problem(handler_call_details.invocation_metadata or ())
        if problem is None:
            return handler
        return _refusal(handler, f"{method} needs authentication: {problem}")

    def _problem(self, metadata) -> str | None:
        """Why the call's credentials are refused, or None when they are accepted."""
        values = [value for key, value in metadata if key == "authorization"]
        if not values:
            return "the call carried no authorization metadata; pass the daemon's token (KVSTORE_TOKEN)."
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if len(values) > 1 or not value.lower().startswith(_SCHEME):
            return "the authorization metadata must be exactly one 'Bearer <token>'."
        offered = value[len(_SCHEME) :].strip().encode()
        # compare_digest takes as long for a near miss as for a wild guess
        if not hmac.compare_digest(offered, self._expected):
            return "the bearer token is not this daemon's token."
        return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable; makes this an async generator, as streaming handlers are

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)
