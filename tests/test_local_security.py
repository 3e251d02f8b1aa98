"""Local multi-user safety, tested as another local user would try it: a second uid (65534)
reads no slot file, cannot hijack a socket directory, cannot call the gRPC API without the
daemon's token; a member of the socket's group maps the slab and saves and loads."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_harness import daemons

from kvstore.api.client import ApiError, connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.paths import load_or_create_token, token_for

pytestmark = pytest.mark.slow

ENGINE = Path(__file__).with_name("engine_proc.py")
OTHER_UID = 65534
GROUP_ID = 4242  # the socket's group in group mode; the other uid joins it where a test says so


def as_other_user(argv: list[str], groups: tuple[int, ...] = (), env: dict[str, str] | None = None, timeout_s: float = 60.0):
    """Run ``argv`` as uid/gid 65534 (in ``groups`` only), with no kvstore token in its environment."""
    group_flag = ["--groups=" + ",".join(map(str, groups))] if groups else ["--clear-groups"]
    environment = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "PYTHONPATH": str(Path(__file__).parent), **(env or {})}
    command = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", *group_flag, *argv]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout_s)


@pytest.fixture(scope="module", autouse=True)
def checkout_reachable():
    """The other uid runs kvstore from this checkout, so every folder above it must let
    others through (o+x: to pass, not to list or read). A checkout under a private folder
    (``mktemp -d`` makes one 0700) has it opened for this module's run and closed after."""
    opened = []
    for folder in Path(__file__).resolve().parents:
        mode = stat.S_IMODE(folder.stat().st_mode)
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)
            opened.append((folder, mode))
    yield
    for folder, mode in reversed(opened):
        folder.chmod(mode)


@pytest.fixture
def shared_tmp(monkeypatch):
    """A work directory the other uid can traverse (pytest's own is 0700), and a token cache
    of this test's own, so that the daemon and this process agree on where the token is."""
    base = Path(tempfile.mkdtemp(prefix="kvstore-local-security-"))
    base.chmod(0o711)
    cache = base / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def daemon(shared_tmp):
    with daemons(shared_tmp) as start:
        yield start


def test_another_user_cannot_read_nvme_slot_files_even_ones_an_older_run_left_loose(daemon, shared_tmp):
    # an older run left the directory 0755 and a slot file 0644
    workdir = shared_tmp / "loose"
    workdir.mkdir()
    nvme = workdir / "nvme"
    nvme.mkdir(mode=0o755)
    nvme.chmod(0o755)
    leftover = nvme / "slots-000.dat"
    leftover.write_bytes(b"\0" * 4096)
    leftover.chmod(0o644)
    d = daemon(extra={"nvme.directory": str(nvme)})
    slot_files = sorted(nvme.glob("slots-*.dat"))
    assert slot_files, d.log()
    assert stat.S_IMODE(nvme.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in slot_files)
    read = as_other_user([sys.executable, "-c", f"open({str(slot_files[0])!r}, 'rb').read(1)"])
    assert read.returncode != 0 and "PermissionError" in read.stderr


def test_a_socket_directory_owned_by_another_user_is_refused(shared_tmp):
    hijacked = shared_tmp / "hijacked"
    hijacked.mkdir()
    os.chown(hijacked, OTHER_UID, OTHER_UID)  # another user made the socket's directory first
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--set", f"server.socket_path={hijacked / 'kvstore.sock'}"]
        + ["--set", "nvme.enabled=false", "--set", "host.capacity_bytes=64MiB", "--set", "host.page_bytes=4MiB"]
        + ["--set", "server.grpc_port=0", "--set", "server.metrics_port=-1", "--set", f"host.name=kvstore-test-hijack-{shared_tmp.name}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert f"{hijacked} is owned by uid {OTHER_UID}" in result.stderr, result.stderr[-2000:]
    assert not (hijacked / "kvstore.sock").exists()
    # a client refuses to trust the same directory: a daemon there may be anyone's
    status = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(hijacked / "kvstore.sock"), "status"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode != 0 and f"{hijacked} is owned by uid {OTHER_UID}" in status.stderr, status.stderr
    # nor does an engine connect to the other user's listener there
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(hijacked / "kvstore.sock"))
    listener.listen()
    try:
        engine = subprocess.run(
            [sys.executable, str(ENGINE), str(hijacked / "kvstore.sock"), "save", "1", "1"], capture_output=True, text=True, timeout=60
        )
    finally:
        listener.close()
    assert engine.returncode != 0 and "not trusting the kvstore socket" in engine.stderr, engine.stderr[-2000:]


