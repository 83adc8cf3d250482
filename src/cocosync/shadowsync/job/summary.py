"""The multi-machine job's summary.json: its embedding-lookup measures (summed over the trainers' `LookupStats`) and
the job's CPU once every rank's is known, written atomically."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from cocosync.shadowsync.metrics import json_safe

__all__ = ["finite_mean", "lookup_summary", "add_job_cpu", "thread_cpu_by_kind", "write_summary",
           "checkpoints_note"]


def finite_mean(values: list[float | None]) -> float:
    """The mean of the finite values (nan when none is: a job stopped before its first batch)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def checkpoints_note(summary: dict) -> str | None:
    """The report's line on the periodic checkpoints not saved after a change of the trainers, if any was skipped."""
    at = summary.get("checkpoints_stopped_at")
    return None if at is None else f"no periodic checkpoint was saved from {at:,} examples on; the end's is the last"


def lookup_summary(lk: list[dict], examples: int, step_s: float, *, transport: str, exchange: bool,
                   hot_rows: int) -> dict:
    """The summary's lookup entries from every trainer's `LookupStats.as_dict()`: `step_s` is the workers' summed
    step time, `exchange` whether the lookup exchange carried the remote rows (else RPC), `hot_rows` the replicated
    rows' count."""
    def total(key: str) -> float:
        return sum(x[key] for x in lk)

    sparse_bytes = total("bytes_sent") + total("bytes_received")
    rows, hot_syncs = total("rows"), total("hot_syncs")  # syncs: counted by each node's first trainer
    return {
        "lookup_wait_fraction": total("wait_s") / max(step_s, 1e-9),
        # its parts (seconds summed over the workers), and the share past each trainer's start window (its workers'
        # first prefetch + 1 lookups wait for the first rounds whatever the run's length); its step time is taken in
        # proportion to the lookups, one a batch
        "lookup_wait_s": total("wait_s"),
        "step_s": step_s,
        "lookup_wait_past_start": _past_start(lk, step_s),
        "sparse_bytes_per_example": sparse_bytes / max(examples, 1),
        "rows_per_example": rows / max(examples, 1),
        "remote_row_fraction": total("remote_rows") / max(rows, 1),
        "_remote_rows": total("remote_rows"),
        "remote_calls": total("rpc_calls") + total("push_calls"),  # lookups and pushes of remote rows
        "lookup_transport": transport,
        "messages_per_example": total("messages") / max(examples, 1),  # to other nodes, per trainer
        "exchange_rounds": total("rounds"),
        "exchange_processes": sum(1 for x in lk if x["rounds"] > 0),  # that ran rounds (node-exchange: add_job_cpu)
        "exchange_cpu_us_per_round": 1e6 * total("exchange_cpu_s") / max(total("rounds"), 1),
        "_exchange_cpu_s": total("exchange_cpu_s"),  # (with node-exchange, the trainers' relays: add_job_cpu)
        "relay_cpu_us_per_round": 0.0,
        "network_bytes_per_example": ((total("wire_bytes") + total("hot_sync_bytes")) if exchange else sparse_bytes)
        / max(examples, 1),
        "hot_rows": hot_rows,
        "hot_row_fraction": total("hot_rows") / max(rows, 1),
        "hot_syncs": hot_syncs,
        "hot_sync_cpu_us_per_sync": 1e6 * total("hot_sync_cpu_s") / max(hot_syncs, 1),
        "hot_sync_interval_ms": 1e3 * total("hot_sync_interval_s") / max(hot_syncs, 1),  # the mean set
        # the longest time between two syncs: one stalled sync holds most of a run's hot-row staleness (its
        # window's updates all missed), so a run whose staleness jumps shows it here
        "hot_sync_longest_gap_ms": 1e3 * max((x.get("hot_sync_longest_gap_s", 0.0) for x in lk), default=0.0),
        "rpc_round_trip_s": total("rpc_s") / max(total("rpc_calls"), 1),
        "staleness": total("stale_sum") / max(total("stale_rows"), 1),
        # its parts, per row like it: other nodes' rows (exchange / RPC answers) and the hot rows' unsynced updates
        # on other nodes; the rest is this node's (Hogwild on its shards and its hot-row replica)
        "staleness_remote": total("stale_remote") / max(total("stale_rows"), 1),
        "staleness_hot_sync": total("stale_hot_sync") / max(total("stale_rows"), 1),
        "_stale_rows": total("stale_rows"),  # (node-exchange: the servers' exchanges count the remote rows' part)
    }


