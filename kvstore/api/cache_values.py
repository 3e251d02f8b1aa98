"""The fleet's cache values, asked of each daemon over gRPC (``Admin.CacheValue``): what
`kvstore drain --plan` (blocking) and the router's ``GET /kvstore/drain-plan`` (asyncio)
rank with kvstore/scaledown.py. It loads no tier manager: the CLI and the router import it.

A daemon that does not answer within the deadline, refuses, or answers a figure that
cannot be one (another node's, a weighted value above its unique bytes) becomes a
`Standing` without a value — unknown, with the sentence why — never an exception.
"""

from __future__ import annotations

import math

import grpc

from kvstore.api.auth import bearer_metadata
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cache_value import CacheValue
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.scaledown import Standing

__all__ = ["DAEMON_KIND", "cache_value_from_proto", "daemon_standings", "ask_daemon"]

DAEMON_KIND = "kvstore"  # NodeInfo.kind of a daemon; engines' GPU caches leave with their replica's daemon


def cache_value_from_proto(response: pb.CacheValueResponse, node_id: str) -> CacheValue:
    """The answer of the daemon asked as ``node_id``; InvalidArgument for one that cannot be its figure."""
    if response.node_id != node_id:
        raise InvalidArgument(f"the daemon at its address answers as node {response.node_id!r}, not {node_id!r}.")
    if not (math.isfinite(response.value_bytes) and 0 <= response.value_bytes <= response.unique_bytes <= response.total_bytes):
        raise InvalidArgument(
            f"it reports {response.value_bytes} weighted bytes of {response.unique_bytes} unique of {response.total_bytes} in all."
        )
    return CacheValue(
        node_id=response.node_id,
        value_bytes=response.value_bytes,
        unique_bytes=response.unique_bytes,
        unique_blocks=response.unique_blocks,
        total_bytes=response.total_bytes,
        total_blocks=response.total_blocks,
        num_peers=response.num_peers,
        half_life_s=response.half_life_s,
    )


def daemon_standings(nodes: list[pb.NodeInfo], token: str | None, half_life_s: float | None, timeout_s: float) -> list[Standing]:
    """Each daemon of ``nodes`` (an Index.Nodes answer) asked in turn, each under its own
    deadline, with ``token`` (None: `kvstore.paths.token_for` its address)."""
    request = pb.CacheValueRequest(half_life_s=half_life_s or 0.0)
    standings = []
    for info in nodes:
        if info.kind != DAEMON_KIND:
            continue
        if not info.grpc_address:
            standings.append(Standing(info.node_id, error="the index lists no gRPC address for it"))
            continue
        try:
            with connect(info.grpc_address, token=token, timeout=timeout_s) as daemon:
                value = cache_value_from_proto(daemon.admin.CacheValue(request), info.node_id)
        except KVStoreError as exc:  # ApiError: no answer, a refusal; InvalidArgument: a doubtful one
            standings.append(Standing(info.node_id, info.grpc_address, error=str(exc)))
            continue
        standings.append(Standing(info.node_id, info.grpc_address, value))
    return standings


async def ask_daemon(node_id: str, address: str, token: str, half_life_s: float | None, timeout_s: float) -> Standing:
    """One daemon's standing, asked over grpc.aio under ``timeout_s``; ``token`` "": none sent."""
    if not address:
        return Standing(node_id, error="its daemon's gRPC address is not known: it is not in the index")
    metadata = bearer_metadata(token) if token else ()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            response = await pb_grpc.AdminStub(channel).CacheValue(
                pb.CacheValueRequest(half_life_s=half_life_s or 0.0), timeout=timeout_s, metadata=metadata
            )
        return Standing(node_id, address, cache_value_from_proto(response, node_id))
    except grpc.aio.AioRpcError as exc:
        return Standing(node_id, address, error=f"{exc.code().name}: {exc.details()}")
    except InvalidArgument as exc:
        return Standing(node_id, address, error=str(exc))