def test_the_default_socket_directory_pre_created_by_another_user_is_refused(shared_tmp):
    # uid 65533 has no XDG_RUNTIME_DIR, so its default is /tmp/kvstore-65533; uid 65534 made it first
    victim_uid = 65533
    taken = Path(f"/tmp/kvstore-{victim_uid}")
    shutil.rmtree(taken, ignore_errors=True)
    taken.mkdir(mode=0o755)
    os.chown(taken, OTHER_UID, OTHER_UID)
    try:
        home = shared_tmp / "victim-home"
        home.mkdir()
        os.chown(home, victim_uid, victim_uid)
        command = ["setpriv", f"--reuid={victim_uid}", f"--regid={victim_uid}", "--clear-groups", sys.executable, "-m", "kvstore"]
        environment = {"PATH": os.environ["PATH"], "HOME": str(home)}
        serve = subprocess.run(
            [*command, "serve", "--set", "nvme.enabled=false", "--set", "host.capacity_bytes=64MiB", "--set", "host.page_bytes=4MiB"]
            + [
                "--set",
                "server.grpc_port=0",
                "--set",
                "server.metrics_port=-1",
                "--set",
                f"host.name=kvstore-test-victim-{shared_tmp.name}",
            ],
            capture_output=True,
            text=True,
            env=environment,
            timeout=60,
        )
        assert serve.returncode != 0
        assert f"{taken} is owned by uid {OTHER_UID}" in serve.stderr, serve.stderr[-2000:]
        assert not (taken / "kvstore.sock").exists()
    finally:
        shutil.rmtree(taken, ignore_errors=True)


def test_grpc_refuses_another_user_without_the_token_and_the_cli_needs_none(daemon, shared_tmp):
    d = daemon()  # no server.auth_token configured
    token_file = shared_tmp / "cache" / "kvstore" / "grpc-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and stat.S_IMODE(d.state_file.stat().st_mode) == 0o600
    probe = (
        "from kvstore.api.client import connect, ApiError\n"
        "from kvstore.api.v1 import kvstore_pb2 as pb\n"
        f"client = connect({d.address!r})\n"
        "print(client.health())\n"
        "try:\n"
        "    client.admin.Evict(pb.EvictRequest(all=True))\n"
        "    print('EVICTED')\n"
        "except ApiError as exc:\n"
        "    print(exc.code)\n"
    )
    other = as_other_user([sys.executable, "-c", probe])
    assert other.stdout.split() == ["SERVING", "UNAUTHENTICATED"], other.stderr[-2000:]
    with connect(d.address) as client:  # the daemon's user: the token is read from its file
        assert client.admin.Stats(pb.StatsRequest()).node_id == d.node_id
    with connect(d.address, token="") as client:
        with pytest.raises(ApiError) as info:
            client.admin.Stats(pb.StatsRequest())
        assert info.value.code == "UNAUTHENTICATED"
    cli = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(d.socket), "--json", "stats"], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0 and json.loads(cli.stdout)["node_id"] == d.node_id, cli.stderr


def test_a_member_of_the_socket_group_maps_the_slab_and_saves_and_loads(daemon):
    d = daemon(extra={"server.socket_mode": "0o660", "server.socket_group": str(GROUP_ID)})
    slab = Path(d.state["host_slab"])
    assert stat.S_IMODE(slab.stat().st_mode) == 0o660 and slab.stat().st_gid == GROUP_ID
    assert d.socket.stat().st_gid == GROUP_ID
    assert stat.S_IMODE(d.state_file.stat().st_mode) == 0o640 and d.state_file.stat().st_gid == GROUP_ID
    saved = as_other_user([sys.executable, str(ENGINE), str(d.socket), "save", "5", "8"], groups=(GROUP_ID,))
    assert saved.returncode == 0, saved.stderr[-2000:]
    assert json.loads(saved.stdout.splitlines()[-1]) == {"stored": 8}
    loaded = as_other_user([sys.executable, str(ENGINE), str(d.socket), "load", "5", "8"], groups=(GROUP_ID,))
    assert json.loads(loaded.stdout.splitlines()[-1]) == {"loaded": 8, "intact": True, "lookup": 8}, loaded.stderr[-2000:]
    # outside the group the same uid is refused at the socket
    stranger = as_other_user([sys.executable, str(ENGINE), str(d.socket), "save", "6", "2"])
    assert stranger.returncode != 0


def test_the_generated_token_is_sent_to_daemons_on_this_host_only(shared_tmp, monkeypatch):
    token_file = shared_tmp / "cache" / "kvstore" / "grpc-token"
    token = load_or_create_token(token_file)
    assert token and stat.S_IMODE(token_file.stat().st_mode) == 0o600 and load_or_create_token(token_file) == token
    assert token_for("127.0.0.1:50551") == token_for("[::1]:50551") == token_for("localhost:50551") == token
    assert token_for("192.0.2.7:50551") == ""  # that host's owner would get into this host's daemon
    monkeypatch.setenv("KVSTORE_TOKEN", "given")
    assert token_for("192.0.2.7:50551") == "given"
