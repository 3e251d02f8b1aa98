"""The chaos run's end-of-run checks, through each daemon's public APIs.

Leaked slots (every engine has exited, nothing is in flight). For each daemon, once
Admin.Stats reports no reservations, leases or sessions (or a timeout passes), and for
each tier t of it:

    used_slots(t)   = TierStats.used_bytes(t) / slot_bytes(t)
    listed(t)       = blocks Admin.ListBlocks reports in tier t
    leaked(t)       = max(0, used_slots(t) - listed(t))
    phantom(t)      = max(0, listed(t) - used_slots(t))

where slot_bytes is what one block of the run's only namespace takes: its bytes rounded
up to 4 KiB in the host tier, plus the 4 KiB slot trailer in the NVMe tier. Every slot in
use must belong to a catalogued block (leaked = 0) and every catalogued block must own a
slot (phantom = 0). Reservations, leases and sessions still open are reported as
``leftover_owners``, and TierStats.num_blocks (the tier's own count of slots in use) is
reported beside used_slots as a cross-check.

Lost blocks: the blocks ListBlocks shows before a clean stop (SIGTERM: the daemon moves
host blocks to NVMe) that it no longer shows after the restart.

Final verification: every block listed after the restart is loaded once through the
engine client and checked byte for byte. A listed block that does not load is
``unreadable``; one whose NVMe payload the driver corrupted is expected to be dropped
that way, any other is counted as lost.

The checker check: before the run, a block whose bytes are damaged in the host slab
(where nothing verifies them) must be caught by the same check the engines use.

Refused peer connections: each daemon's metric
``kvstore_peer_refused_connections_total{reason}``, scraped from its metrics endpoint
while it runs. A daemon's counters start at 0 with each life, so ``RefusalTally`` keeps
the last figures seen in each life and adds the lives up; refusals a daemon counted
after its last scrape before a SIGKILL are not seen (the figures are a lower bound).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections import Counter

import torch

from bench.chaos_workload import BLOCK_BYTES, NAMESPACE, content_digest, expected_bytes, scratch_chain, wrong_bytes
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.tiers.nvme_format import TRAILER_BYTES
from kvstore.tiers.slab import round_up

__all__ = [
    "SLOT_BYTES",
    "RefusalTally",
    "list_blocks",
    "stats",
    "slot_audit",
    "verify_blocks",
    "checker_self_test",
    "refused_connections",
]

SLOT_BYTES = {pb.TIER_HOST: round_up(BLOCK_BYTES, 4096), pb.TIER_NVME: round_up(BLOCK_BYTES, 4096) + TRAILER_BYTES}
TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme"}
_REFUSED = re.compile(r'^kvstore_peer_refused_connections_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$')


def list_blocks(address: str) -> list[pb.BlockInfo]:
    blocks: list[pb.BlockInfo] = []
    token = ""
    with connect(address, timeout=30) as api:
        while True:
            page = api.admin.ListBlocks(pb.ListBlocksRequest(page_size=10_000, page_token=token))
            blocks.extend(page.blocks)
            token = page.next_page_token
            if not token:
                return blocks


def stats(address: str) -> pb.StatsResponse:
    with connect(address, timeout=30) as api:
        return api.admin.Stats(pb.StatsRequest())


def slot_audit(address: str, quiet_timeout_s: float) -> dict:
    """Slots in use against catalogued blocks, per tier (formula in the module docstring)."""
    deadline = time.monotonic() + quiet_timeout_s
    while True:
        response = stats(address)
        owners = response.num_reservations + response.num_leases + response.num_sessions
        if owners == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    blocks = list_blocks(address)
    listed = Counter(b.tier for b in blocks)
    after = stats(address)  # nothing moves while nobody calls: the same state as the listing
    tiers = []
    for tier in after.tiers:
        slot_bytes = SLOT_BYTES.get(tier.tier)
        used_slots = tier.used_bytes // slot_bytes if slot_bytes else 0
        tiers.append(
            {
                "tier": TIER_NAMES.get(tier.tier, str(tier.tier)),
                "used_bytes": tier.used_bytes,
                "slot_bytes": slot_bytes,
                "used_slots": used_slots,
                "uneven_bytes": tier.used_bytes % slot_bytes if slot_bytes else tier.used_bytes,
                "tier_num_blocks": tier.num_blocks,
                "listed": listed.get(tier.tier, 0),
                "leaked": max(0, used_slots - listed.get(tier.tier, 0)),
                "phantom": max(0, listed.get(tier.tier, 0) - used_slots),
            }
        )
    return {
        "reservations": after.num_reservations,
        "leases": after.num_leases,
        "sessions": after.num_sessions,
        "leftover_owners": after.num_reservations + after.num_leases + after.num_sessions,
        "leased_blocks": sum(1 for b in blocks if b.leases),
        "leaked_slots": sum(t["leaked"] for t in tiers),
        "phantom_blocks": sum(t["phantom"] for t in tiers),
        "tiers": tiers,
    }


def verify_blocks(socket: str, hashes: list[bytes], batch: int = 64) -> dict:
    """Load each of ``hashes`` once (in batches; a block that does not load ends its batch's
    prefix and is recorded as unreadable) and check every loaded byte."""
    checked = wrong_total = 0
    unreadable: list[bytes] = []
    wrong_blocks: list[dict] = []
    buffers = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(batch)]
    with KVStoreClient(socket, timeout_s=60) as client:
        digest = client.register_namespace(NAMESPACE)
        position = 0
        while position < len(hashes):
            part = hashes[position : position + batch]
            for buffer in buffers:
                buffer.zero_()
            loaded = client.load(digest, part, buffers[: len(part)])
            for index in range(loaded):
                actual = buffers[index].numpy()
                wrong = wrong_bytes(actual, part[index])
                checked += 1
                wrong_total += wrong
                if wrong:
                    wrong_blocks.append({"block": part[index].hex(), "wrong": wrong, "digest": content_digest(actual)})
            position += loaded
            if loaded < len(part):
                unreadable.append(part[loaded])
                position += 1
    return {"checked_blocks": checked, "wrong_bytes": wrong_total, "wrong_blocks": wrong_blocks, "unreadable": unreadable}


def checker_self_test(socket: str, address: str) -> dict:
    """Damage one byte of a stored block in the host slab, where kvstore does not look, and
    load it: the check must count exactly that byte, unless kvstore itself refused the
    block (a store that verifies host blocks); loaded with no wrong byte counted means the
    harness cannot see damage. The blocks are evicted afterwards."""
    hashes = scratch_chain(engine_id=9_999, incarnation=0, serial=0, num_blocks=2)
    with KVStoreClient(socket, timeout_s=30) as client:
        digest = client.register_namespace(NAMESPACE)
        client.save(digest, hashes, [torch.from_numpy(expected_bytes(h).copy()) for h in hashes])
        with client.reading(digest, hashes) as views:
            leased = len(views)
            if leased == 2:
                views[1].numpy()[1234] ^= 0x10
        into = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in hashes]
        loaded = client.load(digest, hashes, into)
        wrong = sum(wrong_bytes(into[i].numpy(), hashes[i]) for i in range(loaded))
    with connect(address) as api:
        api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
    detected = leased == 2 and (wrong == 1 or loaded < 2)
    return {"leased": leased, "loaded": loaded, "wrong_bytes_seen": wrong, "detected": detected}


def refused_connections(metrics_port: int, timeout_s: float = 1.0) -> dict[str, int]:
    """A daemon's refused peer connections by reason, from its metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    found = (_REFUSED.match(line) for line in text.splitlines())
    return {match[1]: int(float(match[2])) for match in found if match}


class RefusalTally:
    """Refused connections per daemon and reason, added up over the daemons' lives: the
    last figures seen in each life count. Owner: the driver's thread."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], dict[str, int]] = {}  # (daemon, life) -> reason -> count
        self.failed_scrapes = 0

    def scrape(self, daemon: str, life: int, metrics_port: int | None) -> None:
        if not metrics_port:
            return
        try:
            self._last[(daemon, life)] = refused_connections(metrics_port)
        except OSError:
            self.failed_scrapes += 1  # stopped, or going down: the figures of an earlier scrape stand

    def totals(self) -> dict[str, dict[str, int]]:
        """daemon -> reason -> refusals over every life seen."""
        totals: dict[str, dict[str, int]] = {}
        for (daemon, _), counts in sorted(self._last.items()):
            into = totals.setdefault(daemon, {})
            for reason, count in counts.items():
                into[reason] = into.get(reason, 0) + count
        return totals
