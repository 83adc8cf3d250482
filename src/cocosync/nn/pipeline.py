"""PipelineSend: the boundary between pipeline stages, CoCoNeT's pipeline optimization as one compiled DSL plan.

The world is `stages` consecutive groups of G ranks (stage k: ranks k*G ... k*G + G - 1). The last tensor-parallel
layer of a stage leaves Local partial sums y on each of its ranks; the boundary computes

    recv (on stage k+1) = dropout(all_reduce(y over stage k) + b, p)

The program (`pipeline_send_program`) is the paper's pipeline program (examples.model_parallel.pipeline_program)
with dropout written as a multiply by a keep-mask input, as in nn.mlp: call i uses the mask of DSL
`dropout(p, seed + i)` (one mask for the whole activation, the same on every rank). The paper's schedule
(`schedule.standard.pipeline_schedule`) splits the all_reduce, applies bias + dropout on each rank's slice, sends
only that slice (1/G of the bytes cross the stage boundary per rank) and all-gathers on the receiving stage,
overlapped by column chunks.

Every rank of every stage calls it (it is a collective over the world): each stage sends to the next and receives
from the previous, so stage 0 gets zeros and the last stage's send goes nowhere (it may pass zeros for y).

Backward (hand-written, torch.distributed point-to-point + the plan's communicator): the mirror image. Each rank of
stage k+1 sends its slice of dRecv (dRecv is the same on every rank of a stage, as for any Replicated activation)
back to the rank with its index in stage k, which all-gathers the slices within its stage: dZ; then
dy = dZ * mask on every rank (the all_reduce's backward is the identity) and db = sum(dZ * mask). On the first stage
call backward with any gradient (e.g. zeros) for the output: it takes part in the point-to-point exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cocosync.dsl import Local, Program, Replicated, Tensor, all_reduce, send
from cocosync.nn.parallel import PlanCache, check_chunks, check_dropout, group_info, scaled_keep_mask

__all__ = ["PipelineSend", "pipeline_send_program"]


def pipeline_send_program(rows: int, hidden: int, stages: int, dtype: torch.dtype = torch.float32, *,
                          dropout: bool = True) -> Program:
    """recv = send((all_reduce(y, groups=stages) + b) [* mask], groups=stages)."""
    y = Tensor("y", (rows, hidden), dtype, Local)
    b = Tensor("b", (hidden,), dtype, Replicated)
    inputs = [y, b]
    z = all_reduce(y, groups=stages) + b
    if dropout:
        mask = Tensor("mask", (rows, hidden), dtype, Replicated)
        inputs.append(mask)
        z = z * mask
    return Program("pipeline_send", inputs, {"recv": send(z, groups=stages)})


def _schedule(program: Program, chunks: int, rows: int, gsize: int):
    from cocosync.schedule import Schedule
    from cocosync.schedule.standard import pipeline_schedule

    if rows % gsize:
        return Schedule(program)  # rows not divisible by the stage size: whole all_reduce, full send
    return pipeline_schedule(program, chunks=chunks)


class _SendFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, b, mask, plan):
        inputs = {"y": y.detach(), "b": b.detach()}
        if mask is not None:
            inputs["mask"] = mask
        recv = plan(**inputs)["recv"]
        ctx.save_for_backward(mask)
        ctx.plan = plan
        return recv

    @staticmethod
    def backward(ctx, drecv):
        (mask,) = ctx.saved_tensors
        comm = ctx.plan.comm
        drecv = drecv.contiguous()
        rows, G = drecv.shape[0], comm.group_size
        pos = comm.group_index * G + comm.group_rank
        even = rows % G == 0
        mine = drecv.chunk(G, 0)[comm.group_rank].contiguous() if even else drecv
        got = torch.zeros_like(mine)
        reqs = []
        if pos - G >= 0:  # back to the previous stage
            reqs.append(dist.isend(mine, comm.global_ranks[pos - G]))
        if pos + G < comm.world:  # from the next stage
            reqs.append(dist.irecv(got, comm.global_ranks[pos + G]))
        for r in reqs:
            r.wait()
        dz = comm.all_gather(got, 0) if even and G > 1 else got
        if mask is not None:
            dz = dz * mask
        return dz, dz.sum(0), None, None


class PipelineSend(nn.Module):
    """Send an activation from each pipeline stage to the next: recv = dropout(all_reduce(y over my stage) + bias).

    y: (..., hidden) partial sums of this rank (e.g. x @ W_rows of a row-parallel layer whose all_reduce is left to
    this module). Returns (..., hidden): on stage k+1, what stage k computed (the same on every rank of the stage);
    on stage 0, zeros. `stages` groups of world / stages consecutive ranks. bias: (hidden,) parameter, replicated
    within a stage. Dropout: a new mask per training call (seed + call index), none in eval mode or with p=0.
    backend: 'auto' (default: a stage whose ranks share a node reduces and gathers in shared memory; the send
    between stages is torch.distributed), 'shm' or 'torch' (see cocosync.compile). chunks: overlap chunks (None,
    the default: 1 for CPU inputs, 2 on GPUs, see nn.parallel.resolve_chunks)."""

    def __init__(self, hidden: int, *, stages: int = 2, p: float = 0.1, seed: int = 0, chunks: int | None = None,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 backend: str | None = None):
        super().__init__()
        _, world = group_info(group, "PipelineSend")
        if stages < 2 or world % stages:
            raise ValueError(f"PipelineSend: stages={stages} must be >= 2 and divide the world size {world}")
        check_dropout("PipelineSend", p, seed)
        check_chunks("PipelineSend", chunks)
        self.hidden, self.stages, self.p, self.seed, self.chunks = hidden, stages, p, seed, chunks
        self.gsize = world // stages
        self.calls = 0
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype))
        self._plans = PlanCache(lambda key, c: _schedule(pipeline_send_program(key[0], hidden, stages, key[1],
                                                                               dropout=key[2]), c, key[0],
                                                         self.gsize), group, chunks=chunks, backend=backend)

    def mask(self, shape: tuple[int, ...], call: int, dtype: torch.dtype) -> torch.Tensor:
        """The scaled keep-mask of training call `call`: DSL dropout(p, seed + call)'s mask / (1 - p)."""
        return scaled_keep_mask(shape, self.p, self.seed + call, dtype)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"PipelineSend: input must be a tensor, got {type(y).__name__}")
        if y.ndim < 1 or y.shape[-1] != self.hidden:
            raise ValueError(f"PipelineSend: input of shape {tuple(y.shape)} must end with hidden={self.hidden}")
        if y.dtype != self.bias.dtype:
            raise ValueError(f"PipelineSend: input dtype {y.dtype} differs from the bias's {self.bias.dtype}")
        y2 = y.reshape(-1, self.hidden)
        dropout = self.training and self.p > 0
        plan = self._plans.get((y2.shape[0], y.dtype, dropout), y2.device)
        mask = None
        if dropout:
            if "mask" not in plan.unused_inputs:  # the last stage sends nothing: no mask to draw
                mask = self.mask(tuple(y2.shape), self.calls, y.dtype)
            self.calls += 1
        return _SendFn.apply(y2, self.bias, mask, plan).reshape(y.shape)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, stages={self.stages} x {self.gsize} ranks, p={self.p}, chunks={self.chunks}"
