"""The multi-machine job's summary.json: its embedding-lookup measures (summed over the trainers' `LookupStats`) and
the job's CPU once every rank's is known, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cocosync.shadowsync.job.trainer import json_safe

__all__ = ["lookup_summary", "add_job_cpu", "write_summary", "native_thread_cpu", "gloo_cpu_since"]

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # torch's gloo process-group workers, gloo's socket loop


def native_thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each live thread of this process by thread id, with its OS name (/proc/self/task; {} where
    there is none). Threads torch and gloo start in C++ carry names; Python's threads are all 'python'."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        tasks = os.listdir("/proc/self/task")
    except (OSError, ValueError, AttributeError):
        return out
    for tid in tasks:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on: utime, stime are fields 14, 15
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def gloo_cpu_since(before: dict[int, tuple[str, float]]) -> float:
    """CPU seconds gloo's threads of this process used since `before` (a `native_thread_cpu()`): the collectives'
    work, which the threads that wait on them (the exchange, the hot sync) do not see in their own CPU time."""
    now = native_thread_cpu()
    return sum(cpu - before.get(tid, (name, 0.0))[1] for tid, (name, cpu) in now.items() if name in GLOO_THREADS)


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


def add_job_cpu(summary: dict, cpu: list[tuple[str, float, float, dict | None]], out: Path) -> None:
    """Trainers count their training window (summary['trainer_cpu_seconds']), servers the time since set-up; each
    rank's (kind, CPU seconds, of which gloo's threads, its node's lookup exchange if it ran it) since set-up."""
    _add_node_exchanges(summary, [x[3] for x in cpu if x[3] is not None])
    cpu = [x[:3] for x in cpu]
    servers = sum(c for kind, c, _ in cpu if kind != "trainer")
    summary["server_cpu_seconds"] = servers
    # remote rows served (a lookup and a gradient each) per server CPU-second, RPC handling included
    summary["server_rows_per_cpu_s"] = summary.pop("_remote_rows") / max(servers, 1e-9)
    summary["eps_per_job_cpu"] = summary["examples"] / max(summary["trainer_cpu_seconds"] + servers, 1e-9)
    # every process from the end of set-up to the end (trainers' lookup serving and final scoring included): the
    # CPU per example that issue 31's scaling targets compare across node counts
    summary["job_cpu_seconds"] = sum(c for _, c, _ in cpu)
    summary["gloo_cpu_seconds"] = sum(g for _, _, g in cpu)  # of which gloo's threads (Linux; 0 elsewhere)
    summary["job_cpu_us_per_example"] = 1e6 * summary["job_cpu_seconds"] / max(summary["examples"], 1)
    write_summary(summary, out)


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
