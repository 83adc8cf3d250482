"""Shared machinery of the data-parallel optimizers: one DSL program per optimizer, scheduled and compiled once.

A `DistributedOptimizer` flattens its parameters into arena buffers (`FlatParams`), builds its DSL program for the
padded flat length (examples/optimizers.py, examples/lamb.py, examples/mixed_precision.py), schedules it with the
standard sharded-update schedule (RS -> sliced update -> AG, the optimizer state sliced as ZeRO-1 does) and compiles
the plan with the gradients donated. Each ``step()`` calls the compiled plan once with the flat gradient buffer, the
flat parameter buffer, this rank's state slices and the step's scalars.

Without torch.distributed (a single process) the same scheduled program runs under the reference interpreter on
one rank: a plain local update, for debugging.

Restrictions (checked, with an error that says so): one parameter group; all parameters of one dtype, dense, on
CPU. Hyperparameters may change between steps through ``param_groups[0]`` (LR schedulers work); the structure of
the program (momentum on/off, weight decay on/off for SGD, clipping on/off, master dtype) is fixed at construction.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from cocosync.dsl.ir import Program
from cocosync.optim.flat import FlatParams
from cocosync.schedule.standard import sharded_update_schedule

__all__ = ["DistributedOptimizer"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class DistributedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses define `state_names` (program state -> torch.optim state key), `_program` and
    `_scalars`.

    Args (common to all subclasses):
        max_grad_norm: clip the averaged gradient to this global L2 norm (as torch.nn.utils.clip_grad_norm_ on the
            full gradient); None: no clipping.
        master_dtype: dtype of the master weights and of the optimizer state (float32 for bfloat16/float16
            parameters); None: the parameters' dtype.
        group: torch.distributed process group (default: the whole world).
    """

    state_names: dict[str, str] = {}
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
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__}: only one parameter group is supported (got "
                             f"{len(self.param_groups)}); hyperparameters are uniform over all parameters. Use one "
                             "optimizer per group")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm}: expected a positive number or None")
        params = self.param_groups[0]["params"]
        dtype = params[0].dtype
        if master_dtype is not None and master_dtype not in (dtype, torch.float32):
            raise ValueError(f"master_dtype={master_dtype}: expected None, float32 or the parameters' dtype {dtype}")
        self.max_grad_norm = max_grad_norm
        self.master_dtype = master_dtype or dtype
        self.mixed = self.master_dtype != dtype
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self._distributed else 1
        self._structure = self._structure_of(self.param_groups[0])
        n_pad = -(-sum(p.numel() for p in params) // self.world) * self.world
        # clipping is inside the update program: its norm splits the fused collective into two phases
        # (runtime/norm_step.py), still one reduction of the gradients
        self.program = self._program(n_pad, dtype, self.master_dtype if self.mixed else None,
                                     clip=max_grad_norm is not None, **self._structure)
        states = tuple(s for s in self._program_states() if s in self.program.updates)
        self.schedule = sharded_update_schedule(self.program, states)
        self.compiled: Callable | None = None
        alloc = param_alloc = None
        if self._distributed:
            from cocosync.lower.run_plan import compile_plan

            self.compiled = compile_plan(self.schedule.lower(), group, donate=("g",))
            shm = self.compiled.comm.shm
            if shm is not None:
                alloc = shm.arena.empty
                if self.node_shared_params and shm.nnodes == 1 and any(
                        s.startswith("fused_collective") for s in self.compiled.fast_steps):
                    # Replicated parameters stored once per node: each rank's fused step writes its slice of
                    # the update in place and no all-gather is needed within the node
                    param_alloc = shm.arena.shared_empty
            self.index, self.G = self.compiled.comm.index, self.compiled.comm.G
        else:
            self.index, self.G = 0, 1
        self.flat = FlatParams(params, self.world, alloc, param_alloc)
        if param_alloc is not None:
            shm.barrier()  # every local rank has copied its (identical) parameters in before anyone reads them
        n = self.flat.padded // self.G
        self._slice = slice(self.index * n, (self.index + 1) * n)
        self.local_state = {s: torch.zeros(n, dtype=self.master_dtype) for s in self.state_names}
        if self.mixed:
            self.local_state["master"] = self.flat.flat[self._slice].to(self.master_dtype)
        self.steps = 0

    # ---- subclass hooks ----

    def _program(self, n: int, dtype: torch.dtype, master_dtype: torch.dtype | None, *, clip: bool,
                 **structure: bool) -> Program:
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
        if not getattr(self, "_constructing", True):
            raise ValueError(f"{type(self).__name__}: only one parameter group is supported; add_param_group after "
                             "construction is not. Create another optimizer for these parameters")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (one memset of the flat buffer). `set_to_none` is ignored: the gradients
        stay views of the arena buffer so that backward accumulates into it."""
        self.flat.zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average the gradients over ranks and update the parameters (one call of the compiled plan).
        Collective: every rank calls it. Afterwards the gradient buffer's contents are undefined (donated)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        structure = self._structure_of(group)
        if structure != self._structure:
            raise ValueError(f"{type(self).__name__}: {structure} changed since construction ({self._structure}); "
                             "these select the program and are fixed: construct a new optimizer")
        self.flat.sync()
        self.steps += 1
        inputs: dict[str, Any] = {"g": self.flat.grad, "w": self.flat.flat, **self.local_state,
                                  **self._scalars(group, self.steps)}
        if self.max_grad_norm is not None:
            inputs["max_norm"] = float(self.max_grad_norm)
        if self.compiled is not None:
            self.compiled(**inputs)
        else:
            self._run_local(inputs)
        return loss

    def _run_local(self, inputs: dict[str, Any]) -> None:
        from cocosync.interp import interpret

        out = interpret(self.schedule.program, 1, inputs)[0]
        self.flat.flat.copy_(out["w"])
        for name, t in self.local_state.items():
            t.copy_(out[name])

    # ---- state: gathered in full, so it loads on any number of ranks ----

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.compiled is None or self.G == 1:
            return local.clone()
        return self.compiled.comm.all_gather(local.contiguous(), 0)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format, with the FULL state of each parameter (gathered from the slices: collective,
        every rank must call it; every rank returns the same dict)."""
        full = {name: self._gather(t)[:self.flat.numel] for name, t in self.local_state.items()}
        keys = {**self.state_names, "master": "master"}
        state = {}
        for i in range(len(self.flat.params)):
            entry: dict[str, Any] = {"step": torch.tensor(float(self.steps))}
            for name, t in full.items():
                entry[keys[name]] = self.flat.view(t, i).clone()
            state[i] = entry
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.flat.params)))
        return {"state": state, "param_groups": [group]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict` (on any number of ranks): hyperparameters, step and this rank's slices
        of the state. Missing state (saved before the first step) loads as zeros."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or len(groups) != 1 or not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected {{'state': ..., 'param_groups': [one "
                             f"group]}}, got param_groups={groups!r:.80}")
        k = len(self.flat.params)
        if len(groups[0].get("params", [])) != k:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the saved group has "
                             f"{len(groups[0].get('params', []))} parameters, this optimizer {k}")
        keys = {**self.state_names, "master": "master"}
        for i in range(k):
            for name in self.local_state:
                t = state.get(i, state.get(str(i), {})).get(keys[name])
                if t is not None and tuple(t.shape) != tuple(self.flat.shapes[i]):
                    raise ValueError(f"{type(self).__name__}.load_state_dict: state {keys[name]!r} of parameter {i} "
                                     f"has shape {tuple(t.shape)}, the parameter {tuple(self.flat.shapes[i])}")
        structure = self._structure_of({**self.param_groups[0], **groups[0]})
        if structure != self._structure:
            raise ValueError(f"{type(self).__name__}.load_state_dict: saved hyperparameters {structure} select another "
                             f"program than this optimizer's {self._structure}")
        for name, local in self.local_state.items():
            parts = []
            for i in range(k):
                t = state.get(i, state.get(str(i), {})).get(keys[name])
                if t is None:
                    t = (self.flat.view(self.flat.flat, i) if name == "master"
                         else torch.zeros(self.flat.shapes[i], dtype=local.dtype))
                parts.append(t.reshape(-1).to(local.dtype))
            local.copy_(self.flat.pad(torch.cat(parts))[self._slice])
        steps = [float(e["step"]) for e in state.values() if isinstance(e, dict) and "step" in e]
        self.steps = int(steps[0]) if steps else 0
        self.param_groups[0].update({key: v for key, v in groups[0].items() if key != "params"})
