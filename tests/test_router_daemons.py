"""The router on one host without Redis (router.index = "daemons"): its index asks real
daemons, each with its embedded index, over their gRPC API (index/daemons.py). A real ZMQ
publisher speaking vLLM's wire format stands in for an engine's KV events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
from daemon_harness import daemons, eventually
from test_engine_subscriptions import BLOCK, NAMESPACE_TOML, NS, engines_file  # the engines' namespace: the router's too
from vllm_kv_events import batch, publishing, stored

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.config import RoutingConfig
from kvstore.hashing import chain_hashes
from kvstore.index.daemons import MAX_ASKED_BLOCKS, RETRY_AFTER_S, DaemonAddress, DaemonsIndex
from kvstore.index.scoring import Candidate, _rendezvous_rank
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.router import Router
from kvstore.tier_kind import TierKind

PROMPT = list(range(500, 500 + 6 * BLOCK))
KEYS = chain_hashes(PROMPT, BLOCK)
GPU, HOST = TierKind.GPU, TierKind.HOST


def register(client) -> bytes:
    layout = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=BLOCK, dtype="bfloat16", kv_planes=2, inner_order="HND")
    registered = client.store.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="/models/tiny", layout=layout, tp_size=1))
    assert registered.namespace_id == NS.digest
    return registered.namespace_id


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_router_asks_each_daemon_for_its_prefix_and_a_silent_daemon_holds_nothing(tmp_path, caplog):
    async def main():
        with publishing() as publisher, daemons(tmp_path) as start:
            config = engines_file(tmp_path, publisher.endpoint)
            a = start(node_id="gpu-a", token="tok-a", config=config)
            b = start(node_id="gpu-b")
            with connect(a.address, token="tok-a") as client:
                ns = register(client)
                payloads = [os.urandom(NS.block_bytes) for _ in KEYS[:4]]
                assert client.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=KEYS[:4], payloads=payloads)).num_stored == 4

                def counters() -> dict:
                    return dict(client.admin.Stats(pb.StatsRequest()).counters)

                await publisher.handshake(lambda: counters().get("engine_vllm_messages", 0) > 0, timeout_s=20)
                await publisher.send(batch([stored([11, 12], None, PROMPT[: 2 * BLOCK], BLOCK)]))

            listed = [DaemonAddress("gpu-a", a.address, "tok-a"), DaemonAddress("gpu-b", b.address)]
            index = DaemonsIndex(lambda: listed, timeout_s=1.0)
            try:

                async def matched() -> dict:
                    return {m.node_id: m.tiers for m in await index.match(ns, KEYS)}

                deadline = time.monotonic() + 10
                while len(await matched()) < 2 and time.monotonic() < deadline:  # the daemon indexes asynchronously
                    await asyncio.sleep(0.1)
                assert await matched() == {"gpu-a": (HOST,) * 4, "vllm@gpu-a": (GPU,) * 2}
                assert await index.match(ns, KEYS, ["gpu-b"]) == []  # b has never seen the namespace: NOT_FOUND
                assert "did not answer" not in caplog.text  # which is an answer, not a silence
                longest = KEYS + [os.urandom(16) for _ in range(MAX_ASKED_BLOCKS)]  # longer than a daemon takes
                assert [(m.node_id, m.num_blocks) for m in await index.match(ns, longest, ["gpu-a"])] == [("gpu-a", 4)]
                kinds = {n.node_id: n.kind for n in await index.nodes()}
                assert kinds == {"gpu-a": "kvstore", "vllm@gpu-a": "engine", "gpu-b": "kvstore"}

                # the router's code is unchanged: the engine's GPU blocks lead gpu-a's match
                router = Router(None, index, EmbeddedSessionStore(), RoutingConfig(remote_fetch=False))
                candidates = [Candidate("gpu-a", queued_tokens=0), Candidate("gpu-b", queued_tokens=0)]
                decision = await router.route_chain(ns, KEYS, len(PROMPT), BLOCK, NS.block_bytes, "s1", candidates)
                assert (decision.node_id, decision.expected_cached_tokens) == ("gpu-a", 4 * BLOCK)
                assert (await router.sessions.get("s1")).node_id == "gpu-a"

                # a wrong token, a daemon that hangs and an address nobody listens on: misses, within the deadline
                listed[0] = DaemonAddress("gpu-a", a.address, "wrong")
                listed.append(DaemonAddress("gpu-c", f"127.0.0.1:{unused_port()}"))
                b.process.send_signal(signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    assert await index.match(ns, KEYS) == []
                    assert 1.0 <= time.monotonic() - started < 1.5  # the hung daemon's 1 s deadline, once
                    assert "the daemon of gpu-b at" in caplog.text and "the daemon of gpu-c at" in caplog.text
                    started = time.monotonic()  # within RETRY_AFTER_S the hung daemon is not waited for again
                    assert await index.nodes() == []
                    decision = await router.route_chain(ns, KEYS, len(PROMPT), BLOCK, NS.block_bytes, "s2", candidates)
                    assert decision.expected_cached_tokens == 0 and time.monotonic() - started < 0.5
                finally:
                    b.process.send_signal(signal.SIGCONT)
                await asyncio.sleep(RETRY_AFTER_S)
                assert [n.node_id for n in await index.nodes()] == ["gpu-b"]  # asked again, and answers
                listed[0] = DaemonAddress("gpu-a", a.address, "tok-a")
                assert await matched() == {"gpu-a": (HOST,) * 4, "vllm@gpu-a": (GPU,) * 2}  # back once it answers
            finally:
                await index.close()

    asyncio.run(asyncio.wait_for(main(), timeout=90))


ROUTER_TOML = """
[router]
port = {port}
index = "daemons"
health_interval_s = 0.5
daemon_timeout_s = 0.5
{namespace}
[[router.replicas]]
url = "{url_a}"
node_id = "replica-a"
daemon = "{daemon_a}"
daemon_token = "tok-a"
cache_bytes = {cache_a}

