"""Peer authentication against real daemons and real transports: a fleet secret and mutual
TLS let peers fetch from each other and refuse everyone else before any request; a frame
forged or replayed on the way fails its MAC or its counter; a daemon exposed beyond
loopback without authentication refuses to start; the channel limits and the handshake
deadline hold; an engine's reader credential fetches and nothing else; the daemon prints
its security posture."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import trustme
import xxhash
from daemon_harness import daemons
from daemon_harness import eventually as _eventually
from peer_wire import open_raw
from test_peers import ENGINE, engine, indexed, metric

from kvstore.errors import CorruptBlock, PermissionDenied, TransferFailed
from kvstore.localproto import pack_hashes
from kvstore.spawn import serve_command
from kvstore.transport.auth import ClientHandshake, PeerAuth, fleet_key, tls_context
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, block_header, control_header, decode_control, encode_control

SECRET = "0123456789abcdef0123456789abcdef-fleet"
pytestmark = pytest.mark.slow


def eventually(check):
    return _eventually(check, timeout_s=15.0)


def secret_file(tmp_path: Path, secret: str = SECRET) -> Path:
    path = tmp_path / f"peer-secret-{xxhash.xxh32_hexdigest(secret.encode())}"
    path.write_text(secret)
    path.chmod(0o600)
    return path


@pytest.fixture
def fleet(tmp_path, redis):
    settings = {
        "index.backend": redis.url,
        "index.lease_ttl_s": "3",
        "index.heartbeat_interval_s": "0.5",
        "index.publish_interval_s": "0.05",
        "transport.kind": "tcp",
    }
    with daemons(tmp_path) as start:

        def start_node(node_id: str, **extra) -> object:
            return start(node_id=node_id, extra={**settings, **extra})

        yield start_node


class Certificates:
    """A fleet CA with a certificate for loopback, and a stranger's CA with one too."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(exist_ok=True)
        self.directory = directory
        fleet, stranger = trustme.CA(), trustme.CA()
        self.ca = self._write(fleet.cert_pem, "ca.pem")
        self.cert, self.key = self._issue(fleet, "node")
        self.stranger_cert, self.stranger_key = self._issue(stranger, "stranger")

    def _write(self, blob, name: str) -> str:
        path = self.directory / name
        blob.write_to_path(str(path))
        path.chmod(0o600)
        return str(path)

    def _issue(self, ca: trustme.CA, name: str) -> tuple[str, str]:
        issued = ca.issue_cert("127.0.0.1", "localhost")
        return self._write(issued.cert_chain_pems[0], f"{name}.pem"), self._write(issued.private_key_pem, f"{name}.key")

    def settings(self) -> dict[str, str]:
        return {"transport.tls_cert": self.cert, "transport.tls_key": self.key, "transport.tls_ca": self.ca}


def refused_log_lines(daemon) -> int:
    path = daemon.workdir / f"daemon-{daemon.node_id}.log"
    return len(re.findall(r"refused a peer connection from 127\.0\.0\.1", path.read_text(errors="replace")))


def unauthenticated_store(address: str, hashes: list[bytes], payload: bytes) -> bytes:
    """What an attacker without the secret tries: open the conversation and go straight to a
    store of bytes of its choosing. Returns what the daemon answered (an ERROR frame's bytes)."""
    with socket.create_connection(tuple(address[len("tcp://") :].rsplit(":", 1)), timeout=5) as sock:
        hello = encode_control(ClientHandshake(PeerAuth(), tls=False).hello())
        sock.sendall(control_header(FrameKind.AUTH, 0, hello).pack() + hello)
        request = encode_control({"op": "store", "namespace": [], "hashes": pack_hashes(hashes), "parent": None})
        sock.sendall(control_header(FrameKind.CONTROL, 1, request).pack() + request)
        for index, key in enumerate(hashes):
            sock.sendall(block_header(1, bytes(16), key, payload, index).pack() + payload)
        answer = bytearray()
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
        return bytes(answer)


def frames_in(data: bytes) -> list[tuple[FrameHeader, bytes]]:
    frames, offset = [], 0
    while offset + HEADER_BYTES <= len(data):
        header = FrameHeader.unpack(data[offset : offset + HEADER_BYTES])
        frames.append((header, data[offset + HEADER_BYTES : offset + HEADER_BYTES + header.length]))
        offset += HEADER_BYTES + header.length
    return frames


