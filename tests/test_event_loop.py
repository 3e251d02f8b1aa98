"""The daemon's event loop: which loop it runs (server.event_loop), and how long it polls
for an engine's next request after an answer before it sleeps (server.spin_us)."""

import asyncio
import os
import shutil
import time
import urllib.request

import pytest
import torch
from blocks import chain_of
from daemon_harness import daemons

from kvstore.client import KVStoreClient
from kvstore.config import ConfigError, ServerConfig
from kvstore.daemon import _event_loop_runner
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tiers.base import has_spare_core

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
NAMESPACE = Namespace("test/event-loop", LAYOUT)


def test_auto_takes_uvloop_where_it_is_installed_and_asyncio_is_kept_when_asked_for():
    uvloop = pytest.importorskip("uvloop")
    assert _event_loop_runner("auto") is uvloop.run
    assert _event_loop_runner("uvloop") is uvloop.run
    assert _event_loop_runner("asyncio") is asyncio.run


def test_an_unknown_event_loop_is_a_config_error_that_names_the_field():
    with pytest.raises(ConfigError, match="server.event_loop"):
        ServerConfig(event_loop="trio")


def test_a_polling_window_out_of_range_is_a_config_error_that_names_the_field():
    for bad in (-1.0, 10_001.0, float("nan")):
        with pytest.raises(ConfigError, match="server.spin_us"):
            ServerConfig(spin_us=bad)
    assert ServerConfig(spin_us=0).spin_us == 0


def metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"the daemon exports no {name}")


def polling_seconds(daemon) -> float:
    return metric(daemon, "kvstore_loop_polling_seconds_total")


def test_a_host_with_no_idle_cpu_has_none_to_spare(tmp_path, monkeypatch):
    """spare_cpu_now reads the host's idle time from /proc/stat: half a CPU idle or more
    over the last sample is a spare one (polls and helper threads run), less is none."""
    import kvstore.tiers.base as base_module

    stat = tmp_path / "stat"
    monkeypatch.setattr(base_module, "_SPARE_CORE", True)
    monkeypatch.setattr(base_module, "_IDLE_SAMPLE_S", 0.0)
    monkeypatch.setattr(base_module.os, "sched_getaffinity", lambda _pid: {0, 1})
    idle = base_module._IdleCpus(str(stat))
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  1000 0 0 1000 0 0 0 0 0 0\n")
    assert idle.spare()  # the first sample: only the affinity says
    stat.write_text("cpu  1190 0 0 1010 0 0 0 0 0 0\n")  # 10 of 200 ticks idle on 2 CPUs: 0.1 CPU
    assert not idle.spare()
    stat.write_text("cpu  1290 0 0 1110 0 0 0 0 0 0\n")  # 100 of 200: a whole CPU idle
    assert idle.spare()
    stat.write_text("cpu  1350 0 0 1130 10 0 0 0 0 0\n")  # 30 of 90 idle or waiting: 0.67 CPU
    assert idle.spare()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def look_up_in_a_run(daemon, count: int) -> float:
    """``count`` lookups one after another, as a scheduler looks up its waiting requests;
    the seconds from connecting to the last answer."""
    started = time.perf_counter()
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        hashes = chain_of(LAYOUT, 1, 8)
        assert client.save(digest, hashes, [torch.ones(LAYOUT.block_bytes, dtype=torch.uint8)] * 8) == 8
        for _ in range(count):
            assert client.lookup(digest, hashes).num_blocks == 8
        return time.perf_counter() - started


@pytest.mark.skipif(not has_spare_core(), reason="the daemon never polls where it may run on one CPU only")
def test_the_daemon_polls_after_its_answers_then_sleeps(tmp_path):
    with daemons(tmp_path) as start:
        daemon = start(extra={"server.spin_us": "5000"})
        took = look_up_in_a_run(daemon, 50)
        time.sleep(0.1)  # past the window: the poll has ended and counted itself
        polled = polling_seconds(daemon)
        # at least the window after the last answer — unless no CPU of the host was idle
        # then, and the loop slept at once and said so; at most the run and a window past it
        assert polled >= 0.005 or metric(daemon, "kvstore_loop_polls_skipped_total") > 0
        assert polled <= took + 0.1
        cpu = cpu_seconds(daemon.process.pid)
        time.sleep(0.5)
        assert polling_seconds(daemon) == polled  # no request, no polling
        assert cpu_seconds(daemon.process.pid) - cpu < 0.1  # asleep, not spinning


def test_the_daemon_sleeps_at_once_when_told_to_or_on_one_cpu(tmp_path):
    with daemons(tmp_path) as start:
        told = start(node_id="told", extra={"server.spin_us": "0"})
        look_up_in_a_run(told, 50)
        time.sleep(0.1)
        assert polling_seconds(told) == 0.0
        if shutil.which("taskset") is None:
            pytest.skip("taskset is not installed: the one-CPU daemon is not tried")
        one_cpu = start(node_id="one-cpu", extra={"server.spin_us": "5000"}, prefix=("taskset", "-c", "0"))
        look_up_in_a_run(one_cpu, 50)
        time.sleep(0.1)
        assert polling_seconds(one_cpu) == 0.0