[[router.replicas]]
url = "{url_b}"
node_id = "replica-b"
daemon = "{daemon_b}"
cache_bytes = {cache_b}

[routing]
remote_fetch = false
"""


@contextlib.contextmanager
def started(command: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=out, text=True)
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def router_in_front(
    tmp_path: Path, engines: tuple[subprocess.Popen, subprocess.Popen], nodes, routing: str = "", cache_bytes: tuple[int, int] = (0, 0)
) -> Iterator[str]:
    """`kvstore router` (ROUTER_TOML, its [routing] section extended by ``routing``, the
    replicas' ``cache_bytes`` as given) in front of the two http_replica ``engines``
    beside the daemons ``nodes``; yields its url once it is healthy."""
    port = unused_port()
    urls = [f"http://127.0.0.1:{engine.stdout.readline().strip()}" for engine in engines]
    config = tmp_path / "router.toml"
    namespace = NAMESPACE_TOML.replace("[engines.namespace]", "[router.namespace]")
    daemon_a, daemon_b = (node.address for node in nodes)
    addresses = {"url_a": urls[0], "url_b": urls[1], "daemon_a": daemon_a, "daemon_b": daemon_b}
    text = ROUTER_TOML.format(namespace=namespace, port=port, cache_a=cache_bytes[0], cache_b=cache_bytes[1], **addresses)
    config.write_text(text + routing)
    router = f"http://127.0.0.1:{port}"
    with started([sys.executable, "-m", "kvstore", "router", "--config", str(config)], tmp_path / "router.log"):

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{router}/health", timeout=2).status_code == 200
            return False

        assert eventually(healthy, timeout_s=60), (tmp_path / "router.log").read_text()
        yield router


def hold(daemon, token: str, prompt: list[int]) -> None:
    """``daemon`` stores the full blocks of ``prompt`` and its index reports them."""
    with connect(daemon.address, token=token or None) as client:
        ns = register(client)
        keys = chain_hashes(prompt, BLOCK)
        client.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=keys, payloads=[os.urandom(NS.block_bytes) for _ in keys]))
        match = pb.MatchRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=keys))
        assert eventually(lambda: [x.matched_blocks for x in client.index.Match(match).nodes] == [len(keys)])


def complete(router: str, prompt: list[int], session: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    return httpx.post(f"{router}/v1/completions", json=body, headers={"x-session-id": session}, timeout=30)


def test_the_router_sends_each_prompt_to_the_replica_whose_daemon_holds_it_and_survives_a_dead_daemon(tmp_path):
    prompt_a, prompt_b = list(range(2000, 2000 + 6 * BLOCK)), list(range(3000, 3000 + 6 * BLOCK))
    keys_a, keys_b = chain_hashes(prompt_a, BLOCK), chain_hashes(prompt_b, BLOCK)
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    with (
        daemons(tmp_path) as start,
        started([*replica, "replica-a", "tiny"], tmp_path / "replica-a.log") as engine_a,
        started([*replica, "replica-b", "tiny"], tmp_path / "replica-b.log") as engine_b,
    ):
        a, b = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
        for daemon, token, keys, num_blocks in ((a, "tok-a", keys_a, 5), (b, "", keys_b, 4)):
            with connect(daemon.address, token=token or None) as client:
                ns = register(client)
                payloads = [os.urandom(NS.block_bytes) for _ in range(num_blocks)]
                client.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=keys[:num_blocks], payloads=payloads))
                match = pb.MatchRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=keys))
                assert eventually(lambda c=client, m=match, n=num_blocks: [x.matched_blocks for x in c.index.Match(m).nodes] == [n])
        with router_in_front(tmp_path, (engine_a, engine_b), (a, b)) as router:
            for prompt, session, replica_id, cached in ((prompt_a, "s-a", "replica-a", 5), (prompt_b, "s-b", "replica-b", 4)):
                answer = complete(router, prompt, session)
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["text"] == replica_id
                headers = answer.headers
                assert (headers["x-kvstore-replica"], headers["x-kvstore-expected-cached-tokens"]) == (replica_id, str(cached * BLOCK))

            b.stop(signal.SIGKILL)
            started_at = time.monotonic()
            answer = complete(router, prompt_b, "s-new")  # replica-b's daemon is gone: its blocks count as a miss, not an error
            assert answer.status_code == 200 and answer.headers["x-kvstore-expected-cached-tokens"] == "0", answer.text
            assert time.monotonic() - started_at < 5
            answer = complete(router, prompt_a, "s-a2")  # replica-a's daemon still answers
            assert (answer.headers["x-kvstore-replica"], answer.headers["x-kvstore-expected-cached-tokens"]) == (
                "replica-a",
                str(5 * BLOCK),
            )
        log = (tmp_path / "router.log").read_text()
        assert "the daemon of replica-b" in log and "sessions live in this router's memory (one router replica" in log


def test_a_streamed_request_is_queued_prefill_on_its_replica_until_its_first_token(tmp_path):
    """vLLM answers a streamed request's headers at once and its first token only once the
    prompt is computed. Until that token the router counts the prompt's uncached tokens in
    its replica's queue: a new session sharing the prefix the busy replica holds goes to
    the idle one; after it, to the holder again."""
    shared = list(range(4000, 4000 + 4 * BLOCK))
    long_prompt = shared + list(range(5000, 5000 + 40 * BLOCK))  # 640 uncached tokens on replica-a: 0.64 s at 1,000/s
    short_prompts = [shared + list(range(6000 + 100 * i, 6000 + 100 * i + 2 * BLOCK)) for i in range(2)]
    gate = tmp_path / "prefilled"
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    with (
        daemons(tmp_path) as start,
        started([*replica, "replica-a", "tiny", str(gate)], tmp_path / "replica-a.log") as engine_a,
        started([*replica, "replica-b", "tiny"], tmp_path / "replica-b.log") as engine_b,
    ):
        a, b = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
        hold(a, "tok-a", shared)
        routing = "prefill_tokens_per_s = 1000\ndecode_s_per_request = 0.01\n"
        with router_in_front(tmp_path, (engine_a, engine_b), (a, b), routing) as router:
            body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 1, "stream": True}
            with httpx.stream("POST", f"{router}/v1/completions", json=body, headers={"x-session-id": "long"}, timeout=30) as streamed:
                assert streamed.headers["x-kvstore-replica"] == "replica-a"  # it holds the shared prefix
                answer = complete(router, short_prompts[0], "short-1")  # replica-a is still computing the long prompt
                assert answer.status_code == 200 and answer.headers["x-kvstore-replica"] == "replica-b", answer.headers
                gate.touch()
                events = streamed.read().decode()
            assert '"text": "replica-a"' in events and events.rstrip().endswith("data: [DONE]")
            answer = complete(router, short_prompts[1], "short-2")  # its prefill is done: the prefix's holder again
            assert answer.status_code == 200 and answer.headers["x-kvstore-replica"] == "replica-a", answer.headers


def test_concurrent_new_sessions_each_see_the_load_the_ones_before_them_placed(tmp_path):
    """Eight new sessions at once, on two idle replicas that hold none of their prompts,
    with session ids whose rendezvous order prefers replica-a: each decision must count
    the prompts placed while it waited for the index, so they split four and four
    instead of all going where a stale, empty load and the hash would send them."""
    ids = [f"burst-{i}" for i in range(200)]
    preferring_a = [i for i in ids if _rendezvous_rank(i, "replica-a") < _rendezvous_rank(i, "replica-b")][:8]
    gate = tmp_path / "prefilled"
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    with (
        daemons(tmp_path) as start,
        started([*replica, "replica-a", "tiny", str(gate)], tmp_path / "replica-a.log") as engine_a,
        started([*replica, "replica-b", "tiny", str(gate)], tmp_path / "replica-b.log") as engine_b,
    ):
        nodes = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
        with router_in_front(tmp_path, (engine_a, engine_b), nodes, "prefill_tokens_per_s = 1000\n") as router:

            def session(i: int) -> str:
                prompt = list(range(7000 + 1000 * i, 7000 + 1000 * i + 8 * BLOCK))
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}
                headers = {"x-session-id": preferring_a[i]}
                with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=headers, timeout=30) as answer:
                    assert answer.status_code == 200
                    events = answer.read().decode()
                    assert events.rstrip().endswith("data: [DONE]")
                    return answer.headers["x-kvstore-replica"]

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                placed = [pool.submit(session, i) for i in range(8)]
                time.sleep(1.0)  # every request is in: each prompt is being "computed" until the gate opens
                gate.touch()
                where = [future.result() for future in placed]
            assert sorted(where) == ["replica-a"] * 4 + ["replica-b"] * 4, where


def test_a_new_session_goes_where_its_context_fits_rather_than_to_the_full_holder_of_the_shared_prefix(tmp_path):
    """Each replica's caches keep 12 blocks (cache_bytes). replica-a's daemon holds the
    4-block shared prefix, and the first session (12 blocks) is placed there: its working
    set fills replica-a. The second session's own 8 blocks would evict 8 of the first's
    there, to be computed again on its next turn: it goes to replica-b, which computes
    4 blocks more now and evicts nothing. Told no cache sizes, the router sends it to the
    prefix's holder."""
    shared = list(range(4000, 4000 + 4 * BLOCK))
    sessions = [shared + list(range(5000 + 1000 * i, 5000 + 1000 * i + 8 * BLOCK)) for i in range(2)]
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    for cache_bytes, second in ((12 * NS.block_bytes, "replica-b"), (0, "replica-a")):
        run = tmp_path / f"cache-{cache_bytes}"
        run.mkdir()
        with (
            daemons(run) as start,
            started([*replica, "replica-a", "tiny"], run / "replica-a.log") as engine_a,
            started([*replica, "replica-b", "tiny"], run / "replica-b.log") as engine_b,
        ):
            a, b = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
            hold(a, "tok-a", shared)
            routing = "prefill_tokens_per_s = 1000\n"
            with router_in_front(run, (engine_a, engine_b), (a, b), routing, (cache_bytes, cache_bytes)) as router:
                first = complete(router, sessions[0], "first")
                assert first.status_code == 200 and first.headers["x-kvstore-replica"] == "replica-a", first.headers
                answer = complete(router, sessions[1], "second")
                assert answer.status_code == 200 and answer.headers["x-kvstore-replica"] == second, (cache_bytes, answer.headers)


def router_load(router: str) -> tuple[float, float]:
    """The router's requests in flight and queued prefill tokens, over all replicas (/metrics)."""
    totals = {"kvstore_router_in_flight{": 0.0, "kvstore_router_queued_prefill_tokens{": 0.0}
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        for name in totals:
            if line.startswith(name):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())


