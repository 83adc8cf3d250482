"""``cocosync bench faults``: what a lost trainer, embedding server or machine costs a job. For each seed, the same
job (`cocosync train`, T trainers, shadow-bmuf by default) runs uninterrupted, and once per kind of loss in `--kill`
with it inflicted (kill -9) once the job has trained `--at` of its examples: trainer 1 or embedding server 0 of a
one-machine job, trainer 1 with `--max-restarts 1` (its restart joins the running job), or node 1 of `--nodes`
loopback machines (default two: `cocosync train --nnodes N`, T/N trainers and an embedding server each, periodic
checkpoints every fifth of the run; its command and every process under it killed, whatever the job is doing then:
a periodic checkpoint's save included), against the same multi-machine job uninterrupted; `rejoin`: node 1 killed
so, and its command started again once the job has trained `--rejoin-at` of its examples (it joins the running job
in its place); `node-trainer`: trainer 2 alone, node 1's first trainer, in the same multi-machine job (its machine
goes on with its other trainers); `node-restart`: the same with `--max-restarts 1` (its restart joins the running
job); `nodes`: node 1 killed whole, then node 2 once the job has gone on without it and trained `--second-at` of its
examples (three machines or more: the job ends on the others); `grow`: no kill, a job of `--nnodes 1:N` started on
node 0 alone, node 1's command started once the job has trained `--rejoin-at` of its examples (it joins the running
job in its awaited place). Per run:
the eval NE, the examples trained (every one, or the shortfall), how long after the kill the loss was recorded (a
trainer's or server's keeper, or for a machine node 0's launcher) and the trainers left had re-formed their sync,
where a lost machine's shard was restored from and how old its rows were, how soon a restarted trainer trained after
its process started (a machine that joined: after its command started), and the wall time. The target: the job
finishes with no example lost and an eval NE within 0.5% of the uninterrupted run's (1% for a machine), over the
seeds (their mean, the worst named), for each kind; a restart or a machine that joins trains within 10 s of its
start."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console

from cocosync.bench.common import markdown_table, print_table, write_json
from cocosync.testing.launch import free_port
from cocosync.testing.multinode import (
    kill_machine,
    remove_semaphores_since,
    semaphores,
    start_nodes,
    wait_nodes,
    worker_pids,
)
from cocosync.testing.sockets import job_ranks

__all__ = ["faults_cmd", "NE_TARGET"]

NE_TARGET = 0.005
#: a lost machine's target: its cold rows come back from the last checkpoint
NODE_NE_TARGET = 0.01
#: seconds from a restarted trainer's start to its first training step
RESTART_TARGET_S = 10.0
COLUMNS = ["killed", "seed", "eval NE uninterrupted", "eval NE, killed", "NE change", "examples lost",
           "loss recorded (s after kill)", "sync re-formed (s after kill)", "shard restored from (rows' age)",
           "restart or join trains (s after its start)", "seconds (uninterrupted / killed)"]


def _command(out: Path, seed: int, examples: int, trainers: int, sync: str) -> list[str]:
    return [sys.executable, "-m", "cocosync_start", "train", "--examples", str(examples), "-T", str(trainers),
            "--seed", str(seed), "--sync", sync, "--out", str(out), "--no-progress", "--timeout", "1800"]


def _run(cmd: list[str], out: Path) -> dict:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout)[-800:]}")
    return json.loads((out / "summary.json").read_text())


def _run_killing(cmd: list[str], out: Path, victim: int, at: int) -> tuple[dict, float]:
    """Run `cmd`, kill -9 the rank at local rank `victim` once the job has trained `at` examples; (summary, time of
    the kill)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed_at = None
    try:
        metrics = out / "metrics.jsonl"
        while killed_at is None and proc.poll() is None:
            time.sleep(0.05)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            records = [json.loads(x) for x in lines if x.strip().endswith("}")]
            if any(r.get("event") == "train" and r.get("examples", 0) >= at for r in records):
                pid = job_ranks(proc.pid).get(victim)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.time()
        _, err = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    if proc.returncode != 0 or killed_at is None:
        raise click.ClickException(f"{' '.join(cmd)} failed or ended before the kill: {err[-800:]}")
    return json.loads((out / "summary.json").read_text()), killed_at


