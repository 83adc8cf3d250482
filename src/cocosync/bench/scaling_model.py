"""A scaling model of ShadowSync across machines, from quantities measured on this host (bench shadowsync --nodes).

Per machine: `t` trainers and `s` embedding servers, one core each; tables row-hashed over every server, so a fraction
r = (M-1)/M of each example's rows lives on other machines. Three resources bound a machine's examples per second:

* trainers: t * c(r). A trainer's CPU per example is linear in r between the two measured points: c(0) = the
  single-node run's examples per trainer CPU-second (every row updated by the trainer itself) and c(1/2) = the 2-node
  run's (half the rows updated by a server, plus the client's deduplication and RPC work), and c(1/2) beyond;
* servers: each server core pays k_call CPU per message and k_row per row (measured: server_costs.py). Row hash
  sends every trainer batch one message (its lookup, the previous gradients riding on it) to *every* remote server,
  so a server receives (M-1) x / B messages per second from the other machines (x: a machine's examples/s, B:
  batch), whatever s is, plus x u r / s rows (u: distinct rows per example, measured):
  x <= 1 / ((M-1) k_call / B + u r k_row / s). The per-message term grows with the machine count;
* network: NIC bytes per direction per example = the trainers' remote-row traffic (ids out, rows in, gradients out,
  measured per example, scaled by r), mirrored by the servers answering the other machines.

Lookups are prefetched: their round trip leaves the critical path while it is shorter than `prefetch` batches of
compute, else a trainer runs at prefetch batches per RTT. Efficiency compares with one machine using all t + s
cores as trainers on local tables: (t + s) * c(0). Dense sync runs in the shadow thread and costs no throughput;
it costs sync gap: a round moves 2 r D * 4 bytes per machine over the NIC (each of its t trainers all-reduces its
1/t slice across machines), at the bandwidth the sparse traffic leaves, plus 2 (M-1) latencies (ring steps); gap =
round time * iterations per second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Measured", "project", "projection_table", "RATIOS", "MACHINES", "GBPS"]

MACHINES = (1, 2, 4, 8, 16, 32, 64, 128)
GBPS = (10, 25, 100)
RATIOS = ((15, 1), (12, 4), (10, 6), (8, 8))  # (trainers, servers) on a 16-core machine


@dataclass
class Measured:
    """Inputs of the model, each measured (see bench/shadowsync_nodes.py)."""

    c_single: float  # examples per trainer CPU-second, one node (tables local)
    c_remote: float  # ... on the 2-node run (half the rows remote)
    rows_per_example: float  # distinct rows fetched per example
    remote_bytes_per_example: float  # trainer-side RPC bytes per example if every row were remote
    dense_params: int
    rpc_s: float  # lookup round trip
    server_call_s: float  # server CPU per RPC call (k_call)
    server_row_s: float  # server CPU per row of a lookup + its gradient (k_row)
    batch_size: int
    latency_s: float = 50e-6  # one network hop of the dense ring (assumed for data-centre networks)
    lookup_batches: int = 1  # batches whose lookups share one message per server
    prefetch: int = 2  # batches of lookups requested ahead of the one training


def project(m: Measured, machines: int, gbps: float, trainers: int, servers: int) -> dict:
    """Examples per second of `machines` machines, the binding resource, efficiency and sync gap."""
    remote = (machines - 1) / machines
    # trainer CPU per example, linear in the remote fraction between the two measured points (r = 0 and r = 1/2),
    # not extrapolated past the 2-node point: more remote rows are not assumed to make a trainer cheaper still
    per_example = 1.0 / m.c_single + 2 * min(remote, 0.5) * (1.0 / m.c_remote - 1.0 / m.c_single)
    if per_example <= 0:
        raise ValueError(f"c_remote={m.c_remote:g} >= 2 * c_single={m.c_single:g}: the linear trainer-cost model "
                         "does not extrapolate to every row remote")
    c = 1.0 / per_example
    step_s = m.batch_size / c
    # `prefetch` batches of compute hide a round trip; a longer one paces the trainer at prefetch batches per RTT
    ahead = max(1, m.prefetch)
    per_trainer = c if m.rpc_s <= ahead * step_s or machines == 1 else ahead * m.batch_size / m.rpc_s
    bounds = {"trainers": trainers * per_trainer}
    nic = gbps * 1e9 / 8
    if remote > 0:
        bounds["network"] = nic / (m.remote_bytes_per_example * remote)
        per_example = ((machines - 1) * m.server_call_s / (m.batch_size * m.lookup_batches)
                       + m.rows_per_example * remote * m.server_row_s / servers)
        bounds["servers"] = 1.0 / per_example
    limit = min(bounds, key=bounds.get)
    eps_machine = bounds[limit]
    ideal = (trainers + servers) * m.c_single  # one machine, every core a trainer, tables local
    left = nic - eps_machine * m.remote_bytes_per_example * remote
    if machines == 1:
        round_s = 0.0
    elif left <= 0:
        round_s = float("inf")
    else:
        round_s = 2 * remote * m.dense_params * 4 / left + 2 * (machines - 1) * m.latency_s
    gap = round_s * (eps_machine / trainers) / m.batch_size
    return {"machines": machines, "gbps": gbps, "trainers_per_machine": trainers, "servers_per_machine": servers,
            "eps": eps_machine * machines, "efficiency": eps_machine / ideal, "limit": limit,
            "sync_round_s": round_s, "sync_gap": gap}


def projection_table(m: Measured) -> list[dict]:
    return [project(m, n, g, t, s) for t, s in RATIOS for g in GBPS for n in MACHINES]


def as_dict(m: Measured) -> dict:
    return asdict(m)
