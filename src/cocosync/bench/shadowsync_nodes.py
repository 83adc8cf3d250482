"""`cocosync bench shadowsync --nodes 2`: the same ShadowSync job on one node and across two torchrun nodes, with
lookups by torch.distributed.rpc (the former path, whose messages the scaling model counts; the lookup exchange, the
default since, is measured across 1, 2 and 4 nodes by `cocosync bench lookups`).

Round-robin over repeats: the single-node launcher (T trainers) and the 2-node job (T/2 trainers and one embedding
server per node, loopback), with and without prefetching the lookups. Reported (medians): EPS, EPS per trainer
CPU-second and its ratio to the single-node run, eval NE and its difference, the share of step time trainers wait
on lookups, bytes per example over the network (sparse and dense), the lookup round trip, staleness and sync gap.
Then the scaling model (scaling_model.py), fed with these measurements, projects 1-128 machines (table, PNG, JSON).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from cocosync.bench.scaling_model import GBPS, MACHINES, RATIOS, Measured, projection_table
from cocosync.bench.server_costs import measure_server_costs
from cocosync.testing.multinode import run_nodes

__all__ = ["run_nodes_suite", "report"]

GROUP = 16  # the grouped run: lookups of 16 batches per message (and 16 batches of prefetch)
GROUPED = f"2 nodes, {GROUP} batches/message"
CLASSES = "2 nodes, dense sync by the classes"  # --no-compiled-sync: the hand-written MA/BMUF over HierarchicalGroup

KEYS = ("eps", "eps_per_cpu", "eps_per_job_cpu", "eval_ne", "sync_gap", "lookup_wait_fraction",
        "sparse_bytes_per_example", "dense_bytes_per_example", "rpc_round_trip_s", "staleness", "remote_row_fraction",
        "rows_per_example", "server_rows_per_cpu_s", "server_cpu_seconds", "remote_calls")


def _single(cfg_kw: dict, out: Path, console: Any) -> dict:
    from cocosync.shadowsync.config import SyncConfig, TrainConfig
    from cocosync.shadowsync.job.launch import run_training

    sync = cfg_kw.pop("sync")
    cfg = TrainConfig(**cfg_kw, out_dir=str(out), sync=SyncConfig(**sync), progress=False, plot=False,
                      checkpoint=False)
    return dict(run_training(cfg, name="1 node", console=console).summary, nodes=1)


def _two_nodes(args: list[str], trainers: int, out: Path, prefetch: int, group: int) -> dict:
    per_node = trainers // 2
    # the RPC path: the scaling model below counts its messages (the lookup exchange: bench/lookup_scaling.py)
    runs = run_nodes(["-m", "cocosync.shadowsync", *args, "--out", str(out), "--prefetch", str(prefetch),
                      "--lookup-batches", str(group), "--lookup-transport", "rpc"], nproc_per_node=1 + per_node,
                     timeout=900)
    for r in runs:
        if r.returncode != 0:
            raise RuntimeError(f"2-node run failed on node {r.node} (exit {r.returncode}):\n{r.output[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def run_nodes_suite(*, examples: int, eval_examples: int, trainers: int, sync: str, interval: float, batch_size: int,
                    repeats: int, console: Any) -> dict[str, list[dict]]:
    """Every configuration once per round (round-robin), `repeats` rounds."""
    if trainers < 2 or trainers % 2:
        raise ValueError(f"--trainers {trainers}: the 2-node comparison needs an even number of trainers >= 2")
    args = ["--examples", str(examples), "--eval-examples", str(eval_examples), "--batch-size", str(batch_size),
            "--sync", sync, "--sync-interval", str(interval)]
    samples: dict[str, list[dict]] = {"1 node": [], "2 nodes": [], "2 nodes, no prefetch": [], GROUPED: [],
                                      CLASSES: []}
    with tempfile.TemporaryDirectory(prefix="cocosync-bench-nodes-") as tmp:
        for rnd in range(repeats):
            console.print(f"[bold]round {rnd + 1}/{repeats}[/]")
            for name in samples:
                out = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}-{rnd}"
                if name == "1 node":
                    kw = dict(examples=examples, eval_examples=eval_examples, batch_size=batch_size,
                              trainers=trainers, sync={"algorithm": sync, "interval": interval})
                    s = _single(kw, out, console)
                else:
                    group = GROUP if name == GROUPED else 1
                    extra = ["--no-compiled-sync"] if name == CLASSES else []
                    s = _two_nodes(args + extra, trainers, out, prefetch=0 if "no prefetch" in name else max(2, group),
                                   group=group)
                samples[name].append(s)
                console.print(f"  {name:22s} EPS {s['eps']:9,.0f}  EPS/CPU-s {s['eps_per_cpu']:9,.0f}  "
                              f"eval NE {s['eval_ne']:.4f}  lookup wait {s.get('lookup_wait_fraction', 0):.1%}")
    return samples


def _median(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for k in KEYS:
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        out[k] = statistics.median(vals) if vals else float("nan")
    out["eval_ne_samples"] = [round(r["eval_ne"], 5) for r in rows]
    out["eps_per_cpu_samples"] = [round(r["eps_per_cpu"]) for r in rows]
    return out


def report(samples: dict[str, list[dict]], *, batch_size: int, console: Any, out: Path,
           json_path: str | None) -> dict:
    from cocosync.bench.common import markdown_table, print_table, save_figure, write_json
    from cocosync.shadowsync.metrics import json_safe

    med = {k: _median(v) for k, v in samples.items()}
    one, two, cold = med["1 node"], med["2 nodes"], med["2 nodes, no prefetch"]
    cols = ["run", "nodes", "T", "EPS", "EPS/CPU-s", "vs 1 node (CPU)", "EPS/job CPU-s", "eval NE", "NE vs 1 node",
            "lookup wait", "sparse B/ex", "dense B/ex", "RPC RTT", "staleness", "sync gap"]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    rows = []
    for name, r in med.items():
        rows.append([name, str(r.get("nodes", 1)), str(r["T"]), f(r["eps"], ",.0f"), f(r["eps_per_cpu"], ",.0f"),
                     f(r["eps_per_cpu"] / one["eps_per_cpu"], ".2f") + "x",
                     f(r.get("eps_per_job_cpu", r["eps_per_cpu"]), ",.0f"), f(r["eval_ne"], ".4f"),
                     f(100 * (r["eval_ne"] / one["eval_ne"] - 1), "+.2f") + "%",
                     f(r.get("lookup_wait_fraction"), ".1%"), f(r.get("sparse_bytes_per_example"), ",.0f"),
                     f(r.get("dense_bytes_per_example"), ",.0f"), f(1e3 * r.get("rpc_round_trip_s", math.nan), ".2f")
                     + " ms", f(r.get("staleness"), ".2f"), f(r["sync_gap"], ".2f")])
    print_table("bench shadowsync --nodes 2 (medians)", cols, rows, console=console)
    verdicts = [
        _verdict(two["eps_per_cpu"] / one["eps_per_cpu"] >= 0.8, "EPS per trainer CPU-second, 2 nodes vs 1",
                 f"{two['eps_per_cpu'] / one['eps_per_cpu']:.2f}x (target >= 0.8x)"),
        _verdict(two["lookup_wait_fraction"] < 0.05, "lookup wait with prefetch",
                 f"{two['lookup_wait_fraction']:.1%} of step time (without: {cold['lookup_wait_fraction']:.1%}; "
                 "target < 5%)"),
        _verdict(abs(two["eval_ne"] / one["eval_ne"] - 1) <= 0.01, "eval NE, 2 nodes vs 1",
                 f"{100 * (two['eval_ne'] / one['eval_ne'] - 1):+.2f}% (target within 1%)"),
    ]
    costs = measure_server_costs()
    measured = _measured(one, two, costs, batch_size, 1)
    grouped = _measured(one, med[GROUPED], costs, batch_size, GROUP)
    proj, proj_g = projection_table(measured), projection_table(grouped)
    check = _model_check(measured, two)
    verdicts += _projection_verdicts(proj, proj_g, measured)
    for line in verdicts:
        console.print(("[green]" if line.startswith("PASS") else "[red]") + line)
    console.print(f"server costs: {1e6 * costs['call_s']:.0f} us CPU per RPC call, "
                  f"{1e9 * costs['row_s']:.0f} ns per row")
    for c in check:
        err = abs(c["predicted"] - c["measured"]) / max(abs(c["measured"]), 1e-12)
        console.print(f"model check: {c['quantity']}: predicted {c['predicted']:.4g}, measured {c['measured']:.4g} "
                      f"({err:.0%} off)")
    pcols = ["batches/message", "trainers:servers", "Gb/s"] + [str(n) for n in MACHINES]
    prow = []
    for k, table in ((1, proj), (GROUP, proj_g)):
        for t, s in RATIOS:
            for g in GBPS:
                cells = [p for p in table
                         if (p["trainers_per_machine"], p["servers_per_machine"], p["gbps"]) == (t, s, g)]
                prow.append([str(k), f"{t}:{s}", str(g)] + [f"{p['efficiency']:.0%} {p['limit'][0]}" for p in cells])
    print_table("projected scaling efficiency (bound: t = trainers, s = servers, n = network)", pcols, prow,
                console=console)
    console.print(markdown_table(cols, rows), markup=False, highlight=False, soft_wrap=True)
    console.print(markdown_table(pcols, prow), markup=False, highlight=False, soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    plot = save_figure(_plot(proj, proj_g), out / "scaling.png")
    console.print(f"plot: {plot}")
    keys = ("machines", "gbps", "eps", "efficiency", "limit", "sync_gap", "trainers_per_machine",
            "servers_per_machine")
    payload = {"runs": [_json_row(name, r) for name, r in med.items()], "model_inputs": measured.__dict__,
               "model_inputs_grouped": grouped.__dict__, "model_check": check,
               "projection": [{**{k: p[k] for k in keys}, "lookup_batches": k} for k, table in
                              ((1, proj), (GROUP, proj_g)) for p in table],
               "verdicts": verdicts}
    if json_path:
        console.print(f"json: {write_json(json_path, json_safe(payload))}")
    return payload


def _measured(one: dict, two: dict, costs: dict, batch_size: int, group: int) -> Measured:
    """The model's inputs from the 1-node run, a 2-node run (with `group` batches per message) and the server costs."""
    return Measured(
        c_single=one["eps_per_cpu"], c_remote=two["eps_per_cpu"], rows_per_example=two["rows_per_example"],
        remote_bytes_per_example=two["sparse_bytes_per_example"] / max(two["remote_row_fraction"], 1e-9),
        dense_params=int(two["dense_params"]), rpc_s=two["rpc_round_trip_s"], server_call_s=costs["call_s"],
        server_row_s=costs["row_s"], batch_size=batch_size, lookup_batches=group, prefetch=max(2, group))


