"""Shared machinery of the data-parallel optimizers: one DSL program per optimizer, scheduled and compiled once.

A `DistributedOptimizer` flattens its parameters into arena buffers (`FlatParams`), builds its DSL program for the
padded flat length (programs/optimizers.py, programs/lamb.py, programs/mixed_precision.py), schedules it with the
standard sharded-update schedule (RS -> sliced update -> AG, the optimizer state sliced as ZeRO-1 does) and compiles
the plan with the gradients donated. Each ``step()`` calls the compiled plan once with the flat gradient buffer, the
flat parameter buffer, this rank's state slices and the step's scalars.

Without torch.distributed (a single process) the same scheduled program runs under the reference interpreter on
one rank: a plain local update, for debugging.

Parameter groups (e.g. no weight decay on biases and norms) each get their own program, flat buffers and fused
collective, called in group order by every rank. Frozen parameters (requires_grad=False at construction) are left
out, as torch.optim skips them; freezing or unfreezing later needs a new optimizer. A parameter no rank gave a
gradient on a step is skipped on that step, as torch.optim skips a None gradient (optim/presence.py).
Restrictions (checked, with an error that says so): the parameters of a group share one dtype, dense, on CPU.
`max_grad_norm` clips by the norm over all groups (inside the fused update with one group, before the updates
with several: optim/clip.py).
Hyperparameters may change between steps through ``param_groups`` (LR schedulers work); the structure of each
group's program (momentum on/off, weight decay on/off for SGD, clipping on/off, master dtype) is fixed at
construction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.lower import lower
from cocosync.optim.clip import GlobalNormClip, watch_local_clipping
from cocosync.optim.flat import FlatParams
from cocosync.optim.param_state import SlicedState
from cocosync.optim.presence import Agreement, GradientPresence, per_element
from cocosync.optim.state_dict import TorchStateDict
from cocosync.programs.mixed_precision import MASK_INPUTS
from cocosync.runtime.comm.verify import verify_same
from cocosync.runtime.executor import compile_plan
from cocosync.schedule.schedule import Schedule
from cocosync.schedule.standard import sharded_update_schedule

__all__ = ["DistributedOptimizer", "SCHEDULES"]

#: the `schedule=` values the optimizers accept
SCHEDULES = ("standard", "auto")


@dataclass
class _GroupUpdate:
    """One parameter group's update: its program and schedule, the compiled plan (None without torch.distributed),
    the flat buffers of its parameters and this rank's slices of its state."""

    structure: dict[str, bool]
    program: Program
    schedule: Any
    compiled: Callable | None
    flat: FlatParams
    local_state: dict[str, torch.Tensor]
    slice: slice
    trainable: list[int]
    """Positions in the group's "params" of the parameters in `flat`: those that required grad at construction."""
    arena: Any = None
    """The node's arena when the state slices live in it (one node): any rank reads every slice, no collective."""
    master: torch.dtype = torch.float32
    masked: tuple[Any, Callable | None] | None = None
    """(schedule, compiled plan) of the masked program, built when a parameter first has no gradient."""


