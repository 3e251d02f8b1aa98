"""The Redis index secured and bounded: TLS with a private CA and client certificates, an
ACL user, credentials checked when the daemon starts, and index lookups that end at their
caller's deadline when Redis stops answering. Real redis-server processes, real daemons."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trustme
from daemon_harness import daemons, eventually
from engine_proc import LAYOUT, NAMESPACE, kv_for

from bench.chaos_procs import free_port
from bench.redis_server import find_redis_server
from kvstore.client import KVStoreClient
from kvstore.config import ConfigError, IndexConfig, index_config_for, load_config
from kvstore.errors import DaemonUnavailable, IndexUnavailable
from kvstore.hashing import chain_hashes
from kvstore.index.backends import open_index
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.redis import RedisAccess, tls_refusal
from kvstore.layout import KVLayout
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace
from kvstore.node import Node
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier
from kvstore.transfers.service import TransferService
from kvstore.transport.base import MemoryTransport
from kvstore.transport.config import TransportConfig

USER, PASSWORD = "kvstore-node", "s3cret-for-tests"


# -- a TLS redis-server with an ACL user ----------------------------------------------------------


@dataclass
class TlsRedis:
    """A redis-server that speaks only TLS, demands a client certificate of its CA, and
    knows one ACL user besides a disabled ``default``."""

    process: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def path(self, name: str) -> str:
        return str(self.directory / name)


def _write_certificates(directory: Path) -> None:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("kvstore-node")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    server.private_key_pem.write_to_path(str(directory / "server.key"))
    client.cert_chain_pems[0].write_to_path(str(directory / "client.pem"))
    client.private_key_pem.write_to_path(str(directory / "client.key"))
    trustme.CA().cert_pem.write_to_path(str(directory / "other-ca.pem"))  # a CA that signed nothing of this server's


def _start_tls_redis(binary: str, directory: Path) -> TlsRedis | None:
    """The server listening, or None when ``binary`` was built without TLS."""
    port = free_port()
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
        "--save", "", "--appendonly", "no", "--daemonize", "no",
        "--tls-cert-file", str(directory / "server.pem"), "--tls-key-file", str(directory / "server.key"),
        "--tls-ca-cert-file", str(directory / "ca.pem"), "--tls-auth-clients", "yes",
        "--user", "default", "off",
        "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
    ]  # fmt: skip
    log_path = directory / "redis.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return TlsRedis(process, port, directory)
        if process.poll() is not None:
            if "tls-port" in log_path.read_text(errors="replace"):
                return None  # "Bad directive": a build without TLS
            raise AssertionError(f"the TLS redis-server exited: {log_path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the TLS redis-server did not listen within 10 s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A TLS-only redis-server. CI must have a redis-server built with TLS (.ci/run installs
    Debian's); elsewhere the tests that need one skip with the reason."""
    directory = tmp_path_factory.mktemp("tls-redis")
    _write_certificates(directory)
    server = None
    for binary in dict.fromkeys(filter(None, (shutil.which("redis-server"), find_redis_server()))):
        server = _start_tls_redis(binary, directory)
        if server is not None:
            break
    if server is None:
        reason = "no redis-server built with TLS was found (on Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must have one, and .ci/run installs it.")
        pytest.skip(reason)
    yield server
    server.process.terminate()
    server.process.wait(timeout=10)


def _tls_settings(tls_redis: TlsRedis, **changes: str) -> dict[str, str]:
    settings = {
        "index.backend": tls_redis.url,
        "index.tls_ca": tls_redis.path("ca.pem"),
        "index.tls_cert": tls_redis.path("client.pem"),
        "index.tls_key": tls_redis.path("client.key"),
        "index.username": USER,
        "index.heartbeat_interval_s": "0.5",
        "index.publish_interval_s": "0.05",
        "transport.kind": "off",
    }
    settings.update(changes)
    return {k: v for k, v in settings.items() if v}


def _index_nodes(config: IndexConfig) -> set[str]:
    """The node ids a fresh index client of ``config`` sees: what a router would."""

    async def listing() -> set[str]:
        index, _ = open_index(config)
        try:
            return {node.node_id for node in await index.nodes()}
        finally:
            await index.close()

    return asyncio.run(listing())