def _node_args(out: Path, seed: int, examples: int, sync: str, mirror_ms: float) -> list[str]:
    return ["-m", "cocosync.shadowsync", "--examples", str(examples), "--seed", str(seed), "--sync", sync,
            "--out", str(out), "--checkpoint-every", str(examples // 5), "--timeout", "1800",
            *(["--shard-mirror-interval", f"{mirror_ms:g}"] if mirror_ms else [])]


def _trained(metrics: Path, examples: int) -> bool:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [json.loads(x) for x in lines if x.strip().endswith("}")]
    return any(r.get("event") == "train" and r.get("examples", 0) >= examples for r in records)


@dataclass(frozen=True)
class _NodesRun:
    """A multi-machine run's summary, when node 1 was killed, when its command started again (--kill rejoin) and when
    node 2 was killed (--kill nodes; time.time())."""

    summary: dict
    killed_at: float | None
    rejoined_at: float | None = None
    second_killed_at: float | None = None


def _run_nodes(args: list[str], out: Path, trainers: int, at: int | None, nodes: int = 2,
               rejoin_at: int | None = None, lone: bool = False, second_at: int | None = None,
               grow: bool = False) -> _NodesRun:
    """`nodes` loopback machines of `trainers // nodes` trainers each (after an embedding server, and EASGD's sync
    server); with `at`, node 1 killed whole once the job has trained `at` examples (`lone`: node 1's first trainer
    alone); with `rejoin_at`, its command started again once the job has trained that many (and node 0 has recorded
    the loss: a start refused before is made again); with `second_at`, node 2 killed whole once the job has trained
    that many and the job went on without node 1 (SECOND_AFTER_S after its kill). `grow`: a job of `--nnodes 1:nodes`
    started on node 0 alone (`killed_at`: then), node 1's command started at `rejoin_at`."""
    before = semaphores()
    servers = 1 + any(a.endswith("easgd") for a in args)
    port = free_port()
    nproc = servers + trainers // nodes
    layout = f"1:{nodes}" if grow else nodes
    procs = start_nodes(args, nnodes=layout, nproc_per_node=nproc, port=port, only=[0] if grow else None)
    killed_at = rejoined_at = second_killed_at = None
    if grow:
        killed_at = time.time()
    metrics = out / "metrics.jsonl"
    try:
        while at is not None and killed_at is None and all(p.poll() is None for p in procs):
            time.sleep(0.05)
            if _trained(metrics, at):
                if lone:  # (node 1's ranks: its servers, then its trainers)
                    os.kill(worker_pids(procs[1].pid)[nproc + servers], signal.SIGKILL)
                else:
                    kill_machine(procs[1].pid)
                killed_at = time.time()
        while second_at is not None and killed_at is not None and second_killed_at is None and \
                procs[0].poll() is None:
            time.sleep(0.05)
            if _trained(metrics, second_at) and time.time() - killed_at > SECOND_AFTER_S:
                kill_machine(procs[2].pid)
                second_killed_at = time.time()
        while rejoin_at is not None and killed_at is not None and rejoined_at is None and procs[0].poll() is None:
            time.sleep(0.05)
            if _trained(metrics, rejoin_at) and time.time() - killed_at > 3.5:
                started = time.time()
                again = start_nodes(args, nnodes=layout, nproc_per_node=nproc, port=port, only=[1])[0]
                procs.append(again)
                try:
                    again.wait(timeout=1.5)  # (refused: node 0 has not recorded the loss yet)
                except subprocess.TimeoutExpired:
                    rejoined_at = started
        runs = wait_nodes(procs, timeout=3600)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_machine(p.pid)
    remove_semaphores_since(before)
    # (node 1 killed, and its starts again that were refused, fail; the start that joined must not)
    ignored = {1, *range(nodes, len(runs) - 1)} if at is not None and not lone else set()
    if grow:  # (node 0, then node 1's starts: those refused before node 0 recorded it as awaited fail)
        ignored = set(range(1, len(runs) - 1))
    if second_at is not None:
        ignored.add(2)
    failed = [r for i, r in enumerate(runs) if r.returncode != 0 and i not in ignored]
    if failed or (at is not None and killed_at is None) or (rejoin_at is not None and rejoined_at is None) or \
            (second_at is not None and second_killed_at is None):
        raise click.ClickException(f"the multi-machine job failed or ended before the kill (or the machine's join): "
                                   f"{(failed[0].output if failed else runs[0].output)[-800:]}")
    return _NodesRun(json.loads((out / "summary.json").read_text()), killed_at, rejoined_at, second_killed_at)


#: the rank each kind of kill hits, by its local rank (0: the embedding server, 1: trainer 0); a machine: node 1
VICTIMS = {"trainer": 2, "restart": 2, "server": 0, "node": -1, "rejoin": -1, "node-trainer": -1,
           "node-restart": -1, "nodes": -1, "grow": -1}
#: the kinds that kill in a job across machines (the others: a one-machine job)
ACROSS = ("node", "rejoin", "node-trainer", "node-restart", "nodes", "grow")
#: the kinds whose loss is a machine's (compared with NODE_NE_TARGET)
MACHINES = ("node", "rejoin", "nodes", "grow")
#: the kinds where a machine joins (its trains-after is from its command's start)
JOINS = ("rejoin", "grow")
#: seconds after node 1's kill before --kill nodes kills node 2 (the job has gone on without node 1 by then)
SECOND_AFTER_S = 6.0
#: the kinds whose killed trainer is started again (--max-restarts 1)
RESTARTS = ("restart", "node-restart")


@click.command("faults")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--trainers", "-T", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--examples", type=click.IntRange(min=10_000), default=2_000_000, show_default=True,
              help="examples of every run.")
