"""`cocosync bench lookups`: CPU per example of a ShadowSync job on 1, 2, 4 ... torchrun nodes (loopback), for each
lookup transport (the exchange, RPC; the exchange with and without replicated hot rows), and the straight-line
projection to 32 and 128 machines.

Each node runs one embedding server and `--trainers-per-node` trainers (`--sync none`: the lookups alone). A
configuration's **CPU per example** is the CPU-seconds of every process (set-up excluded) per *extra* example between
a short and a long run, so start-up and the final scoring cancel; its **efficiency** is one node's CPU per example
over its own. Every configuration runs once per round (round-robin, both lengths back to back), medians over the
rounds; `--parallel` runs a round's jobs side by side in balanced waves instead (`waves`), for a machine with a core
per process of a wave (the lent 16-core machine), where one job at a time would leave most cores idle. A
least-squares line through CPU per example against the node count projects the efficiency at 32 and 128 machines:
(a + b) / (a + b N). Loopback nodes share one machine's cores, caches and clock, which N machines do not: with
`--side-by-side` each node count N > 1 also gets N one-node jobs run side by side as its reference (the same
processes on the machine and examples per trainer), and every N-node row reports its efficiency against them too
("vs side by side"), with a second projection through those ratios. Also reported (long runs, medians): staleness
(updates a pushed row received since its fetch), the share of step time trainers waited on lookups, messages and
bytes per example between nodes, eval NE (with `--sync none` the N nodes' N trainers do not average their dense
replicas: compare NE across node counts with a sync algorithm and as many trainers on one node, as BENCHMARKS.md
does).
Written: the table (and markdown), lookups.json and lookups.png (CPU per example vs nodes, measured and fitted).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import click

from cocosync.bench.common import TimeBudget, fit_line
from cocosync.bench.exchange_model import model_report

__all__ = ["lookups_cmd", "run_lookups", "projected_efficiency", "thread_rows", "SIDE_BY_SIDE"]

SIDE_BY_SIDE = "side by side"  # the label of N one-node jobs run at once: an N-node job's machine-load reference

TARGETS = {"efficiency_4": 0.9, "efficiency_32": 0.9, "efficiency_128": 0.75, "staleness": 4.0, "wait": 0.05}


def projected_efficiency(a: float, b: float, nodes: int) -> float:
    """One node's CPU per example over N nodes', both on the fitted line a + b N."""
    return (a + b) / (a + b * nodes)


def variants(transports: list[str], hot_rows: list[int], hot_staleness: list[float] | None = None,
             gloo_devices: list[str] | None = None, launchers: list[str] | None = None) -> dict[str, list[str]]:
    """The configurations to compare across nodes: their labels and job options (the exchanges once per hot-row
    count and hot-row staleness bound, every configuration once per gloo device mode and launcher; labelled by those
    that vary). A device mode is an `env:` option, which the bench hands to the job's environment
    (runtime/comm/gloo_device.py); a launcher a `launcher:` option, how the bench starts each node
    (testing/multinode.py)."""
    from cocosync.shadowsync.config import EXCHANGES

    bounds, devices, launch = hot_staleness or [0.0], gloo_devices or ["shared"], launchers or ["cocosync"]
    out = {}
    for t in transports:
        for h in (hot_rows if t in EXCHANGES else [0]):
            for b in (bounds if t in EXCHANGES and h > 0 else [0.0]):
                for d, how in itertools.product(devices, launch):
                    label = t + (f" hot={h}" if t in EXCHANGES and len(hot_rows) > 1 else "") \
                        + (f" bound={b:g}" if t in EXCHANGES and h > 0 and len(bounds) > 1 else "") \
                        + (f" dev={d}" if len(devices) > 1 else "") + (f" via {how}" if len(launch) > 1 else "")
                    out[label] = ["--lookup-transport", t, "--hot-rows", str(h), "--hot-staleness", str(b),
                                  *([f"env:COCOSYNC_GLOO_DEVICE={d}"] if len(devices) > 1 else []),
                                  f"launcher:{how}"]
    return out


def waves(nodes: list[int], labels: list[str], parallel: bool,
          side_by_side: bool = False) -> list[list[tuple[int, str]]]:
    """One round's jobs as waves run one after another, a wave's jobs side by side: one job a wave (every
    configuration once), or with `parallel` one wave per variant, each holding the 1-node reference and, for the i-th
    node count above 1, variant (wave + i) mod V: every variant once per node count and round, and every wave the
    same number of processes (a Latin square), so neighbours load each variant alike."""
    if parallel and side_by_side:
        raise ValueError("side-by-side references run their own waves: not with parallel waves")
    if not parallel:  # (`side_by_side`: after each node count's variants, its one-node jobs side by side)
        more = [*labels, *([SIDE_BY_SIDE] if side_by_side else [])]
        return [[(n, t)] for n in nodes for t in (more if n > 1 else labels[:1])]
    multi = [n for n in nodes if n > 1]
    return [[(1, labels[0]), *((n, labels[(w + i) % len(labels)]) for i, n in enumerate(multi))]
            for w in range(len(labels))]


def _starts(nodes: int, label: str, examples: int, out: Path) -> list[tuple[int, int, Path]]:
    """The torchrun starts (nnodes, examples, out) of one bench job: itself, or for SIDE_BY_SIDE N one-node jobs of
    examples / N each (an N-node job's machine-load reference)."""
    if label != SIDE_BY_SIDE:
        return [(nodes, examples, out)]
    return [(1, examples // nodes, out / f"copy-{i}") for i in range(nodes)]


def _run_wave(jobs: list[tuple[int, str, int, list[str], Path]], per_node: int) -> list[dict]:
    """Start every job (nodes, label, examples, options, out) of a wave, then wait for each: their summaries (a
    SIDE_BY_SIDE job's copies, started together, as one: `combined`)."""
    from cocosync.testing.multinode import start_nodes, wait_nodes

    runs = [(n, label, extra, out, start) for n, label, ex, extra, out in jobs for start in _starts(n, label, ex, out)]
    started = [start_nodes(["-m", "cocosync.shadowsync", "--examples", str(ex), "--sync", "none", "--out", str(path),
                            *(x for x in extra if not x.startswith(("env:", "launcher:")))], nnodes=nn,
                           nproc_per_node=1 + per_node,
                           env=dict(x[4:].split("=", 1) for x in extra if x.startswith("env:")),
                           launcher=next((x[9:] for x in extra if x.startswith("launcher:")), "cocosync"))
               for *_, extra, _, (nn, ex, path) in runs]
    got: dict[Path, list[dict]] = {}
    for (n, label, _, out, (_, _, path)), procs in zip(runs, started):
        for r in wait_nodes(procs, 900):
            if r.returncode != 0:
                raise click.ClickException(f"{n}-node {label} run failed on node {r.node} (exit {r.returncode}):"
                                           f"\n{r.output[-3000:]}")
        got.setdefault(out, []).append(json.loads((path / "summary.json").read_text()))
    return [combined(got[out]) for *_, out in jobs]


def combined(summaries: list[dict]) -> dict:
    """One summary of jobs run side by side: their CPU, examples, counts and CPU by thread summed, the rest (NE,
    staleness, rates) the median of theirs."""
    if len(summaries) == 1:
        return summaries[0]
    out = {k: statistics.median(s[k] for s in summaries) for k in _KEYS
           if all(isinstance(s.get(k), (int, float)) for s in summaries)}
    for k in ("job_cpu_seconds", "examples", "exchange_rounds", "hot_syncs", "gloo_cpu_seconds"):
        out[k] = sum(s.get(k, 0) for s in summaries)
    out["cpu_seconds_by_thread"] = {}
    for s in summaries:
        for k, v in s.get("cpu_seconds_by_thread", {}).items():
            out["cpu_seconds_by_thread"][k] = out["cpu_seconds_by_thread"].get(k, 0.0) + v
    return out


def run_lookups(*, nodes: list[int], transports: dict[str, list[str]], examples: tuple[int, int], per_node: int,
                repeats: int, eval_examples: int, extra: list[str], console: Any, parallel: bool = False,
                time_limit: float | None = None, side_by_side: bool = False) -> dict:
    """Every configuration's samples (one per round, and per wave with `parallel`: see `waves`) and its medians.
    `transports`: label -> job options. `time_limit` (seconds): start no wave after it (one that would not finish
    by it, judged by the slowest wave so far) and report the rounds that finished, so a bench under a machine's time
    limit keeps what it measured. `side_by_side`: also N one-node jobs at once per node count N > 1 (the N-node
    rows' machine-load reference: see the module doc)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    labels = list(transports)
    plan = waves(nodes, labels, parallel, side_by_side)
    configs = list(dict.fromkeys(c for wave in plan for c in wave))
    small, big = examples
    args = ["--eval-examples", str(eval_examples), *extra]
    samples: dict[tuple[int, str], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="cocosync-bench-lookups-") as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console) as bar:
        config = Path(tmp) / "bench.toml"  # no checkpoint, no plot: the runs measure training and scoring only
        config.write_text("checkpoint = false\nplot = false\n")
        args = ["--config", str(config), *args]
        task = bar.add_task("lookup runs", total=2 * repeats * sum(len(w) for w in plan))
        budget, stopped = TimeBudget(time_limit), False
        for rnd in range(repeats):
            for w, wave in enumerate(plan):
                if not budget.allows():
                    stopped = True
                    break
                got: dict[tuple[int, str], list[dict]] = {}
                with budget.step():
                    for ex in (small, big):
                        jobs = [(n, t, ex, [*args, *transports.get(t, transports[labels[0]])],
                                 Path(tmp) / f"{n}-{t.replace(' ', '-')}-{ex}-{rnd}-{w}") for n, t in wave]
                        for c, summary in zip(wave, _run_wave(jobs, per_node)):
                            got.setdefault(c, []).append(summary)
                        bar.advance(task, len(wave))
                for (n, t), (a, b) in got.items():
                    _sample(samples[(n, t)], a, b, rnd, bar.console, n, t)
            if stopped:
                break
    if stopped:
        console.print(f"[yellow]--time-limit {time_limit:g} s: stopped after {sum(map(len, samples.values()))} "
                      f"of {repeats * len(configs)} samples; the medians below are of those that finished")
    samples = {c: v for c, v in samples.items() if v}
    if stopped and (not any(n == 1 for n, _ in samples) or len(samples) < 2):
        raise click.ClickException(f"--time-limit {time_limit:g} s: too short for the 1-node reference and one more "
                                   f"node count ({sum(map(len, samples.values()))} samples finished)")
    rows = [_median(n, t, v) for (n, t), v in samples.items()]
    one = next(r for r in rows if r["nodes"] == 1)
    side = {r["nodes"]: r["cpu_us_per_example"] for r in rows if r["transport"] == SIDE_BY_SIDE}
    for r in rows:
        r["efficiency"] = one["cpu_us_per_example"] / r["cpu_us_per_example"]
        if r["nodes"] > 1 and r["transport"] != SIDE_BY_SIDE and r["nodes"] in side:
            r["efficiency_side_by_side"] = side[r["nodes"]] / r["cpu_us_per_example"]
    fits, fits_side = {}, {}
    for t in labels:
        mine = [r for r in rows if r["nodes"] == 1 or r["transport"] == t]
        fit = _fit(mine, lambda r: r["cpu_us_per_example"])
        if fit:
            fits[t] = fit
        # the same line through CPU per example with the machine's load taken out: c(1) / efficiency vs side by side
        fit = _fit([r for r in mine if r["nodes"] == 1 or "efficiency_side_by_side" in r],
                   lambda r: one["cpu_us_per_example"] / r.get("efficiency_side_by_side", 1.0))
        if fit and side:
            fits_side[t] = fit
    relay = _relay_us(rows, per_node)
    models = {t: _model(rows, one, t, extra, relay) for t in labels if t.startswith("exchange")}
    if side:  # the same model with each node count's machine load taken out (exchange_model.py's module doc)
        load = _load_line(one["cpu_us_per_example"], side)
        models.update({f"{t}, load matched": _model(rows, one, t, extra, relay, load)
                       for t in labels if t.startswith("exchange")})
    return {"rows": rows, "fits": fits, "fits_side_by_side": fits_side,
            "models": {t: m for t, m in models.items() if m is not None},
            "samples": {f"{n}:{t}": v for (n, t), v in samples.items()},
            "settings": {"nodes": nodes, "transports": transports, "examples": list(examples),
                         "trainers_per_node": per_node, "repeats": repeats, "extra": extra}}


def _load_line(one: float, side: dict[int, float]) -> dict[int, float]:
    """The machine's load at each side-by-side node count, read off a straight line through one node alone and every
    side-by-side point: one reference is a difference of two noisy runs (a 2-node reference once came out below one
    node alone), and the model's per-row cost is fitted on what it leaves."""
    a, b = fit_line([1, *side], [one, *side.values()])
    return {n: a + b * n for n in side}


def _fit(rows: list[dict], cost: Any) -> dict | None:
    """The straight line of `cost(row)` against nodes and its projected efficiencies; None with one node count."""
    pts = [(r["nodes"], cost(r)) for r in rows]
    if len({x for x, _ in pts}) < 2:
        return None
    a, b = fit_line([x for x, _ in pts], [y for _, y in pts])
    return {"intercept_us": a, "slope_us_per_node": b,
            **{f"efficiency_{m}": projected_efficiency(a, b, m) for m in (4, 8, 32, 128)}}


def _relay_us(rows: list[dict], per_node: int) -> float | None:
    """k_relay: a trainer's relay CPU us per round, the median over the node-exchange multi-node rows (None: none)."""
    vals = [r["relay_cpu_us_per_round"] / per_node for r in rows if r["nodes"] > 1
            and r["transport"].startswith("node-exchange") and r.get("relay_cpu_us_per_round", 0) > 0]
    return statistics.median(vals) if vals else None


def _model(rows: list[dict], one: dict, label: str, extra: list[str], relay_us: float | None = None,
           load: dict[int, float] | None = None) -> dict | None:
    """The exchange model (exchange_model.py) fitted to one exchange variant's rows; None without a multi-node row.
    `load`: N -> CPU per example of N one-node jobs side by side, the load-matched bases."""
    import dataclasses

    from cocosync.shadowsync.config import ClusterConfig

    mine = [one, *(r for r in rows if r["transport"] == label)]
    if len(mine) < 2:
        return None
    default = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}
    interval = default["exchange_interval"]
    if "--exchange-interval" in extra:
        interval = float(extra[extra.index("--exchange-interval") + 1]) / 1e3
    hot = [r["hot_sync_interval_ms"] / 1e3 for r in mine[1:] if r.get("hot_sync_interval_ms", 0) > 0]
    hot_interval = statistics.median(hot) if hot else default["hot_sync_interval"]  # a bound sets it: measured
    return model_report(mine, interval_s=interval, hot_interval_s=hot_interval, relay_us=relay_us, load=load)


def _sample(into: list[dict], a: dict, b: dict, rnd: int, console: Any, n: int, t: str) -> None:
    """One configuration's sample from its short run `a` and long run `b`: CPU per extra example, and b's measures."""
    extra = b["examples"] - a["examples"]
    cpu = 1e6 * (b["job_cpu_seconds"] - a["job_cpu_seconds"]) / extra
    # the exchange model's counts per extra example (the rounds while scoring and closing cancel like the CPU)
    counts = {f"{k}_per_example": (b.get(k, 0) - a.get(k, 0)) / extra
              for k in ("exchange_rounds", "hot_syncs", "gloo_cpu_seconds")}
    into.append({**{k: b.get(k) for k in _KEYS}, "cpu_us_per_example": cpu,
                 "rounds_per_example": counts["exchange_rounds_per_example"],
                 "hot_syncs_per_example": counts["hot_syncs_per_example"],
                 "gloo_cpu_us_per_example": 1e6 * counts["gloo_cpu_seconds_per_example"],
                 "cpu_us_per_example_by_thread": _by_thread(a, b, extra),
                 "job_cpu_seconds": [a["job_cpu_seconds"], b["job_cpu_seconds"]],
                 "examples_run": [a["examples"], b["examples"]]})
    console.print(f"  {n} node{'s' if n > 1 else ' '} {t if n > 1 else 'local':16s} round {rnd + 1}: "
                  f"{cpu:6.2f} us CPU per extra example, staleness {b['staleness']:.2f} (other nodes' rows "
                  f"{b.get('staleness_remote', 0):.2f}, hot rows' syncs {b.get('staleness_hot_sync', 0):.2f}"
                  + (f" every {b['hot_sync_interval_ms']:.1f} ms" if b.get("hot_sync_interval_ms") else "") + "), "
                  f"lookup wait {b['lookup_wait_fraction']:.1%}, eval NE {b['eval_ne']:.4f}")


def _by_thread(a: dict, b: dict, extra: int) -> dict[str, float]:
    """CPU us per extra example of each '<process kind>/<thread role>' (the summary's cpu_seconds_by_thread)."""
    ta, tb = a.get("cpu_seconds_by_thread", {}), b.get("cpu_seconds_by_thread", {})
    return {k: 1e6 * (tb.get(k, 0.0) - ta.get(k, 0.0)) / extra for k in {*ta, *tb}}


_KEYS = ("eval_ne", "staleness", "staleness_remote", "staleness_hot_sync", "hot_sync_interval_ms",
         "lookup_wait_fraction", "lookup_wait_past_start", "messages_per_example", "network_bytes_per_example",
         "exchange_cpu_us_per_round", "rpc_round_trip_s", "eps", "prefetch", "examples", "hot_row_fraction",
         "hot_sync_cpu_us_per_sync", "rows_per_example", "remote_row_fraction", "relay_cpu_us_per_round",
         "hot_sync_longest_gap_ms")


def _median(nodes: int, transport: str, v: list[dict]) -> dict:
    out: dict = {"nodes": nodes, "transport": transport if nodes > 1 else "local", "samples": len(v)}
    for k in ("cpu_us_per_example", "rounds_per_example", "hot_syncs_per_example", "gloo_cpu_us_per_example",
              *_KEYS):
        vals = [s[k] for s in v if isinstance(s.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else float("nan")
    out["cpu_samples"] = [round(s["cpu_us_per_example"], 2) for s in v]
    threads = {k for s in v for k in s.get("cpu_us_per_example_by_thread", {})}
    out["cpu_us_per_example_by_thread"] = {
        k: statistics.median(s.get("cpu_us_per_example_by_thread", {}).get(k, 0.0) for s in v) for k in threads}
    return out


def verdicts(result: dict) -> list[str]:
    out = []
    for r in result["rows"]:
        if r["transport"] == SIDE_BY_SIDE:  # a reference, not a configuration the targets are about
            continue
        if r["nodes"] == 4:
            out.append(_verdict(r["efficiency"] >= TARGETS["efficiency_4"],
                                f"CPU efficiency at 4 nodes, {r['transport']}",
                                f"{r['efficiency']:.2f} (target >= 0.9)"))
        if r["nodes"] > 1:
            out.append(_verdict(r["staleness"] <= TARGETS["staleness"], f"staleness at {r['nodes']} nodes, "
                                f"{r['transport']}", f"{r['staleness']:.2f} updates per row (target <= 4)"))
            out.append(_verdict(r["lookup_wait_fraction"] < TARGETS["wait"], f"lookup wait at {r['nodes']} nodes, "
                                f"{r['transport']}", f"{r['lookup_wait_fraction']:.1%} of step time (target < 5%)"))
            steady = r.get("lookup_wait_past_start", float("nan"))
            if steady == steady:
                out.append(_verdict(steady < TARGETS["wait"], f"lookup wait past the start at {r['nodes']} nodes, "
                                    f"{r['transport']}", f"{steady:.1%} of step time past each trainer's first "
                                    "prefetch window (target < 5%)"))
        if r["nodes"] == 4 and "efficiency_side_by_side" in r:
            out.append(_verdict(r["efficiency_side_by_side"] >= TARGETS["efficiency_4"],
                                f"CPU efficiency at 4 nodes against 4 one-node jobs side by side, {r['transport']}",
                                f"{r['efficiency_side_by_side']:.2f} (target >= 0.9)"))
    for key, how in (("fits", "straight line"), ("fits_side_by_side", "straight line, load matched")):
        for t, f in result.get(key, {}).items():
            out.append(_verdict(f["efficiency_32"] >= TARGETS["efficiency_32"] and f["efficiency_128"] >= TARGETS[
                "efficiency_128"], f"projected efficiency, {t} ({how})", f"32 machines {f['efficiency_32']:.2f} "
                f"(target >= 0.9), 128 machines {f['efficiency_128']:.2f} (target >= 0.75)"))
    return out


def _print_model(console: Any, label: str, m: dict) -> None:
    c = m["costs"]
    console.print(f"{label}, the exchange model (exchange_model.py): c(1) {c['c_one']:.2f} us, "
                  f"rest {c['k_row']:.3f} us per remote row, round {c['round_us'][0]:.0f} + {c['round_us'][1]:.0f} "
                  f"x peers us, hot sync "
                  f"{c['hot_us'][0]:.0f} + {c['hot_us'][1]:.0f} x peers us, gloo's threads per collective "
                  f"{c['gloo_us'][0]:.0f} + {c['gloo_us'][1]:.0f} x peers us")
    for k in m["checks"]:
        console.print(f"  {k['nodes']} nodes: measured {k['measured_us']:.2f} us/example, "
                      f"model {k['predicted_us']:.2f} ({k['error']:+.0%})")
    relay = c.get("relay_us")
    console.print("  one exchange per node: " + (f"a trainer's relay {relay:.0f} us per round (measured)" if relay
                                                  is not None else "relay cost unknown (no node-exchange run)"))
    for p in m["projections"]:
        load = f", its server {p['server_load']:.0%} busy" if p.get("server_load") is not None else ""
        console.print(f"  {p['machines']:4d} machines x {p['trainers_per_node']:2d} trainers: efficiency "
                      f"{p['per_trainer_exchange']:.2f} (an exchange per trainer), {p['per_node_exchange']:.2f} "
                      f"(one per node{load})")


def _numbers(text: str, kind: type, flag: str, what: str) -> list:
    """A comma-separated list of numbers >= 0, or a usage error naming the flag and its value."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        values = [-1]
    if min(values) < 0:
        raise click.UsageError(f"{flag} {text!r}: expected {what} >= 0, comma-separated")
    return values


def _verdict(ok: bool, what: str, detail: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {what}: {detail}"


COLUMNS = ["nodes", "transport", "CPU us/example", "efficiency", "vs side by side", "staleness",
           "of it: hot syncs / remote", "lookup wait", "past the start", "messages/example", "net B/example",
           "eval NE", "samples"]


def _cells(r: dict) -> list[str]:
    parts = f"{r.get('staleness_hot_sync', 0):.2f} / {r.get('staleness_remote', 0):.2f}"
    side = f"{r['efficiency_side_by_side']:.2f}" if "efficiency_side_by_side" in r else "-"
    return [str(r["nodes"]), r["transport"], f"{r['cpu_us_per_example']:.2f}", f"{r['efficiency']:.2f}", side,
            f"{r['staleness']:.2f}", parts, f"{r['lookup_wait_fraction']:.1%}", _pct(r.get("lookup_wait_past_start")),
            f"{r['messages_per_example']:.4f}",
            f"{r['network_bytes_per_example']:,.0f}", f"{r['eval_ne']:.4f}",
            str(r["samples"])]


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, (int, float)) and v == v else "-"


def thread_rows(rows: list[dict]) -> list[list[str]]:
    """A table of CPU us per example by '<kind>/<role>' (rows, largest in the last configuration first) against the
    configurations (columns), and their sums: its header first; [] without the summaries' split."""
    rows = [r for r in rows if r.get("cpu_us_per_example_by_thread")]
    if not rows:
        return []
    keys = sorted({k for r in rows for k in r["cpu_us_per_example_by_thread"]},
                  key=lambda k: -rows[-1]["cpu_us_per_example_by_thread"].get(k, 0.0))
    header = ["process / thread", *(f"{r['nodes']} {r['transport']}" for r in rows)]
    table = [header]
    for k in keys:
        vals = [r["cpu_us_per_example_by_thread"].get(k, 0.0) for r in rows]
        if max(abs(v) for v in vals) >= 0.005:
            table.append([k, *(f"{v:.2f}" for v in vals)])
    table.append(["all", *(f"{sum(r['cpu_us_per_example_by_thread'].values()):.2f}" for r in rows)])
    return table


def _plot(result: dict):
    import logging

    import matplotlib

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    one = [r for r in result["rows"] if r["nodes"] == 1]
    for t, f in result["fits"].items():
        pts = sorted(one + [r for r in result["rows"] if r["transport"] == t], key=lambda r: r["nodes"])
        line = ax.plot([r["nodes"] for r in pts], [r["cpu_us_per_example"] for r in pts], "o", label=f"{t} (measured)")
        xs = [1, max(r["nodes"] for r in pts) * 2]
        ax.plot(xs, [f["intercept_us"] + f["slope_us_per_node"] * x for x in xs], "--", color=line[0].get_color(),
                label=f"{t} fit: 32 machines {f['efficiency_32']:.0%}")
    side = sorted((r for r in result["rows"] if r["transport"] == SIDE_BY_SIDE), key=lambda r: r["nodes"])
    if side:
        ax.plot([1, *(r["nodes"] for r in side)], [one[0]["cpu_us_per_example"], *(r["cpu_us_per_example"]
                for r in side)], "x:", color="gray", label="N one-node jobs side by side (the machine's load)")
    ax.set_xlabel("torchrun nodes (loopback)")
    ax.set_ylabel("CPU us per extra example (all processes)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("ShadowSync CPU per example vs nodes")
    fig.tight_layout()
    return fig


@click.command("lookups")
@click.option("--nodes", default="1,2,4", show_default=True, help="node counts (comma-separated; 1 is the reference).")
@click.option("--transports", default="exchange,rpc", show_default=True, help="lookup transports to compare.")
@click.option("--hot-rows", default="4096", show_default=True,
              help="the exchange's replicated hot rows, one configuration per value (comma-separated; 0: none).")
@click.option("--examples", default="100000,300000", show_default=True,
              help="the short and the long run (CPU per example is their difference over the extra examples).")
@click.option("--hot-staleness", default="0", show_default=True,
              help="the hot rows' staleness bound, one configuration per value (comma-separated; 0: the fixed "
                   "interval).")
@click.option("--gloo-device", default="shared", show_default=True,
              help="gloo devices: 'shared' (one per process, the job's), 'per-group' (torch's default), or both "
                   "comma-separated to compare them (the 1-node reference runs the first).")
@click.option("--launcher", default="cocosync", show_default=True,
              help="how each node starts: 'cocosync' (`cocosync train --nnodes`: ranks forked warm, one session a "
                   "node), 'torchrun' (torchrun's command: a session per rank), or both comma-separated to compare "
                   "them (the 1-node reference runs the first).")
@click.option("--trainers-per-node", type=int, default=1, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True, help="rounds (medians over them).")
@click.option("--eval-examples", type=int, default=20_000, show_default=True)
@click.option("--exchange-interval", type=float, default=None, help="milliseconds (the job's default if not set).")
@click.option("--prefetch", type=int, default=None, help="batches (the transport's default if not set).")
@click.option("--parallel", is_flag=True,
              help="run each round's jobs side by side in balanced waves (one per variant; for a machine with a core "
                   "for every process of a wave: the 1-node job and one job per larger node count).")
@click.option("--side-by-side", is_flag=True,
              help="also run N one-node jobs side by side for each node count N > 1 (the same processes on the "
                   "machine as the N-node job, the same examples per trainer), and report each N-node row's "
                   "efficiency against them: loopback nodes share one machine's cores, caches and clock.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="seconds: start no job wave that would end after it (judged by the slowest so far) and report the "
                   "rounds that finished (a machine lent for minutes).")
@click.option("--out", default="bench-out/lookups", show_default=True, help="directory for lookups.png/.json.")
@click.option("--json", "json_path", default=None, help="also write the JSON here.")
def lookups_cmd(nodes: str, transports: str, hot_rows: str, hot_staleness: str, examples: str, gloo_device: str,
                launcher: str, trainers_per_node: int, repeats: int,
                eval_examples: int, exchange_interval: float | None, prefetch: int | None, parallel: bool,
                side_by_side: bool, time_limit: float | None, out: str, json_path: str | None) -> None:
    """CPU per example of a ShadowSync job on 1, 2, 4 ... loopback nodes, per lookup transport."""
    from rich.console import Console

    from cocosync.bench.common import markdown_table, print_table, save_figure, write_json
    from cocosync.shadowsync.config import TRANSPORTS
    from cocosync.testing.multinode import LAUNCHERS

    node_list = sorted({int(x) for x in nodes.split(",")})
    trans = [t.strip() for t in transports.split(",")]
    bad = [t for t in trans if t not in TRANSPORTS]
    if bad or 1 not in node_list or len(node_list) < 2 or min(node_list) < 1:
        raise click.UsageError(f"--nodes {nodes!r} --transports {transports!r}: expected node counts including 1 and "
                               f"another, transports from {TRANSPORTS}")
    hot = _numbers(hot_rows, int, "--hot-rows", "row counts")
    bounds = _numbers(hot_staleness, float, "--hot-staleness", "updates per use")
    devices = [d.strip() for d in gloo_device.split(",")]
    if not devices or any(d not in ("shared", "per-group") for d in devices) or len(set(devices)) < len(devices):
        raise click.UsageError(f"--gloo-device {gloo_device!r}: expected 'shared', 'per-group' or both")
    launchers = [x.strip() for x in launcher.split(",")]
    if not launchers or any(x not in LAUNCHERS for x in launchers) or len(set(launchers)) < len(launchers):
        raise click.UsageError(f"--launcher {launcher!r}: expected 'cocosync', 'torchrun' or both")
    if parallel and side_by_side:
        raise click.UsageError("--side-by-side runs its own one-node jobs at once: not with --parallel")
    small, big = (int(x) for x in examples.split(","))
    if not 0 < small < big:
        raise click.UsageError(f"--examples {examples!r}: expected SHORT,LONG with 0 < SHORT < LONG")
    extra = [*(["--exchange-interval", str(exchange_interval)] if exchange_interval else []),
             *(["--prefetch", str(prefetch)] if prefetch is not None else [])]
    console = Console()
    result = run_lookups(nodes=node_list, transports=variants(trans, hot, bounds, devices, launchers),
                         examples=(small, big), per_node=trainers_per_node,
                         repeats=repeats, eval_examples=eval_examples, extra=extra, console=console, parallel=parallel,
                         time_limit=time_limit, side_by_side=side_by_side)
    rows = [_cells(r) for r in result["rows"]]
    print_table("bench lookups (medians; CPU per extra example of every process)", COLUMNS, rows, console=console)
    for t, f in result["fits"].items():
        console.print(f"{t}: CPU per example = {f['intercept_us']:.2f} + {f['slope_us_per_node']:.3f} x nodes us; "
                      f"projected efficiency 8: {f['efficiency_8']:.2f}, 32: {f['efficiency_32']:.2f}, "
                      f"128: {f['efficiency_128']:.2f}")
    for t, f in result["fits_side_by_side"].items():
        console.print(f"{t}, the machine's load taken out (one node's CPU / efficiency vs side by side): "
                      f"{f['intercept_us']:.2f} + {f['slope_us_per_node']:.3f} x nodes us; projected efficiency 32: "
                      f"{f['efficiency_32']:.2f}, 128: {f['efficiency_128']:.2f}")
    threads = thread_rows(result["rows"])
    if threads:
        print_table("where the CPU goes: us per extra example by process kind / thread role (medians)",
                    threads[0], threads[1:], console=console)
    for t, m in result["models"].items():
        _print_model(console, t, m)
    result["verdicts"] = verdicts(result)
    for line in result["verdicts"]:
        console.print(("[green]" if line.startswith("PASS") else "[red]") + line)
    console.print(markdown_table(COLUMNS, rows), markup=False, highlight=False, soft_wrap=True)
    if threads:
        console.print(markdown_table(threads[0], threads[1:]), markup=False, highlight=False, soft_wrap=True)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    console.print(f"plot: {save_figure(_plot(result), path / 'lookups.png')}")
    console.print(f"json: {write_json(json_path or path / 'lookups.json', result)}")