def _json_row(name: str, r: dict) -> dict:
    return {"run": name, "nodes": r.get("nodes", 1), "T": r["T"], "W": r["W"], "sync": r["sync"], "eps": r["eps"],
            "eps_per_cpu": r["eps_per_cpu"], "eps_per_job_cpu": r.get("eps_per_job_cpu", r["eps_per_cpu"]),
            "eval_ne": r["eval_ne"], "eval_ne_samples": r["eval_ne_samples"],
            "lookup_wait_fraction": r.get("lookup_wait_fraction", 0.0),
            "bytes_per_example": r.get("sparse_bytes_per_example", 0.0) + r.get("dense_bytes_per_example", 0.0),
            "sparse_bytes_per_example": r.get("sparse_bytes_per_example", 0.0),
            "dense_bytes_per_example": r.get("dense_bytes_per_example", 0.0),
            "rpc_round_trip_s": r.get("rpc_round_trip_s"), "staleness": r.get("staleness"), "sync_gap": r["sync_gap"],
            "server_rows_per_cpu_s": r.get("server_rows_per_cpu_s")}


def _model_check(m: Measured, two: dict) -> list[dict]:
    """The model against what the 2-node run measured: the servers' CPU, network bytes, the lookup wait."""
    remote = 0.5  # two nodes, row hash
    rows = two["remote_row_fraction"] * two["rows_per_example"] * two["examples"]
    return [{"quantity": "server CPU seconds, 2 nodes (calls x k_call + rows x k_row)",
             "predicted": two["remote_calls"] * m.server_call_s + rows * m.server_row_s,
             "measured": two["server_cpu_seconds"]},
            {"quantity": "sparse bytes per example, 2 nodes", "predicted": m.remote_bytes_per_example * remote,
             "measured": two["sparse_bytes_per_example"]},
            {"quantity": "lookup wait fraction, 2 nodes (0 when RTT < batch compute)",
             "predicted": 0.0 if m.rpc_s <= m.batch_size / m.c_remote else 1 - m.rpc_s / (m.batch_size / m.c_remote),
             "measured": two["lookup_wait_fraction"]}]