class DistributedOptimizer(TorchStateDict, torch.optim.Optimizer):
    # torch.amp.GradScaler's protocol for optimizers that average gradients themselves (as torch's fused ones take
    # part in it): the scaler hands us `grad_scale` and its local `found_inf` instead of stepping around us
    _step_supports_amp_scaling = True

    """Base class: subclasses define `state_names` (program state -> torch.optim state key), `_program` and
    `_scalars`.

    Args (common to all subclasses):
        max_grad_norm: clip the averaged gradient to this global L2 norm over every parameter group (as
            torch.nn.utils.clip_grad_norm_ on DDP-averaged gradients); None: no clipping. With one group the clipping
            runs inside the fused update; with several, one reduce-scatter more per step (optim/clip.py).
        master_dtype: dtype of the master weights and of the optimizer state (float32 for bfloat16/float16
            parameters); None: the parameters' dtype.
        group: torch.distributed process group (default: the whole world).
        schedule: "standard" (RS -> sliced update -> AG as one fused collective) or "auto": at construction each
            group's update is timed under every schedule that keeps the state sliced and the fastest runs
            (tune/in_job.py; the choice is cached on disk per program, world and machine, so later jobs read it).
            "auto" chose the standard schedule for every optimizer measured (BENCHMARKS.md), so it is not the
            default. The masked update (some parameters without gradients) always runs the standard schedule.
    """

    state_names: dict[str, str] = {}
    #: torch.optim's group keys that our state dicts carry, with the values that describe what this optimizer does
    #: (so its state dict loads into the matching torch.optim class, and one saved there loads here)
    torch_group_keys: dict[str, Any] = {}
    #: of those, the ones that cannot change the result (implementation choices): any saved value is accepted
    _IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
    #: on one node with the fused path, keep the parameters once per node in shared memory (every rank's model
    #: reads the same memory; no all-gather within the node). All ranks hold identical parameters in data
    #: parallelism; after loading new weights into the model on every rank, have ranks meet (dist.barrier())
    #: before the next forward. Set to False for a private copy per rank.
    node_shared_params = True

    def __init__(self, params: Iterable, defaults: dict[str, Any], *, max_grad_norm: float | None = None,
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None,
                 schedule: str = "standard"):
        if schedule not in SCHEDULES:
            raise ValueError(f"{type(self).__name__}: schedule={schedule!r}; expected one of {', '.join(SCHEDULES)}")
        self._schedule_mode = schedule
        #: with schedule="auto": per parameter group, the tuner's Choice (candidate, medians, cached, reason)
        self.schedule_choices: list[Any] = []
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm}: expected a positive number or None")
        self.max_grad_norm = max_grad_norm
        # one group: clipping runs inside its fused update; several: before them, by the norm over all (clip.py)
        self._clip_in_program = max_grad_norm is not None and len(self.param_groups) == 1
        self._clipper = GlobalNormClip(self)
        #: with max_grad_norm: the norm of the averaged gradient before clipping in the last step() (a 0-dim tensor,
        #: the same on every rank: what torch.nn.utils.clip_grad_norm_ returns); None before the first step
        self.last_grad_norm: torch.Tensor | None = None
        self._master_arg = master_dtype
        self._distributed = dist.is_available() and dist.is_initialized()
        self._process_group = group
        self.world = dist.get_world_size(group) if self._distributed else 1
        self.group_rank, self.group_size = 0, 1
        if self._distributed:  # fail at once, naming the difference, rather than hang or update differently
            verify_same(type(self).__name__, self._signature(), group)
        self._updates = [self._build(gi, g, group) for gi, g in enumerate(self.param_groups)]
        #: which parameters got a gradient this step, and each one's step count (optim/presence.py)
        self._presence = GradientPresence([u.flat.params for u in self._updates])
        self._agreement = self._new_agreement()
        #: step() calls that updated (not skipped by GradScaler); each parameter's own count is in _presence
        self.steps = 0
        self.state = SlicedState(self)  # torch.optim's per-parameter view (optim/param_state.py)
        if self.world > 1:
            watch_local_clipping([p for u in self._updates for p in u.flat.params], type(self).__name__)

    def _signature(self) -> dict[str, Any]:
        """What every rank must agree on: each group's trainable parameters (shapes, dtypes) and settings."""
        sig: dict[str, Any] = {"parameter groups": len(self.param_groups), "max_grad_norm": self.max_grad_norm,
                               "master_dtype": str(self._master_arg), "schedule": self._schedule_mode}
        for gi in range(len(self.param_groups)):
            sig.update(self._group_signature(gi))
        return sig

    def _group_signature(self, gi: int) -> dict[str, Any]:
        g = self.param_groups[gi]
        params = [p for p in g["params"] if p.requires_grad]
        sig: dict[str, Any] = {f"group {gi} parameters": len(params)}
        for i, p in enumerate(params):
            sig[f"group {gi} parameter {i}"] = (tuple(p.shape), str(p.dtype))
        for k, v in g.items():
            if k != "params":
                sig[f"group {gi} {k}"] = v.tolist() if isinstance(v, torch.Tensor) else v
        return sig

    def _build(self, gi: int, param_group: dict[str, Any], group: dist.ProcessGroup | None) -> _GroupUpdate:
        # frozen parameters (requires_grad=False) are left out: torch.optim skips them (their grad stays None),
        # while a zero gradient here would still apply weight decay and momentum to them
        trainable = [i for i, p in enumerate(param_group["params"]) if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(self).__name__}: parameter group {gi} has no parameter "
                             "that requires grad; leave it out")
        params = [param_group["params"][i] for i in trainable]
        _refuse_dtensors(type(self).__name__, gi, params)
        dtype = params[0].dtype
        master = self._master_arg
        if master is not None and master not in (dtype, torch.float32):
            raise ValueError(f"master_dtype={master}: expected None, float32 or the parameters' dtype {dtype}")
        master = master or dtype
        structure = self._structure_of(param_group)
        n_pad = -(-sum(p.numel() for p in params) // self.world) * self.world
        # clipping is inside the update program: its norm splits the fused collective into two phases
        # (runtime/steps/fused_collective.py), still one reduction of the gradients
        program = self._program(n_pad, dtype, master if master != dtype else None,
                                clip=self._clip_in_program, params=params, **structure)
        schedule, compiled = self._compile(program, group, tune=self._schedule_mode == "auto",
                                           param_group=param_group)
        alloc = param_alloc = shm = None
        if compiled is not None:
            shm = compiled.comm.shm
            if shm is not None:
                alloc = shm.arena.empty
                if self.node_shared_params and shm.nnodes == 1 and any(
                        s.startswith("fused_collective") for s in compiled.fast_steps):
                    # Replicated parameters stored once per node: each rank's fused step writes its slice of
                    # the update in place and no all-gather is needed within the node
                    param_alloc = shm.arena.shared_empty
            self.group_rank, self.group_size = compiled.comm.group_rank, compiled.comm.group_size
        flat = FlatParams(params, self.world, alloc, param_alloc)
        if param_alloc is not None:
            shm.barrier()  # every local rank has copied its (identical) parameters in before anyone reads them
        n = flat.padded // self.group_size
        sl = slice(self.group_rank * n, (self.group_rank + 1) * n)
        # on one node the state slices live in the arena: state_dict() on one rank reads the others' slices where
        # they are (saving on rank 0 only works; the peers cannot change them before that rank joins the next step)
        arena = shm.arena if shm is not None and shm.nnodes == 1 and shm.world == self.group_size else None
        new = (lambda: arena.empty(n, master)) if arena is not None else (lambda: torch.empty(n, dtype=master))
        local_state = {s: new().zero_() for s in self.state_names}
        if master != dtype:
            local_state["master"] = new().copy_(flat.flat[sl])
        return _GroupUpdate(structure, program, schedule, compiled, flat, local_state, sl, trainable, arena, master)

    def _compile(self, program: Program, group: dist.ProcessGroup | None, *, tune: bool = False,
                 param_group: dict[str, Any] | None = None) -> tuple[Any, Callable | None]:
        """The standard sharded-update schedule of `program` (its state and per-element inputs sliced) and its
        compiled plan (None without torch.distributed); `tune`: the fastest schedule keeping the state sliced,
        measured now or read from the tuner's cache (collective)."""
        names = {x.name for x in program.inputs if x.ndim}  # the per-element inputs of the masked programs
        sliced = tuple(s for s in self._program_states() if s in program.updates)
        schedule = sharded_update_schedule(program, sliced + tuple(x for x in MASK_INPUTS if x in names))
        if not self._distributed:
            return schedule, None
        if tune and param_group is not None:
            from cocosync.tune.in_job import choose_update_schedule

            choice = choose_update_schedule(program, sliced, group, self._float_scalars(param_group, 1),
                                            donate=("g",))
            self.schedule_choices.append(choice)
            if choice is None:  # no schedule of this program's space keeps its state sliced but the standard one
                return schedule, compile_plan(lower(schedule), group, donate=("g",))
            if dist.get_rank(group) == 0:
                print(f"cocosync: {type(self).__name__}(schedule='auto') runs {choice.candidate.name}: "
                      f"{choice.reason}", file=sys.stderr)
            return Schedule(program, choice.candidate.directives), choice.compiled
        return schedule, compile_plan(lower(schedule), group, donate=("g",))

    def _masked(self, gi: int, u: _GroupUpdate) -> tuple[Any, Callable | None]:
        """The group's masked program, scheduled and compiled (collective: every rank needs it on the same step,
        since the ranks agree on which parameters have gradients)."""
        if u.masked is None:
            params = [self.param_groups[gi]["params"][i] for i in u.trainable]
            program = self._program(u.flat.padded, u.flat.dtype, u.master if u.master != u.flat.dtype else None,
                                    clip=self._clip_in_program, params=params, masked=True, **u.structure)
            u.masked = self._compile(program, self._process_group)
        return u.masked

    # the first group's parts (the only ones with a single group, the common case)
    flat = property(lambda self: self._updates[0].flat)
    compiled = property(lambda self: self._updates[0].compiled)
    program = property(lambda self: self._updates[0].program)
    schedule = property(lambda self: self._updates[0].schedule)
    local_state = property(lambda self: self._updates[0].local_state)

    # ---- subclass hooks ----

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], masked: bool = False, **structure: bool) -> Program:
        """The update program of one parameter group (`params`, flattened and padded to `n` elements); `masked`:
        its variant that skips the elements whose input "keep" is 0 (programs/mixed_precision.py)."""
        raise NotImplementedError

    def _scalars(self, group: dict[str, Any], step: int) -> dict[str, float]:
        raise NotImplementedError

    def _structure_of(self, group: dict[str, Any]) -> dict[str, bool]:
        """Hyperparameters that change the program (e.g. momentum != 0); fixed after construction."""
        return {}

    def _program_states(self) -> tuple[str, ...]:
        return (*self.state_names, "master")

    # ---- torch.optim.Optimizer interface ----

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim: after construction the new group gets its own compiled fused update (collective: every
        rank adds the same group)."""
        if getattr(self, "_constructing", True):
            return super().add_param_group(param_group)
        name = type(self).__name__
        if self._clip_in_program:
            raise ValueError(f"{name}.add_param_group: max_grad_norm clips over one parameter group; a second group "
                             "would be clipped separately")
        super().add_param_group(param_group)  # torch's checks and defaults
        gi = len(self.param_groups) - 1
        try:
            if self._distributed:
                verify_same(f"{name}.add_param_group", self._group_signature(gi), self._process_group)
            self._updates.append(self._build(gi, self.param_groups[gi], self._process_group))
            self._presence.add_group(self._updates[-1].flat.params)
            self._agreement = self._new_agreement()
        except BaseException:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (one memset of the flat buffer). `set_to_none` is ignored: the gradients
        stay views of the arena buffer so that backward accumulates into it (a None .grad would make backward
        allocate a fresh tensor and cost a copy into the buffer per step). What set_to_none is for in torch.optim,
        telling which parameters got no gradient, is kept: such parameters are skipped (optim/presence.py); code
        that tests `p.grad is None` can call `model.zero_grad()` instead, at that copy's cost."""
        for u in self._updates:
            u.flat.zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients over ranks and update the parameters (one call of the compiled plan per group).
        Collective: every rank calls it. Afterwards the gradient buffer's contents are undefined (donated)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, (g, u) in enumerate(zip(self.param_groups, self._updates)):
            trainable = [i for i, p in enumerate(g["params"]) if p.requires_grad]
            if trainable != u.trainable:
                changed = sorted(set(trainable) ^ set(u.trainable))
                raise ValueError(f"{type(self).__name__}: requires_grad of parameter(s) {changed} of group {gi} "
                                 "changed since construction (frozen parameters are left out of the flat buffers); "
                                 "construct a new optimizer after freezing or unfreezing")
            structure = self._structure_of(g)
            if structure != u.structure:
                raise ValueError(f"{type(self).__name__}: {structure} changed since construction ({u.structure}); "
                                 "these select the program and are fixed: construct a new optimizer")
        skip, inv_scale, used = self._agree()
        if skip:
            return loss
        self.steps += 1
        for g, u in zip(self.param_groups, self._updates):  # every rank: the same groups in the same order
            u.flat.sync()
            if inv_scale is not None:
                u.flat.grad.mul_(inv_scale)
            if g.get("maximize"):  # ascend: the average of -g is -(the average of g)
                u.flat.grad.neg_()
        if self.max_grad_norm is not None and not self._clip_in_program:
            self.last_grad_norm = self._clipper.clip_(float(self.max_grad_norm))
        for gi, (g, u, has) in enumerate(zip(self.param_groups, self._updates, used)):
            steps = self._presence.steps[gi]
            steps += has
            if not has.any():  # no rank has a gradient for any parameter of the group: torch skips them all
                continue
            uniform = bool(has.all()) and steps.min() == steps.max()
            inputs: dict[str, Any] = {"g": u.flat.grad, "w": u.flat.flat, **u.local_state,
                                      **self._float_scalars(g, int(steps.max()))}
            if self._clip_in_program:
                inputs["max_norm"] = float(self.max_grad_norm)
            schedule, compiled = (u.schedule, u.compiled) if uniform else self._masked(gi, u)
            if not uniform:
                inputs.update(self._per_element_inputs(g, u, schedule.program, has, steps))
            out = compiled(**inputs) if compiled is not None else self._run_local(u, schedule, inputs)
            if "grad_norm" in out:
                self.last_grad_norm = out["grad_norm"]
        return loss

    def _float_scalars(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        return {k: float(v) if isinstance(v, torch.Tensor) else v  # a Tensor lr: its value this step
                for k, v in self._scalars(group, step).items()}

    def _per_element_inputs(self, group: dict[str, Any], u: _GroupUpdate, program: Program, has: np.ndarray,
                            steps: np.ndarray) -> dict[str, torch.Tensor]:
        """The masked program's "keep" and step-dependent inputs, each parameter's value over its elements (this
        rank's slice with a compiled plan, all of it under the interpreter)."""
        part = u.slice if u.compiled is not None else None
        out = {"keep": per_element(u.flat, has, 0.0, part, u.master)}
        by_step = {t: self._float_scalars(group, t) for t in set(steps.tolist()) if t > 0}
        names = {x.name for x in program.inputs if x.ndim}
        for name in MASK_INPUTS[1:]:
            if name in names:  # a parameter never stepped is masked out: any finite value will do
                values = np.array([by_step[t][name] if t > 0 else 1.0 for t in steps.tolist()])
                out[name] = per_element(u.flat, values, 1.0, part, u.master)
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients so that their average over ranks has global L2 norm <= max_norm, over every group;
        returns the norm before clipping, the same on every rank (FSDP's convention for gradients it reduces
        itself). Collective: every rank calls it before step(). It costs one reduce-scatter of the gradients more
        than `max_grad_norm=` with one group (clipped inside the fused update). torch.nn.utils.clip_grad_norm_
        here would clip each rank's own gradient before the average, and log a per-rank norm."""
        if norm_type != 2.0:
            raise ValueError(f"{type(self).__name__}.clip_grad_norm_: norm_type={norm_type!r}; only the L2 norm "
                             "(2.0) is supported")
        if not max_norm > 0:
            raise ValueError(f"{type(self).__name__}.clip_grad_norm_: max_norm={max_norm!r} must be > 0")
        for u in self._updates:
            u.flat.sync()
        self.last_grad_norm = self._clipper.clip_(float(max_norm))
        return self.last_grad_norm

    def _agree(self) -> tuple[bool, float | None, list[np.ndarray]]:
        """What the ranks agree on before a step, in one exchange (optim/presence.py): (skip the step, 1/scale to
        unscale the gradients by or None, per group which parameters have a gradient on some rank).

        Under torch.amp.GradScaler (`grad_scale` / `found_inf` set for this step) a rank's found_inf is its own
        gradients' (GradScaler checks before we average), so every rank skips or steps together, where skipping
        alone would leave its peers waiting in the fused collective. Each rank's scaler then follows torch's rules
        on its own found_inf; ranks whose scales differ stay correct, as each unscales its own gradients before
        they are averaged. Gradient presence: optim/presence.py."""
        found, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        flag = 0.0 if found is None else float(found)
        local = self._presence.local([u.flat for u in self._updates])
        self._presence.reset()
        flags = self._agreement([flag, *local])
        if flags[0] > 0:
            return True, None, []
        return False, (None if scale is None else 1.0 / float(scale)), self._presence.split(flags[1:])

    def _new_agreement(self) -> Agreement:
        """[found_inf, a flag per parameter] agreed by the ranks each step (collective to construct)."""
        compiled = self._updates[0].compiled
        return Agreement(compiled.comm if compiled is not None else None, 1 + sum(len(m) for m in self._presence.marks))

    def __del__(self) -> None:
        presence = self.__dict__.get("_presence")
        if presence is not None:
            presence.remove()

    @staticmethod
    def _run_local(u: _GroupUpdate, schedule: Any, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        from cocosync.interp import interpret

        out = interpret(schedule.program, 1, inputs)[0]
        u.flat.flat.copy_(out["w"])
        for name, t in u.local_state.items():
            t.copy_(out[name])
        return out


def _refuse_dtensors(name: str, gi: int, params: list[torch.Tensor]) -> None:
    """FSDP2 (`fully_shard`) and tensor parallelism give DTensor parameters whose gradients torch has reduced
    already; our optimizers average plain replicated tensors themselves, so they refuse them, saying what works."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            raise TypeError(f"{name}: parameter {i} of group {gi} is a DTensor (placements {p.placements}), as "
                            f"FSDP2's fully_shard or tensor parallelism make them: their gradients are already "
                            f"reduced, and {name} averages replicated tensors itself. Use torch.optim."
                            f"{name.removeprefix('Distributed')} on the sharded model, with "
                            "init_process_group('cocosync') for shared-memory collectives.")
