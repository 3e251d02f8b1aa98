"""A blocking client of a daemon's kvstore.v1 API, for the CLI and tools.

    with connect("127.0.0.1:50551") as client:
        stats = client.admin.Stats(pb.StatsRequest())

The stubs are the generated ones; every call carries the bearer token and a default
deadline. Without a token given, it is ``$KVSTORE_TOKEN``, else, for a daemon on this
host, the one a daemon of this user generated (kvstore/paths.py: ``token_for``);
``token=""`` sends none, and a failed call raises ``ApiError`` — a KVStoreError
whose message is the server's sentence — instead of ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.api.auth import bearer_metadata
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError
from kvstore.paths import token_for

__all__ = ["ApiError", "Client", "connect", "MAX_MESSAGE_BYTES"]

# above the server's own limit for its default Limits, so the server's sentence wins
MAX_MESSAGE_BYTES = 128 * 1024 * 1024


class ApiError(KVStoreError):
    """A call to a daemon failed; ``code`` is the gRPC status name (e.g. ``"NOT_FOUND"``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def connect(address: str, token: str | None = None, timeout: float = 10.0) -> Client:
    """A client of the daemon at ``address`` (``host:port``). Connects lazily: an
    unreachable daemon shows as an ApiError with code UNAVAILABLE on the first call."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}.")
    if token is None:
        token = token_for(address)
    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    boundary = _Boundary(address, bearer_metadata(token) if token else (), timeout)
    return Client(address, channel, grpc.intercept_channel(channel, boundary))


class Client:
    def __init__(self, address: str, raw_channel: grpc.Channel, channel: grpc.Channel) -> None:
        self.address = address
        self._raw_channel = raw_channel
        self.channel = channel
        self.store = pb_grpc.StoreStub(channel)
        self.index = pb_grpc.IndexStub(channel)
        self.admin = pb_grpc.AdminStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    def health(self, service: str = "") -> str:
        """The serving status of ``service`` ("" for the daemon), e.g. ``"SERVING"``."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._raw_channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _Boundary(grpc.UnaryUnaryClientInterceptor):
    """Adds credentials and a default deadline; turns RpcError into ApiError."""

    def __init__(self, address: str, metadata: tuple[tuple[str, str], ...], timeout: float) -> None:
        self._address = address
        self._metadata = metadata
        self._timeout = timeout

    def intercept_unary_unary(self, continuation: Callable, client_call_details: grpc.ClientCallDetails, request: Any):
        details = client_call_details
        timeout = self._timeout if details.timeout is None else details.timeout
        call_details = _CallDetails(
            details.method,
            timeout,
            tuple(details.metadata or ()) + self._metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )
        outcome = continuation(call_details, request)
        error = outcome.exception()
        if isinstance(error, grpc.RpcError):
            raise _translated(error, self._address, timeout) from error
        return outcome


def _translated(error: grpc.RpcError, address: str, timeout: float) -> ApiError:
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"kvstore at {address} did not answer within {timeout:g} s; is the daemon running and reachable?"
    elif code == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
        message = f"cannot reach kvstore at {address} ({details}); is the daemon running and listening there?"
    elif code == grpc.StatusCode.UNAVAILABLE:
        message = f"kvstore at {address} is unavailable: {details}"
    else:
        message = details or f"the call to {address} failed with {code.name}."
    return ApiError(code.name, message)
