"""The `kvstore` CLI against a live daemon, asserting on --json output and exit codes."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import new_daemon

ENGINE = Path(__file__).with_name("engine_proc.py")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = new_daemon(tmp_path_factory.mktemp("cli")).start()
    subprocess.run([sys.executable, str(ENGINE), str(d.socket), "save", "11", "6"], check=True, capture_output=True)
    yield d
    d.stop(signal.SIGTERM)


def kv(live, *args, expect=0):
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(live.socket), "--json", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == expect, (result.stdout, result.stderr)
    if expect == 0:
        return json.loads(result.stdout)
    assert result.stderr.startswith("kvstore: ") and "Traceback" not in result.stderr
    return result.stderr


def test_version_and_status(live):
    assert kv(live, "version")["api"] == "kvstore.v1"
    status = kv(live, "status")
    assert status["status"] == "SERVING" and status["node_id"] == live.node_id and status["blocks"] == 6
    assert {t["tier"] for t in status["tiers"]} == {"host", "nvme"}


def test_ls_pages_and_lookup_by_hashes_and_tokens(live, tmp_path):
    first = kv(live, "ls", "--limit", "4")
    assert len(first["blocks"]) == 4 and first["total"] == 6 and first["next_page_token"]
    second = kv(live, "ls", "--limit", "4", "--page-token", first["next_page_token"])
    assert len(second["blocks"]) == 2 and not second["next_page_token"]
    blocks = first["blocks"] + second["blocks"]
    namespace = blocks[0]["namespace"]
    chain = [b for b in blocks if not b["parent"]]
    assert len(chain) == 1
    by_parent = {b["parent"]: b["hash"] for b in blocks}
    ordered = [chain[0]["hash"]]
    while ordered[-1] in by_parent:
        ordered.append(by_parent[ordered[-1]])
    assert kv(live, "lookup", "--namespace", namespace, *ordered[:3])["matched_blocks"] == 3
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str((11 * 7919 + i) % 50_000) for i in range(6 * 16 + 5)))
    found = kv(live, "lookup", "--namespace", namespace, "--tokens", str(tokens))
    assert found["matched_blocks"] == 6 and found["matched_tokens"] == 96


def test_pin_evict_unpin(live):
    blocks = kv(live, "ls")["blocks"]
    namespace, leaf = blocks[0]["namespace"], blocks[-1]["hash"]
    assert kv(live, "pin", "--namespace", namespace, leaf) == {"pinned": 1}
    assert kv(live, "ls", "--tier", "host")["total"] == 6
    assert kv(live, "evict", "--namespace", namespace, leaf) == {"evicted": 0, "skipped": 1}
    assert kv(live, "unpin", "--namespace", namespace, leaf) == {"unpinned": 1}
    assert kv(live, "evict", "--namespace", namespace, leaf) == {"evicted": 1, "skipped": 0}
    assert kv(live, "stats")["blocks"] == 5


def test_refusals_are_sentences_with_exit_codes(live, tmp_path):
    assert "all" in kv(live, "evict", expect=1)  # no filter and no --all
    assert "not registered" in kv(live, "lookup", "--namespace", "00" * 16, "ab" * 16, expect=1)
    assert "no live peer" in kv(live, "drain", expect=1)  # a lone node has nowhere to drain to
    assert "no live peer" in kv(live, "warm", expect=1)
    missing = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(tmp_path / "nope.sock"), "status"], capture_output=True, text=True
    )
    assert missing.returncode == 3 and "kvstore serve" in missing.stderr and "Traceback" not in missing.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(live.socket), "pin", "--namespace", "zz", "ab"], capture_output=True, text=True
    )
    assert usage.returncode == 2


def clean(daemon, *, socket: Path | None = None, expect: int = 0, dry_run: bool = False):
    settings = [f"--set={key}={value}" for key, value in daemon.settings().items()]
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(socket or daemon.socket), "--json", "clean", *settings]
        + (["--dry-run"] if dry_run else []),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == expect, (result.stdout, result.stderr)
    return json.loads(result.stdout) if expect == 0 else result.stderr


def test_clean_refuses_while_the_daemon_runs_and_removes_a_stopped_nodes_files(tmp_path):
    d = new_daemon(tmp_path).start()
    shm = Path(f"/dev/shm/{d.shm_name}")
    nvme = sorted((d.workdir / "nvme").glob("slots-*.dat"))
    try:
        log = d.log()
        assert f"host tier: 0.06 GiB of shared memory reserved in {shm}" in log
        assert f"NVMe tier: 0.12 GiB preallocated in 2 slot file(s) under {d.workdir / 'nvme'}" in log
        assert "serving on" in clean(d, expect=1)
        # a socket configured elsewhere: the daemon's locks on its files still refuse
        assert "a running kvstore daemon holds" in clean(d, socket=tmp_path / "elsewhere.sock", expect=1)
        assert shm.exists() and all(path.exists() for path in nvme) and len(nvme) == 2
    finally:
        assert d.stop(signal.SIGTERM) == 0
    assert not shm.exists()  # a clean stop removes the shared memory; the NVMe files stay for a restart
    assert clean(d, dry_run=True)["removed"] == [str(path) for path in nvme] and all(path.exists() for path in nvme)
    removed = clean(d)
    assert removed["removed"] == [str(path) for path in nvme] and removed["bytes"] == 128 << 20
    assert not (d.workdir / "nvme").exists()
    assert clean(d)["removed"] == []


def test_clean_removes_the_shared_memory_of_a_killed_daemon(tmp_path):
    d = new_daemon(tmp_path).start()
    shm = Path(f"/dev/shm/{d.shm_name}")
    d.stop(signal.SIGKILL)
    assert shm.exists()
    removed = clean(d)["removed"]
    assert str(shm) in removed and str(d.socket) in removed and not shm.exists() and not d.socket.exists()
    d.start()  # and the node starts again where it was
    try:
        assert kv(d, "status")["status"] == "SERVING"
    finally:
        d.stop(signal.SIGTERM)


def test_status_stops_at_the_tiers_and_stats_names_its_counters(live):
    def human(*args):
        return subprocess.run(
            [sys.executable, "-m", "kvstore", "--socket", str(live.socket), *args], capture_output=True, text=True, timeout=60, check=True
        ).stdout.splitlines()

    status = human("status")
    assert status[-1].startswith("leases ") and not any(line.startswith("  ") for line in status)
    stats = human("stats")
    assert "counters" in stats and stats.index("counters") < len(stats) - 1
