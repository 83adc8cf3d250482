"""One ShadowSync trainer process: W Hogwild worker threads over a dense replica and the shared embedding rows,
and the replica's dense synchronization (shadow thread, foreground every k iterations, or none).

`Trainer.train_step(batch)` is one lock-free Hogwild iteration (dense replica + the batch's embedding rows from the
servers' shards); `Trainer.train()` runs the W workers over this trainer's shards and the sync of its replica. The
job around it (roles, servers, groups, checkpoints) is rank.py.

Workers are threads (not processes): torch ops release the GIL, and on this 2-core machine T=2 trainers
already fill the cores; see the README for the measurement.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from cocosync.runtime.comm.shm import CollectiveTimeout
from cocosync.shadowsync.config import TrainConfig
from cocosync.shadowsync.data.sources import build_configs
from cocosync.shadowsync.job.recovery import Recovery, Takeover
from cocosync.shadowsync.job.run_model import run_model
from cocosync.shadowsync.model.embeddings import Lookup, ShardedEmbeddings
from cocosync.shadowsync.model.lookup_thread import ExchangeLost
from cocosync.shadowsync.model.sharding import active
from cocosync.shadowsync.model.transport import ServerLost
from cocosync.shadowsync.sync import FlatParams, NoSync, ShadowThread, make_sync
from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["Trainer", "TrainerState", "TrainerFailure", "CheckpointMarks"]


@dataclass
class TrainerState:
    """A trainer's counters (rows indexed by trainer; a trainer writes its own): reader positions, iterations,
    syncs; the stop flag (the launcher's stop request, copied in by the heartbeat thread: link.py); the common
    starting point of the dense replicas."""

    positions: torch.Tensor  # int64 [T, W]: rows consumed by each worker shard (the reader position)
    iterations: torch.Tensor  # int64 [T]
    syncs: torch.Tensor  # int64 [T]
    stop: torch.Tensor  # int32 [1]
    init_dense: torch.Tensor

    @classmethod
    def new(cls, trainers: int, workers: int, init_dense: torch.Tensor,
            positions: torch.Tensor | None = None) -> "TrainerState":
        """`positions`: the reader positions' tensor to use (the node's shared one), else a new one."""
        T = trainers
        if positions is None:
            positions = torch.zeros(T, workers, dtype=torch.int64)
        return cls(positions, torch.zeros(T, dtype=torch.int64),
                   torch.zeros(T, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), init_dense.clone())


class TrainerFailure(RuntimeError):
    """A trainer process raised, died, or the run timed out; the message names the trainer and the cause."""


class CheckpointMarks:
    """Pauses a trainer's W workers when its reader positions cross a multiple of `every` (up to `limit`) and runs
    `save(mark)` in the last worker to arrive, every worker stopped between two batches. A worker that runs out of
    data leaves (`leave`), so the others never wait for it.

    With a foreground collective sync (fr-ma, fr-bmuf) only the worker that just ran sync round k opens a mark (under
    the sync lock), with `seen` = k * every * batch_size, and a worker due for round k+1 joins the open mark first:
    every trainer pauses after exactly k rounds, so none is paused while a peer waits in a collective for it (marks
    opened from each trainer's own positions could differ by a round across trainers and deadlock)."""

    def __init__(self, every: int, start: int, limit: int, workers: int, save: Callable[[int], None]):
        if every < 1:
            raise ValueError(f"checkpoint every={every!r} must be >= 1 example per trainer")
        self.every, self.limit, self.save = every, limit, save
        self.next = (start // every + 1) * every
        self.active, self.waiting, self.pending, self.round = workers, 0, None, 0
        self.cond = threading.Condition()
        self.saved: list[int] = []

    def after_batch(self, seen: int | None) -> None:
        """A worker finished a batch; `seen`: this trainer's examples so far (None: join an open mark, open none)."""
        if seen is not None:
            self.open(seen)
        self.join()

    def open(self, seen: int) -> None:
        """Open the next mark if `seen` crossed it (no waiting)."""
        with self.cond:
            if self.pending is None and self.next <= self.limit and seen >= self.next:
                self.pending, self.next = self.next, self.next + self.every

    def join(self) -> None:
        """If a mark is open, wait until every worker has arrived (the last one to arrive saves)."""
        with self.cond:
            if self.pending is None:
                return
            self.waiting += 1
            if self.waiting >= self.active:
                self._save()
                return
            r = self.round
            while self.round == r:
                self.cond.wait()

    def leave(self) -> None:
        with self.cond:
            self.active -= 1
            if self.pending is not None and 0 < self.active <= self.waiting:  # the others wait only for the leaver
                self._save()

    def _save(self) -> None:
        """Run the save with every remaining worker paused, then release them (the condition's lock is held)."""
        try:
            self.save(self.pending)
            self.saved.append(self.pending)
        finally:
            self.pending, self.waiting = None, 0
            self.round += 1
            self.cond.notify_all()


# ---------------------------------------------------------------------------------------------- trainer
class Trainer:
    """One trainer: a dense replica updated by W Hogwild worker threads, synced by `cfg.sync`."""

    def __init__(self, cfg: TrainConfig, rank: int, state: TrainerState, source: Any, *,
                 embeddings: ShardedEmbeddings, group: Any = None, emit: Callable[[dict], None] = lambda rec: None,
                 center: Any = None, prefetch: int = 1, stop_at: int | None = None,
                 checkpoints: "CheckpointMarks | None" = None,
                 on_eval: Callable[[torch.Tensor, int], None] | None = None, eval_every: int | None = None,
                 recovery: Recovery | None = None):
        """`embeddings`: the tables on the embedding servers (this node's shards in place, others remote); `center`:
        EASGD's centre (a RemoteCenter); `prefetch`: request the rows of the next `prefetch` batches from remote
        servers while the current batch trains (0: fetch each batch when due; local shards are read when due);
        `stop_at`: stop once this trainer's reader positions sum to this many examples; `checkpoints`: pause the
        workers at marks of the reader positions and save (CheckpointMarks); `on_eval(dense, read)`: called from the
        trainer's own thread every `eval_every` examples of this trainer while the workers train (an eval curve),
        with a copy of the dense replica and the examples this trainer's readers have read (resumed ones included);
        `recovery`: where peers may be lost (one machine), re-forms the sync among the trainers left and shares out
        the lost trainers' unread rows once this trainer has read its own."""
        self.cfg, self.rank, self.state, self.source, self.emit = cfg, rank, state, source, emit
        self.data, self.model_cfg = build_configs(cfg)
        self.remote, self.prefetch, self.stop_at, self.checkpoints = embeddings, prefetch, stop_at, checkpoints
        self._shadow: ShadowThread | None = None
        if on_eval is not None and (eval_every is None or eval_every < 1):
            raise ValueError(f"eval_every={eval_every!r}: expected examples >= 1 with on_eval")
        self.on_eval, self.eval_every = on_eval, eval_every
        self.run = run_model(cfg, self.data, self.model_cfg)
        self.model, self.plan = self.run.model, self.run.plan
        self.dense = self.run.dense_parameters()
        self.flat = FlatParams(self.dense)
        self.flat.flat.copy_(state.init_dense)  # every replica starts from the same point
        self.accumulator = torch.zeros_like(self.flat.flat)  # dense Adagrad state (local to the trainer)
        self.dense_lr = cfg.dense_lr * cfg.sync.replica_lr_scale
        self.sync = make_sync(self.flat.flat, cfg.sync, center=center, group=group, trainers=cfg.trainers)
        self._counter = itertools.count(1)
        self._sync_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._loss = np.zeros(cfg.window)
        self._ctr = np.zeros(cfg.window)
        self._n = np.zeros(cfg.window)
        self._slot = 0
        self.examples = 0
        self.active_syncs = 0
        self.mark_base: int | None = None  # fr marks count from here (default: this trainer's start); equal on all
        self.errors: list[str] = []
        self.recovery = recovery
        if recovery is not None:  # what a trainer that joins the job takes from a peer
            recovery.carried = (self.flat.flat, self.accumulator)
        self.takeovers: list[Takeover] = []  # the shares of lost trainers' rows this trainer read
        self.takeover_positions = torch.zeros(cfg.workers, dtype=torch.int64)  # the current share's (Recovery.begin)

    # -- one Hogwild iteration ----------------------------------------------------------------------------
    def train_step(self, batch: Any, lookup: Lookup | None = None) -> float:
        """Forward, backward, and lock-free updates of the dense replica and of the batch's embedding rows (pushed
        to their shards as gradients: in place on this node's, queued for remote ones; `lookup`: a prefetched fetch)."""
        features = self.run.features(batch.sparse)
        lookup = lookup or self.remote.fetch(self.plan.row_ids(features))
        rows = self.remote.wait(lookup).requires_grad_()
        looked = self.plan.looked_up(features, rows, lookup.inverse)
        with active(looked):  # (a plain EmbeddingBag of the model returns its feature's vectors of this batch)
            logits = self.model(batch.dense, looked).view(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.label)
        grads = torch.autograd.grad(loss, self.dense + [rows], allow_unused=True)
        row_grads = grads[-1] if grads[-1] is not None else torch.zeros_like(rows)
        self.plan.fill_padding(lookup.uniq, row_grads)
        self.remote.push(lookup, row_grads)
        with torch.no_grad():
            g = self.flat.flatten_grads(grads[:len(self.dense)])
            if self.cfg.dense_weight_decay:  # L2, as torch.optim.Adagrad/SGD's weight_decay
                g.add_(self.flat.flat, alpha=self.cfg.dense_weight_decay)
            if self.cfg.dense_optimizer == "adagrad":
                self.accumulator.addcmul_(g, g)
                self.flat.flat.addcdiv_(g, self.accumulator.sqrt().add_(1e-8), value=-self.dense_lr)
            else:
                self.flat.flat.add_(g, alpha=-self.dense_lr)
        value = float(loss.detach())
        n = len(batch)
        with self._metrics_lock:
            i = self._slot % self.cfg.window
            self._loss[i], self._ctr[i], self._n[i] = value * n, float(batch.label.sum()), n
            self._slot += 1
            self.examples += n
        return value

    def window_ne(self) -> float:
        """NE of the last `window` batches (log loss over the entropy of their click rate)."""
        with self._metrics_lock:
            n = self._n.sum()
            if n == 0:
                return float("nan")
            p = self._ctr.sum() / n
            if not 0 < p < 1:
                return float("nan")
            return float(self._loss.sum() / n / -(p * math.log(p) + (1 - p) * math.log(1 - p)))

    # -- the W workers + sync ------------------------------------------------------------------------------
    def _worker(self, w: int, takeover: Takeover | None = None) -> None:
        """Worker w: its reader shard of this trainer's data, or of `takeover` (a share of lost trainers' rows)."""
        marks, stop_at = self.checkpoints, self.stop_at
        if takeover is None and self.recovery is not None and not self.recovery.reads_own:
            return  # (a restarted trainer whose rows were shared out before it joined)
        if takeover is None:
            source, shard, shards = self.source, self.rank * self.cfg.workers + w, self.cfg.trainers * self.cfg.workers
            pos = self.state.positions[self.rank]
        else:  # (no checkpoint marks or --stop-after count after a loss)
            source, shard, shards, pos = takeover.source, takeover.first + w, takeover.shards, self.takeover_positions
            marks, stop_at = None, None
        fr = self.cfg.sync.mode == "foreground"
        batches = source.batches(shard, shards, self.cfg.batch_size, int(pos[w]))
        if self.prefetch > 0:
            pairs = self.remote.prefetching(batches, lambda b: self.plan.row_ids(self.run.features(b.sparse)),
                                            depth=self.prefetch)
        else:
            pairs = ((b, None) for b in batches)
        try:
            for batch, lookup in pairs:
                if self.state.stop[0] or self.errors:
                    break
                if stop_at is not None and int(pos.sum()) >= stop_at:
                    break
                self.train_step(batch, lookup)
                pos[w] += len(batch)
                it = next(self._counter)
                self.state.iterations[self.rank] = it
                if fr and it % self.cfg.sync.iterations_per_sync == 0:
                    self._foreground_round(pos, marks)
                elif marks is not None:  # fr collective: marks open at sync rounds only
                    marks.after_batch(None if fr and self.sync.collective else int(pos.sum()))
        except (ExchangeLost, ServerLost, CollectiveTimeout) as e:  # (a lost peer: the message names it)
            self.errors.append(f"trainer {self.rank} worker {w}: {e}")
        except BaseException:
            self.errors.append(f"trainer {self.rank} worker {w}:\n{traceback.format_exc()}")
        finally:
            if marks is not None:
                marks.leave()

    def _sync_round(self, active: bool) -> int:
        """One round of the sync (the foreground's); a round that failed because a peer was lost is skipped after
        the sync is re-formed among the trainers left (returns 1: someone may still be active)."""
        if self.recovery is not None and self.recovery.changed():
            self._regroup(self.sync)
            return 1  # (as after a failed round: every member asks `changed` before its new group's first)
        try:
            return self.sync.sync(active)
        except Exception:
            if self.recovery is None or self._regroup(self.sync) is None:
                raise
            return 1

    def _regroup(self, old: SyncAlgorithm) -> SyncAlgorithm | None:
        """The sync re-formed among the trainers left after a loss (None: no loss explains the failure)."""
        new = self.recovery.regroup(old) if self.recovery is not None else None
        if new is not None:
            self.sync = new  # (its checkpoint marks stay: each is a command every rank counts, 'skip' after a loss)
        return new

    def _foreground_round(self, pos: torch.Tensor, marks: CheckpointMarks | None) -> None:
        """One foreground sync round, then the checkpoint mark it may open (see CheckpointMarks)."""
        while True:
            with self._sync_lock:
                if marks is None or marks.pending is None:
                    self._sync_round(True)
                    self.active_syncs += 1
                    self.state.syncs[self.rank] += 1
                    if marks is not None:
                        every, bs = self.cfg.sync.iterations_per_sync, self.cfg.batch_size
                        marks.open(self.mark_base + self.active_syncs * every * bs if self.sync.collective
                                   else int(pos.sum()))
                    break
            marks.join()  # the round before opened a mark: pause for it before running this round
        if marks is not None:
            marks.join()

    def train(self) -> dict:
        """Run the workers to the end of this trainer's data (or a stop), then (where peers may be lost) its shares
        of the lost trainers' unread rows, finish the sync protocol, and return this trainer's measurements and
        final dense parameters."""
        if self.mark_base is None:
            self.mark_base = int(self.state.positions[self.rank].sum())
        t0, cpu0 = time.time(), time.process_time()
        t_end, cpu_end = self._phase(None, t0)
        taken = 0
        while self.recovery is not None and not self.state.stop[0]:
            takeover = self.recovery.takeover(lambda: bool(self.state.stop[0]))
            if takeover is None:
                break
            self.takeovers.append(takeover)
            self.takeover_positions = self.recovery.begin()
            t_end, cpu_end = self._phase(takeover, t0)
            taken += int(self.takeover_positions.sum())
        iterations = int(self.state.iterations[self.rank])
        self.state.syncs[self.rank] = self.sync.syncs
        self._log(t0)
        return {
            "trainer": self.rank, "examples": self.examples, "iterations": iterations,
            "seconds": t_end - t0, "start": t0, "end": t_end, "cpu_seconds": cpu_end - cpu0, "syncs": self.sync.syncs,
            "active_syncs": self.active_syncs, "sync_impl": type(self.sync).__name__,
            "sync_gap": iterations / self.active_syncs if self.active_syncs else float("nan"),
            "train_ne": self.window_ne(), "dense": self.flat.flat.numpy().copy(),
            "state": {k: v.numpy() for k, v in self.checkpoint_state().items()},
            "lookups": self.remote.stats.as_dict(), "takeover_rows": taken,
            "regrouped_at": self.recovery.regrouped_at if self.recovery is not None else None,
        }

    def _phase(self, takeover: Takeover | None, t0: float) -> tuple[float, float]:
        """The W workers over this trainer's shards (or `takeover`'s) with the sync in the background (shadow mode)
        until every trainer is done; returns the time and CPU time when this trainer's workers finished."""
        workers = [threading.Thread(target=in_role("worker", self._worker), args=(w, takeover), name=f"worker{w}",
                                    daemon=True) for w in range(self.cfg.workers)]
        done = threading.Event()
        shadow = None
        # (one trainer, from the start or left alone after losses: nothing to sync, unless trainers may join)
        may_join = self.recovery is not None and self.cfg.max_restarts > 0
        if self.cfg.sync.mode == "shadow" and (not isinstance(self.sync, NoSync) or may_join):
            def on_active() -> bool:
                return not done.is_set()

            shadow = ShadowThread(self.sync, interval=self.cfg.sync.interval, is_active=on_active,
                                  iterations=lambda: int(self.state.iterations[self.rank]),
                                  recover=self._regroup if self.recovery is not None else None,
                                  changed=self.recovery.changed if self.recovery is not None else lambda: False)
            self._shadow = shadow
        for t in workers:
            t.start()
        if shadow is not None:
            shadow.start()
        last_log = time.time()
        next_eval = (self.examples // self.eval_every + 1) * self.eval_every if self.eval_every else 0
        while any(t.is_alive() for t in workers):
            for t in workers:
                t.join(timeout=0.05)
            if shadow is not None:
                self.state.syncs[self.rank] = self.sync.syncs
                said = f"trainer {self.rank} shadow sync: {shadow.error!r}"
                if shadow.error is not None and said not in self.errors:
                    self.errors.append(said)
                    self.state.stop[0] = 1
            if time.time() - last_log >= self.cfg.log_every:
                last_log = time.time()
                self._log(t0)
            if self.on_eval is not None and self.examples >= next_eval:
                self.on_eval(self.flat.flat.clone(), int(self.state.positions[self.rank].sum()))
                next_eval += self.eval_every
        if not self.errors:
            self.remote.flush()  # every row gradient has reached its server before the trainer reports
        t_end, cpu_end = time.time(), time.process_time()
        done.set()
        if self.errors:
            if shadow is not None:
                shadow.abort()
            raise TrainerFailure("\n".join(self.errors))
        if shadow is not None:  # keeps joining collectives until every trainer is done
            while not shadow.join(timeout=1.0):
                pass
            if shadow.error is not None:
                raise TrainerFailure(f"trainer {self.rank} shadow sync failed: {shadow.error!r}")
            self.active_syncs += shadow.active_syncs
        elif self.sync.collective:
            while self._sync_round(False) != 0:
                pass
        return t_end, cpu_end

    #: the keys of `state_dict` that are the trainer's own (the others are its sync algorithm's)
    OWN_STATE = ("flat", "accumulator", "positions")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A consistent copy of this trainer's state (`checkpoint_state`, waiting as long as it takes)."""
        state = self.checkpoint_state()
        assert state is not None  # (never gives up)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a `state_dict`: the dense replica, its Adagrad accumulator, the reader positions, and the sync
        algorithm's keys (absent ones keep the fresh state)."""
        self.flat.flat.copy_(state["flat"])
        self.accumulator.copy_(state["accumulator"])
        self.state.positions[self.rank].copy_(state["positions"])
        self.sync.load_state({k: v for k, v in state.items() if k not in self.OWN_STATE})

    def checkpoint_state(self, give_up: Callable[[], bool] = lambda: False) -> dict[str, torch.Tensor] | None:
        """Copies of what a checkpoint holds of this trainer (dense replica, Adagrad accumulator, sync state, reader
        positions), read between two sync rounds: the foreground sync's lock, and in shadow mode a pause of the
        shadow thread (for MA/BMUF after a round every trainer paused at, so all trainers' states are from one
        round). None if `give_up()` turned true while waiting for the other trainers."""
        paused = self._shadow.paused(give_up) if self._shadow is not None else contextlib.nullcontext(True)
        with self._sync_lock, paused as ok:
            if not ok:
                return None
            out = {"flat": self.flat.flat.clone(), "accumulator": self.accumulator.clone(),
                   "positions": self.state.positions[self.rank].clone(), **self.sync.state()}
        return out

    def _log(self, t0: float) -> None:
        elapsed = max(time.time() - t0, 1e-9)
        self.emit({"kind": "train", "trainer": self.rank, "trainer_examples": self.examples,
                   "train_ne": self.window_ne(), "trainer_eps": self.examples / elapsed,
                   "syncs": self.sync.syncs, "start": t0})


# ---------------------------------------------------------------------------------------------- process side
