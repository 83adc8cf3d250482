"""MA and BMUF as compiled DSL programs (programs/sync.py) on the cocosync runtime: the trainers average in one
collective per round through the runtime's communicator (shared memory within a machine; across machines the same
program on its hierarchical form: shared memory within each node, gloo between nodes, job/rank.py registers it),
instead of the classes' gloo all-reduce.

One program per algorithm, two schedules, chosen by size (SLICED_FROM_BYTES, measured): for small vectors the
program runs as written (a one-shot all-reduce, then the update on the whole vector, the state replicated: fewest
round trips); above it with the optimizers' sharded-update schedule (reduce-scatter -> update on this trainer's
slice -> all-gather, one fused collective), BMUF's state sliced across the trainers (each holds 1/T of the global
model and block momentum). The hand-written classes (ma.py, bmuf.py) are the reference the tests compare against,
and run where this does not apply: one trainer, `--no-compiled-sync` (then across machines over HierarchicalGroup).

The active and hold flags ride in the same collective: two elements past the parameters (`x[n]`, `x[n+1]`), whose
BMUF state is reset before every round, so the round's restart point there is a known multiple of their mean. BMUF
with Nesterov momentum looks ahead while any trainer trains; the round that finds none active (the last) is known
only after it, so it is corrected then: every trainer ends on the global model itself, as the class does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cocosync.lower import lower
from cocosync.programs.sync import bmuf_program, ma_program
from cocosync.runtime.comm.native import one_shot as native_module
from cocosync.runtime.executor import compile_plan
from cocosync.runtime.steps.codegen import compile_function
from cocosync.schedule import Schedule
from cocosync.schedule.standard import STANDARD
from cocosync.shadowsync.config import SyncConfig
from cocosync.shadowsync.sync.base import SyncAlgorithm

__all__ = ["CompiledSync", "NotOnOneMachine"]


#: elements from which a round's copies in and out run as one generated loop each (fork: the live vector read once
#: into the snapshot and the collective's buffer; write-back: flat += s - snapshot in one pass): at 16M, T=2 the
#: round went 38 -> 23.5 ms (BENCHMARKS.md); below it the torch calls (a compiled call costs 25-80 us)
FUSED_COPIES_FROM = 1 << 20
#: elements from which the fork is the native streaming copy (runtime/comm/native: read once, no read for ownership
#: of the two copies): 16M, T=2: BENCHMARKS.md "sync: the round's fork with streaming stores"
STREAM_FORK_FROM = 2 << 20


def _fork(flat: torch.Tensor, snapshot: torch.Tensor, x: torch.Tensor) -> None:
    snapshot.copy_(flat)
    x.copy_(flat)


def _write_back(flat: torch.Tensor, s: torch.Tensor, snapshot: torch.Tensor) -> None:
    flat.add_(s - snapshot)


#: peer bytes from which the sliced schedule runs (T=2, rounds measured here: at 27,601 parameters replicated MA/BMUF
#: 382/585 us vs sliced 444/725 us; at 200,000 replicated 1231/3379 us vs sliced 881/1088 us)
SLICED_FROM_BYTES = 256 << 10
#: across machines, (local trainers - 1) x bytes from which the sliced schedule runs: 2 simulated nodes x 2 trainers
#: at 27,601 parameters, sliced rounds (gloo reduce-scatter + all-gather between nodes) left a 3.6x (MA) / 1.7x
#: (BMUF) longer sync gap than the classes' one gloo all-reduce; not measured above that (BENCHMARKS.md)
SLICED_ACROSS_FROM_BYTES = 16 << 20


class NotOnOneMachine(ValueError):
    """The trainers' group has no shared-memory communicator (it spans machines without a registered hierarchical
    one: make_sync falls back to the classes)."""


class CompiledSync(SyncAlgorithm):
    """MA ('ma') or BMUF ('bmuf') of `flat` over `group` (a process group of the trainers: on one machine, or
    across machines with a registered hierarchical communicator)."""

    collective = True

    def __init__(self, flat: torch.Tensor, cfg: SyncConfig, group: dist.ProcessGroup | None = None, *,
                 sliced: bool | None = None, fused_copies_from: int = FUSED_COPIES_FROM,
                 stream_fork_from: int = STREAM_FORK_FROM):
        """`sliced`: force the schedule (None: by size, see module doc); `fused_copies_from`: elements from which
        the copies in and out run as generated loops."""
        super().__init__(flat, cfg, group)
        self.name = cfg.method
        if self.name not in ("ma", "bmuf"):
            raise ValueError(f"CompiledSync runs 'ma' and 'bmuf', not {self.name!r}")
        world = self.group_size()
        n = flat.numel()
        self.n, self.padded = n, -(-(n + 2) // world) * world  # + the active and hold flags
        program = (bmuf_program if self.name == "bmuf" else ma_program)(self.padded, flat.dtype)
        self.plan = compile_plan(lower(Schedule(program)), group, donate=("x",))  # (kernels compile on first call)
        shm = self.plan.comm.shm  # its nodes decide the schedule
        if sliced is None and shm is not None:
            # across machines the sliced schedule puts two gloo calls (reduce-scatter, all-gather) on the network
            # where the replicated one has one all-reduce: only worth it for large vectors
            peers = shm.local_size - 1 if shm.nnodes > 1 else world - 1
            sliced = n * flat.element_size() * peers > (SLICED_FROM_BYTES if shm.nnodes == 1 else
                                                        SLICED_ACROSS_FROM_BYTES)
        self.sliced = bool(sliced)
        if self.sliced:
            self.plan = compile_plan(lower(STANDARD[self.name](program)), group, donate=("x",))
        if shm is None:
            raise NotOnOneMachine("CompiledSync needs the trainers on one machine (the shared-memory communicator)")
        self._comm, alloc = shm, shm.arena.empty
        self.x = alloc(self.padded, flat.dtype)
        self.s = alloc(self.padded, flat.dtype).zero_()  # the point every trainer restarts from
        self.s[:n].copy_(flat)
        self.rank, size = self.plan.comm.group_rank, self.plan.comm.group_size
        k = self.padded // size if sliced else self.padded
        self._lo = self.rank * k if sliced else 0
        if self.name == "bmuf":  # MA keeps no state
            self.glob = alloc(k, flat.dtype).copy_(self.s[self._lo:self._lo + k])  # x_prev_global (its slice)
            self.delta = alloc(k, flat.dtype).zero_()
        self._flag_slots = [(i - self._lo) for i in (n, n + 1) if self._lo <= i < self._lo + k]  # in my slice
        self._flag_index = torch.tensor(self._flag_slots, dtype=torch.int64)
        self.momentum = cfg.momentum_for(world)
        self.world = world
        # a round's fixed parts, made once (at the default model's size a round is ~100 us: each torch call counts)
        self._snapshot = torch.empty_like(flat)
        self._x_head, self._s_head, self._s_tail = self.x[:n], self.s[:n], self.s[n:]
        self._flags = {(a, h): torch.tensor([float(a), float(h)] + [0.0] * (self.padded - n - 2), dtype=flat.dtype)
                       for a in (False, True) for h in (False, True)}  # the active and hold flags, then padding
        big = n >= fused_copies_from
        self._fork = compile_function(_fork) if big else (lambda f, p, x: (p.copy_(f), x.copy_(p)))
        native = native_module() if n >= stream_fork_from and flat.is_contiguous() else None
        if native is not None:
            self._fork = lambda f, p, x: native.stream_copy2(p, x, f)
        # one in-place add of the difference: the workers read `flat` while this runs (Hogwild), and flat += s then
        # flat -= snapshot let them read flat + s, about twice the weights, in between (train-NE spikes of 1.5-4.6)
        diff = torch.empty_like(flat)
        self._write_back = compile_function(_write_back) if big else (
            lambda f, s, p: f.add_(torch.sub(s, p, out=diff)))

    def _sync(self, active: bool) -> int:
        n, x, s, snapshot = self.n, self.x, self.s, self._snapshot
        self._fork(self.flat, snapshot, self._x_head)
        x[n:].copy_(self._flags[(active, bool(self.holding))])
        self._s_tail.zero_()
        if self.name == "bmuf":
            if self._flag_slots:
                self.glob.index_fill_(0, self._flag_index, 0.0)
                self.delta.index_fill_(0, self._flag_index, 0.0)
            look_ahead = self.momentum if self.cfg.nesterov else 0.0
            self.plan(x=x, s=s, glob=self.glob, delta=self.delta, mom=self.momentum, blr=self.cfg.block_lr,
                      nm=look_ahead)
            scale = self.cfg.block_lr * (1.0 + look_ahead)  # s = glob + nm * delta = blr * (1 + nm) * mean there
        else:
            self.plan(x=x, s=s)
            scale = 1.0
        active_sum, hold_sum = s[n:n + 2].tolist()  # one read of both flags
        n_active = int(round(active_sum / scale * self.world))
        self.holds = int(round(hold_sum / scale * self.world))
        if self.name == "bmuf" and look_ahead and n_active == 0:  # the last round: end on the global model
            self._s_head.copy_(self._full(self.glob))
        self._write_back(self.flat, self._s_head, snapshot)  # delta write-back: keeps updates made during the round
        return n_active

    # -- the state a checkpoint holds (full vectors; the slices are read from the peers' shared memory) ----------
    def _full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vector of a state this trainer holds a slice of: read from the peers' shared memory on one
        machine; across machines gathered (collective: every trainer asks at the same point, between rounds)."""
        if not self.sliced:
            return local[:self.n].clone()
        if self._comm.nnodes > 1:
            return self._comm.all_gather(local.clone())[:self.n]
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
