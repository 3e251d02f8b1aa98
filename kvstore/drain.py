"""Drain (before a node leaves) and warm-up (when a node joins), over the transport.

Drain: pick this node's most valuable chains (kvstore/chains.py), ask each live peer how
much room it has, push each chain to the peer with the most room left, then point the
sessions that stuck to this node at the peer that took the most, so their next turn lands
where their prefix now is. Peers publish what they stored to the index themselves (the
blocks arrive through their tier managers like any save). Requests keep being served
here meanwhile: a drain copies, it never removes.

Warm-up: ask peers for their hottest shared prefixes (system prompts, tool definitions)
and fetch them, so a new node's first requests are not all cold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstore.chains import describable, drain_plan
from kvstore.errors import KVStoreError, NotFound
from kvstore.index.base import Index, NodeInfo, SessionStore
from kvstore.transfers.service import TransferService

__all__ = ["MoveReport", "drain", "warm"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MoveReport:
    moved_blocks: int = 0
    moved_bytes: int = 0
    remaining_blocks: int = 0  # chosen but not moved (no room, peer failed)
    sessions_moved: int = 0
    blocks_by_peer: dict[str, int] = field(default_factory=dict)


async def _peers(index: Index, self_id: str, only: set[str] | None) -> list[NodeInfo]:
    peers = [
        n for n in await index.nodes()
        if n.node_id != self_id and n.transport_address and (not only or n.node_id in only)
    ]  # fmt: skip
    if not peers:
        which = f" among {sorted(only)}" if only else ""
        raise NotFound(f"no live peer with a transport address{which} is in the index; start one or name a target.")
    return peers


async def drain(
    service: TransferService, index: Index, sessions: SessionStore, targets: list[str] | None = None, max_bytes: int = 0
) -> MoveReport:
    node, manager = service.node, service.manager
    peers = await _peers(index, node.node_id, set(targets or ()))
    room: dict[str, int] = {}
    for peer in peers:
        try:
            room[peer.node_id] = await service.capacity(peer.transport_address)
        except KVStoreError as exc:
            logger.warning("drain: peer %s is unreachable: %s", peer.node_id, exc)
    addresses = {p.node_id: p.transport_address for p in peers}
    namespaces = manager.namespaces()
    chains = drain_plan(describable(manager.blocks(), namespaces), max_bytes)
    report = MoveReport()
    for chain in chains:
        peer_id = max(room, key=room.__getitem__, default=None)
        if peer_id is None or room[peer_id] < chain.nbytes:
            report.remaining_blocks += chain.num_blocks
            continue
        try:
            stored = await service.push_chain(addresses[peer_id], namespaces[chain.namespace], chain.hashes, chain.parent)
        except KVStoreError as exc:
            logger.warning("drain: pushing %d blocks to %s failed: %s", chain.num_blocks, peer_id, exc)
            room.pop(peer_id)
            report.remaining_blocks += chain.num_blocks
            continue
        room[peer_id] -= chain.nbytes
        report.moved_blocks += stored
        report.moved_bytes += stored * (chain.nbytes // chain.num_blocks)
        report.remaining_blocks += chain.num_blocks - stored
        report.blocks_by_peer[peer_id] = report.blocks_by_peer.get(peer_id, 0) + stored
    heir = max(report.blocks_by_peer, key=report.blocks_by_peer.__getitem__, default=None) or next(iter(room), None)
    if heir is not None:
        report.sessions_moved = await sessions.reassign(node.node_id, heir, "drain")
    logger.info(
        "drain: moved %d blocks (%d bytes) to %s; %d sessions to %s",
        report.moved_blocks,
        report.moved_bytes,
        report.blocks_by_peer,
        report.sessions_moved,
        heir,
    )
    return report


async def warm(service: TransferService, index: Index, sources: list[str] | None = None, max_bytes: int = 0) -> MoveReport:
    node = service.node
    report = MoveReport()
    for peer in await _peers(index, node.node_id, set(sources or ())):
        budget = max_bytes - report.moved_bytes if max_bytes else 0
        if max_bytes and budget <= 0:
            break
        try:
            chains = await service.hot_chains(peer.transport_address, budget)
        except KVStoreError as exc:
            logger.warning("warm: peer %s is unreachable: %s", peer.node_id, exc)
            continue
        for namespace, parent, hashes in chains:
            try:
                with node.peer_namespace(namespace) as digest:  # a peer named it: it counts against the peers' share
                    stored = await service.fetch_from(peer.transport_address, digest, hashes, parent, service.config.handoff_timeout_s)
            except KVStoreError as exc:
                logger.warning("warm: fetching %d blocks from %s failed: %s", len(hashes), peer.node_id, exc)
                report.remaining_blocks += len(hashes)
                continue
            report.moved_blocks += stored
            report.moved_bytes += stored * namespace.block_bytes
            report.remaining_blocks += len(hashes) - stored
            report.blocks_by_peer[peer.node_id] = report.blocks_by_peer.get(peer.node_id, 0) + stored
    return report