# -- a fleet secret ------------------------------------------------------------------------------
def test_peers_with_the_fleet_secret_fetch_and_strangers_are_refused_before_any_request(fleet, tmp_path):
    secret = {"transport.peer_secret_file": str(secret_file(tmp_path))}
    a, b = fleet("a", **secret), fleet("b", **secret)
    assert engine(a, "save", 1, 12, script=ENGINE)[0]["stored"] == 12
    assert eventually(lambda: indexed(b, "a"))
    fetched = engine(b, "fetch", 1, 12)[0]  # the engine reads from a itself, with the reader key b handed it
    assert fetched["loaded"] == 12 and fetched["intact"]

    # no secret: the daemon proves it holds one, and the stranger cannot answer
    with pytest.raises(PermissionDenied, match="requires a fleet secret"):
        open_raw(a.transport_address)
    # a wrong secret: the daemon's proof does not check out, and the stranger would not be let in either
    with pytest.raises(PermissionDenied, match="did not prove"):
        open_raw(a.transport_address, PeerAuth(key=fleet_key("not the fleet's secret, but long enough")))
    # skipping the proof: a store straight after the hello is refused, and nothing is stored
    planted = [bytes([0xEE]) * 16, bytes([0xEF]) * 16]
    for _ in range(5):
        answer = unauthenticated_store(a.transport_address, planted, b"\x66" * 1024)
        kinds = [header.kind for header, _ in frames_in(answer)]
        assert FrameKind.ERROR in kinds and FrameKind.CONTROL not in kinds and FrameKind.END not in kinds
    error_header, error = next((header, payload) for header, payload in frames_in(answer) if header.kind is FrameKind.ERROR)
    assert decode_control(error_header, error)[0] in ("InvalidArgument", "PermissionDenied")
    assert metric(a, 'kvstore_peer_refused_connections_total{reason="refused"}') >= 5
    assert metric(a, "kvstore_stored_blocks_total") == 12  # the engine's, none of the stranger's
    assert 1 <= refused_log_lines(a) <= 2  # refusals from one host are logged once a minute, counted always


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (pip install 'kvstore[ucx]')")
def test_ucx_peers_authenticate_with_the_fleet_secret_and_seal_every_frame(fleet, tmp_path, monkeypatch):
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    secret = {"transport.kind": "ucx", "transport.peer_secret_file": str(secret_file(tmp_path))}
    a, b = fleet("a", **secret), fleet("b", **secret)
    stranger = fleet("stranger", **{"transport.kind": "ucx"})  # same index, no secret
    assert engine(a, "save", 4, 8, script=ENGINE)[0]["stored"] == 8
    assert eventually(lambda: indexed(b, "a") and indexed(stranger, "a"))
    fetched = engine(b, "fetch", 4, 8)[0]  # a UCX peer: b's daemon fetches for its engine
    assert fetched["loaded"] == 8 and fetched["intact"]
    assert engine(stranger, "fetch", 4, 8)[0]["loaded"] == 0
    assert eventually(lambda: metric(a, "kvstore_peer_refused_connections_total") >= 1)


def test_a_daemon_without_the_secret_cannot_fetch_from_one_that_has_it(fleet, tmp_path):
    a = fleet("a", **{"transport.peer_secret_file": str(secret_file(tmp_path))})
    b = fleet("b", **{"transport.peer_secret_file": str(secret_file(tmp_path, "another fleet's secret, 32+ characters"))})
    assert engine(a, "save", 2, 8, script=ENGINE)[0]["stored"] == 8
    assert eventually(lambda: indexed(b, "a"))
    fetched = engine(b, "fetch", 2, 8)[0]
    assert fetched["loaded"] == 0  # a miss to the engine, never an error
    assert eventually(lambda: metric(a, "kvstore_peer_refused_connections_total") >= 1)
    assert metric(a, "kvstore_transfer_blocks_total") == 0


