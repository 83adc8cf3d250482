"""A scaling model of the lookup exchange, from what `cocosync bench lookups` measures.

The exchange's costs are per *round* and per *row*, not per message (model/exchange.py): each trainer's exchange
thread runs one gloo all_to_all with the other nodes every `interval` (packing, serving the peers' rows, unpacking),
each node's first trainer all-reduces the hot rows' gradients every `hot_interval`, and each remote row costs the
workers and the serving thread a little CPU. So a job's CPU per example (every process) at N nodes is

    c(N) = c(1) + k_row R(N) + k_round(N) rho(N) + k_hot(N) eta(N) + k_gloo(N) (rho(N) + eta(N))

with R the remote rows per example, rho the exchange rounds per example, eta the hot syncs per example (all measured
per run), k_round(N) and k_hot(N) the CPU of one round / one sync in the threads that run them, k_gloo(N) the CPU of
gloo's own threads per collective (they do the all_to_all's and the all_reduce's work while those threads wait; the
job measures them from /proc, over the 1-node run's), each a line in the peer count N - 1 fitted over the measured
node counts, and k_row the one unknown, fitted on the smallest multi-node point: what the measured threads leave of
its extra CPU, per remote row. That rest holds the per-row work and what no counter here sees (the kernel, the
workers' hand-offs), so the model's check, its prediction of the measured c(N) at the other node counts, says whether
that rest grows with the rows.

Projection to M machines with one core per process and t trainers per node: a trainer core spends k_round(M) /
interval of its time on its rounds (the node's hot sync, k_hot(M) / hot_interval, is shared by its t trainers),
gloo's threads add k_gloo(M) per round and per sync, the rest goes to examples at c(1) + k_row R(M) each, R(M)
growing as (M - 1) / M. Efficiency against one node:

    eff(M) = (1 - (k_round(M) + k_gloo(M)) / interval - (k_hot(M) + k_gloo(M)) / (t hot_interval))
             * c(1) / (c(1) + k_row R(M))

and with one exchange per node (`--lookup-transport node-exchange`: the node's server runs the rounds, on its own
core) a trainer core pays only its relay, k_relay / interval (k_relay: a trainer's relay CPU per round, measured
by a node-exchange run of the same bench), in place of the round term; the server keeps up while
(t k_round(M) + k_gloo(M)) / interval < 1 (every trainer's round merged: an upper bound, deduplication ignored),
reported as its load. Without a node-exchange run k_relay is unknown, and the per-node column falls back to the
rounds shared by the t trainers with no relay cost (the optimistic estimate this model gave before it was built).

Load matched (`bench lookups --side-by-side`): N loopback nodes share one machine, and its clock, caches and memory
bandwidth make every process slower the more of them run, whatever the job does (BENCHMARKS.md: on a quiet 2-core VM
4 one-node jobs side by side cost ~1.5x one alone per example, and the 4-node job's workers no more than theirs).
Fitted against c(1) alone, that load lands in k_row, which then stands for the machine rather than the rows and
under-predicts the larger node counts. With `load` (N -> CPU us per example of N one-node jobs at once) each c(N)
grows from its own load-matched base, load(N), instead of c(1) (the bench reads load(N) off a straight line
through one node alone and the side-by-side points, lookup_scaling.py): k_row is what the distribution adds to the same
processes on the same machine, and the projection (a core per process on M machines: no shared machine) uses c(1)
with that k_row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Mapping

from cocosync.bench.common import fit_line

__all__ = ["ExchangeCosts", "fit_costs", "predict_cpu", "project_efficiency", "server_load", "model_report"]


@dataclass(frozen=True)
class ExchangeCosts:
    """The model's inputs, fitted from bench rows (us and per-example counts)."""

    c_one: float  # CPU us per example at one node (every process)
    k_row: float  # CPU us per remote row: the rest of the smallest multi-node point's extra CPU (fitted)
    round_us: tuple[float, float]  # k_round(N) = a + b (N - 1): CPU us per exchange round
    hot_us: tuple[float, float]  # k_hot(N) = a + b (N - 1): CPU us per hot-row sync
    gloo_us: tuple[float, float]  # k_gloo(N) = a + b (N - 1): gloo's threads' CPU us per collective
    remote_rows_all: float  # remote rows per example when (M - 1) / M -> 1
    interval_s: float
    hot_interval_s: float
    relay_us: float | None = None  # k_relay: a trainer's relay CPU us per round of its node's exchange (measured)
    load_us: tuple[tuple[int, float], ...] = ()  # (N, CPU us per example of N one-node jobs at once): c(N)'s base

    def base(self, nodes: int) -> float:
        """CPU us per example that N nodes' processes cost the machine without the distribution: load(N), or c(1)."""
        return dict(self.load_us).get(nodes, self.c_one)

    def k_round(self, nodes: int) -> float:
        return max(0.0, self.round_us[0] + self.round_us[1] * (nodes - 1))

    def k_hot(self, nodes: int) -> float:
        return max(0.0, self.hot_us[0] + self.hot_us[1] * (nodes - 1))

    def k_gloo(self, nodes: int) -> float:
        return max(0.0, self.gloo_us[0] + self.gloo_us[1] * (nodes - 1))


def _remote_rows(row: dict) -> float:
    return row["rows_per_example"] * row["remote_row_fraction"]


def _fixed(row: dict, costs_round: float, costs_hot: float, costs_gloo: float) -> float:
    """CPU us per example of the rounds, the hot syncs and gloo's work for them, at these costs per operation."""
    return (costs_round * row["rounds_per_example"] + costs_hot * row["hot_syncs_per_example"]
            + costs_gloo * _collectives(row))


