"""The pieces bench.transport and bench.daemon measure peer authentication with: the fleet
credentials they configure, the secured links and the raw TLS baseline, which must move
the same bytes intact (a block that failed its checksum or MAC raises), the handshake
timings, and the count of connections a process holds to a peer; and a TLS channel's
receive of a last record that arrives in parts, which the raw TLS baseline must not stall on."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import pytest

from bench.daemon import connections_to
from bench.transport import FramedLink, RawTlsLink, bench_handshakes, cpu_seconds, fleet_credentials, median_round
from kvstore.transport.auth import tls_context
from kvstore.transport.config import TransportConfig
from kvstore.transport.tcp import _TlsChannel
from kvstore.transport.wire import block_header

MiB = 1 << 20


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    return fleet_credentials(tmp_path_factory.mktemp("credentials"))


def test_each_mode_configures_the_transport_it_names(credentials):
    plain, mac, tls = (TransportConfig(kind="tcp", **credentials[mode]) for mode in ("plain", "mac", "tls"))
    assert not plain.authenticates
    assert mac.authenticates and not mac.uses_tls
    assert tls.authenticates and tls.uses_tls
    assert os.stat(credentials["mac"]["peer_secret_file"]).st_mode & 0o077 == 0  # the daemon refuses a readable secret


@pytest.mark.slow
def test_the_secured_channels_and_the_raw_tls_socket_move_every_block_intact(credentials):
    destination = memoryview(bytearray(4 * MiB))

    async def run() -> list[float]:
        seconds = []
        async with FramedLink("tcp", destination, credentials["mac"]) as mac, FramedLink("tcp", destination, credentials["tls"]) as tls:
            async with RawTlsLink(destination, credentials["tls"]) as raw_tls:
                assert raw_tls.cipher[1] == "TLSv1.3"
                for link in (mac, tls, raw_tls):
                    for block_bytes in (256 << 10, MiB):  # every block verified as it lands, or CorruptBlock
                        seconds.append(await link.run(block_bytes))
                seconds.append(await raw_tls.run(len(destination)))  # one sendall of everything
                assert cpu_seconds(raw_tls.sender.pid) > 0
        return seconds

    assert all(s > 0 for s in asyncio.run(asyncio.wait_for(run(), 120)))


@pytest.mark.slow
def test_the_handshake_is_timed_for_every_mode(credentials):
    figures = asyncio.run(asyncio.wait_for(bench_handshakes(credentials, 3), 120))
    assert {mode for mode, _ in figures} == {"plain", "mac", "tls"}
    for timings in figures.values():
        assert timings["connect_us"] > 0 and timings["round_trip_us"] > 0
        assert timings["handshake_us"] == timings["first_reply_us"] - timings["raw_first_reply_us"]


def test_connections_to_finds_each_connection_this_process_holds_to_a_port():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as other:
        port = server.getsockname()[1]
        assert connections_to(os.getpid(), port) == set()
        with socket.create_connection(("127.0.0.1", port)) as first, socket.create_connection(("127.0.0.1", port)) as second:
            with socket.create_connection(("127.0.0.1", other.getsockname()[1])):
                assert connections_to(os.getpid(), port) == {first.getsockname()[1], second.getsockname()[1]}


def test_a_tls_channel_receives_a_payload_whose_last_record_arrives_in_two_parts(credentials):
    """The receiver takes the first part of the last record into OpenSSL's buffer; it must
    then wake for the rest, which is fewer bytes than the payload still to come."""
    security = credentials["tls"]
    payload = bytes(range(256)) * 256  # 64 KiB: four 16 KiB records
    hold_back = 5000  # of the last record's ciphertext, sent 0.3 s after the rest

    async def receive() -> bytes:
        server = tls_context(security["tls_cert"], security["tls_key"], security["tls_ca"], server_side=True)
        client = tls_context(security["tls_cert"], security["tls_key"], security["tls_ca"], server_side=False)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            raw = socket.create_connection(listener.getsockname())
            conn, _ = listener.accept()
        conn.setblocking(False)
        channel = _TlsChannel(server.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), "tls peer", 16, lambda _: None)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sender = client.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")  # ciphertext we cut where we like

        def client_handshake() -> None:
            raw.settimeout(5)
            while True:
                try:
                    sender.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    raw.sendall(outgoing.read())
                    incoming.write(raw.recv(1 << 16))
            raw.sendall(outgoing.read())

        try:
            await asyncio.gather(channel.secure(), asyncio.to_thread(client_handshake))
            sender.write(block_header(1, bytes(16), bytes(16), payload, 0).pack())
            sender.write(payload)
            ciphertext = outgoing.read()
            raw.sendall(ciphertext[:-hold_back])
            asyncio.get_running_loop().call_later(0.3, raw.sendall, ciphertext[-hold_back:])
            header = await channel.recv_header()
            into = bytearray(header.length)
            await asyncio.wait_for(channel.recv_payload(memoryview(into)), 3)
            return bytes(into)
        finally:
            await channel.close()
            raw.close()

    assert asyncio.run(receive()) == payload


def test_median_round_takes_both_figures_from_the_round_with_the_median_ratio():
    link = [2.0, 1.0, 4.0, 1.5, 3.0]  # seconds; the baseline 1 s each round: ratios 0.5, 1, 0.25, 0.67, 0.33
    assert median_round(link, [1.0] * 5) == (2.0, 1.0)
    assert median_round([1.0, 2.0], [1.0, 1.0]) == (2.0, 1.0)  # an even count: the lower of the two middle ratios