# -- configuration --------------------------------------------------------------------------------
def test_index_tls_and_credentials_are_validated_at_load(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here: the TLS handshake reads it")
    with pytest.raises(ConfigError, match=r"index\.tls_ca .*rediss://"):
        IndexConfig(backend="redis://127.0.0.1:6379/0", tls_ca=ca)
    with pytest.raises(ConfigError, match=r"index\.tls_cert and index\.tls_key"):
        IndexConfig(backend="rediss://127.0.0.1:6379/0", tls_ca=ca, tls_cert=ca)
    with pytest.raises(ConfigError, match=r"index\.tls_ca .*cannot be read"):
        IndexConfig(backend="rediss://127.0.0.1:6379/0", tls_ca=tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match=r"index\.password .*URL"):
        IndexConfig(backend="rediss://u:p@127.0.0.1:6379/0", password="other")
    with pytest.raises(ConfigError, match=r"index\.username .*index\.password"):
        IndexConfig(backend="rediss://127.0.0.1:6379/0", username="someone")
    with pytest.raises(ConfigError, match=r"index\.tls_ca"):
        IndexConfig(tls_ca=ca)  # the embedded index talks to no one
    environ = {"KVSTORE_INDEX_PASSWORD": "from-env", "KVSTORE_INDEX_USERNAME": "u", "KVSTORE_INDEX_BACKEND": "rediss://h:1/0"}
    config = load_config(environ=environ, overrides={"nvme": {"enabled": "false"}}).index
    assert (config.username, config.password) == ("u", "from-env")
    assert "from-env" not in repr(config)


# -- TLS, client certificates, ACL users ----------------------------------------------------------
@pytest.mark.slow
def test_a_daemon_publishes_over_mutual_tls_as_an_acl_user(tls_redis, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_INDEX_PASSWORD", PASSWORD)  # never on a command line, where ps shows it
    with daemons(tmp_path) as start:
        daemon = start(extra=_tls_settings(tls_redis))
        access = {"tls_ca": Path(tls_redis.path("ca.pem")), "tls_cert": Path(tls_redis.path("client.pem"))}
        config = IndexConfig(backend=tls_redis.url, **access, tls_key=Path(tls_redis.path("client.key")), username=USER, password=PASSWORD)
        assert eventually(lambda: daemon.node_id in _index_nodes(config))
        in_url = IndexConfig(backend=f"rediss://{USER}:{PASSWORD}@127.0.0.1:{tls_redis.port}/0", **access, tls_key=config.tls_key)
        assert daemon.node_id in _index_nodes(in_url)  # credentials may come in the URL instead
    assert PASSWORD not in daemon.log()


def test_the_router_reads_a_tls_index_with_the_variables_a_daemon_takes(tls_redis, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_INDEX_PASSWORD", PASSWORD)
    with daemons(tmp_path) as start:
        daemon = start(extra=_tls_settings(tls_redis))
        environ = {
            "KVSTORE_INDEX_TLS_CA": tls_redis.path("ca.pem"),
            "KVSTORE_INDEX_TLS_CERT": tls_redis.path("client.pem"),
            "KVSTORE_INDEX_TLS_KEY": tls_redis.path("client.key"),
            "KVSTORE_INDEX_USERNAME": USER,
            "KVSTORE_INDEX_PASSWORD": PASSWORD,
            "KVSTORE_SERVER_NODE_ID": "ignored: the router reads the index's access alone",
        }
        assert eventually(lambda: daemon.node_id in _index_nodes(index_config_for(tls_redis.url, environ)))
        with pytest.raises(IndexUnavailable):  # without them the same URL is refused
            _index_nodes(index_config_for(tls_redis.url, {}))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "changes", "sentence"),
    [
        ("wrong password", {}, r"password"),
        ("no client certificate", {"index.tls_cert": "", "index.tls_key": ""}, r"certificate"),
        ("untrusted server", {"index.tls_ca": "other-ca.pem"}, r"certificate"),
    ],
)
def test_a_daemon_refuses_to_start_with_credentials_redis_refuses(tls_redis, tmp_path, monkeypatch, case, changes, sentence):
    monkeypatch.setenv("KVSTORE_INDEX_PASSWORD", "wrong" if case == "wrong password" else PASSWORD)
    if "index.tls_ca" in changes:
        changes = {"index.tls_ca": tls_redis.path(changes["index.tls_ca"])}
    started = time.monotonic()
    with daemons(tmp_path) as start:
        try:
            daemon = start(extra=_tls_settings(tls_redis, **changes))
        except DaemonUnavailable as exc:
            message = str(exc)
        else:
            pytest.fail(f"the daemon started although Redis refuses it ({case}): {daemon.log()}")
    assert "exited" in message and time.monotonic() - started < 20, "a refusal must not wait out retries for long"
    assert "index" in message and re.search(sentence, message, flags=re.IGNORECASE), message
    assert PASSWORD not in message


@pytest.mark.slow
def test_a_handshake_alone_tells_whether_redis_refuses_this_certificate(tls_redis):
    """The verdict a refused start relies on when a command's reset hid Redis's alert."""
    trusted = {"tls_ca": Path(tls_redis.path("ca.pem"))}
    certified = {**trusted, "tls_cert": Path(tls_redis.path("client.pem")), "tls_key": Path(tls_redis.path("client.key"))}
    for _ in range(5):
        assert isinstance(asyncio.run(tls_refusal(tls_redis.url, RedisAccess(**trusted))), ssl.SSLError)
    assert asyncio.run(tls_refusal(tls_redis.url, RedisAccess(**certified))) is None
    assert isinstance(asyncio.run(tls_refusal(tls_redis.url, RedisAccess(tls_ca=Path(tls_redis.path("other-ca.pem"))))), ssl.SSLError)


# -- deadlines --------------------------------------------------------------------------------------
def _metric(daemon, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}{{{wanted}}}"))


@contextlib.contextmanager
def _frozen(process: subprocess.Popen):
    """Redis alive but silent: connections open, nothing answers (a stalled host)."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


class StalledIndex(EmbeddedIndex):
    """An index whose backend stopped answering: every lookup waits for ever."""

    async def match(self, namespace, hashes, node_ids=None):
        await asyncio.Event().wait()

    async def nodes(self):
        await asyncio.Event().wait()


def test_the_transfer_service_gives_up_an_index_lookup_at_its_callers_deadline():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
    namespace = Namespace("test/stalled-index", layout)
    host = MemoryTier(TierKind.HOST, torch.zeros(16 * layout.block_bytes, dtype=torch.uint8), page_bytes=4 * layout.block_bytes)
    node = Node("a", TierManager(TierManagerConfig(), [host]), Metrics())
    node.register_namespace(namespace)
    hashes = chain_hashes(list(range(6 * layout.block_size)), layout.block_size)
    node.manager.put(namespace.digest, hashes[:2], [torch.zeros(layout.block_bytes, dtype=torch.uint8)] * 2)

    def timeouts(op: str) -> float:
        return node.metrics.registry.get_sample_value("kvstore_index_timeouts_total", {"op": op}) or 0.0

    async def main():
        service = TransferService(node, MemoryTransport(), TransportConfig(connect_timeout_s=0.3), StalledIndex())
        try:
            assert await service.fetch_missing(namespace.digest, hashes, deadline_s=0.2) == 2
            assert await service.locate(namespace.digest, hashes, 2, deadline_s=0.2) == ("", 2)
            assert await service.locate(namespace.digest, hashes, 2, source="b") == ("", 2)  # no deadline: connect_timeout_s
        finally:
            await service.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert (timeouts("fetch"), timeouts("locate")) == (1, 2)


@pytest.mark.slow
def test_a_frozen_redis_costs_load_and_fetch_only_their_deadline(redis, tmp_path):
    settings = {"index.backend": redis.url, "index.heartbeat_interval_s": "0.5", "index.publish_interval_s": "0.05"}
    hashes = chain_hashes([(11 * 7919 + i) % 50_000 for i in range(8 * LAYOUT.block_size)], LAYOUT.block_size)
    with daemons(tmp_path) as start:
        daemon = start(extra=settings)
        assert eventually(lambda: daemon.node_id in _index_nodes(IndexConfig(backend=redis.url)))
        with KVStoreClient(str(daemon.socket)) as client:
            digest = client.register_namespace(NAMESPACE)
            assert client.save(digest, hashes[:4], [kv_for(h) for h in hashes[:4]]) == 4
            into = [torch.empty(LAYOUT.block_bytes // 2, dtype=torch.float16) for _ in hashes]
            with _frozen(redis.process):
                started = time.monotonic()
                loaded = client.load(digest, hashes, into, allow_remote=True, deadline_s=0.2)
                load_s = time.monotonic() - started
                started = time.monotonic()
                fetched = client.fetch(digest, hashes, deadline_s=0.2)
                fetch_s = time.monotonic() - started
            assert loaded == 4 and all(torch.equal(t, kv_for(h)) for t, h in zip(into[:4], hashes))
            assert fetched == 4
            timeouts = _metric(daemon, "kvstore_index_timeouts_total", op="fetch")
            # the lookups given up left the daemon's Redis connections usable: the next one answers in time
            assert client.fetch(digest, hashes, deadline_s=10) == 4
            assert _metric(daemon, "kvstore_index_timeouts_total", op="fetch") == timeouts
        assert load_s < 1.5, f"a load with a 0.2 s deadline took {load_s:.2f} s on a frozen Redis"
        assert fetch_s < 1.5, f"a fetch with a 0.2 s deadline took {fetch_s:.2f} s on a frozen Redis"
        assert _metric(daemon, "kvstore_index_timeouts_total", op="locate") >= 1
        assert _metric(daemon, "kvstore_index_timeouts_total", op="fetch") >= 1
