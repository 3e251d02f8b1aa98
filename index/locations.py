"""Block locations: which node holds which block of which namespace, in which tier.

The pure core of the embedded index (DESIGN.md §10): synchronous, single-owner, no I/O.

Layout. Each namespace has one table that maps a 128-bit block hash to a row; a row holds
4 bits per node slot, 16 slots per uint64 word: 0 when the node lacks the block, else
1 + the rank of the tier it holds it in (a node keeps a block in one tier at a time,
tiers/manager.py). Matching a chain therefore resolves every block once, whatever the
number of nodes, and reads every node's answer out of the same gathered rows.

The table is 3-choice cuckoo hashing over numpy arrays, not a dict: a dict lookup of a
fresh 16-byte key costs ~100 ns at a million keys (cache misses taken one at a time, in
Python), so an 8,192-block chain alone would eat the 1 ms budget; numpy gathers resolve
the same chain in a few C loops whose misses overlap. A block hash is already uniform
(XXH3), so its bits index the table directly. Rows live at their table position and move
with their key; nothing outside a table holds a row number.

Node slots are handed out on `add_node` and given back on `remove_node` in O(1): the old
node's nibbles stay behind ("dirty" slot) and are invisible because no node maps to the
slot. A dirty slot is scrubbed — its nibbles zeroed in every table, emptied rows freed —
before it is handed out again (so a new node never inherits blocks), or by `sweep`.

Owner: whoever holds the EmbeddedIndex (the daemon's event loop); not thread-safe.
"""

from __future__ import annotations

import heapq
import operator
import random
from collections.abc import Collection, Sequence

import numpy as np

from kvstore.errors import CapacityExhausted, InvalidArgument, NotFound
from kvstore.events import AllBlocksCleared, BlockEvent, BlockMoved, BlockRemoved, BlockStored
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.index.base import NodeMatch
from kvstore.tier_kind import TierKind

__all__ = ["BlockLocations", "SLOTS_PER_WORD", "MAX_NODES"]

SLOTS_PER_WORD = 16
MAX_NODES = 1024
_TIER_OF_CODE: tuple[TierKind, ...] = (TierKind.GPU, *sorted(TierKind, key=lambda kind: kind.rank))  # [0] unused
_CODE_OF_TIER = {kind: kind.rank + 1 for kind in TierKind}
_NIBBLE = np.uint64(15)
_ZERO_HASH = bytes(HASH_BYTES)
_MIN_CAPACITY = 1024
_MAX_LOAD = 0.75  # 3-choice cuckoo fills to ~0.91 before inserts start failing
_MAX_KICKS = 500
_MAX_RUNS = 16  # beyond this many tier changes, a match's tuple is built block by block


def _split_hashes(hashes: Sequence[BlockHash]) -> tuple[np.ndarray, np.ndarray]:
    """Both 64-bit halves of every hash, as two uint64 arrays."""
    try:
        joined = b"".join(hashes)
    except TypeError as exc:
        raise InvalidArgument("block hashes must be bytes.") from exc
    if len(joined) != HASH_BYTES * len(hashes):
        raise InvalidArgument(f"every block hash is {HASH_BYTES} bytes; the chain given has one of another length.")
    halves = np.frombuffer(joined, dtype=np.uint64).reshape(-1, 2).T
    return halves[1].copy(), halves[0].copy()  # contiguous: every later pass is faster