def _projection_verdicts(proj: list[dict], proj_g: list[dict], m: Measured) -> list[str]:
    out = []
    for k, table in ((1, proj), (GROUP, proj_g)):
        best = max((p for p in table if p["machines"] == 32), key=lambda p: p["efficiency"])
        out.append(_verdict(best["efficiency"] >= 0.9, f"projected efficiency at 32 machines, {k} batch(es)/message",
                            f"{best['efficiency']:.0%} at {best['trainers_per_machine']}:"
                            f"{best['servers_per_machine']} trainers:servers, {best['gbps']} Gb/s (bound: "
                            f"{best['limit']}; target >= 90%)"))
    at32 = [p for p in proj if p["machines"] == 32]
    ok = max(p["efficiency"] for p in at32) >= 0.9
    for p in at32:
        if p["gbps"] == 10:
            out.append(f"NOTE at 32 machines, {p['trainers_per_machine']}:{p['servers_per_machine']}, 10 Gb/s: "
                       f"{p['efficiency']:.0%}, bound by {p['limit']}")
    if not ok:  # what the binding resource would have to cost for the target
        need = _needed_call_cost(m)
        out.append(f"NOTE 90% at 32 machines (best ratio, 10 Gb/s) needs a server message to cost <= "
                   f"{1e6 * need:.1f} us of CPU (measured {1e6 * m.server_call_s:.0f} us), or as many fewer "
                   f"messages (lookups of {m.server_call_s / max(need, 1e-12):.0f} batches per message)"
                   if need > 0 else "NOTE 90% at 32 machines is out of reach whatever a message costs "
                   "(another resource binds first)")
    return out


