"""MA and BMUF as compiled DSL programs (programs/sync.py) on the cocosync runtime: the trainers of one machine
average through shared memory, in one collective per round, instead of gloo over loopback TCP.

One program per algorithm. BMUF has two schedules, chosen by size as the communicator chooses its all-reduce: up
to the one-shot size (1 MB of peer data) the program runs as written (a one-shot all-reduce, then the update on the
whole vector, the state replicated: fewest round trips); above it with the optimizers' sharded-update schedule
(reduce-scatter -> update on this trainer's slice -> all-gather, one fused collective), the BMUF state sliced across
the trainers (each holds 1/T of the global model and block momentum). MA has no state to slice: its program is the
communicator's all-reduce, which itself goes one-shot or reduce-scatter + all-gather by size. The hand-written classes
(ma.py, bmuf.py) are the reference the tests compare against, and run where this does not apply: one trainer, and
across machines (HierarchicalGroup). The active and hold flags ride on a separate 8-byte all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.lower import lower
from cocosync.programs.sync import bmuf_program, ma_program
from cocosync.reduce_op import ReduceOp
from cocosync.runtime.comm.collectives import DEFAULT_ONE_SHOT_BYTES
from cocosync.runtime.executor import compile_plan
from cocosync.schedule import Schedule
from cocosync.schedule.standard import sharded_update_schedule
from cocosync.shadowsync.sync.base import SyncAlgorithm
from cocosync.shadowsync.train_config import SyncConfig

__all__ = ["CompiledSync", "NotOnOneMachine"]


class NotOnOneMachine(ValueError):
    """The trainers' group spans machines: no shared-memory communicator (make_sync falls back to the classes)."""


class CompiledSync(SyncAlgorithm):
    """MA ('ma') or BMUF ('bmuf') of `flat` over `group` (a process group of the trainers, one machine)."""

    collective = True

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | None = None, *,
                 sliced: bool | None = None):
        """`sliced`: force the schedule (None: by size, see module doc)."""
        super().__init__(flat, cfg, group)
        self.name = cfg.method
        if self.name not in ("ma", "bmuf"):
            raise ValueError(f"CompiledSync runs 'ma' and 'bmuf', not {self.name!r}")
        world = self._world()
        n = flat.numel()
        self.n, self.padded = n, -(-n // world) * world
        program = (bmuf_program if self.name == "bmuf" else ma_program)(self.padded, flat.dtype)
        if sliced is None:  # the size up to which the communicator's own all-reduce is one-shot
            sliced = n * flat.element_size() * (world - 1) > DEFAULT_ONE_SHOT_BYTES
        self.sliced = sliced = sliced and self.name == "bmuf"  # MA has no state; its all-reduce splits itself
        states = ("glob", "delta") if self.name == "bmuf" else ()
        schedule = sharded_update_schedule(program, states) if sliced else Schedule(program)
        self.plan = compile_plan(lower(schedule), group, donate=("x",))
        shm = self.plan.comm.shm
        if shm is None:
            raise NotOnOneMachine("CompiledSync needs the trainers on one machine (the shared-memory communicator)")
        self._comm, alloc = shm, shm.arena.empty
        self.x = alloc(self.padded, flat.dtype)
        self.s = alloc(self.padded, flat.dtype).zero_()  # the point every trainer restarts from
        self.s[:n].copy_(flat)
        self.rank, size = self.plan.comm.group_rank, self.plan.comm.group_size
        k = self.padded // size if sliced else self.padded
        self._lo = self.rank * k if sliced else 0
        self.glob = alloc(k, flat.dtype).copy_(self.s[self._lo:self._lo + k])  # x_prev_global (its slice)
        self.delta = alloc(k, flat.dtype).zero_()
        self._flags = alloc(2, torch.float32)
        m = cfg.block_momentum
        self.momentum = (1.0 - 1.0 / world) if m is None else m

    def _sync(self, active: bool) -> int:
        self._flags[0], self._flags[1] = float(active), float(self.holding)
        self._comm.all_reduce(self._flags, ReduceOp.SUM)
        n_active, self.holds = int(round(self._flags[0].item())), int(round(self._flags[1].item()))
        snapshot = self.flat.clone()
        self.x[:self.n].copy_(snapshot)
        self.x[self.n:].zero_()
        if self.name == "bmuf":
            look_ahead = self.momentum if self.cfg.nesterov and n_active > 0 else 0.0
            self.plan(x=self.x, s=self.s, glob=self.glob, delta=self.delta, mom=self.momentum,
                      blr=self.cfg.block_lr, nm=look_ahead)
        else:
            self.plan(x=self.x, s=self.s)
        self.flat.add_(self.s[:self.n]).sub_(snapshot)  # delta write-back: keeps updates made during the round
        return n_active

    # -- the state a checkpoint holds (full vectors; the slices are read from the peers' shared memory) ----------
    def _full(self, local: torch.Tensor) -> torch.Tensor:
        if not self.sliced:
            return local[:self.n].clone()
        parts = [self._comm.arena.peer_view(local, p) for p in range(self.plan.comm.group_size)]
        return torch.cat(parts)[:self.n]

    def state(self) -> dict[str, torch.Tensor]:
        if self.name != "bmuf":
            return {}
        return {"bmuf.global": self._full(self.glob), "bmuf.start": self.s[:self.n].clone(),
                "bmuf.delta": self._full(self.delta)}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        if self.name != "bmuf" or "bmuf.global" not in saved:
            return
        k = self.glob.numel()
        for key, local in (("bmuf.global", self.glob), ("bmuf.delta", self.delta)):
            full = torch.zeros(self.padded, dtype=local.dtype)
            full[:self.n] = torch.as_tensor(saved[key])
            local.copy_(full[self._lo:self._lo + k])
        self.s[:self.n].copy_(torch.as_tensor(saved["bmuf.start"]))
