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
out, as torch.optim skips them; freezing or unfreezing later needs a new optimizer. Restrictions (checked, with an
error that says so): the parameters of a group share one dtype, dense, on CPU. `max_grad_norm` clips by the norm
over all groups (inside the fused update with one group, before the updates with several: optim/clip.py).
Hyperparameters may change between steps through ``param_groups`` (LR schedulers work); the structure of each
group's program (momentum on/off, weight decay on/off for SGD, clipping on/off, master dtype) is fixed at
construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.lower import lower
from cocosync.optim.clip import GlobalNormClip
from cocosync.optim.flat import FlatParams
from cocosync.optim.param_state import SlicedState
from cocosync.runtime.comm.verify import verify_same
from cocosync.runtime.executor import compile_plan
from cocosync.schedule.standard import sharded_update_schedule

__all__ = ["DistributedOptimizer"]


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


class DistributedOptimizer(torch.optim.Optimizer):
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
                 master_dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None):
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
        self.steps = 0
        self.state = SlicedState(self)  # torch.optim's per-parameter view (optim/param_state.py)

    def _signature(self) -> dict[str, Any]:
        """What every rank must agree on: each group's trainable parameters (shapes, dtypes) and settings."""
        sig: dict[str, Any] = {"parameter groups": len(self.param_groups), "max_grad_norm": self.max_grad_norm,
                               "master_dtype": str(self._master_arg)}
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
        states = tuple(s for s in self._program_states() if s in program.updates)
        schedule = sharded_update_schedule(program, states)
        compiled: Callable | None = None
        alloc = param_alloc = shm = None
        if self._distributed:
            compiled = compile_plan(lower(schedule), group, donate=("g",))
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
        return _GroupUpdate(structure, program, schedule, compiled, flat, local_state, sl, trainable, arena)

    # the first group's parts (the only ones with a single group, the common case)
    flat = property(lambda self: self._updates[0].flat)
    compiled = property(lambda self: self._updates[0].compiled)
    program = property(lambda self: self._updates[0].program)
    schedule = property(lambda self: self._updates[0].schedule)
    local_state = property(lambda self: self._updates[0].local_state)

    # ---- subclass hooks ----

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 params: list[torch.Tensor], **structure: bool) -> Program:
        """The update program of one parameter group (`params`, flattened and padded to `n` elements)."""
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
        except BaseException:
            self.param_groups.pop()
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (one memset of the flat buffer). `set_to_none` is ignored: the gradients
        stay views of the arena buffer so that backward accumulates into it."""
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
        skip, inv_scale = self._amp_scaling()
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
        for g, u in zip(self.param_groups, self._updates):
            scalars = {k: float(v) if isinstance(v, torch.Tensor) else v  # a Tensor lr: its value this step
                       for k, v in self._scalars(g, self.steps).items()}
            inputs: dict[str, Any] = {"g": u.flat.grad, "w": u.flat.flat, **u.local_state, **scalars}
            if self._clip_in_program:
                inputs["max_norm"] = float(self.max_grad_norm)
            out = u.compiled(**inputs) if u.compiled is not None else self._run_local(u, inputs)
            if "grad_norm" in out:
                self.last_grad_norm = out["grad_norm"]
        return loss

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

    def _amp_scaling(self) -> tuple[bool, float | None]:
        """Under torch.amp.GradScaler (`grad_scale` / `found_inf` set for this step): (skip the step, 1/scale to
        unscale the gradients by, or None when they are unscaled already). A rank's found_inf is its own gradients'
        (GradScaler checks before we average), so the ranks agree through one all-reduce (MAX) of one flag: every
        rank skips or steps together, where skipping alone would leave its peers waiting in the fused collective.
        Each rank's scaler then follows torch's rules on its own found_inf; ranks whose scales differ stay correct,
        as each unscales its own gradients before they are averaged."""
        found, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found is None and scale is None:
            return False, None
        flag = torch.zeros(1) if found is None else found.detach().float().reshape(1).cpu().clone()
        group = self._process_group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() > 0:
            return True, None
        return False, (None if scale is None else 1.0 / float(scale))

    @staticmethod
    def _run_local(u: _GroupUpdate, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        from cocosync.interp import interpret

        out = interpret(u.schedule.program, 1, inputs)[0]
        u.flat.flat.copy_(out["w"])
        for name, t in u.local_state.items():
            t.copy_(out[name])
        return out

    # ---- state: gathered in full, so it loads on any number of ranks ----

    def _gather(self, u: _GroupUpdate, local: torch.Tensor) -> torch.Tensor:
        if u.compiled is None or self.group_size == 1:
            return local.clone()
        if u.arena is not None:  # every slice is readable here: no collective
            return torch.cat([u.arena.peer_view(local, peer) for peer in range(self.group_size)])
        return u.compiled.comm.all_gather(local.contiguous(), 0)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format, with the FULL state of each parameter, gathered from the slices: on one node read
        from shared memory, so one rank may call it alone (nanoGPT's `if master_process: save`); across nodes a
        collective, which every rank must call. Every caller gets the same dict. Parameters are numbered across the
        groups in order, as torch.optim does; groups carry torch.optim's keys (`torch_group_keys`). The state-dict
        hooks registered as with torch.optim run before and after."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        out = self._state_dict()
        for post in self._optimizer_state_dict_post_hooks.values():
            returned = post(self, out)
            out = out if returned is None else returned
        return out

    def _state_dict(self) -> dict[str, Any]:
        keys = {**self.state_names, "master": "master"}
        state, groups, first = {}, [], 0
        for g, u in zip(self.param_groups, self._updates):
            full = {name: self._gather(u, t)[:u.flat.numel] for name, t in u.local_state.items()}
            k = len(g["params"])
            for i, pos in enumerate(u.trainable):  # frozen parameters have no state, as in torch.optim
                entry: dict[str, Any] = {"step": torch.tensor(float(self.steps))}
                for name, t in full.items():
                    entry[keys[name]] = u.flat.view(t, i).clone()
                state[first + pos] = entry
            groups.append({**self.torch_group_keys, **{key: v for key, v in g.items() if key != "params"},
                           "params": list(range(first, first + k))})
            first += k
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` (on any number of ranks), or by the matching torch.optim class:
        hyperparameters, step and this rank's slices of the state. Missing state (saved before the first step) loads
        as zeros. A saved setting this optimizer does not implement (amsgrad, maximize, ...) is refused, naming it.
        The load-state-dict hooks registered as with torch.optim run before and after."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre(self, state_dict)
            state_dict = state_dict if returned is None else returned
        self._load_state_dict(state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _check_torch_keys(self, gi: int, saved: dict[str, Any]) -> None:
        name = type(self).__name__
        group = self.param_groups[gi]
        mine = {**self.torch_group_keys, **{k: group[k] for k in ("decoupled_weight_decay",) if k in group}}
        for key, ours in mine.items():
            if key in self._IMPLEMENTATION_KEYS or key not in saved or saved[key] == ours:
                continue
            if key == "decoupled_weight_decay" and not saved.get("weight_decay"):
                continue  # without weight decay both forms are the same update
            raise ValueError(f"{name}.load_state_dict: saved group {gi} has {key}={saved[key]!r}; {name} "
                             f"implements {key}={ours!r} only, so loading it would silently change the update")

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        name = type(self).__name__
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or not isinstance(state, dict):
            raise ValueError(f"{name}.load_state_dict: expected {{'state': ..., 'param_groups': "
                             f"[{len(self.param_groups)} group(s)]}}, got param_groups={groups!r:.80}")
        # without weight decay both forms of it are the same update: keep this optimizer's (its compiled program)
        groups = [{**saved, "decoupled_weight_decay": mine["decoupled_weight_decay"]}
                  if "decoupled_weight_decay" in mine and "decoupled_weight_decay" in saved
                  and not saved.get("weight_decay") else saved for saved, mine in zip(groups, self.param_groups)]
        keys = {**self.state_names, "master": "master"}
        entry = lambda i: state.get(i, state.get(str(i), {}))  # noqa: E731 - JSON-like dicts have str keys
        for gi, (saved, u) in enumerate(zip(groups, self._updates)):
            ids = saved.get("params", [])
            if len(ids) != len(self.param_groups[gi]["params"]):
                raise ValueError(f"{name}.load_state_dict: saved group {gi} has {len(ids)} parameters, this "
                                 f"optimizer's {len(self.param_groups[gi]['params'])}")
            for i, pid in enumerate(ids[pos] for pos in u.trainable):
                for sname in u.local_state:
                    t = entry(pid).get(keys[sname])
                    if t is not None and tuple(t.shape) != tuple(u.flat.shapes[i]):
                        raise ValueError(f"{name}.load_state_dict: state {keys[sname]!r} of parameter {pid} has "
                                         f"shape {tuple(t.shape)}, the parameter {tuple(u.flat.shapes[i])}")
            self._check_torch_keys(gi, saved)
            structure = self._structure_of({**self.param_groups[gi], **saved})
            if structure != u.structure:
                raise ValueError(f"{name}.load_state_dict: saved hyperparameters {structure} of group {gi} select "
                                 f"another program than this optimizer's {u.structure}")
        for saved, u in zip(groups, self._updates):
            for sname, local in u.local_state.items():
                parts = []
                for i, pid in enumerate(saved["params"][pos] for pos in u.trainable):
                    t = entry(pid).get(keys[sname])
                    if t is None:
                        t = (u.flat.view(u.flat.flat, i) if sname == "master"
                             else torch.zeros(u.flat.shapes[i], dtype=local.dtype))
                    parts.append(t.reshape(-1).to(local.dtype))
                local.copy_(u.flat.pad(torch.cat(parts))[u.slice])
        steps = [float(e["step"]) for e in state.values() if isinstance(e, dict) and "step" in e]
        self.steps = int(steps[0]) if steps else 0
        for g, saved in zip(self.param_groups, groups):
            g.update({key: v for key, v in saved.items() if key != "params"})


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