def _needed_call_cost(m: Measured) -> float:
    """The largest server CPU per message at which some trainer:server ratio reaches 90% at 32 machines (0: none)."""
    from dataclasses import replace

    from cocosync.bench.scaling_model import project

    lo, hi = 0.0, m.server_call_s
    best = lambda k: max(project(replace(m, server_call_s=k), 32, 10, t, s)["efficiency"] for t, s in RATIOS)
    if best(lo) < 0.9:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid) >= 0.9 else (lo, mid)
    return lo


def _verdict(ok: bool, what: str, detail: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {what}: {detail}"


def _plot(proj: list[dict], proj_g: list[dict]):
    import logging

    import matplotlib

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)  # font-cache chatter on a bare machine
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATIOS), figsize=(5 * len(RATIOS), 4), sharey=True)
    for ax, (t, s) in zip(axes, RATIOS):
        for k, table, style in ((1, proj, "-"), (GROUP, proj_g, "--")):
            pts = [p for p in table if (p["trainers_per_machine"], p["servers_per_machine"], p["gbps"]) == (t, s, 10)]
            ax.plot([p["machines"] for p in pts], [p["efficiency"] for p in pts], style, marker="o",
                    label=f"{k} batch{'es' if k > 1 else ''}/message, 10 Gb/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{t} trainers : {s} server{'s' if s > 1 else ''} per machine")
        ax.set_xlabel("machines")
        ax.axhline(0.9, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (EPS / machines x one-machine EPS)")
    axes[0].legend()
    fig.suptitle("ShadowSync projected from measured per-example compute, bytes and server capacity")
    fig.tight_layout()
    return fig
