"""A kvstore namespace addressed by an engine's own string keys.

SGLang's HiCache names a page, and LMCache a chunk, by strings of the engine's making
(prefix hashes computed by the engine itself). The connectors for those engines cannot
recompute kvstore's chained token hashes, because the storage interface they implement
sees keys and bytes, never token ids. So a key string maps to a block hash by

    XXH3-128(b"kvstore/engine-key/v1\\0" ‖ UTF-8 key)

and the namespace (model, KV shape, dtype, TP/PP shard, a salt naming the engine) keeps
such blocks apart from every other engine and shard, exactly as for token-hashed blocks.

Block bytes are kvstore's layout: layer-major ``[layer][K plane | V plane]``, each plane
``tokens × heads × head_dim``. Engines hand in and receive *views* of that shape over
their own memory (any strides); the copy between a view and the daemon's shared slab is
the only copy. Shapes and dtypes are checked before a byte moves, because ``copy_`` would
otherwise broadcast or convert silently and store plausible garbage.

One daemon connection per engine thread: SGLang calls from its prefetch and backup
threads at once and LMCache from its event loop and its scheduler, and a connection
carries one request at a time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import xxhash

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.hashing import BlockHash
from kvstore.layout import DTYPE_SIZES
from kvstore.namespace import Namespace

__all__ = ["EngineKeyStore", "ErrorsAsMisses", "engine_key_hash", "layout_dtype"]

_KEY_SEED = b"kvstore/engine-key/v1\x00"


def engine_key_hash(key: str) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(_KEY_SEED + key.encode()))


def layout_dtype(dtype: torch.dtype) -> str:
    """The KVLayout name of a torch dtype, or a sentence saying it cannot be stored."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise InvalidArgument(f"KV of dtype {dtype} cannot be stored; kvstore keeps {', '.join(sorted(DTYPE_SIZES))}.")
    return name


class EngineKeyStore:
    def __init__(self, namespace: Namespace, socket_path: Path | str | None = None) -> None:
        layout = namespace.layout
        self.namespace = namespace
        self.block_shape = torch.Size((layout.num_layers, layout.kv_planes, layout.block_size, layout.num_kv_heads, layout.head_dim))
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self._socket_path = socket_path
        self._local = threading.local()
        self._clients: list[KVStoreClient] = []  # every thread's connection, closed by close()
        self._clients_lock = threading.Lock()
        with self._connection():  # connect now, so a daemon that is not there is logged at start
            pass

    def hashes(self, keys: Sequence[str]) -> list[BlockHash]:
        return [engine_key_hash(key) for key in keys]

    def num_cached(self, keys: Sequence[str]) -> int:
        """How many leading keys are cached (side-effect free)."""
        with self._connection() as client:
            return client.lookup(self.namespace.digest, self.hashes(keys)).num_blocks

    def write(self, keys: Sequence[str], sources: Sequence[torch.Tensor], parent_key: str | None = None) -> int:
        """Store the blocks not cached yet from ``sources`` (views of ``block_shape``);
        returns how many leading keys are cached afterwards. ``parent_key`` names the block
        before ``keys[0]`` in the engine's prefix chain, when the engine says so."""
        if len(sources) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys were given with {len(sources)} blocks.")
        for source in sources:
            self._check(source)
        digest, hashes = self.namespace.digest, self.hashes(keys)
        parent = None if parent_key is None else engine_key_hash(parent_key)
        with self._connection() as client:
            with client.writing(digest, hashes, parent) as slots:
                for index, raw in slots:
                    self._typed(raw).copy_(sources[index])
            if not slots or slots[-1][0] == len(keys) - 1:
                return len(keys)  # every key before the last written one was cached already
            return client.lookup(digest, hashes).num_blocks  # the tier ran out of room part-way

    def read(self, keys: Sequence[str], target: Callable[[int], torch.Tensor | None]) -> int:
        """Copy the cached prefix of ``keys`` into ``target(i)`` (a view of ``block_shape``)
        block by block, stopping where ``target`` returns None (the engine has no room).
        Returns how many leading blocks were copied; everything after is a miss."""
        with self._connection() as client, client.reading(self.namespace.digest, self.hashes(keys)) as blocks:
            for index, raw in enumerate(blocks):
                destination = target(index)
                if destination is None:
                    return index
                self._check(destination)
                destination.copy_(self._typed(raw))
            return len(blocks)

    def close(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[KVStoreClient]:
        """This thread's daemon connection. The client reconnects by itself after the
        daemon went away (and registers the namespace again); meanwhile calls raise
        DaemonUnavailable, which the connectors count as misses."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = KVStoreClient(self._socket_path, require_daemon=False)
            client.ensure_namespace(self.namespace)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        yield client

    def _typed(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.view(self.dtype).view(self.block_shape)

    def _check(self, view: torch.Tensor) -> None:
        if view.shape != self.block_shape or view.dtype != self.dtype:
            raise InvalidArgument(
                f"a block view of shape {tuple(view.shape)} and dtype {view.dtype} does not match this namespace's "
                f"blocks of shape {tuple(self.block_shape)} and dtype {self.dtype}."
            )


class ErrorsAsMisses:
    """Runs daemon calls for an engine interface that wants counts, not exceptions
    (SGLang's and LMCache's storage backends): a kvstore error counts as 0 blocks — a
    miss, or nothing stored — so the engine recomputes. Logged once per kind of call, so
    a daemon that is gone does not flood the engine's log."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._logged: set[str] = set()

    def count(self, what: str, call: Callable[[], int]) -> int:
        try:
            return call()
        except KVStoreError as exc:
            if what not in self._logged:
                self._logged.add(what)
                self._logger.warning("kvstore %s failed; counted as a miss: %s", what, exc)
            return 0
