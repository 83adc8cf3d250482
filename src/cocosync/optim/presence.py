"""Which parameters got a gradient this step, agreed by all ranks: torch.optim skips a parameter whose ``.grad`` is
None (a branch used only on some steps, MoE experts, conditional heads), and DDP(find_unused_parameters=True)
leaves a parameter's gradient None only when no rank used it. Our gradients are views of one flat buffer, never
None, so presence is observed instead:

* a post-accumulate-grad hook on each parameter marks it when backward accumulates into it;
* a gradient the user assigned (``p.grad = t``) counts; ``p.grad`` set to None (``model.zero_grad()``) does not;
* a view nobody accumulated into counts when it is nonzero (a gradient written in place, ``p.grad.copy_(t)``).

The ranks agree once per step on [found_inf, one flag per parameter] (`Agreement`: one barrier on one node, ~14 us
at 2 ranks), the round trip GradScaler's flag needs anyway. A parameter no rank used keeps its weights and state
and its step count (torch's ``state[p]["step"]``) does not advance; the group then runs its masked program
(programs/mixed_precision.py, compiled on first need), which also takes the step-dependent inputs (bias
corrections, SGD's first-step dampening) per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cocosync.dsl.types import ReduceOp
from cocosync.optim.flat import FlatParams

__all__ = ["Agreement", "GradientPresence", "per_element"]


class GradientPresence:
    """Per parameter group: hook marks of this step, and each parameter's step count."""

    def __init__(self, groups: list[list[torch.Tensor]]):
        self.marks = [[False] * len(ps) for ps in groups]
        # numpy: a step's bookkeeping on a few flags costs ~1 us per operation, torch's ~3 us
        self.steps = [np.zeros(len(ps), dtype=np.int64) for ps in groups]
        self._handles = []
        for gi, ps in enumerate(groups):
            self._hook(gi, ps)

    def _hook(self, gi: int, params: list[torch.Tensor]) -> None:
        marks = self.marks[gi]  # the hooks hold the list, not the optimizer

        def mark(i: int):
            return lambda p: marks.__setitem__(i, True)
        self._handles += [p.register_post_accumulate_grad_hook(mark(i)) for i, p in enumerate(params)]

    def add_group(self, params: list[torch.Tensor]) -> None:
        self.marks.append([False] * len(params))
        self.steps.append(np.zeros(len(params), dtype=np.int64))
        self._hook(len(self.marks) - 1, params)

    def local(self, flats: list[FlatParams]) -> list[bool]:
        """This rank's flags (1.0 = has a gradient), all groups in order; call before FlatParams.sync."""
        out: list[bool] = []
        for marks, flat in zip(self.marks, flats):
            for i, (p, gv) in enumerate(zip(flat.params, flat._gviews)):
                if marks[i]:
                    out.append(True)
                elif p.grad is None:
                    out.append(False)
                elif not FlatParams._same(p.grad, gv):
                    out.append(True)
                else:
                    out.append(_nonzero(gv))
        return out

    def reset(self) -> None:
        for marks in self.marks:
            marks[:] = [False] * len(marks)

    def split(self, used: np.ndarray) -> list[np.ndarray]:
        """The agreed flags per group (bool)."""
        return np.split(used > 0, np.cumsum([len(m) for m in self.marks])[:-1])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _nonzero(view: torch.Tensor, prefix: int = 64) -> bool:
    """Whether a gradient view holds a nonzero: its first elements first (a real gradient almost always has one
    there), so only a zero one pays a full pass (per-parameter `any()` over 16.8M elements took 17 ms a step)."""
    flat = view.reshape(-1)
    return bool(flat[:prefix].any()) or bool(flat[prefix:].any())


class Agreement:
    """The elementwise maximum over ranks of a small float vector of fixed length, once per step.

    On one node through a table in shared memory: each rank writes its row, one barrier, each reads every row
    (about 2 us at 2 ranks, against 45 us for the communicator's general all_reduce of a few floats). Two tables
    alternate, so a rank that runs ahead to the next call cannot overwrite a row a slower peer still reads (it
    would first need that peer at the barrier of the call in between). Otherwise (several nodes, a group the node's
    communicator does not span): the compiled plan's communicator (`comm`, a StageComm; None: one process)."""

    def __init__(self, comm: Any, length: int):
        self.comm, self.length, self.calls = comm, length, 0
        shm = comm.shm if comm is not None else None
        self.shm = shm if shm is not None and shm.nnodes == 1 and shm.world == comm.group_size else None
        if self.shm is not None:  # collective: every rank constructs its optimizer
            self._memory = self.shm.arena.shared_empty((2, self.shm.local_size, length), torch.float32)
            self.table = self._memory.numpy()

    def __call__(self, flags: list[float]) -> np.ndarray:
        if self.comm is None or self.comm.group_size == 1:
            return np.asarray(flags, dtype=np.float32)
        if self.shm is None:
            return self.comm.all_reduce(torch.tensor(flags, dtype=torch.float32), ReduceOp.MAX).numpy()
        table = self.table[self.calls % 2]
        self.calls += 1
        table[self.shm.local_rank] = flags
        self.shm.barrier()
        return table.max(0)


def per_element(flat: FlatParams, values: np.ndarray, pad: float, part: slice | None,
                dtype: torch.dtype) -> torch.Tensor:
    """One value per parameter spread over its elements of the flat buffer, `pad` in the padding; `part`: this
    rank's slice of it."""
    full = torch.full((flat.padded,), pad, dtype=dtype)
    full[:flat.numel] = torch.repeat_interleave(torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype),
                                                torch.tensor(flat.numels))
    return full if part is None else full[part].clone()
