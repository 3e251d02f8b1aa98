"""The router explains every computed prompt token (kvstore_router_prefill_tokens{cause,
replica}, kvstore/gateway/misses.py) and keeps each session's turns (`kvstore sessions`,
kvstore/gateway/session_log.py), provoked cause by cause against the real `kvstore router`
process, two real daemons (replica-a's holding a shared system prompt) and two
http_replica engines, whose prefix caches report what they hold as vLLM's do
(tests/test_router_stale_load.py's fleet). The same with real vLLM engines and chat
templates: tests/test_router_http.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
from daemon_harness import eventually
from test_engine_subscriptions import BLOCK
from test_router_daemons import register
from test_router_stale_load import SYSTEM, conversation, fleet

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.hashing import chain_hashes


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60)


def held_blocks(address: str, token: str, prompt: list[int]) -> int:
    """The leading blocks of ``prompt`` the daemon at ``address`` says it holds."""
    with connect(address, token=token) as client:
        match = pb.MatchRequest(namespace_id=register(client), block_hashes=pb.BlockHashes(hashes=chain_hashes(prompt, BLOCK)))
        return max((node.matched_blocks for node in client.index.Match(match).nodes), default=0)


def causes_of(text: str) -> dict[tuple[str, str], float]:
    """kvstore_router_prefill_tokens_total by (cause, replica)."""
    found = re.findall(r'^kvstore_router_prefill_tokens_total\{cause="([^"]+)",replica="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {(cause, replica): float(value) for cause, replica, value in found}


def test_every_computed_token_is_explained_by_one_cause(tmp_path):
    computed = 0  # prompt less cached tokens, as the engines' answers report them

    def sent(answer: httpx.Response) -> dict:
        nonlocal computed
        usage = answer.json()["usage"]
        computed += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        return usage

    def delta(before: dict, after: dict) -> dict[str, float]:
        """The tokens counted per cause between two readings (those counted at all)."""
        by_cause: dict[str, float] = {}
        for (cause, replica), value in after.items():
            by_cause[cause] = by_cause.get(cause, 0.0) + value - before.get((cause, replica), 0.0)
        return {cause: tokens for cause, tokens in by_cause.items() if tokens}

    with fleet(tmp_path) as f:
        metrics = lambda: causes_of(httpx.get(f"{f.router}/metrics", timeout=5).text)  # noqa: E731

        # not_loaded: replica-a's daemon holds the system prompt, its engine loads none of it
        before = metrics()
        first = f.complete(conversation(30_000), "s-a", "tenant-1")
        assert first.headers["x-kvstore-replica"] == "replica-a" and sent(first)["prompt_tokens_details"]["cached_tokens"] == 0
        assert delta(before, metrics()) == {"not_loaded": len(SYSTEM), "new": 32}

        # elsewhere: replica-a is busy with a request that did not come through the router,
        # so a new session sharing the system prompt goes to replica-b, which holds none of it
        body = {"model": "tiny", "prompt": conversation(40_000), "max_tokens": 1, "stream": True}
        with httpx.stream("POST", f"{f.engines['replica-a']}/v1/completions", json=body, timeout=30) as direct:
            f.check_now("replica-a", engine_requests=1)
            before = metrics()
            busy = f.complete(conversation(41_000), "s-b", "tenant-1")
            assert busy.headers["x-kvstore-replica"] == "replica-b"
            sent(busy)
            assert delta(before, metrics()) == {"elsewhere": len(SYSTEM), "new": 32}
            f.gate.touch()
            direct.read()
        f.check_now("replica-a", engine_requests=0)

        # evicted: the fleet computed s-a's chain; now neither engine nor daemon holds it
        for url in f.engines.values():
            httpx.post(f"{url}/reset_prefix_cache", timeout=5).raise_for_status()
        address = re.search(r'daemon = "([^"]+)"\ndaemon_token = "tok-a"', (tmp_path / "router.toml").read_text()).group(1)
        evicted = kvstore("--address", address, "--token", "tok-a", "evict", "--all")
        assert evicted.returncode == 0, evicted.stderr
        assert eventually(lambda: held_blocks(address, "tok-a", SYSTEM) == 0)  # the daemon's index has them gone
        before = metrics()
        again = f.complete(conversation(30_000), "s-c", "tenant-2")
        assert sent(again)["prompt_tokens_details"]["cached_tokens"] == 0
        assert delta(before, metrics()) == {"evicted": len(conversation(30_000))}

        # new, then diverged: a session whose second turn changes a token of its first
        own = list(range(50_000, 50_000 + 64))
        before = metrics()
        assert sent(f.complete(own, "s-d", "tenant-2"))["prompt_tokens_details"]["cached_tokens"] == 0
        assert delta(before, metrics())["new"] == 64
        changed = own[:20] + [59_999] + own[21:] + list(range(51_000, 51_032))
        before = metrics()
        usage = sent(f.complete(changed, "s-d", "tenant-2"))
        assert usage["prompt_tokens_details"]["cached_tokens"] == 16  # the first block is alike
        # the 64 tokens and 1-token answer it sent before, from position 20 on, are diverged
        assert delta(before, metrics()) == {"diverged": 65 - 20, "new": 4 + 96 - 65}

        text = httpx.get(f"{f.router}/metrics", timeout=5).text
        assert sum(causes_of(text).values()) == computed  # every computed token, once
        assert 'kvstore_router_diverged_turns_total{part="prompt"} 1.0' in text
        by_tenant = r'^kvstore_router_tenant_prefill_tokens_by_cause_total\{cause="diverged",tenant="([^"]+)"\} (\S+)$'
        tenants = dict(re.findall(by_tenant, text, re.MULTILINE))
        assert tenants == {"tenant-2": "45.0"}

        # the operator's view of the sessions, and where s-d diverged
        listed = kvstore("--json", "sessions", "--router", f.router)
        assert listed.returncode == 0, listed.stderr
        rows = {row["session"]: row for row in json.loads(listed.stdout)["sessions"]}
        assert set(rows) == {"h:s-a", "h:s-b", "h:s-c", "h:s-d"}  # sessions named by the x-session-id header
        assert (rows["h:s-d"]["turns"], rows["h:s-d"]["divergences"], rows["h:s-d"]["lost_tokens"]) == (2, 1, 45)
        assert rows["h:s-d"]["prefill_tokens"] == 64 + 96 - 16
        shown = kvstore("sessions", "--router", f.router, "show", "s-d")
        assert shown.returncode == 0 and "diverged at token 20 in prompt, 45 tokens lost" in shown.stdout, shown.stdout
        missing = kvstore("sessions", "--router", f.router, "show", "nope")
        assert missing.returncode != 0 and "keeps no session 'nope'" in missing.stderr