def _past_start(lk: list[dict], step_s: float) -> float:
    lookups, start = sum(x["lookups"] for x in lk), sum(x.get("start_lookups", 0) for x in lk)
    if lookups <= start or step_s <= 0:
        return float("nan")
    return (sum(x["wait_s"] for x in lk) - sum(x.get("start_wait_s", 0.0) for x in lk)) / (
        step_s * (lookups - start) / lookups)


def add_job_cpu(summary: dict, cpu: list[tuple[str, float, dict[str, float], dict | None]], out: Path) -> None:
    """Trainers count their training window (summary['trainer_cpu_seconds']), servers the time since set-up; each
    rank's (kind, CPU seconds, those seconds by thread role (thread_cpu.py), its node's lookup exchange if it ran it)
    since set-up."""
    _add_node_exchanges(summary, [x[3] for x in cpu if x[3] is not None])
    servers = sum(c for kind, c, _, _ in cpu if kind != "trainer")
    summary["server_cpu_seconds"] = servers
    # remote rows served (a lookup and a gradient each) per server CPU-second, RPC handling included
    summary["server_rows_per_cpu_s"] = summary.pop("_remote_rows") / max(servers, 1e-9)
    summary["eps_per_job_cpu"] = summary["examples"] / max(summary["trainer_cpu_seconds"] + servers, 1e-9)
    # every process from the end of set-up to the end (trainers' lookup serving and final scoring included): the
    # CPU per example that the scaling targets compare across node counts
    summary["job_cpu_seconds"] = sum(c for _, c, _, _ in cpu)
    summary["cpu_seconds_by_thread"] = by_thread = thread_cpu_by_kind(cpu)
    # of which gloo's threads (Linux; 0 elsewhere)
    summary["gloo_cpu_seconds"] = sum(s for k, s in by_thread.items() if k.endswith("/gloo"))
    summary["job_cpu_us_per_example"] = 1e6 * summary["job_cpu_seconds"] / max(summary["examples"], 1)
    write_summary(summary, out)


def thread_cpu_by_kind(cpu: list[tuple[str, float, dict[str, float], Any]]) -> dict[str, float]:
    """Every rank's CPU seconds by thread role summed as '<kind>/<role>' (largest first); '<kind>/rest' is what no
    thread accounted for (thread_cpu.py), so the values add up to the ranks' CPU (or a little over it, by /proc's
    10 ms ticks, where the rest is 0)."""
    out: dict[str, float] = {}
    for kind, total, roles, *_ in cpu:
        for role, s in {**roles, "rest": max(0.0, total - sum(roles.values()))}.items():
            out[f"{kind}/{role}"] = out.get(f"{kind}/{role}", 0.0) + s
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _add_node_exchanges(summary: dict, exchanges: list[dict]) -> None:
    """node-exchange: the rounds run by the nodes' servers join the trainers' counters; the trainers' relays' CPU is
    its own entry, per round of their node's exchange."""
    relay_cpu_s = summary.pop("_exchange_cpu_s", 0.0)
    stale_rows = max(summary.pop("_stale_rows", 0), 1)
    if not exchanges:
        return
    examples = max(summary["examples"], 1)
    stale = sum(x.get("stale_sum", 0) for x in exchanges) / stale_rows
    summary["staleness"] += stale
    summary["staleness_remote"] += stale
    rounds = sum(x["rounds"] for x in exchanges)
    summary["exchange_rounds"] = summary["exchange_rounds"] + rounds
    summary["exchange_processes"] += sum(1 for x in exchanges if x["rounds"] > 0)
    summary["messages_per_example"] += sum(x["messages"] for x in exchanges) / examples
    summary["network_bytes_per_example"] += sum(x["wire_bytes"] for x in exchanges) / examples
    total = max(summary["exchange_rounds"], 1)
    summary["exchange_cpu_us_per_round"] = 1e6 * sum(x["exchange_cpu_s"] for x in exchanges) / total  # the servers'
    summary["relay_cpu_us_per_round"] = 1e6 * relay_cpu_s / total  # a node's trainers' relays, per round of its own


def write_summary(summary: dict, out: Path) -> None:
    tmp = out / "summary.json.tmp"  # atomic: a reader never sees half a file
    tmp.write_text(json.dumps(json_safe(summary), indent=2, default=str) + "\n")
    os.replace(tmp, out / "summary.json")