class _Table:
    """One namespace's hash → row map (3-choice cuckoo hashing, one key per position).

    ``entries[p]`` is [lo, hi, code words…]: the key and its codes share a cache line, so
    a probe that finds the key has fetched the codes too.
    """

    __slots__ = ("entries", "used", "num_used", "_mask", "_rng")

    def __init__(self, capacity: int, num_words: int) -> None:
        self._reset(capacity, num_words)

    def _reset(self, capacity: int, num_words: int) -> None:
        if capacity > 2**32:
            raise CapacityExhausted("a namespace of the embedded index holds at most 2**32 block positions.")
        self.entries = np.zeros((capacity, 2 + num_words), np.uint64)
        self.used = np.zeros(capacity, np.bool_)
        self.num_used = 0
        self._mask = np.uint64(capacity - 1)
        self._rng = random.Random(capacity)  # kicks are reproducible run to run

    @property
    def capacity(self) -> int:
        return len(self.used)

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes + self.used.nbytes

    def _position(self, choice: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # capacity <= 2**32, so the three choices come from disjoint bits of the hash
        if choice == 0:
            return (lo & self._mask).view(np.intp)
        if choice == 1:
            return ((lo >> np.uint64(32)) & self._mask).view(np.intp)
        return (hi & self._mask).view(np.intp)

    def find(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The position of each hash (-1 where absent) and its code words (meaningless
        where absent): a match needs the codes of the rows it has just probed."""
        position = self._position(0, lo, hi)
        probed = self.entries.take(position, axis=0)
        hit = (probed[:, 0] == lo) & (probed[:, 1] == hi)
        found = np.where(hit, position, -1)
        pending = np.flatnonzero(~hit)
        if pending.size:  # three keys in four sit at their first choice: probe only the rest
            lo, hi = lo[pending], hi[pending]
            second, third = self._position(1, lo, hi), self._position(2, lo, hi)
            probed_second, probed_third = self.entries.take(second, axis=0), self.entries.take(third, axis=0)
            in_second = (probed_second[:, 0] == lo) & (probed_second[:, 1] == hi)
            in_third = (probed_third[:, 0] == lo) & (probed_third[:, 1] == hi)
            found[pending] = np.where(in_second, second, np.where(in_third, third, -1))
            probed[pending] = np.where(in_second[:, None], probed_second, probed_third)
        return found, probed[:, 2:]

    def insert(self, lo: np.ndarray, hi: np.ndarray, codes: np.ndarray) -> None:
        """Add distinct hashes that are not in the table, with their code words."""
        needed = self.num_used + len(lo)
        if needed > _MAX_LOAD * self.capacity:
            capacity = self.capacity
            while needed > _MAX_LOAD * capacity:
                capacity *= 2
            self._rehash(capacity)
        leftover = self._place(np.column_stack((lo, hi, codes)))
        if leftover is not None:
            self._rehash(self.capacity * 2, leftover)

    def _rehash(self, capacity: int, extra: np.ndarray | None = None) -> None:
        entries = self.entries[self.used]
        if extra is not None:
            entries = np.concatenate((entries, extra))
        while True:
            self._reset(capacity, entries.shape[1] - 2)
            if self._place(entries) is None:
                return
            if capacity >= 4 * max(_MIN_CAPACITY, len(entries) / _MAX_LOAD):
                # only crafted keys get here; the few left homeless are dropped (the index is advisory)
                raise InvalidArgument("block hashes collide far beyond chance; publish kvstore chain hashes (XXH3), not arbitrary bytes.")
            capacity *= 2

    def _place(self, entries: np.ndarray) -> np.ndarray | None:
        """Write new entries into free positions; those that find none after kicking are
        returned."""
        lo, hi = entries[:, 0], entries[:, 1]
        placed = np.zeros(len(entries), np.bool_)
        pending = np.arange(len(entries))
        for _round in range(3):
            for choice in range(3):
                if not pending.size:
                    return None
                position = self._position(choice, lo[pending], hi[pending])
                free = ~self.used[position]
                positions, first = np.unique(position[free], return_index=True)
                winners = pending[free][first]
                self._write(positions, entries[winners])
                placed[winners] = True
                pending = pending[~placed[pending]]
        for index, item in enumerate(pending.tolist()):
            homeless = self._kick_in(entries[item].copy())
            if homeless is not None:
                return np.concatenate((homeless[None, :], entries[pending[index + 1 :]]))
        return None

    def _kick_in(self, entry: np.ndarray) -> np.ndarray | None:
        """Cuckoo insertion of one entry: None once placed, else the entry left homeless."""
        mask = int(self._mask)
        for _kick in range(_MAX_KICKS):
            lo, hi = int(entry[0]), int(entry[1])
            choices = (lo & mask, (lo >> 32) & mask, hi & mask)
            for position in choices:
                if not self.used[position]:
                    self._write(position, entry)
                    return None
            position = choices[self._rng.randrange(3)]
            evicted = self.entries[position].copy()
            self.entries[position] = entry
            entry = evicted
        return entry

    def _write(self, positions, entries: np.ndarray) -> None:
        self.entries[positions] = entries
        self.used[positions] = True
        self.num_used += np.size(positions)

    def release_empty(self, positions: np.ndarray | None = None) -> int:
        """Free the rows (of ``positions``, distinct, else all) that no slot holds any more."""
        if positions is None:
            positions = np.flatnonzero(self.used)
        empty = positions[~self.entries[positions, 2:].any(axis=1)]
        self.entries[empty] = 0
        self.used[empty] = False
        self.num_used -= len(empty)
        if self.capacity > _MIN_CAPACITY and self.num_used < self.capacity // 8:
            capacity = self.capacity // 2
            while capacity > _MIN_CAPACITY and self.num_used < capacity // 4:
                capacity //= 2
            self._rehash(capacity)
        return len(empty)

    def widen(self, num_words: int) -> None:
        extra = np.zeros((self.capacity, 2 + num_words - self.entries.shape[1]), np.uint64)
        self.entries = np.concatenate((self.entries, extra), axis=1)


class BlockLocations:
    """Every node's blocks, per namespace and tier; answers longest-prefix matches."""

    def __init__(self, max_nodes: int = 64) -> None:
        if not 1 <= max_nodes <= MAX_NODES:
            raise InvalidArgument(f"max_nodes must lie in [1, {MAX_NODES}], got {max_nodes}.")
        self.max_nodes = max_nodes
        self._num_words = 1  # grows a word (16 slots) at a time, only when live nodes need it
        self._tables: dict[bytes, _Table] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = list(range(min(SLOTS_PER_WORD, max_nodes)))  # a heap: lowest first
        self._dirty_slots: set[int] = set()

    # -- nodes ---------------------------------------------------------------------------

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._slot_of

    def add_node(self, node_id: str) -> None:
        """Start tracking a node, holding nothing."""
        if node_id in self._slot_of:
            raise InvalidArgument(f"node {node_id!r} is already tracked; remove it first to start it empty.")
        self._slot_of[node_id] = self._acquire_slot()

    def remove_node(self, node_id: str) -> None:
        """Forget a node and every block it held, in O(1); unknown nodes are ignored."""
        slot = self._slot_of.pop(node_id, None)
        if slot is not None:
            self._dirty_slots.add(slot)

    def clear_node(self, node_id: str) -> None:
        """The node holds nothing any more (it stays tracked)."""
        self.remove_node(node_id)
        self.add_node(node_id)

    def _acquire_slot(self) -> int:
        # scrubbing costs one pass over every table, widening costs 8 bytes per row for good
        if not self._free_slots and self._dirty_slots:
            self.sweep()
        if not self._free_slots and self._num_words * SLOTS_PER_WORD < self.max_nodes:
            first = self._num_words * SLOTS_PER_WORD
            self._num_words += 1
            for table in self._tables.values():
                table.widen(self._num_words)
            self._free_slots = list(range(first, min(first + SLOTS_PER_WORD, self.max_nodes)))
        if not self._free_slots:
            raise CapacityExhausted(f"the embedded index tracks at most {self.max_nodes} nodes; raise max_nodes or let idle nodes leave.")
        return heapq.heappop(self._free_slots)

    def sweep(self) -> int:
        """Scrub the slots of removed nodes now: zero their nibbles and free the rows that
        no node holds any more. Returns how many rows were freed."""
        if not self._dirty_slots:
            return 0
        keep = np.full(self._num_words, np.iinfo(np.uint64).max, np.uint64)
        for slot in self._dirty_slots:
            word, shift = divmod(slot, SLOTS_PER_WORD)
            keep[word] &= ~(_NIBBLE << np.uint64(4 * shift))
        num_freed = 0
        for namespace, table in list(self._tables.items()):
            table.entries[:, 2:] &= keep
            num_freed += table.release_empty()
            if not table.num_used:
                del self._tables[namespace]
        for slot in self._dirty_slots:
            heapq.heappush(self._free_slots, slot)
        self._dirty_slots.clear()
        return num_freed

    # -- events --------------------------------------------------------------------------

    def apply(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        """Apply a node's events in order. The whole batch is checked before anything
        changes, so a malformed event leaves the locations as they were."""
        if node_id not in self._slot_of:
            raise NotFound(f"node {node_id!r} is not tracked; add it before applying its events.")
        for group in _group(events):
            if group is None:
                self.clear_node(node_id)
            else:
                namespace, sets, lo, hi, codes = group
                (self._set if sets else self._remove)(namespace, self._slot_of[node_id], lo, hi, codes)

    def _set(self, namespace: bytes, slot: int, lo: np.ndarray, hi: np.ndarray, codes: np.ndarray) -> None:
        if len(lo) > 1:  # a later event about the same block wins (same low half: same block)
            _, last_reversed = np.unique(lo[::-1], return_index=True)
            if len(last_reversed) < len(lo):
                keep = len(lo) - 1 - last_reversed
                lo, hi, codes = lo[keep], hi[keep], codes[keep]
        table = self._tables.get(namespace)
        if table is None:
            table = self._tables[namespace] = _Table(_MIN_CAPACITY, self._num_words)
        word, shift = divmod(slot, SLOTS_PER_WORD)
        shift = np.uint64(4 * shift)
        positions = table.find(lo, hi)[0]
        present = positions >= 0
        held = positions[present]  # updated before inserting: an insert may move rows
        table.entries[held, 2 + word] = (table.entries[held, 2 + word] & ~(_NIBBLE << shift)) | (codes[present] << shift)
        if not present.all():
            new = ~present
            rows = np.zeros((int(new.sum()), self._num_words), np.uint64)
            rows[:, word] = codes[new] << shift
            table.insert(lo[new], hi[new], rows)

    def _remove(self, namespace: bytes, slot: int, lo: np.ndarray, hi: np.ndarray, codes: np.ndarray) -> None:
        table = self._tables.get(namespace)
        if table is None:
            return
        word, shift = divmod(slot, SLOTS_PER_WORD)
        shift = np.uint64(4 * shift)
        positions = table.find(lo, hi)[0]
        present = positions >= 0
        positions, codes = positions[present], codes[present]
        current = table.entries[positions, 2 + word]
        # a removal from another tier than the one the node holds the block in is stale
        hit = ((current >> shift) & _NIBBLE) == codes
        table.entries[positions[hit], 2 + word] = current[hit] & ~(_NIBBLE << shift)
        table.release_empty(np.unique(positions[hit]))
        if not table.num_used:
            del self._tables[namespace]

    # -- queries -------------------------------------------------------------------------

    def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        """Each node (of ``node_ids``) holding the chain's first block, with the tier of
        every block of the longest prefix it holds; longest first, then by node id."""
        table = self._tables.get(namespace)
        if table is None or not hashes:
            return []
        if node_ids is None:
            slot_of = self._slot_of
        else:
            slot_of = {node_id: self._slot_of[node_id] for node_id in node_ids if node_id in self._slot_of}
        if not slot_of:
            return []
        lo, hi = _split_hashes(hashes)
        positions, rows = table.find(lo, hi)
        missing = np.flatnonzero(positions < 0)
        length = int(missing[0]) if missing.size else len(positions)  # no node holds more
        if not length:
            return []
        rows = rows[:length]
        names = list(slot_of)
        slots = np.fromiter(slot_of.values(), np.intp, len(names))
        # work on bytes, not words: temporaries 8x smaller, which is what a cold cache pays for
        octets = np.ascontiguousarray(rows).astype("<u8", copy=False).view(np.uint8)  # (length, 8 × words)
        octet_of_slot = 8 * (slots // SLOTS_PER_WORD) + (slots % SLOTS_PER_WORD) // 2
        shifts = (4 * (slots % 2)).astype(np.uint8)
        holders = np.flatnonzero((octets[0, octet_of_slot] >> shifts) & 15)
        if not holders.size:
            return []
        nibbles = np.ascontiguousarray(octets[:, octet_of_slot[holders]].T)  # (holders, length)
        nibbles >>= shifts[holders, None]
        nibbles &= 15
        absent = nibbles == 0
        first_absent = absent.argmax(axis=1)
        lengths = np.where(absent[np.arange(len(holders)), first_absent], first_absent, length).tolist()
        # where each holder's tier changes from one block to the next (flat: 2-D nonzero is slow)
        changes = np.flatnonzero((nibbles[:, 1:] != nibbles[:, :-1]).ravel())
        bounds = np.searchsorted(changes, np.arange(len(holders) + 1) * (length - 1)).tolist()
        matches = []
        for j, holder in enumerate(holders.tolist()):
            num_blocks = lengths[j]
            own = changes[bounds[j] : bounds[j + 1]] - (j * (length - 1) - 1)
            own = own[own < num_blocks].tolist()
            matches.append(NodeMatch(names[holder], _tier_tuple(nibbles[j], own, num_blocks)))
        matches.sort(key=lambda match: (-match.num_blocks, match.node_id))
        return matches

    # -- accounting ----------------------------------------------------------------------

    def num_blocks(self) -> int:
        """Distinct (namespace, block) rows held, including those of unscrubbed slots."""
        return sum(table.num_used for table in self._tables.values())

    def num_locations(self) -> int:
        """(node, block) pairs of tracked nodes: what a router can be told about."""
        live = np.zeros(self._num_words, np.uint64)
        for slot in self._slot_of.values():
            word, shift = divmod(slot, SLOTS_PER_WORD)
            live[word] |= _NIBBLE << np.uint64(4 * shift)
        total = 0
        for table in self._tables.values():
            held = table.entries[:, 2:] & live
            held |= (held >> np.uint64(1)) | (held >> np.uint64(2)) | (held >> np.uint64(3))
            total += int(np.bitwise_count(held & np.uint64(0x1111_1111_1111_1111)).sum())
        return total

    def memory_bytes(self) -> int:
        """Bytes of every table's arrays (the rest is a few objects per node and namespace)."""
        return sum(table.nbytes for table in self._tables.values())


def _group(events: Sequence[BlockEvent]) -> list[tuple | None]:
    """Check every event and merge runs of them: consecutive changes of one kind (set a
    tier, or remove from one) in one namespace commute but for repeats of a block, which
    `_set` resolves, so one vectorised pass applies a run. Each run becomes (namespace,
    sets, lo, hi, codes); an AllBlocksCleared becomes None."""
    groups: list[tuple | None] = []
    key: tuple[bytes, bool] | None = None
    hashes: list[BlockHash] = []
    codes: list[int] = []

    def close() -> None:
        if key is not None:
            if set(map(len, hashes)) != {HASH_BYTES}:
                raise InvalidArgument(f"every block hash is {HASH_BYTES} bytes; an event has one of another length.")
            if key[1] and _ZERO_HASH in hashes:
                raise InvalidArgument("the all-zero hash is the chain's root parent, never a block's hash.")
            groups.append((*key, *_split_hashes(hashes), np.array(codes, np.uint64)))

    for event in events:
        if isinstance(event, AllBlocksCleared):
            close()
            key, hashes, codes = None, [], []
            groups.append(None)
            continue
        if isinstance(event, BlockStored):
            sets, tier = True, event.tier
        elif isinstance(event, BlockMoved):
            sets, tier = True, event.dst  # where the node holds them now, whatever it held before
        elif isinstance(event, BlockRemoved):
            sets, tier = False, event.tier
        else:
            raise InvalidArgument(f"{type(event).__name__} is not a block event.")
        if not isinstance(event.namespace, bytes) or tier not in _CODE_OF_TIER:
            raise InvalidArgument(f"a {type(event).__name__} needs a bytes namespace and a TierKind.")
        if not event.block_hashes:
            continue
        if (event.namespace, sets) != key:
            close()
            key, hashes, codes = (event.namespace, sets), [], []
        hashes += event.block_hashes
        codes += [_CODE_OF_TIER[tier]] * len(event.block_hashes)
    close()
    return groups


def _tier_tuple(nibbles: np.ndarray, changes: list[int], num_blocks: int) -> tuple[TierKind, ...]:
    """The tiers of a node's first ``num_blocks`` blocks, built run by run (a block at a
    time costs ~40 ns a block; a run of repeats, ~1 ns)."""
    if len(changes) > _MAX_RUNS:
        return operator.itemgetter(*nibbles[:num_blocks].tolist())(_TIER_OF_CODE)
    tiers: tuple[TierKind, ...] = ()
    start = 0
    for end in (*changes, num_blocks):
        tiers += (_TIER_OF_CODE[nibbles[start]],) * (end - start)
        start = end
    return tiers
