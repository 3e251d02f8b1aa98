"""The chaos run's figures: totals over every engine life, faults by kind, the end-of-run
audit, and for every wrong block found, whose bytes it held instead.

Attribution: the run knows every block's expected bytes (sessions' chains, and the
scratch chains the engines log when they abandon or stall a reservation), so a wrong
block whose bytes are exactly another block's is named after that block
(``ContentNames``). "late write of a stalled save" means bytes an engine wrote into its
reservation's slots after the reservation expired: a slot reused while its old writer
still held it. Daemon logs are searched for tracebacks (the last line of each is
counted), which are findings even when no figure moved.

The attacker (bench/chaos_attacker.py): its attempts by kind and how each ended, the
bytes of requests the daemons served it (block payloads, hot-chain lists, any other
reply), and the blocks it planted: blocks of its own chain that a daemon listed, and
wrong blocks (served to an engine, or found by the final check) holding its bytes.
"""

from __future__ import annotations

import collections
import json
import re
from typing import TYPE_CHECKING

import numpy as np

from bench.chaos_attacker import ATTACK_KINDS, attacker_digest
from bench.chaos_workload import BLOCK_BYTES, Workload, content_digest, expected_bytes
from bench.report import Report

if TYPE_CHECKING:
    from bench.chaos import ChaosRun

__all__ = ["ContentNames", "summarize", "print_result", "log_exceptions"]

CRASH_FINDINGS = (
    "engine_crash",
    "engine_did_not_exit",
    "daemon_crash",
    "daemon_failed_to_start",
    "daemon_unclean_exit_on_sigterm",
    "daemon_hung_on_sigterm",
)
ATTACKER_BYTES = "the attacker's bytes"


class ContentNames:
    """Content digest → the block whose expected bytes have it."""

    def __init__(self, workload: Workload, scratch: list[dict]) -> None:
        self.names: dict[str, str] = {content_digest(np.zeros(BLOCK_BYTES, np.uint8)): "zeros", attacker_digest(): ATTACKER_BYTES}
        for session in range(workload.num_sessions):
            for index, block_hash in enumerate(workload.chain(session)):
                self.names.setdefault(content_digest(expected_bytes(block_hash)), f"session {session} block {index}")
        for record in scratch:
            for index, block_hex in enumerate(record["hashes"]):
                late = " (late write of a stalled save)" if index in record["late"] else ""
                name = f"engine {record['engine']} life {record['incarnation']} {record['purpose']} block {index}{late}"
                self.names[content_digest(expected_bytes(bytes.fromhex(block_hex)))] = name

    def name(self, digest: str) -> str:
        return self.names.get(digest, "bytes of no block of the run")


def _category(name: str) -> str:
    if "late write" in name:
        return "late write of a stalled save (slot reused after its reservation expired)"
    if name.startswith("engine"):
        return "bytes of another engine's scratch block"
    if name.startswith("session"):
        return "bytes of another session block"
    return name


def attacker_figures(record: dict) -> dict:
    """The attacker's last stats line as the report's figures."""
    counters = record.get("counters", {})
    attempts = {kind: counters.get(f"attempts_{kind}", 0) for kind in ATTACK_KINDS}
    outcomes: dict[str, dict[str, int]] = {kind: {} for kind in ATTACK_KINDS}
    for name, count in sorted(counters.items()):
        if name.startswith("outcome:"):
            _, kind, outcome = name.split(":")
            outcomes.setdefault(kind, {})[outcome] = count
    return {
        "finished": bool(record.get("done")),
        "source_host": record.get("source_host"),
        "cpu_s": record.get("cpu_s", 0.0),
        "attempts": attempts,
        "outcomes": outcomes,
        "bytes_served": counters.get("served_bytes", 0),
        "block_bytes_served": counters.get("served_block_bytes", 0),
        "chain_list_bytes_served": counters.get("served_chain_list_bytes", 0),
        "stores_accepted": counters.get("stores_accepted", 0),
        "flood": {k: counters.get(f"flood_{k}", 0) for k in ("connections", "connected", "closed_by_daemon")},
        "silent": {
            "opened": outcomes.get("silent", {}).get("opened", 0),
            **{k: counters.get(f"silent_{k}", 0) for k in ("closed_by_daemon", "outlived_patience")},
        },
        "tls_attempts": counters.get("tls_attempts", 0),
        "unparsed_bytes": counters.get("unparsed_bytes", 0),
        "refusals_seen": record.get("error_classes", {}),
        "served_sample": record.get("served", []),
    }


