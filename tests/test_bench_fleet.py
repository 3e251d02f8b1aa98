"""bench.fleet's settings, its choice of the best peer stack and the parts of its fleet
that need no engine: regimes and overrides, argument refusals, vllm-router's counters, and
the KV-event endpoints a subscriber connects to."""

from __future__ import annotations

import argparse

import pytest

from bench.fleet import PEERS, REGIMES, STACKS, best_peer, settings_of, spread
from bench.peer_routers import routing_counters
from bench.router_fleet import KvEvents, engines_config, session_pauses, session_starts


def args(**changes) -> argparse.Namespace:
    defaults = dict(
        quick=False, json=False, regime="binding", rounds=None, engine_blocks=None, sessions=None, turns=None,
        replicas=2, cache_share=0.0, size="", stacks="", sets="apart", think_s=0.2, session_gap_s=0.5,
    )  # fmt: skip
    return argparse.Namespace(**(defaults | changes))


def test_a_regime_sets_the_sessions_turns_and_engine_cache_unless_overridden():
    binding = settings_of(args())
    assert (binding.shape.sessions, binding.shape.turns, binding.engine_blocks) == (16, 8, 320)
    assert (binding.size, binding.rounds, binding.stacks) == ("mid", 3, tuple(s.name for s in STACKS))
    ample = settings_of(args(regime="ample"))
    assert (ample.shape.sessions, ample.shape.turns, ample.engine_blocks) == (8, 12, 0)
    quick = settings_of(args(quick=True))
    assert (quick.size, quick.rounds, quick.shape.sessions) == ("tiny", 1, 16)
    mine = settings_of(args(regime="ample", sessions=3, turns=2, engine_blocks=300, rounds=5, size="tiny"))
    assert (mine.shape.sessions, mine.shape.turns, mine.engine_blocks, mine.rounds, mine.size) == (3, 2, 300, 5, "tiny")
    assert settings_of(args(regime="binding", engine_blocks=0)).engine_blocks == 0  # the engines' default cache
    assert set(REGIMES) == {"binding", "ample"}


def test_sessions_start_apart_and_pause_for_drawn_times_the_same_in_every_stack_of_a_round():
    starts = session_starts(1, 8, 0.5)
    assert starts == session_starts(1, 8, 0.5) != session_starts(2, 8, 0.5)
    assert starts[0] == 0.0 and all(b >= a for a, b in zip(starts, starts[1:])) and starts[-1] > 0
    assert session_starts(1, 8, 0.0) == [0.0] * 8
    pauses = [next(p) for p in [session_pauses(1, 3, 0.2)] for _ in range(200)]
    again = session_pauses(1, 3, 0.2)
    assert pauses == [next(again) for _ in range(200)]
    assert len(set(pauses)) == 200 and 0.1 < sum(pauses) / 200 < 0.3  # no two alike: no convoy
    assert next(session_pauses(1, 3, 0.0)) == 0.0


def test_stacks_run_in_the_documented_order_whatever_order_they_are_named_in():
    chosen = settings_of(args(stacks="kvstore_full,plain_round_robin"))
    assert chosen.stacks == ("plain_round_robin", "kvstore_full")


@pytest.mark.parametrize(
    "bad",
    [
        dict(regime="tight"),
        dict(sessions=0),
        dict(turns=-1),
        dict(rounds=0),
        dict(engine_blocks=-1),
        dict(engine_blocks=255),  # less than one 8,192-token prompt
        dict(replicas=1),
        dict(cache_share=-0.5),
        dict(stacks="kvstore_full,lmcache"),
        dict(stacks=","),
        dict(sets="sometimes"),
        dict(think_s=-1.0),
        dict(session_gap_s=float("nan")),
    ],
)
def test_bad_settings_are_refused_with_a_message(bad):
    with pytest.raises(SystemExit) as refused:
        settings_of(args(**bad))
    assert isinstance(refused.value.code, str) and refused.value.code


def test_the_best_peer_is_the_peer_with_the_most_requests_per_second():
    medians = {"plain_round_robin": 3.0, "vllm_router_cache_aware": 4.5, "vllm_router_kv_aware": 4.0, "kvstore_full": 9.0}
    assert best_peer(medians) == "vllm_router_cache_aware"  # kvstore's own stacks are never a peer
    assert best_peer({"plain_round_robin": 2.0, "vllm_router_kv_aware": 2.0}) == "vllm_router_kv_aware"  # a tie: PEERS' order
    assert best_peer({"plain_round_robin": 1.0}) == "plain_round_robin"
    assert PEERS == ("vllm_router_cache_aware", "vllm_router_kv_aware", "plain_round_robin")
    with pytest.raises(ValueError):
        best_peer({"kvstore_full": 9.0, "kvstore_routing_only": 8.0})


def test_a_figure_over_rounds_is_its_median_and_range():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([0.5]) == {"median": 0.5, "min": 0.5, "max": 0.5}


def test_vllm_router_counters_are_read_by_outcome():
    exposition = "\n".join(
        [
            "# HELP vllm_router_prefix_routing_decisions_total decisions",
            'vllm_router_prefix_routing_decisions_total{policy="kv_aware",stage="regular",outcome="prefix_cost"} 12',
            'vllm_router_kv_routing_inputs_total{transport="http",result="render"} 24',
            'vllm_router_kv_routing_inputs_total{transport="grpc",result="render"} 1',
            'vllm_router_running_requests{worker="http://127.0.0.1:1"} 0',
        ]
    )
    assert routing_counters(exposition) == {"prefix_routing_decisions:prefix_cost": 12.0, "kv_routing_inputs:render": 25.0}


def test_kv_events_bound_on_every_interface_are_reached_on_loopback(tmp_path):
    events = KvEvents.on_tcp(5557, 5558)
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")  # what vLLM binds
    assert (events.connect_endpoint, events.connect_replay_endpoint) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    ipc = KvEvents.in_directory(tmp_path, "a")
    assert ipc.connect_endpoint == ipc.endpoint and ipc.connect_replay_endpoint == ipc.replay_endpoint
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64}')
    text = engines_config(tmp_path / "daemon.toml", model, events).read_text()
    assert 'endpoint = "tcp://127.0.0.1:5557"' in text and 'replay_endpoint = "tcp://127.0.0.1:5558"' in text