# -- mutual TLS ----------------------------------------------------------------------------------
def test_mutual_tls_peers_fetch_and_other_certificates_or_plain_tcp_are_refused(fleet, tmp_path):
    certs = Certificates(tmp_path / "certs")
    a, b = fleet("a", **certs.settings()), fleet("b", **certs.settings())
    assert engine(a, "save", 3, 10, script=ENGINE)[0]["stored"] == 10
    assert eventually(lambda: indexed(b, "a"))
    fetched = engine(b, "fetch", 3, 10)[0]
    assert fetched["loaded"] == 10 and fetched["intact"]

    stranger = tls_context(certs.stranger_cert, certs.stranger_key, certs.ca, server_side=False)
    with pytest.raises((TransferFailed, PermissionDenied)):
        open_raw(a.transport_address, PeerAuth(client_tls=stranger))  # its certificate does not chain to the fleet's CA
    with pytest.raises((TransferFailed, OSError, CorruptBlock)):
        open_raw(a.transport_address)  # plain TCP where TLS is due
    fleet_client = tls_context(certs.cert, certs.key, certs.ca, server_side=False)
    sock, seal = open_raw(a.transport_address, PeerAuth(client_tls=fleet_client))
    sock.close()
    assert seal is None  # TLS protects the frames: no MAC on them
    assert eventually(lambda: metric(a, "kvstore_peer_refused_connections_total") >= 2)


