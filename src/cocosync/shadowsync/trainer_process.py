"""One trainer process of a single-machine run: its plan from the launcher (resume states, checkpoint marks, stop
and eval points), the heartbeat thread, the gloo group among the trainers, and the Trainer (trainer.py) with its
periodic checkpoints and eval curve. The launcher (launcher.py) spawns `trainer_main` once per trainer."""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch
import torch.distributed as dist

from cocosync.shadowsync.eval_curve import BestModelCurve
from cocosync.shadowsync.sources import build_configs, eval_batches
from cocosync.shadowsync.state import SharedState
from cocosync.shadowsync.train_config import TrainConfig
from cocosync.shadowsync.trainer import CheckpointMarks, Trainer

__all__ = ["TrainerPlan", "plan_trainers", "trainer_main"]


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this trainer if the launcher dies, so no orphan survives a killed run
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _beat(state: SharedState, rank: int, interval: float) -> None:
    """The heartbeat thread: it runs whatever the trainer does (torch ops and gloo release the GIL), so a missing
    beat means the process is stopped, hung in native code holding the GIL, or not scheduled."""
    while True:
        state.heartbeat[rank] = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across processes
        time.sleep(interval)


@dataclass
class TrainerPlan:
    """What the launcher tells every trainer beyond the config: where to resume, when to checkpoint and stop."""

    resume: list[dict] | None = None  # per trainer: Trainer.checkpoint_state() of the checkpoint resumed from
    checkpoint_every: int | None = None  # examples per trainer between two periodic checkpoints
    stop_at: int | None = None  # a trainer stops once its reader positions sum to this
    mark_base: int = 0  # examples every trainer had seen at the start (the least of them): marks count from here
    limit: int = 0  # the last mark: below every trainer's share (the end writes its own checkpoint)
    eval_every: int | None = None  # trainer 0 scores its replica every this many of its examples (eval_curve.py)


def plan_trainers(cfg: TrainConfig, positions: torch.Tensor, resume: list[dict] | None, checkpoint_every: int | None,
          stop_after: int | None, eval_every: int | None) -> TrainerPlan:
    T, W = cfg.trainers, cfg.workers
    stop_at = stop_after // T if stop_after is not None else None
    limit = W * (cfg.total_examples // (T * W)) - 1
    if stop_at is not None:
        limit = min(limit, stop_at - 1)
    every = max(1, checkpoint_every // T) if checkpoint_every is not None and cfg.checkpoint else None
    return TrainerPlan(resume, every, stop_at, int(positions.sum(dim=1).min()), limit,
                       max(1, eval_every // T) if eval_every is not None else None)


def _periodic_save(trainer: Trainer, state: SharedState, rank: int, send: Callable[[dict], None]):
    """The save of a trainer's CheckpointMarks: hand its state to the launcher, wait (workers paused) until the
    launcher has written the checkpoint with every trainer's state, or let the mark pass, or the run stops."""
    def save(mark: int) -> None:
        def passed() -> bool:  # written, or let pass because a trainer cannot come, or the run stops
            return bool(state.released[0] >= mark or state.stop[0])

        saved = trainer.checkpoint_state(give_up=passed)
        if saved is None:
            return
        send({"kind": "checkpoint", "trainer": rank, "mark": mark, "state": {k: v.numpy() for k, v in saved.items()}})
        while not passed():
            time.sleep(0.002)

    return save


def trainer_main(rank: int, cfg: TrainConfig, state: SharedState, source: Any, store_port: int | None,
                  conn: Connection, plan: TrainerPlan) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and tells us through state.stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent()
    threading.Thread(target=_beat, args=(state, rank, cfg.heartbeat_timeout / 10), daemon=True,
                     name="cocosync-heartbeat").start()
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo between trainers stays on loopback
    group_ready = False
    try:
        group = None
        if store_port is not None:
            timeout = datetime.timedelta(seconds=min(cfg.timeout, 120))
            store = dist.TCPStore("127.0.0.1", store_port, cfg.trainers, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.trainers, timeout=timeout)
            group_ready = True
        lock = threading.Lock()  # the workers (checkpoint marks) and the main thread (progress) both send

        def send(msg: dict) -> None:
            with lock:
                conn.send(msg)

        curve = None
        if rank == 0 and plan.eval_every is not None:
            curve = BestModelCurve(cfg, state, eval_batches(cfg, build_configs(cfg)[0]), send)
        trainer = Trainer(cfg, rank, state, source, group=group, emit=send, stop_at=plan.stop_at, on_eval=curve,
                          eval_every=plan.eval_every)
        if curve is not None:
            curve.trainer = trainer
        if plan.resume is not None:
            trainer.load_checkpoint_state(plan.resume[rank])
        trainer.mark_base = plan.mark_base
        if plan.checkpoint_every is not None:
            trainer.checkpoints = CheckpointMarks(plan.checkpoint_every, plan.mark_base, plan.limit, cfg.workers,
                                                  _periodic_save(trainer, state, rank, send))
        send({"kind": "ready", "trainer": rank})
        while not state.go[0] and not state.stop[0]:  # start together: EPS is measured over a common window
            time.sleep(0.001)
        result = trainer.train()
        send({"kind": "result", **result})
    except BaseException:
        try:
            conn.send({"kind": "error", "trainer": rank, "traceback": traceback.format_exc()})
        except OSError:
            pass
        conn.close()
        os._exit(1)  # do not wait on gloo/threads of a broken run
    finally:
        if group_ready:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    conn.close()