def log_exceptions(text: str) -> collections.Counter[str]:
    """The last line of every traceback in a log, numbers masked so that alike ones add up."""
    found: collections.Counter[str] = collections.Counter()
    lines = text.splitlines()
    for position, line in enumerate(lines):
        if not line.startswith("Traceback"):
            continue
        for later in lines[position + 1 :]:
            if later and not later.startswith(" "):
                found[re.sub(r"\d+", "N", later)[:200]] += 1
                break
    return found


def _error_samples(events: list[dict]) -> dict[str, list[str]]:
    """Distinct sentences of each error class the engines saw (numbers masked), a few each."""
    samples: dict[str, set[str]] = {}
    for event in events:
        if event["kind"] == "error":
            samples.setdefault(event["error"], set()).add(f"{event['phase']}: {re.sub(r'[0-9]+', 'N', event['message'])}")
    return {error: sorted(found)[:5] for error, found in sorted(samples.items())}


def summarize(run: ChaosRun, self_test: dict, audit: dict, engines: dict, events: list[dict], seconds: float) -> dict:
    faults = dict(run.faults)
    faults["wire_flip"] = run.proxy.flips
    faults["reservation_abandoned"] = engines.get("reservations_abandoned", 0)
    faults["writer_stalled_past_ttl"] = engines.get("stalled_saves", 0)
    names = ContentNames(run.config.workload, [e for e in events if e["kind"] == "scratch"])
    wrong_found: dict[str, dict] = {}  # block -> what it held, where and how often it was served
    for event in events:
        if event["kind"] == "wrong":
            found = wrong_found.setdefault(event["block"], {"block": event["block"], "bytes_are": names.name(event["digest"]), "served": 0})
            found["served"] += 1
            if event["t"] < found.get("first_served", {}).get("t", float("inf")):
                found["first_served"] = {"t": event["t"], "engine": event["engine"], "op": event["op"]}
            found["daemon"] = run.engine_daemon[event["engine"]]
    for daemon, final in audit["final"].items():
        for wrong in final["wrong_blocks"]:
            found = wrong_found.setdefault(wrong["block"], {"block": wrong["block"], "bytes_are": names.name(wrong["digest"]), "served": 0})
            found.setdefault("in_final_check_of", []).append(daemon)
    distinct = list(wrong_found.values())
    final_wrong = sum(f["wrong_bytes"] for f in audit["final"].values())
    crashes = [f for f in run.findings if f["kind"] in CRASH_FINDINGS]
    attacker = attacker_figures(run.attacker.record())
    planted_served = [f["block"] for f in distinct if f["bytes_are"] == ATTACKER_BYTES]
    refused = run.refusals.totals()
    return {
        "seconds": round(seconds, 1),
        "checker_self_test": self_test,
        "operations": engines.get("ops", 0),
        "failed_operations": engines.get("failed_ops", 0),
        "load_calls": engines.get("load_calls", 0),
        "loaded_blocks": engines.get("loaded_blocks", 0),
        "remote_load_calls": engines.get("remote_load_calls", 0),
        "remote_loaded_blocks": engines.get("remote_loaded_blocks", 0),
        "in_place_load_calls": engines.get("in_place_load_calls", 0),
        "save_calls": engines.get("save_calls", 0),
        "saved_blocks": engines.get("saved_blocks", 0),
        "hit_blocks_host": engines.get("hit_blocks_host", 0),
        "hit_blocks_nvme": engines.get("hit_blocks_nvme", 0),
        "operator_evictions": run.evictions,
        "engine_lives": sum(e.lives for e in run.engines),
        "daemon_lives": {d.name: d.lives for d in run.daemons},
        "engine_errors": {k.removeprefix("error_"): v for k, v in sorted(engines.items()) if k.startswith("error_")},
        "unexpected_engine_errors": engines.get("unexpected_errors", 0),
        "stale_commits_refused": engines.get("stale_commits_refused", 0),
        "stale_commits_accepted": engines.get("stale_commits_accepted", 0),
        "faults": faults,
        "total_faults": sum(faults.values()),
        "signals_sent": run.signals_sent,
        "wire_flips_log": run.proxy.flip_log[:20],
        "wrong_bytes_during_run": engines.get("wrong_bytes", 0),
        "wrong_blocks_during_run": engines.get("wrong_blocks", 0),
        "wrong_bytes_final_check": final_wrong,
        "wrong_bytes": engines.get("wrong_bytes", 0) + final_wrong,
        "wrong_distinct_blocks": len(distinct),
        "wrong_bytes_sources": dict(collections.Counter(_category(found["bytes_are"]) for found in distinct)),
        "wrong_found": distinct[:50],
        "lost_blocks": sum(p["missing"] for p in audit["persisted"].values())
        + sum(f["unreadable_unexplained"] for f in audit["final"].values())
        + sum(r["missing"] for r in run.clean_restarts),
        "lost_blocks_at_clean_restarts_during_run": sum(r["missing"] for r in run.clean_restarts),
        "clean_restarts_during_run": run.clean_restarts,
        "leaked_slots": sum(leak["leaked_slots"] for leak in audit["leaks"].values()),
        "phantom_blocks": sum(leak["phantom_blocks"] for leak in audit["leaks"].values()),
        "leftover_owners": sum(leak["leftover_owners"] for leak in audit["leaks"].values()),
        "crashes": len(crashes) + engines.get("unexpected_errors", 0),
        "peer_auth": run.credentials.mode,
        "attacker": attacker,
        "attacker_attempts": attacker["attempts"],
        "attacker_bytes_served": attacker["bytes_served"],
        "attacker_blocks_planted": len(run.planted_listed) + len(set(planted_served) - run.planted_listed.keys()),
        "attacker_planted_listed": run.planted_listed,
        "attacker_planted_served": planted_served,
        "refused_connections": refused,
        "refused_connections_total": sum(sum(reasons.values()) for reasons in refused.values()),
        "daemon_log_exceptions": {d.name: dict(log_exceptions(d.log_tail(1 << 30))) for d in run.daemons},
        "audit": audit,
        "findings": run.findings,
        "fault_timeline": run.timeline,
        "engine_events": [e for e in events if e["kind"] == "unexpected"][:20],
        "engine_error_samples": _error_samples(events),
    }


