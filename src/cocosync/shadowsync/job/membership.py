"""Which trainers of a one-machine job are still training, and what the others do when one is lost.

A trainer is *lost* when its process dies by a signal (kill -9, the OOM killer, the monitor's SIGKILL of a trainer
silent past --heartbeat-timeout). The elastic agent stops every rank when one of them fails, so a trainer that may be
lost runs under a *keeper* (`keep_trainer`): its rank process forks the trainer and waits for it. When the trainer
dies by a signal and enough trainers are left (--min-trainers), the keeper records the loss in the job's store and
ends as a rank that finished; otherwise it dies by the same signal, and the job stops naming the trainer as before.

The record of losses is the store's (the launcher's loopback store, which outlives every rank): `losses` counts them
(the membership's epoch) and `lost/<t>` says which trainer, its pid and signal, in the order they were counted. Every
other rank reads it through `Membership`:

* a trainer whose dense sync failed because a peer died waits for the loss to be recorded and re-forms the sync among
  the trainers left (`dense_group`: a new process group among them only, no collective over the job);
* when the trainers left have read their own shards, they agree (`agree`, through the store) on the losses so far
  and read the lost trainers' unread rows between them;
* the job's end (the results' gather, the last checkpoint, the CPU time) runs over the ranks still there
  (`group`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from setproctitle import setproctitle

from cocosync.runtime.comm.backend import BACKEND
from cocosync.shadowsync.job.roles import Roles

__all__ = ["Loss", "Membership", "keep_trainer", "LOSSES"]

LOSSES = "losses"  # the count of lost trainers (a store counter: the membership's epoch)
#: seconds between two reads of the store while waiting for peers (a loss, an agreement, a command)
POLL = 0.02


@dataclass(frozen=True)
class Loss:
    """One lost trainer: its index, the pid of its process, the signal that ended it, when (time.time()), and its
    place in the order of losses (1 for the first)."""

    trainer: int
    pid: int
    signal: str
    time: float
    seq: int

    def describe(self) -> str:
        return f"trainer {self.trainer} (pid {self.pid}) was lost: killed by {self.signal}"


class Membership:
    """A rank's view of which trainers are left, read from the job's store (`store`: a client of it, under the
    job's prefix)."""

    def __init__(self, store: Any, roles: Roles, min_trainers: int, timeout: float):
        """`timeout`: seconds a rank waits for peers that are alive (a loss to be recorded, an agreement)."""
        self.store, self.roles, self.min_trainers, self.timeout = store, roles, min_trainers, timeout
        self._current: tuple[tuple[int, ...], Any] | None = None  # the group made last, by its ranks
        self._losses: dict[int, Loss] = {}

    # -- the record -----------------------------------------------------------------------------------------
    def epoch(self) -> int:
        """Losses recorded so far."""
        return int(self.store.add(LOSSES, 0))

    def losses(self, epoch: int | None = None) -> list[Loss]:
        """The first `epoch` losses (default: all recorded), in order; waits for the records of the counted ones."""
        epoch = self.epoch() if epoch is None else epoch
        deadline = time.monotonic() + self.timeout
        while len(self._losses) < epoch:
            for t in range(self.roles.trainers):
                if t not in self._losses and self.store.check([f"lost/{t}"]):
                    rec = json.loads(self.store.get(f"lost/{t}"))
                    self._losses[t] = Loss(t, int(rec["pid"]), str(rec["signal"]), float(rec["time"]),
                                           int(rec["seq"]))
            if len(self._losses) < epoch:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{epoch} losses counted but {len(self._losses)} recorded after "
                                       f"{self.timeout:.0f}s")
                time.sleep(POLL)
        return sorted((x for x in self._losses.values() if x.seq <= epoch), key=lambda x: x.seq)

    def live(self, epoch: int | None = None) -> list[int]:
        """The trainers not lost by `epoch` (default: now), in index order."""
        lost = {x.trainer for x in self.losses(epoch)}
        return [t for t in range(self.roles.trainers) if t not in lost]

    def wait_for_loss(self, epoch: int, timeout: float | None = None) -> int | None:
        """The epoch once a loss past `epoch` is recorded, or None if none comes within `timeout` (default: the
        membership's; a peer failed for another reason)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            now = self.epoch()
            if now > epoch:
                return now
            time.sleep(POLL)
        return None

    def record_start(self, trainer: int, examples: int) -> None:
        """Trainer `trainer` starts from `examples` read (its resumed reader positions)."""
        self.store.set(f"start/{trainer}", str(examples))

    def start(self, trainer: int) -> int:
        raw = self.store.get(f"start/{trainer}") if self.store.check([f"start/{trainer}"]) else b"0"
        return int(raw)

    # -- agreement among the trainers left ------------------------------------------------------------------
    def agree(self, key: str, trainer: int, give_up: Callable[[], bool] = lambda: False) -> int | None:
        """Every trainer left calls this with the same `key` once it has read all it was given: returns the epoch
        all of them take as the losses so far (the first to see every live trainer arrived fixes it). A trainer
        lost while the others wait is not waited for; one still training is, however long it takes (without a
        collective sync the trainers finish apart; a silent one is the heartbeats' to find). None if `give_up()`
        turns true first (the job is stopping)."""
        self.store.set(f"agree/{key}/{trainer}", "1")
        decided = f"agree/{key}/epoch"
        while not self.store.check([decided]):
            if give_up():
                return None
            epoch = self.epoch()
            if all(self.store.check([f"agree/{key}/{t}"]) for t in self.live(epoch)):
                self.store.compare_set(decided, "", str(epoch))
                break
            time.sleep(POLL)
        return int(self.store.get(decided))

    # -- groups among the ranks left ------------------------------------------------------------------------
    def trainer_group(self, live: list[int]) -> Any:
        """The process group of the live trainers `live` (the `cocosync` backend: shared memory), made by them
        alone: no collective over the job, whose lost ranks would never come."""
        return self._group(self.trainer_ranks(live), BACKEND)

    def job_group(self, live: list[int], held: tuple[Any, ...] = ()) -> Any:
        """The process group (gloo) of every rank still in the job: the servers and the live trainers `live`. `held`:
        the other groups this rank is a member of (the job's trainer groups), destroyed first: see `_group`."""
        for group in held:
            dist.destroy_process_group(group)
        return self._group(self.alive_ranks(live), None)

    def _group(self, ranks: list[int], backend: str | None) -> Any:
        """One group at a time: the one before is destroyed first. torch names a group made by its members alone by
        its ranks and by how many groups the process holds, which must then be equal on every member: the trainers'
        groups are held by trainers only, so a group with the servers is made once they are gone."""
        key = tuple(ranks)
        if self._current is not None and self._current[0] == key:
            return self._current[1]
        if self._current is not None:
            dist.destroy_process_group(self._current[1])
            self._current = None
        group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True,
                               timeout=datetime.timedelta(seconds=self.timeout))
        self._current = (key, group)
        return group

    def trainer_ranks(self, live: list[int]) -> list[int]:
        return [self.roles.rank_of("trainer", t) for t in live]

    def alive_ranks(self, live: list[int]) -> list[int]:
        """Every server's rank and the live trainers', in rank order."""
        trainers = set(self.trainer_ranks(live))
        return [r for r in range(self.roles.topo.world_size)
                if self.roles.role(r)[0] != "trainer" or r in trainers]


def keep_trainer(trainer: int, trainers: int, min_trainers: int, store: Callable[[], Any]) -> bool:
    """Fork this rank: True in the child, which runs the trainer (and must leave through os._exit: it is not the
    process the agent started); in this process, the keeper, which waits for it: False once the trainer finished
    (exit status 0) or was lost, a rank that finished as far as the agent is concerned. A trainer that failed (another
    exit status) ends the keeper with its status; one killed by a signal is recorded as lost if at least
    `min_trainers` are left, else the keeper dies by the same signal (the agent then stops the job, naming it).
    `store()`: a client of the job's store, under the job's prefix."""
    pid = os.fork()
    if pid == 0:
        return True
    setproctitle(f"cocosync keeper of trainer {trainer} (pid {pid})")  # (the trainer keeps the rank's title)
    # the agent's SIGTERM (the job stopping) ends the keeper, and the trainer with it (its parent-death signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        if code == 0:
            return False
        os._exit(code)
    sig = os.WTERMSIG(status)
    client = store()
    seq = int(client.add(LOSSES, 1))
    if trainers - seq >= min_trainers:
        client.set(f"lost/{trainer}", json.dumps({"pid": pid, "signal": signal.Signals(sig).name,
                                                  "time": time.time(), "seq": seq}))
        return False
    client.add(LOSSES, -1)  # not a loss the job goes on from: it stops, naming the trainer
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two have no handler to reset)
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