def test_a_client_that_goes_away_before_its_answer_leaves_no_load_behind(tmp_path):
    """One client hangs up while the engine has not even sent its headers, another after
    the headers and before the first token. Once the engines answer, neither request is in
    flight or queued any more: a replica's load is what it is computing, never a phantom
    that would keep routing away from it."""
    gate, headers_gate = tmp_path / "prefilled", tmp_path / "answering"
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    with (
        daemons(tmp_path) as start,
        started([*replica, "replica-a", "tiny", str(gate), str(headers_gate)], tmp_path / "replica-a.log") as engine_a,
        started([*replica, "replica-b", "tiny", str(gate), str(headers_gate)], tmp_path / "replica-b.log") as engine_b,
    ):
        nodes = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
        with router_in_front(tmp_path, (engine_a, engine_b), nodes) as router:
            prompt = list(range(9000, 9000 + 8 * BLOCK))
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}).encode()
            port = int(router.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as hung_up:
                head = f"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                hung_up.sendall(head.encode() + b"x-session-id: gone-1\r\n\r\n" + body)
                assert eventually(lambda: router_load(router) == (1, len(prompt)))  # sent, waiting for the headers
            headers_gate.touch()  # the engine answers a client that is gone
            with httpx.stream("POST", f"{router}/v1/completions", content=body, headers={"x-session-id": "gone-2"}, timeout=30) as left:
                assert left.status_code == 200  # the headers, and no token yet: the client leaves here
            gate.touch()
            assert eventually(lambda: router_load(router) == (0, 0)), router_load(router)
            answer = complete(router, prompt, "after")
            assert answer.status_code == 200
            assert router_load(router) == (0, 0)


class _Answers(pb_grpc.IndexServicer):
    """A gRPC Index service that answers what a test gives it (a daemon's answers that a
    router must not believe)."""

    def __init__(self, nodes: list[pb.NodeMatch]) -> None:
        self.nodes = nodes

    async def Match(self, request, context):
        return pb.MatchResponse(nodes=self.nodes)

    async def Nodes(self, request, context):
        return pb.NodesResponse(nodes=[pb.NodeInfo(node_id=n.node_id, kind="kvstore") for n in self.nodes])


def test_a_daemons_doubtful_answer_is_a_miss(caplog):
    host = pb.TierCount(tier=pb.TIER_HOST, blocks=3)

    async def main():
        answers = _Answers([])
        server = grpc.aio.server()
        pb_grpc.add_IndexServicer_to_server(answers, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        index = DaemonsIndex(lambda: [DaemonAddress("gpu-a", f"127.0.0.1:{port}")], timeout_s=1.0)
        try:
            answers.nodes = [pb.NodeMatch(node_id="gpu-a", matched_blocks=3, tier_counts=[host])]
            assert [(m.node_id, m.tiers) for m in await index.match(NS.digest, KEYS)] == [("gpu-a", (HOST,) * 3)]
            doubtful = [
                [pb.NodeMatch(node_id="gpu-z", matched_blocks=3, tier_counts=[host])],  # another node's blocks
                [pb.NodeMatch(node_id="vllm@gpu-z", matched_blocks=3, tier_counts=[host])],  # another replica's engine
                [pb.NodeMatch(node_id="gpu-a", matched_blocks=4, tier_counts=[host])],  # counts that do not add up
                [pb.NodeMatch(node_id="gpu-a", matched_blocks=7, tier_counts=[pb.TierCount(tier=pb.TIER_HOST, blocks=7)])],  # > chain
                [pb.NodeMatch(node_id="gpu-a", matched_blocks=3, tier_counts=[pb.TierCount(tier=99, blocks=3)])],  # unknown tier
            ]
            for nodes in doubtful:
                answers.nodes = nodes
                assert await index.match(NS.digest, KEYS) == [], nodes
            answers.nodes = [*doubtful[0], *doubtful[1], *doubtful[2]]
            assert [n.node_id for n in await index.nodes()] == ["gpu-a"]  # not another node, nor another replica's engine
            assert "answered a doubtful match" in caplog.text
        finally:
            await index.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), timeout=30))
