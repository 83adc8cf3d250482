"""A launcher's view of a running job: progress, heartbeats, Ctrl-C, SIGTERM and --timeout, read and written
through the ranks' store (link.py); eval and checkpoint records read from trainer 0's metrics.jsonl as it grows.

One machine (launch.py): the launcher's own store; every rank is this machine's. Many (`cocosync train --nnodes`,
node_launch.py): the job's rendezvous store; each machine's launcher shows the whole job's progress, asks every
trainer to stop, and watches and kills only its own ranks (their pids and heartbeat clocks are this machine's)."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cocosync.runtime.comm.shm import is_descendant, pid_alive
from cocosync.runtime.comm.topology import Topology
from cocosync.shadowsync.checkpoint import read_meta
from cocosync.shadowsync.config import ClusterConfig, TrainConfig
from cocosync.shadowsync.job.eval_curve import describe
from cocosync.shadowsync.job.link import FIRST_FAILURE, PREFIX, get_if_set, report_failure
from cocosync.shadowsync.job.membership import (
    ABSENT,
    EPOCH,
    SERVER_LOSSES,
    checkpoints_stopped,
    job_ending,
    loss_across,
    record_node_loss,
    restored_ranges,
    restored_shards,
)
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.segments import SEGMENTS_ID
from cocosync.shadowsync.job.survival import Survival

__all__ = ["Monitor", "exit_status", "FENCED"]

_ROLE_NAMES = {"embedding": "embedding server", "sync": "sync server", "trainer": "trainer"}
#: seconds between two progress lines when the output is not a terminal (CI, nohup, a log file)
LINE_EVERY = 5.0
#: seconds the trainers get to stop (and checkpoint) after a stop request before the job is aborted
STOP_GRACE = 120.0
#: seconds without a beat from a machine's launcher (a counter it raises every loop, ~0.2 s) after which the launcher
#: that hosts the job's store records the machine as lost, where the job survives that (Survival.machine_loss)
NODE_SILENCE = 3.0
#: what a machine recorded as lost says as it stops its ranks (it was silent, not gone)
FENCED = (f"this machine was recorded as lost by the machine that hosts the job's store (its launcher heard nothing "
          f"from this one for {NODE_SILENCE:g} s): the job goes on without it")


class Monitor:
    """Watches the job until the elastic agent's thread ends; `failure` says why it had to be stopped, if it was."""

    def __init__(self, cfg: TrainConfig, name: str, store: Any, nproc: int, cluster: ClusterConfig, console: Any,
                 *, nodes: int = 1, ranks: list[int] | None = None, bar: bool = True, tail: bool = True,
                 prefix: str = PREFIX, hosts_store: bool = True, fence_key: str | None = None):
        """`store`: a client of the ranks' store; `nproc`: ranks per machine; `cfg.trainers`: the job's trainers,
        over `nodes` machines. `ranks`: the ranks on this machine (default: node 0's, one machine). `bar`: a live
        progress bar on a terminal (off where the ranks write to the same terminal); `tail`: print trainer 0's eval
        and checkpoint records; `prefix`: the job's keys' (link.job_prefix); `hosts_store`: this machine hosts the
        job's store (across machines: it watches the others' launchers and records a silent one as lost);
        `fence_key`: the store key that says this machine was recorded as lost (default `lost-node/<node>`; a machine
        that joined in a lost one's place has its own)."""
        self.cfg, self.name, self.nproc, self.console = cfg, name, nproc, console
        self.store = dist.PrefixStore(prefix, store)
        self.nodes, self.per_node = nodes, cfg.trainers // nodes
        E = cluster.embedding_servers  # (the roles of every rank, numbered as the ranks number them)
        topo = Topology(rank=0, world_size=nproc * nodes, local_rank=0, local_world_size=nproc, node=0)
        self.roles = Roles(topo, E, nproc - E - self.per_node)
        self.ranks = list(range(nproc)) if ranks is None else list(ranks)
        self.bar, self.tail = bar, tail
        self.agent_store = ranks is not None  # the rendezvous store of an agent: it leaves as the agent ends
        self.trainers_done = False  # every trainer of this machine said it is done
        self._pids: dict[int, int] = {}  # this machine's ranks' pids, as each said it
        self.started = time.monotonic()  # a heartbeat from before is not one of this job's trainers
        self.first_failure: str | None = None  # across machines: the job's first failure, on any machine
        self.logs = Path(cfg.out_dir) / "logs"
        self.failure: str | None = None
        self._status: str | None = None
        self.interrupted = False
        self.presses = 0
        self.signal_name = "SIGINT"  # the last stop signal received
        self.stop_at: float | None = None  # when the stop was requested
        self.stop_reason: str | None = None  # by what: Ctrl-C, SIGTERM, --timeout (on any machine)
        self.lost: dict[int, dict] = {}  # trainers lost (job/membership.py), by index: their record
        self._changes = 0  # the changes of the trainers said so far (losses and joins)
        self.segments: str | None = None  # the id that names the job's named segments (--max-restarts), once made
        self.banked = 0  # examples of trainers' processes that were lost and started again (their records restart)
        self.lost_servers: dict[int, dict] = {}  # embedding servers lost, by index: their record
        self.node = self.ranks[0] // nproc if self.ranks else 0  # this machine's node index in the job
        self.hosts_store = hosts_store
        self.fence_key = fence_key or f"lost-node/{self.node}"
        self.lost_nodes: dict[int, float] = {}  # machines lost: how long their launcher had been silent
        self.awaited: set[int] = set()  # machines of the layout not there at the start (--nnodes MIN:MAX)
        self._said_restored: set[tuple[int, int]] = set()  # (loss, server) of each restored shard named
        self._said_ranges: set[tuple[int, int]] = set()  # (loss, range) of each adopted range of EASGD's centre named
        self._said_substitutes: set[int] = set()  # lone lost trainers whose stand-in was named (across machines)
        self._said_joins: dict[int, bool] = {}  # lost machines whose place another took: whether its trainers joined
        self._node_beats: dict[int, tuple[bytes, float]] = {}  # each machine's last beat and when it changed
        self.every = cluster.checkpoint_every or 0
        self._said_checkpoints = not self.every  # the periodic checkpoints' stop was named (none: nothing to name)
        self.survival = Survival.of(cfg, cluster, nodes, self.per_node, True)  # (what the job goes on without)
        self.killed: set[int] = set()  # trainers this monitor killed for silence, to be recorded as lost
        self.resumed = _examples_seen(cluster.resume)
        target = cfg.total_examples if cluster.stop_after is None else min(cfg.total_examples, cluster.stop_after)
        self.total = max(target - self.resumed, 0)
        metrics = Path(cfg.out_dir) / "metrics.jsonl"  # a resumed run appends to it: read what this run adds
        self._metrics_at = metrics.stat().st_size if cluster.resume and metrics.is_file() else 0

    # -- names --------------------------------------------------------------------------------------------
    def label(self, rank: int) -> str:
        kind, index = self.roles.role(rank)
        where = f"rank {rank}" + (f", node {self.roles.node_of(rank)}" if self.nodes > 1 else "")
        return f"{_ROLE_NAMES[kind]} {index} ({where})"

    def trainer_of(self, rank: int) -> int | None:
        """The trainer index of `rank` (None: a server)."""
        kind, index = self.roles.role(rank)
        return index if kind == "trainer" else None

    def _get(self, key: str) -> Any:
        raw = get_if_set(self.store, key)
        return json.loads(raw) if raw is not None else None

    def failure_messages(self) -> list[tuple[int, str]]:
        """(rank, message) of every rank that said why it failed, earliest first."""
        found = [(rank, self._get(f"failed/{rank}")) for rank in range(self.nproc * self.nodes)]
        found = sorted(((m["time"], r, m["message"]) for r, m in found if m), key=lambda x: x[0])
        return [(r, f"{self.label(r)} failed: {msg}") for _, r, msg in found]

    def ranks_exited(self) -> bool:
        """Every rank of this machine said its pid and none runs any more. Across machines the job's store may then
        leave with the agent that hosts it at any moment, and a read of a store that left makes c10d log a C++ stack
        trace (it did after 2 of 3 jobs that succeeded): the monitor stops reading it."""
        # a verified pid (read once), else what the store says (a rank gone before it was verified; only read here,
        # nothing is signalled on it)
        pids = [self._pid(rank) or self._said_pid(rank) for rank in self.ranks]
        return None not in pids and not any(map(pid_alive, pids))

    def _said_pid(self, rank: int) -> int | None:
        try:
            pid = int(self._get(f"pid/{rank}") or 0)
        except (TypeError, ValueError):
            return None
        return pid if pid > 1 else None

    def _pid(self, rank: int) -> int | None:
        """The pid rank `rank` said (read once), or None before it said it. The store is untrusted (anyone who can
        reach it can write it): a pid is taken only if it is a process this launcher started (its agent's worker,
        or the warm fork server's child), so the monitor never signals another process."""
        if rank not in self._pids:
            pid = self._said_pid(rank)
            if pid is not None and is_descendant(pid):
                self._pids[rank] = pid
        return self._pids.get(rank)

    def verified_pids(self) -> list[int]:
        """The pids of this machine's ranks verified so far (`_pid`), without reading the store (which may be gone)."""
        return list(self._pids.values())

    def pid_of(self, rank: int) -> int | None:
        """The pid rank `rank` said, once verified as a process this launcher started (None before)."""
        return self._pid(rank)

    def report(self, rank: int, message: str) -> None:
        """Record in the job's store that `rank` failed (best effort: the store may be gone)."""
        try:
            report_failure(self.store, rank, message)
        except RuntimeError:
            pass

    def kill_ranks(self) -> None:
        """SIGKILL every rank of this machine that said its pid (the agent then reports them and returns)."""
        for rank in self.ranks:
            pid = self._pid(rank)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, agent: threading.Thread) -> None:
        main = threading.current_thread() is threading.main_thread()
        # Ctrl-C, and SIGTERM (what schedulers and `kill` send), stop the trainers with a checkpoint
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        t_launch = time.monotonic()
        bar = None
        if self.cfg.progress and self.bar and self.console.is_terminal:
            bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[eps]} examples/s"), TextColumn("train NE {task.fields[ne]}"),
                           TimeElapsedColumn(), console=self.console)
        last_line = time.monotonic()
        try:
            if bar is not None:
                bar.start()
                task = bar.add_task("starting", total=self.total, eps="-", ne="-")
            watching = True  # False once the store may leave with the agent that hosts it: signals only
            while agent.is_alive():
                agent.join(0.2)
                if not watching:
                    if self.presses >= 2:
                        self.failure = f"aborted by a second {self._signal_label()}"
                        break
                    if self.lost_nodes and self.ranks_exited():  # (no other machine's agent comes to the end)
                        break
                    continue
                try:
                    if self.agent_store and self.ranks_exited():  # (the rest is the agents')
                        if self.lost_nodes:  # (no other machine's agent comes to the end: see node_launch.py)
                            break
                        watching = False
                        continue
                    if self.survival.machine_loss:
                        self.store.add(f"node-beat/{self.node}", 1)
                    if self._check(t_launch):
                        self.kill_ranks()
                        break
                    if self.agent_store and self.trainers_done:  # (the rest is the servers' and the agent's)
                        watching = False
                        continue
                    # (every trainer's record: at each line only, a store read per trainer of the job)
                    due = bar is not None or (self.cfg.progress and time.monotonic() - last_line >= LINE_EVERY)
                    examples, eps, ne = self._progress() if due else (0, 0.0, None)
                    self._tail_metrics()
                    self._say_checkpoints_stopped()
                    status = self._get("status")
                    if self.cfg.max_restarts and self.segments is None and self.store.check([SEGMENTS_ID]):
                        self.segments = self.store.get(SEGMENTS_ID).decode()
                    if self.agent_store and self.first_failure is None:
                        first = self._get(FIRST_FAILURE)
                        if first:
                            self.first_failure = f"{self.label(first['rank'])} failed: {first['message']}"
                except RuntimeError:  # the store left with the agent that hosts it: the job is ending
                    if not self.agent_store:
                        raise
                    watching = False
                    continue
                if status and status != self._status:  # what the ranks are doing before training (a build)
                    self._status = status
                    self.console.print(f"{status} ...", soft_wrap=True)
                if bar is not None:
                    bar.update(task, completed=examples, eps=f"{eps:,.0f}" if eps else "-",
                               ne=f"{ne:.4f}" if ne is not None else "-",
                               description=self.name if examples else "starting")
                elif examples:
                    last_line = time.monotonic()
                    eta = f", ETA {timedelta(seconds=round((self.total - examples) / eps))}" if eps > 0 else ""
                    self.console.print(f"{examples:,} / {self.total:,} examples, {eps:,.0f} examples/s, train NE "
                                       + (f"{ne:.4f}" if ne is not None else "-") + eta, soft_wrap=True)
            self._tail_metrics()
        finally:
            if bar is not None:
                bar.stop()
            if main:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.presses += 1
        self.signal_name = signal.Signals(signum).name

    def _signal_label(self) -> str:
        return "Ctrl-C" if self.signal_name == "SIGINT" else self.signal_name

    def _request_stop(self, why: str) -> None:
        if self.stop_at is None:
            self.stop_at, self.stop_reason = time.monotonic(), why
            self.store.set("stop", why)  # (the trainers stop when the key exists; other machines read why)
            every = " of every machine" if self.nodes > 1 else ""
            self.console.print(f"[yellow]{escape(why)}: stopping the trainers{every} (they keep what they trained: a "
                               "checkpoint and the summary)" + (" — again to abort" if self.presses else ""),
                               soft_wrap=True)

    def _check(self, t_launch: float) -> bool:
        """Whether the job must be aborted now (self.failure says why); asks for a stop on Ctrl-C or --timeout."""
        why = self._signal_label()
        if self.presses >= 2:
            self.failure = f"aborted by a second {why}"
            return True
        if self.presses == 1:
            self.interrupted = True
            self._request_stop(why)
        if self.cfg.timeout is not None and time.monotonic() - t_launch > self.cfg.timeout:
            self.interrupted = True
            self._request_stop(f"--timeout {self.cfg.timeout:g} s reached")
        if self.stop_at is None and self.nodes > 1:  # a stop another machine's launcher asked for
            elsewhere = get_if_set(self.store, "stop")
            if elsewhere is not None:
                self.interrupted, self.stop_at, self.stop_reason = True, time.monotonic(), elsewhere.decode()
                self.console.print(f"[yellow]{escape(self.stop_reason)} on another machine: the trainers are "
                                   "stopping (they keep what they trained: a checkpoint and the summary)")
        if self.stop_at is not None and time.monotonic() - self.stop_at > STOP_GRACE:
            self.failure = f"the trainers did not stop within {STOP_GRACE:.0f} s of the stop request"
            return True
        if self.survival.machine_loss:
            self.failure = self._watch_nodes()
            if self.failure is not None:
                return True
        self.failure = self._stalled()
        return self.failure is not None

    def _watch_nodes(self) -> str | None:
        """Across machines: on the machine that hosts the job's store, record another machine whose launcher fell
        silent (NODE_SILENCE) as lost, unless a rank reported a failure first (the job stops then) or its trainers
        are done (the job is ending); say the restored shards as they come. Elsewhere: a failure once this machine
        was recorded as lost (it was silent too long: its ranks are stopped, the job goes on without them). Once the
        trainers have agreed that the job ends, no machine is recorded as lost (the end is collective over all)."""
        if not self.hosts_store:
            if self.fenced():
                return FENCED
            for n in range(self.nodes):  # (the others lost: this machine's launcher then ends with its ranks)
                if n != self.node and n not in self.lost_nodes:
                    rec = get_if_set(self.store, f"lost-node/{n}")
                    try:
                        if rec is not None:
                            self.lost_nodes[n] = float(json.loads(rec)["silent_s"])
                    except (ValueError, TypeError, KeyError):  # (not a record node 0's launcher wrote: skipped)
                        pass
            return None
        now = time.monotonic()
        for n in range(self.nodes):
            if n == self.node or n in self.lost_nodes:
                continue
            if self._awaited(n):
                continue
            beat = get_if_set(self.store, f"node-beat/{n}")
            if beat is None:  # (not watching yet)
                continue
            last = self._node_beats.get(n)
            if last is None or last[0] != beat:
                self._node_beats[n] = (beat, now)
                continue
            silent = now - last[1]
            if silent < NODE_SILENCE or get_if_set(self.store, FIRST_FAILURE) is not None or self._node_done(n) \
                    or job_ending(self.store):
                continue
            first = loss_across(self.store)
            if first is not None and first != "node":
                return (f"node {n} was lost (no word from its launcher for {silent:.1f} s) after {first} was: a job "
                        "across machines goes on after its first loss only (resume from its last checkpoint)")
            if record_node_loss(self.store, self.roles, n, silent):
                self.lost_nodes[n] = silent
                trainers = [t for t in range(self.cfg.trainers) if self._node_of_trainer(t) == n]
                E, P = self.roles.embedding_per_node, self.roles.sync_per_node
                left = sum(self._node_of_trainer(t) not in self.lost_nodes for t in range(self.cfg.trainers))
                sync = (f", sync server{'s' if P > 1 else ''} {', '.join(str(i) for i in range(n * P, (n + 1) * P))}"
                        if P else "")
                self.console.print(f"[yellow]node {n} was lost (no word from its launcher for {silent:.1f} s): "
                                   f"trainer{'s' if len(trainers) > 1 else ''} {', '.join(map(str, trainers))}{sync}"
                                   " and embedding server"
                                   f"{'s' if E > 1 else ''} {', '.join(str(s) for s in range(n * E, (n + 1) * E))} "
                                   f"with it; {left} trainer{'s go' if left > 1 else ' goes'} on, restore its shards"
                                   f"{' and centre ranges' if P else ''} and read its unread rows", soft_wrap=True)
        self._say_restored()
        self._say_joined()
        return None

    def _awaited(self, n: int) -> bool:
        """Whether machine `n` of the job's layout was not there at its start (--nnodes MIN:MAX: the ranks recorded it
        before training); said once."""
        rec = self._get(f"lost-node/{n}")
        if not isinstance(rec, dict) or not rec.get("awaited"):
            return False
        self.lost_nodes[n] = 0.0
        self.awaited.add(n)
        trainers = [t for t in range(self.cfg.trainers) if self._node_of_trainer(t) == n]
        E = self.roles.embedding_per_node
        self.console.print(f"[yellow]node {n} has not joined: its trainer{'s' if len(trainers) > 1 else ''} "
                           f"{', '.join(map(str, trainers))} wait for a machine started with the same command and "
                           f"--node-rank {n}; until one joins, the machines here hold its embedding shard"
                           f"{'s' if E > 1 else ''} and read its rows once they have read their own", soft_wrap=True)
        return True

    def _say_joined(self) -> None:
        """Say each machine that joins in a lost one's place (job/node_join.py): as it claims the place, and once its
        trainers have joined (they train from then on)."""
        for n in self.lost_nodes:
            rec = self._get(f"node-join/{n}")
            if not isinstance(rec, dict):
                continue
            trainers = [t for t in range(self.cfg.trainers) if self._node_of_trainer(t) == n]
            place = f"as node {n}" if n in self.awaited else f"in node {n}'s place"
            if n not in self._said_joins:
                self._said_joins[n] = False
                self.console.print(f"[green]a machine (host {escape(str(rec.get('host')))}) joins the job {place} "
                                   f"with trainers {', '.join(map(str, trainers))}: they take the dense model from a "
                                   "trainer in the job and the rest of their rows", soft_wrap=True)
            if not self._said_joins[n]:
                joined = {int(x["trainer"]) for x in (self._get(f"change/{k}") for k in range(
                    1, int(self.store.add(EPOCH, 0)) + 1)) if isinstance(x, dict) and x.get("kind") == "joined"}
                if set(trainers) <= joined:
                    self._said_joins[n] = True
                    self.console.print(f"[green]trainers {', '.join(map(str, trainers))} joined {place} "
                                       f"({time.time() - float(rec.get('time', time.time())):.1f} s after the "
                                       f"machine came): {self.cfg.trainers - int(self.store.add(ABSENT, 0))} "
                                       "trainers train", soft_wrap=True)

    def fenced(self) -> bool:
        """Whether this machine was recorded as lost (False where the store cannot say: it left)."""
        try:
            return get_if_set(self.store, self.fence_key) is not None
        except RuntimeError:
            return False

    def _node_of_trainer(self, t: int) -> int:
        return self.roles.node_of(self.roles.rank_of("trainer", t))

    def _node_done(self, n: int) -> bool:
        """Every trainer of machine `n` said it is done (its launcher stops watching then)."""
        return all(get_if_set(self.store, f"beat/{t}") == b"done" for t in range(self.cfg.trainers)
                   if self._node_of_trainer(t) == n)

    def _say_restored(self) -> None:
        for c in restored_ranges(self.store, self.roles.sync_per_node * self.nodes):
            if (c.batch, c.range) in self._said_ranges:
                continue
            self._said_ranges.add((c.batch, c.range))
            self.console.print(f"range {c.range} of EASGD's centre adopted by {c.server} from {c.source} (current)",
                               soft_wrap=True)
        for r in restored_shards(self.store, self.roles.embedding_per_node * self.nodes):
            if (r.batch, r.server) in self._said_restored:
                continue
            self._said_restored.add((r.batch, r.server))
            where = {"initial rows": "its initial rows", "mirror": "its mirror on this machine"}.get(
                r.source, f"the checkpoint at {r.examples:,} examples")
            if r.lost_with in self.awaited:
                self.console.print(f"embedding server {r.server}'s shard (node {r.lost_with}'s) held on node {r.node} "
                                   f"until a machine joins: {r.rows:,} rows from {where}", soft_wrap=True)
                continue
            self.console.print(f"embedding server {r.server}'s shard restored on node {r.node} from {where} "
                               f"({r.rows:,} rows, {r.age_s:.1f} s old; its {r.hot_rows:,} hot rows current: this "
                               "machine's replica)", soft_wrap=True)

    def may_lose(self, t: int) -> bool:
        """Whether the job goes on without trainer `t` (it runs under a keeper, and more than --min-trainers would be
        left; across machines, as the job's first loss, on a machine that keeps a trainer)."""
        gone = len(self.lost) + len(self.killed - set(self.lost))
        if self.nodes > 1 and (gone or self.lost_nodes or self.per_node < 2):
            return False
        return self._trainers_survive() and t not in self.lost and self.cfg.trainers - gone - 1 >= self.cfg.min_trainers

    def _trainers_survive(self) -> bool:
        """Whether the job goes on without a lone lost trainer (survival.py)."""
        return self.survival.trainer_loss

    def _watch_losses(self) -> None:
        """Say each trainer or embedding server lost, and each trainer started again, since the last look (recorded
        by their keepers and the restarted trainers)."""
        self._watch_server_losses()
        epoch = int(self.store.add(EPOCH, 0))
        while self._changes < epoch:
            rec = self._get(f"change/{self._changes + 1}")
            if not isinstance(rec, dict):
                return  # (counted, not written yet)
            self._changes += 1
            t = int(rec.get("trainer", -1))
            if not 0 <= t < self.cfg.trainers:
                continue
            progress = self._get(f"progress/{t}") or {}
            if rec.get("kind") == "joined":
                self.lost.pop(t, None)
                self.killed.discard(t)
                self._pids.pop(self.roles.rank_of("trainer", t), None)  # (the new process says its own)
                self.banked += int(progress.get("trainer_examples", 0))  # (the new process counts from 0)
                if rec.get("node") is not None:  # (a machine's trainer, joining in a lost or awaited one's place:
                    continue  # its machine's join is said once, _say_joined)
                self.console.print(f"[green]trainer {t} (pid {rec.get('pid')}) joined again (restart "
                                   f"{rec.get('restart')} of {self.cfg.max_restarts}): it takes the dense model from "
                                   "a trainer in the job and the rest of its rows; "
                                   f"{self.cfg.trainers - len(self.lost)} trainers train", soft_wrap=True)
                continue
            self.lost[t] = rec
            if rec.get("node") is not None:  # (a lost machine's trainer: its machine's loss is said once)
                continue
            left = self.cfg.trainers - len(self.lost)
            self.console.print(f"[yellow]trainer {t} (pid {rec.get('pid')}) was lost ("
                               + ("no heartbeat: killed" if t in self.killed else f"killed by {rec.get('signal')}"
                                  if str(rec.get("signal")).startswith("SIG") else str(rec.get("signal")))
                               + f") after about {progress.get('trainer_examples', 0):,} examples: {left} trainer"
                               + ("s go" if left > 1 else " goes") + " on and will read its unread rows "
                               f"(--min-trainers {self.cfg.min_trainers})", soft_wrap=True)

    def _say_substitutes(self) -> None:
        """Across machines: say which trainer stands in for each lone lost trainer on its machine (loss_across.py)."""
        for t, rec in self.lost.items():
            if t in self._said_substitutes or rec.get("node") is not None:
                continue
            sub = self._get(f"lone/{t}")
            if not isinstance(sub, dict):
                continue
            self._said_substitutes.add(t)
            n = sub.get("node")
            hot = f" and syncs node {n}'s hot rows" if sub.get("hot_rows") else ""
            self.console.print(f"node {n} goes on: trainer {sub.get('substitute')} serves trainer {t}'s part of the "
                               f"lookup exchange{hot}", soft_wrap=True)

    def _watch_server_losses(self) -> None:
        if len(self.lost_servers) >= int(self.store.add(SERVER_LOSSES, 0)):
            return
        for s in range(self.roles.embedding_per_node):
            rec = self._get(f"lost-server/{s}") if s not in self.lost_servers else None
            if not isinstance(rec, dict):
                continue
            self.lost_servers[s] = rec
            self.console.print(f"[yellow]embedding server {s} (pid {rec.get('pid')}) was lost (killed by "
                               f"{rec.get('signal')}): its shard stays in this machine's shared memory, the trainers "
                               "go on, and the last checkpoint saves it", soft_wrap=True)

    def _stalled(self) -> str | None:
        """The first trainer whose heartbeat is older than cfg.heartbeat_timeout (one that finished says 'done'; one
        the job can lose is killed instead, and recorded as lost by its keeper)."""
        now = time.monotonic()  # (a heartbeat is its machine's clock: only this machine's trainers are watched)
        done = 0
        if self._trainers_survive():
            self._watch_losses()
            if self.nodes > 1:
                self._say_substitutes()
        for t, rank in ((self.trainer_of(r), r) for r in self.ranks):
            if t is None:
                continue
            if t in self.lost or t in self.killed:
                done += 1
                continue
            beat = get_if_set(self.store, f"beat/{t}")
            done += beat == b"done"
            if beat is None or beat == b"done":
                continue
            try:  # (untrusted: a value that is no reading of this machine's clock since the launch is no heartbeat)
                at = float(beat)
            except ValueError:
                continue
            if not self.started <= at <= now or self._pid(rank) is None:  # (no pid of ours said yet: not started)
                continue
            age = now - at
            if age > self.cfg.heartbeat_timeout:
                pid = self._pid(rank)
                why = (f"no heartbeat for {age:.0f}s (--heartbeat-timeout {self.cfg.heartbeat_timeout:g}s; the "
                       "process is stopped, hung or not scheduled)")
                if self.may_lose(t) and pid is not None:
                    self.killed.add(t)
                    self.console.print(f"[yellow]trainer {t} (pid {pid}) stopped responding: {why}; killing it",
                                       soft_wrap=True)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    continue
                if self.agent_store:  # the other machines' launchers name it too (before this one kills its ranks)
                    report_failure(self.store, rank, f"stopped responding (pid {pid} on its machine): {why}")
                    time.sleep(1.0)
                return f"trainer {t} (pid {pid}) stopped responding: {why}"
        self.trainers_done = done == self.per_node
        return None

    def _progress(self) -> tuple[int, float, float | None]:
        """(examples trained since this launch, examples/s: the trainers' rates since their first example, as of their
        last records, summed; mean train NE of the trainers)."""
        recs = {t: self._get(f"progress/{t}") for t in range(self.cfg.trainers)}
        recs = {t: r for t, r in recs.items() if r}
        examples = sum(r["trainer_examples"] for r in recs.values()) + self.banked
        if not examples:
            return 0, 0.0, None
        live = [r for t, r in recs.items() if t not in self.lost]  # (a lost trainer's examples stay trained)
        nes = [r["train_ne"] for r in live if r["train_ne"] is not None and math.isfinite(r["train_ne"])]
        return examples, sum(r["trainer_eps"] or 0.0 for r in live), (sum(nes) / len(nes) if nes else None)

    def _say_checkpoints_stopped(self) -> None:
        """Name where and why the periodic checkpoints stopped (--checkpoint-every), once, as a trainer records it."""
        if self._said_checkpoints:
            return
        stopped = checkpoints_stopped(self.store)
        if stopped is not None:
            self._said_checkpoints = True
            self.console.print(f"periodic checkpoints (every {self.every:,} examples) stop at {stopped.examples:,}: "
                               f"{escape(stopped.reason)}; the job's end still saves one", soft_wrap=True)

    def _tail_metrics(self) -> None:
        """Print the eval and checkpoint records trainer 0 has added to metrics.jsonl since the last look."""
        if not self.tail:
            return
        path = Path(self.cfg.out_dir) / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._metrics_at:  # trainer 0 started the file afresh
                    self._metrics_at = 0
                f.seek(self._metrics_at)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._metrics_at += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "eval" and "calibration" in rec:
                self.console.print(escape(describe(rec)), soft_wrap=True)
            elif rec.get("event") == "checkpoint":
                self.console.print(f"checkpoint at {rec['examples']:,} examples: {escape(rec['path'])}",
                                   soft_wrap=True)


def _examples_seen(resume: str | None) -> int:
    """Examples a resumed run's checkpoint had seen (0: not resumed, or its metadata is not on this machine)."""
    if not resume:
        return 0
    try:
        return int(read_meta(Path(resume))["examples_seen"])
    except Exception:  # noqa: BLE001 - the ranks check the checkpoint and say what is wrong with it
        return 0


def exit_status(stop_reason: str | None) -> int:
    """A stopped job's exit status, by what stopped it: 124 --timeout (as timeout(1)), 143 SIGTERM, 130 Ctrl-C."""
    reason = stop_reason or ""
    return 143 if reason == "SIGTERM" else 124 if reason.startswith("--timeout") else 130