# -- the seal on every frame --------------------------------------------------------------------
async def _through_proxy(config: TransportConfig, rewrite) -> tuple:
    """A client and a server channel over TCP with a proxy between them that passes the
    client's frames through ``rewrite(header, payload) -> [(header, payload)…]``."""
    server, client = open_transport(config), open_transport(config)
    accepted: asyncio.Queue = asyncio.Queue()
    finished = asyncio.Event()

    async def on_channel(channel):
        await accepted.put(channel)
        await finished.wait()

    address = await server.listen("127.0.0.1", 0, on_channel)

    async def pump_frames(reader, writer):
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                header = FrameHeader.unpack(await reader.readexactly(HEADER_BYTES))
                payload = await reader.readexactly(header.length)
                for out_header, out_payload in rewrite(header, payload):
                    writer.write(out_header.pack() + out_payload)
                await writer.drain()
        writer.close()

    async def pump_bytes(reader, writer):
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def on_client(client_reader, client_writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", int(address.rpartition(":")[2]))
        await asyncio.gather(pump_frames(client_reader, upstream_writer), pump_bytes(upstream_reader, client_writer))

    proxy = await asyncio.start_server(on_client, "127.0.0.1", 0)
    channel = await client.connect(f"tcp://127.0.0.1:{proxy.sockets[0].getsockname()[1]}", timeout_s=10)

    async def close():
        finished.set()
        proxy.close()
        await client.close()
        await server.close()

    return channel, await accepted.get(), close


def _forge(header: FrameHeader, payload: bytes) -> list[tuple[FrameHeader, bytes]]:
    """An on-path forger: a block's bytes changed, its checksum and header check made to match."""
    if header.kind is not FrameKind.BLOCK:
        return [(header, payload)]
    forged = bytes([payload[0] ^ 0xFF]) + payload[1:]
    return [(dataclasses.replace(header, checksum=xxhash.xxh3_64_intdigest(forged)), forged)]


def _replay(header: FrameHeader, payload: bytes) -> list[tuple[FrameHeader, bytes]]:
    return [(header, payload), (header, payload)] if header.kind is FrameKind.BLOCK else [(header, payload)]


def _received(server_channel) -> tuple:
    async def receive():
        header = await server_channel.recv_header()
        slot = bytearray(header.length)
        await server_channel.recv_payload(memoryview(slot))
        return header, slot

    return receive()


def test_a_block_forged_on_the_way_fails_its_mac_where_a_checksum_alone_would_pass():
    payload = os.urandom(64 << 10)

    async def body(config: TransportConfig):
        client, server, close = await _through_proxy(config, _forge)
        try:
            await client.send(block_header(1, bytes(16), bytes(range(16)), payload, 0), payload)
            header, slot = await _received(server)
            try:
                server.verify(header, slot)
            except CorruptBlock as exc:
                return str(exc)
            return None
        finally:
            await close()

    assert asyncio.run(body(TransportConfig())) is None  # unauthenticated: the forgery's checksum matches
    refusal = asyncio.run(body(TransportConfig(peer_secret=SECRET)))
    assert refusal is not None and "MAC" in refusal


def test_a_frame_replayed_on_the_way_breaks_the_channel():
    payload = os.urandom(4096)

    async def body():
        client, server, close = await _through_proxy(TransportConfig(peer_secret=SECRET), _replay)
        try:
            await client.send(block_header(1, bytes(16), bytes(range(16)), payload, 0), payload)
            header, slot = await _received(server)
            server.verify(header, slot)
            with pytest.raises(CorruptBlock, match="number 0 where 1 was due"):
                await server.recv_header()
        finally:
            await close()

    asyncio.run(body())


# -- fail closed, and say so ---------------------------------------------------------------------
def _settings(workdir: Path, **extra: str) -> dict[str, str]:
    return {
        "server.grpc_port": "0",
        "server.metrics_port": "-1",
        "host.capacity_bytes": "64MiB",
        "host.page_bytes": "4MiB",
        "host.name": f"kvstore-test-posture-{workdir.name}",
        "nvme.enabled": "false",
        **extra,
    }


def test_a_daemon_exposed_beyond_loopback_without_authentication_refuses_to_start(tmp_path):
    command = serve_command(tmp_path / "kvstore.sock", _settings(tmp_path, **{"transport.host": "0.0.0.0"}))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "transport.peer_secret" in done.stderr + done.stdout and "allow_unauthenticated" in done.stderr + done.stdout
    assert not (tmp_path / "kvstore.sock").exists()


def test_the_daemon_prints_its_security_posture_and_warns_loudly_when_told_to_run_open(tmp_path):
    with daemons(tmp_path) as start:
        daemon = start(node_id="posture", extra={"transport.host": "0.0.0.0", "transport.allow_unauthenticated": "true"})
        log = (daemon.workdir / "daemon-posture.log").read_text()
    for surface in ("local socket", "host slab", "NVMe files", "gRPC", "metrics", "peer transport", "router"):
        assert re.search(rf"security posture: {surface}\s", log), surface
    assert "THE PEER PORT IS NOT AUTHENTICATED" in log
    assert re.search(r"security posture: peer transport .*\[OPEN\]", log)


# -- limits before authentication ----------------------------------------------------------------
def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_channel_limits_a_handshake_deadline_and_a_bounded_first_frame(tmp_path):
    limits = {"transport.max_peer_channels": "4", "transport.max_peer_channels_per_source": "3", "transport.handshake_timeout_s": "2"}
    with daemons(tmp_path) as start:
        daemon = start(node_id="limits", extra=limits)
        host, port = daemon.transport_address[len("tcp://") :].rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(5)]
        time.sleep(0.3)
        # over the per-source limit: closed at once, before the handshake deadline
        assert sum(_closed_by_peer(sock, 0.2) for sock in silent) == 2
        started = time.monotonic()
        assert all(_closed_by_peer(sock, 3) for sock in silent)  # the rest, at the handshake deadline
        assert time.monotonic() - started < 4
        # a first frame that announces 64 MiB is refused from its header, nothing allocated for it
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            header = FrameHeader(FrameKind.AUTH, 0, length=64 << 20)
            sock.sendall(header.pack())
            assert _closed_by_peer(sock, 3)
        log = (daemon.workdir / "daemon-limits.log").read_text()
        assert "max_peer_channels_per_source" in log
        for sock in silent:
            sock.close()


# -- an engine's credential ----------------------------------------------------------------------
def test_the_reader_credential_an_engine_is_handed_fetches_but_cannot_store(fleet, tmp_path):
    a = fleet("a", **{"transport.peer_secret_file": str(secret_file(tmp_path))})
    reader = PeerAuth(key=fleet_key(SECRET)).for_reader()
    sock, seal = open_raw(a.transport_address, reader)
    with sock:
        request = encode_control({"op": "hot", "max_bytes": 1 << 20})
        header = seal.sign(control_header(FrameKind.CONTROL, 1, request), request)
        sock.sendall(header.pack() + request)
        answer = bytearray()
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    [(header, payload)] = frames_in(bytes(answer))
    assert header.kind is FrameKind.ERROR
    assert decode_control(header, payload)[0] == "PermissionDenied"
    # the same credential reads: it is what the engine in the first test fetched with
    sock, _ = open_raw(a.transport_address, reader)
    sock.close()