def _collectives(row: dict) -> float:
    return row["rounds_per_example"] + row["hot_syncs_per_example"]


def _gloo(row: dict) -> float:
    """gloo's threads' CPU us per example (0 where the job could not measure it)."""
    v = row.get("gloo_cpu_us_per_example")
    return v if isinstance(v, (int, float)) and v == v else 0.0


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of a + b (N - 1) through the points; one point: flat (a 1- and 2-node bench cannot see peers)."""
    if len({n for n, _ in points}) < 2:
        return (points[0][1], 0.0)
    a, b = fit_line([n - 1 for n, _ in points], [y for _, y in points])
    return (a, b)


def fit_costs(rows: list[dict], *, interval_s: float, hot_interval_s: float,
              load: Mapping[int, float] | None = None) -> ExchangeCosts:
    """The costs from one transport's bench rows (the 1-node row and its multi-node rows): the round and sync lines
    over every multi-node row, k_row from the smallest multi-node count (what its measured threads leave over its
    base: c(1), or with `load` its load-matched reference, module doc)."""
    one = next(r for r in rows if r["nodes"] == 1)
    multi = sorted((r for r in rows if r["nodes"] > 1), key=lambda r: r["nodes"])
    if not multi:
        raise ValueError("the exchange model needs a run on more than one node")
    round_us = _line([(r["nodes"], r["exchange_cpu_us_per_round"]) for r in multi])
    hot = [(r["nodes"], r["hot_sync_cpu_us_per_sync"]) for r in multi if r["hot_syncs_per_example"] > 0]
    hot_us = _line(hot) if hot else (0.0, 0.0)
    gloo = [(r["nodes"], max(0.0, _gloo(r) - _gloo(one)) / _collectives(r)) for r in multi if _collectives(r) > 0]
    gloo_us = _line(gloo) if gloo else (0.0, 0.0)
    first = multi[0]
    remote = _remote_rows(first)
    per_op = gloo[0][1] if gloo and gloo[0][0] == first["nodes"] else 0.0
    load_us = tuple(sorted((int(n), float(v)) for n, v in (load or {}).items() if n > 1))
    share = (first["nodes"] - 1) / first["nodes"]
    costs = ExchangeCosts(c_one=one["cpu_us_per_example"], k_row=0.0, round_us=round_us, hot_us=hot_us,
                          gloo_us=gloo_us, remote_rows_all=remote / share, interval_s=interval_s,
                          hot_interval_s=hot_interval_s, load_us=load_us)
    left = first["cpu_us_per_example"] - costs.base(first["nodes"]) - _fixed(
        first, first["exchange_cpu_us_per_round"], first["hot_sync_cpu_us_per_sync"], per_op)
    return replace(costs, k_row=max(0.0, left / remote) if remote > 0 else 0.0)


def predict_cpu(costs: ExchangeCosts, row: dict) -> float:
    """The model's CPU us per example for a measured row (its own counts of rounds, syncs and remote rows)."""
    n = row["nodes"]
    if n == 1:
        return costs.c_one
    fixed = _fixed(row, costs.k_round(n), costs.k_hot(n), costs.k_gloo(n))
    return costs.base(n) + costs.k_row * _remote_rows(row) + fixed


def project_efficiency(costs: ExchangeCosts, machines: int, trainers_per_node: int, *, per_node: bool = False) -> float:
    """eff(M) of the module doc, for t trainers per node; `per_node`: one exchange per node instead of per trainer."""
    if machines == 1:
        return 1.0
    t = trainers_per_node
    gloo = costs.k_gloo(machines)
    if per_node and costs.relay_us is not None:
        busy = costs.relay_us * 1e-6 / costs.interval_s
    else:
        busy = (costs.k_round(machines) + gloo) * 1e-6 / (costs.interval_s * (t if per_node else 1))
    busy += (costs.k_hot(machines) + gloo) * 1e-6 / (costs.hot_interval_s * t)
    remote = costs.remote_rows_all * (machines - 1) / machines
    return max(0.0, 1.0 - busy) * costs.c_one / (costs.c_one + costs.k_row * remote)


def server_load(costs: ExchangeCosts, machines: int, trainers_per_node: int) -> float:
    """The node-exchange server's busy fraction at M machines and t trainers per node (module doc)."""
    return (trainers_per_node * costs.k_round(machines) + costs.k_gloo(machines)) * 1e-6 / costs.interval_s


def model_report(rows: list[dict], *, interval_s: float, hot_interval_s: float,
                 machines: tuple[int, ...] = (4, 32, 128), trainers: tuple[int, ...] = (1, 15),
                 relay_us: float | None = None, load: Mapping[int, float] | None = None) -> dict:
    """The fitted costs, the prediction against each measured row, and the projections (per-trainer and per-node
    exchange) for each trainer count per node; `relay_us`: k_relay, from a node-exchange run; `load`: the
    load-matched bases (module doc)."""
    costs = replace(fit_costs(rows, interval_s=interval_s, hot_interval_s=hot_interval_s, load=load),
                    relay_us=relay_us)
    checks = []
    for r in sorted(rows, key=lambda r: r["nodes"]):
        predicted = predict_cpu(costs, r)
        checks.append({"nodes": r["nodes"], "measured_us": r["cpu_us_per_example"], "predicted_us": predicted,
                       "error": predicted / r["cpu_us_per_example"] - 1})
    projections = [{"machines": m, "trainers_per_node": t, "per_trainer_exchange": project_efficiency(costs, m, t),
                    "per_node_exchange": project_efficiency(costs, m, t, per_node=True),
                    "server_load": server_load(costs, m, t) if relay_us is not None else None}
                   for t in trainers for m in machines]
    return {"costs": asdict(costs), "checks": checks, "projections": projections}