def print_result(report: Report, result: dict) -> None:
    report.print_table(
        f"operations ({result['seconds']:.0f} s, checker self-test detected: {result['checker_self_test']['detected']})",
        ["ops", "failed", "load calls", "loaded blocks", "remote loads", "in-place loads", "saves", "saved blocks", "evictions"],
        [[result["operations"], result["failed_operations"], result["load_calls"], result["loaded_blocks"], result["remote_load_calls"],
          result["in_place_load_calls"], result["save_calls"], result["saved_blocks"], result["operator_evictions"]]],
    )  # fmt: skip
    faults = [[kind, count] for kind, count in result["faults"].items()] + [["total", result["total_faults"]]]
    report.print_table("faults injected", ["kind", "count"], faults)
    errors = sorted(result["engine_errors"].items())
    report.print_table("engine errors (each a miss or failed save; the engine reconnects)", ["error", "count"], errors)
    rows = []
    for name, leak in result["audit"]["leaks"].items():
        persisted, final = result["audit"]["persisted"][name], result["audit"]["final"][name]
        for tier in leak["tiers"]:
            rows.append([name, tier["tier"], tier["used_slots"], tier["tier_num_blocks"], tier["listed"], tier["leaked"], tier["phantom"]])
        rows.append([name, "owners left", leak["leftover_owners"], "", "", "", ""])
        rows.append([name, "clean restart", persisted["before"], persisted["after"], persisted["missing"], "", ""])
        checked = [final["checked_blocks"], final["unreadable"], final["unreadable_unexplained"], final["wrong_bytes"]]
        rows.append([name, "final check", *checked, ""])
    report.print_table(
        "end of run per daemon (slots: used / tier count / listed / leaked / phantom; restart: before / after / missing; "
        "final check: checked / unreadable / unexplained / wrong bytes)",
        ["daemon", "what", "a", "b", "c", "d", "e"],
        rows,
    )
    attacker = result["attacker"]
    rows = [[kind, n, " ".join(f"{o}={c}" for o, c in attacker["outcomes"][kind].items())] for kind, n in attacker["attempts"].items()]
    report.print_table(
        f"attacker attempts (peer auth: {result['peer_auth']}; from {attacker['source_host']}, {attacker['cpu_s']:.1f} CPU s; "
        f"flood: {attacker['flood']}; silent: {attacker['silent']})",
        ["kind", "attempts", "outcomes"],
        rows,
    )
    refused = result["refused_connections"]
    reasons = sorted({reason for counts in refused.values() for reason in counts})
    report.print_table(
        "refused peer connections (daemons' kvstore_peer_refused_connections_total, added over their lives)",
        ["daemon", *reasons, "total"],
        [[name, *(counts.get(r, 0) for r in reasons), sum(counts.values())] for name, counts in refused.items()],
    )
    report.print_table(
        "attacker served and planted (all must be 0)",
        ["bytes served", "block bytes", "chain-list bytes", "stores accepted", "planted blocks", "listed", "served with its bytes"],
        [[result["attacker_bytes_served"], attacker["block_bytes_served"], attacker["chain_list_bytes_served"],
          attacker["stores_accepted"], result["attacker_blocks_planted"], len(result["attacker_planted_listed"]),
          len(result["attacker_planted_served"])]],
    )  # fmt: skip
    restarts = result["clean_restarts_during_run"]
    report.print_table(
        f"integrity (lost blocks include {len(restarts)} clean restarts during the run)",
        ["wrong bytes (run)", "wrong bytes (final)", "wrong blocks", "lost blocks", "lost at run restarts", "leaked slots", "phantom",
         "owners left", "crashes"],
        [[result["wrong_bytes_during_run"], result["wrong_bytes_final_check"], result["wrong_distinct_blocks"], result["lost_blocks"],
          result["lost_blocks_at_clean_restarts_during_run"], result["leaked_slots"], result["phantom_blocks"], result["leftover_owners"],
          result["crashes"]]],
    )  # fmt: skip
    if result["wrong_bytes_sources"]:
        report.print_table("what the wrong blocks held", ["bytes", "blocks"], sorted(result["wrong_bytes_sources"].items()))
    exceptions = [[d, line, n] for d, found in result["daemon_log_exceptions"].items() for line, n in found.items()]
    if exceptions:
        report.print_table("tracebacks in the daemon logs", ["daemon", "last line", "count"], exceptions)
    for error, sentences in result["engine_error_samples"].items():
        for sentence in sentences:
            print(f"engine error {error}: {sentence[:300]}")
    for finding in result["findings"][:20]:
        print(f"finding: {json.dumps({k: v for k, v in finding.items() if k != 'log'})[:400]}")
    for found in result["wrong_found"][:20]:
        print(f"wrong block: {json.dumps(found)[:400]}")
    for event in result["engine_events"][:10]:
        print(f"unexpected engine error: {json.dumps({k: v for k, v in event.items() if k != 'traceback'})[:400]}")