@click.option("--at", type=click.FloatRange(0.0, 0.95), default=0.3, show_default=True,
              help="the kill comes once the job has trained this fraction of its examples.")
@click.option("--kill", default="trainer,restart,server,node", show_default=True,
              help="what each killed run kills, comma-separated: trainer (trainer 1), restart (trainer 1, started "
                   "again: --max-restarts 1), server (embedding server 0), node (node 1 of --nodes loopback machines), "
                   "rejoin (node 1, its command started again at --rejoin-at), node-trainer (trainer 2 of the "
                   "--nodes machines' job, node 1's first trainer, alone: its machine goes on), node-restart (the "
                   "same, started again: --max-restarts 1), nodes (node 1, then node 2 at --second-at: --nodes 3 "
                   "or more), grow (no kill: --nnodes 1:N on node 0 alone, node 1 started at --rejoin-at).")
@click.option("--rejoin-at", type=click.FloatRange(0.0, 0.95), default=0.5, show_default=True,
              help="--kill rejoin, grow: node 1's command starts (again) once the job has trained this fraction.")
@click.option("--second-at", type=click.FloatRange(0.0, 0.95), default=0.6, show_default=True,
              help="--kill nodes: node 2 is killed once the job has trained this fraction (and gone on without "
                   "node 1).")
@click.option("--sync", default="shadow-bmuf", show_default=True)
@click.option("--shard-mirror-interval", "mirror_ms", type=click.FloatRange(0, 60_000), default=0, show_default=True,
              help="milliseconds: the jobs of two machines mirror their shards (0: none; a lost machine's come "
                   "back from the last checkpoint).")
@click.option("--nodes", type=click.IntRange(2, 8), default=2, show_default=True,
              help="loopback machines of the job whose node 1 --kill node kills (T/nodes trainers each).")
@click.option("--out", type=click.Path(file_okay=False), default="runs/bench-faults", show_default=True)
def faults_cmd(seeds: int, trainers: int, examples: int, at: float, rejoin_at: float, second_at: float, kill: str,
               sync: str, mirror_ms: float, nodes: int, out: str) -> None:
    """A trainer or an embedding server killed (kill -9) during a one-machine job, or a machine of a multi-machine job,
    against the same job uninterrupted, over seeds: eval NE, examples lost, how soon the job recovered."""
    kinds = [k.strip() for k in kill.split(",") if k.strip()]
    for k in kinds:
        if k not in VICTIMS:
            raise click.BadParameter(f"{k!r}: expected a comma-separated list of {', '.join(VICTIMS)}",
                                     param_hint="--kill")
    if any(k in ACROSS for k in kinds) and trainers % nodes:
        raise click.BadParameter(f"{trainers}: a machine's loss runs T/{nodes} trainers on each of {nodes} machines: "
                                 f"expected a multiple of {nodes}", param_hint="--trainers")
    if "nodes" in kinds and nodes < 3:
        raise click.BadParameter(f"{nodes}: --kill nodes loses two machines and the job goes on with the others: "
                                 "expected 3 or more", param_hint="--nodes")
    if "nodes" in kinds and second_at <= at:
        raise click.BadParameter(f"{second_at:g}: node 2 is killed after node 1 (--at {at:g}): expected more",
                                 param_hint="--second-at")
    if mirror_ms and nodes > 2:
        raise click.BadParameter(f"{mirror_ms:g}: shards are mirrored between two machines, not {nodes}",
                                 param_hint="--shard-mirror-interval")
    console = Console(width=180)
    root = Path(out)
    rows: list[list] = []
    found: dict[str, dict[str, list[float]]] = {k: {"changes": [], "lost": [], "recorded": [], "reformed": [],
                                                    "trains_after": []} for k in kinds}
    for seed in range(seeds):
        bases: dict[bool, dict] = {}
        for kind in kinds:
            node = kind in ACROSS
            if node not in bases:  # the uninterrupted job of the same shape
                base_out = root / f"seed{seed}-uninterrupted{f'-{nodes}nodes' if node else ''}"
                bases[node] = (_run_nodes(_node_args(base_out, seed, examples, sync, mirror_ms), base_out, trainers,
                                          None, nodes).summary
                               if node else _run(_command(base_out, seed, examples, trainers, sync), base_out))
            base = bases[node]
            kill_out = root / f"seed{seed}-{kind}-killed"
            rejoined_at = second_killed_at = None
            if node:
                run = _run_nodes(
                    _node_args(kill_out, seed, examples, sync, mirror_ms) + (
                        ["--max-restarts", "1"] if kind in RESTARTS else []), kill_out, trainers, int(at * examples),
                    nodes, int(rejoin_at * examples) if kind in JOINS else None,
                    lone=kind in ("node-trainer", "node-restart"),
                    second_at=int(second_at * examples) if kind == "nodes" else None, grow=kind == "grow")
                hit, killed_at, rejoined_at, second_killed_at = (run.summary, run.killed_at, run.rejoined_at,
                                                                 run.second_killed_at)
            else:
                cmd = _command(kill_out, seed, examples, trainers, sync) + (
                    ["--max-restarts", "1"] if kind == "restart" else [])
                hit, killed_at = _run_killing(cmd, kill_out, VICTIMS[kind], int(at * examples))
            assert killed_at is not None
            change = hit["eval_ne"] / base["eval_ne"] - 1
            losses = hit.get({"trainer": "lost", "restart": "lost", "server": "lost_servers",
                              "node": "lost_nodes", "rejoin": "lost_nodes", "node-trainer": "lost",
                              "node-restart": "lost", "nodes": "lost_nodes", "grow": "lost_nodes"}[kind])
            loss = losses[0] if losses else None
            rec = loss["time"] - killed_at if loss else float("nan")
            recorded = f"{rec:.2f}" if kind != "grow" else "-"  # (grow: no loss; node 1 awaited from the start)
            if kind == "nodes":  # (and node 2's, from its own kill)
                assert second_killed_at is not None
                rec2 = losses[1]["time"] - second_killed_at if len(losses) > 1 else float("nan")
                recorded = f"{rec:.2f} / {rec2:.2f}"
                found[kind]["recorded"].append(rec2)
                loss = losses[1] if len(losses) > 1 else None  # (its restore is the one said)
            ref = (hit.get("regrouped_at") or float("nan")) - killed_at
            restored = "-"
            if kind in MACHINES and loss and loss["restored"]:
                r = loss["restored"][0]
                where = (r["source"] if r["source"] in ("initial rows", "mirror")
                         else f"checkpoint at {r['examples']:,}")
                restored = f"{where} ({r['age_s']:.1f} s)"
            restarts = hit.get("restarts") or []
            after = restarts[0]["trains_after_s"] if restarts else float("nan")
            if kind in JOINS:  # (from its command's start: the launcher's own start-up counts)
                after = max(r["joined"] for r in restarts) - rejoined_at if restarts else float("nan")
            f = found[kind]
            f["trains_after"].append(after)
            f["changes"].append(change)
            f["lost"].append(examples - hit["examples"])
            f["recorded"].append(rec)
            f["reformed"].append(ref)
            rows.append([kind, seed, f"{base['eval_ne']:.4f}", f"{hit['eval_ne']:.4f}", f"{change:+.2%}",
                         f"{examples - hit['examples']:,}", recorded, "-" if kind == "server" else f"{ref:.2f}",
                         restored, "-" if kind not in (*RESTARTS, *JOINS) else f"{after:.1f}" if restarts
                         else "did not join",
                         f"{base['seconds']:.1f} / {hit['seconds']:.1f}"])
            what = "nodes 1 and 2 killed" if kind == "nodes" else "node 1 joining" if kind == "grow" else \
                f"a {kind} killed"
            console.print(f"  seed {seed}: eval NE {base['eval_ne']:.4f} uninterrupted, {hit['eval_ne']:.4f} with "
                          f"{what} ({change:+.2%}); recorded as lost: {'yes' if loss else 'no'}")
    verdicts = []
    for kind in kinds:
        f = found[kind]
        mean, worst = statistics.fmean(f["changes"]), max(f["changes"], key=abs)
        rows.append([kind, "mean", "", "", f"{mean:+.2%} (worst {worst:+.2%})", f"{max(f['lost']):,.0f} (most)",
                     f"{statistics.median(f['recorded']):.2f} (median)" if kind != "grow" else "-",
                     "-" if kind == "server" else f"{statistics.median(f['reformed']):.2f} (median)", "",
                     f"{max(f['trains_after']):.1f} (most)" if kind in (*RESTARTS, *JOINS) else "", ""])
        target = NODE_NE_TARGET if kind in MACHINES else NE_TARGET
        ok = abs(mean) <= target and max(f["lost"]) == 0
        joined = ""
        if kind in (*RESTARTS, *JOINS):  # (nan, a restart that did not join, fails the comparison)
            ok = ok and all(x <= RESTART_TARGET_S for x in f["trains_after"])
            who = "the restart" if kind in RESTARTS else "the machine that joined"
            joined = (f", {who} trained {max(f['trains_after']):.1f} s after its start at most (target: "
                      f"{RESTART_TARGET_S:g} s)")
        what = "node 1 joined" if kind == "grow" else f"{kind} killed"
        verdicts.append(f"{'PASS' if ok else 'FAIL'} ({what}): every run finished, {max(f['lost']):,.0f} "
                        f"examples lost at most, eval NE {mean:+.2%} on average against the uninterrupted runs "
                        f"(target: 0 lost, within {target:.1%}){joined}")
    mirrored = f", shards mirrored every {mirror_ms:g} ms" if mirror_ms and "node" in kinds else ""
    seconds = f", node 2 killed at {second_at:.0%}" if "nodes" in kinds else ""
    machines = f", {nodes} machines" if any(k in ACROSS for k in kinds) and nodes != 2 else ""
    rejoins = (f", node 1 started (again) at {rejoin_at:.0%}" if "rejoin" in kinds and "grow" in kinds else
               f", node 1 started again at {rejoin_at:.0%}" if "rejoin" in kinds else
               f", node 1 started at {rejoin_at:.0%}" if "grow" in kinds else "")
    what = (f"a job of --nnodes 1:{nodes} started on node 0, {examples:,} examples" if kinds == ["grow"] else
            f"a rank or machine killed at {at:.0%} of {examples:,} examples")
    title = (f"{what}{rejoins}{seconds}, T={trainers}, {sync}{mirrored}{machines}, {seeds} seeds "
             f"(os.cpu_count()={os.cpu_count()})")
    print_table(title, COLUMNS, rows, console)
    console.print(markdown_table(COLUMNS, rows), markup=False)
    for line in verdicts:
        console.print(line)
    write_json(root / "faults.json", {"by_kill": {k: {"ne_change": f["changes"], "examples_lost": f["lost"],
                                                      "loss_recorded_s": f["recorded"],
                                                      "sync_reformed_s": f["reformed"],
                                                      "restart_trains_after_s": f["trains_after"]}
                                                  for k, f in found.items()},
                                      "trainers": trainers, "examples": examples, "at": at, "rejoin_at": rejoin_at,
                                      "second_at": second_at,
                                      "sync": sync,
                                      "shard_mirror_interval_ms": mirror_ms})
