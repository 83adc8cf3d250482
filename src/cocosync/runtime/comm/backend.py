"""`cocosync` as a torch.distributed backend: `import cocosync; dist.init_process_group("cocosync")` (or
"cpu:cocosync,cuda:nccl"), so DDP, ZeroRedundancyOptimizer and any program using torch.distributed collectives run
their CPU collectives through the node's shared memory instead of gloo over loopback TCP.

A Python ProcessGroup (as PyTorch's test/distributed/test_c10d_pypg.py builds them): every operation the shared-memory
communicator implements runs there when it applies (CPU tensors of float32/bfloat16/float16; sum, avg, min, max; the
whole group on one node); everything else goes to an internal gloo group built on the same store, so every operation
of torch.distributed works, through its Python API and through the dispatcher (functional collectives, FSDP2,
DTensor). Results equal gloo's (tests/runtime/comm/test_backend.py runs DDP and FSDP2 on both).

Shared memory serves a group whose members all live on this node (the torchrun environment tells each rank's
node): the default group of a one-node job, or any `new_group` of ranks on one node. The whole job across nodes runs
hierarchically: shared memory within each node, and an internal gloo group per local rank between the nodes. Other
groups spanning nodes use the internal gloo group for everything.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import torch
import torch.distributed as dist

from cocosync.runtime.comm import gloo_device
from cocosync.runtime.comm.collectives import ShmCommunicator
from cocosync.runtime.comm.reduction import SUPPORTED_DTYPES
from cocosync.runtime.comm.topology import NodeGroups, Topology, machine_id, topology_from_env

__all__ = ["CocosyncProcessGroup", "register", "BACKEND"]

BACKEND = "cocosync"
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}


class _Done(dist._Work):
    """A Work that completed during the call (the shared-memory collectives are synchronous)."""

    def __init__(self, result: Any):
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _all_done(works: list[dist._Work], result: Any) -> dist._Work:
    """One Work for several: the gloo ones are waited for here (the shared-memory ones are done already)."""
    for w in works:
        if not isinstance(w, _Done):
            w.wait()  # releases the GIL
    return _Done(result)


def _op_of(opts: Any) -> str | None:
    op = getattr(opts, "reduceOp", opts)
    for k, v in _OPS.items():
        if op == k:
            return v
    return None


class CocosyncProcessGroup(dist.ProcessGroup):
    """The `cocosync` backend's process group: shared memory where it applies, gloo (internal) otherwise."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._gloo = gloo_device.gloo_backend(dist.PrefixStore("cocosync/gloo", store), rank, size, timeout)
        # the C++ side of the group: torch keeps the group's name on its backend. The dispatcher-based APIs
        # (functional collectives, hence FSDP2 and DTensor) call the group's methods, which land in this class
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._store = dist.PrefixStore("cocosync/shm", store)
        self._timeout = timeout
        self._shm: ShmCommunicator | None = None
        self._shm_ready = False
        self._members, self._spans_nodes = _members(self._store, rank, size)

    def getBackendName(self) -> str:  # noqa: N802 - the c10d interface
        return BACKEND

    def _comm(self) -> ShmCommunicator | None:
        """The shared-memory communicator, created on first use (collective over the group: every rank makes
        the same decision, as every rank calls the same collectives with the same dtypes)."""
        if not self._shm_ready:
            self._shm_ready = True
            if self._members is not None and self.size() > 1:
                if self.rank() == 0:
                    self._store.set("job", uuid.uuid4().hex[:12])
                job = self._store.get("job").decode()
                n, r = self.size(), self.rank()
                if self._spans_nodes:  # the whole job: shared memory within each node, gloo between them
                    topo = topology_from_env()
                    inter = _gloo_group(self._store, f"inter{topo.local_rank}", topo.node, topo.nnodes,
                                        self._timeout)
                    groups = NodeGroups(topo=topo, job_id=f"pg-{job}", inter=inter)
                else:
                    topo = Topology(rank=r, world_size=n, local_rank=r, local_world_size=n, node=0)
                    groups = NodeGroups(topo=topo, job_id=f"pg-{job}", members=self._members)
                self._shm = ShmCommunicator(groups, timeout=self._timeout.total_seconds())
        return self._shm

    def _shm_for(self, tensors: list[torch.Tensor]) -> ShmCommunicator | None:
        if not tensors or any(t.device.type != "cpu" or t.dtype not in SUPPORTED_DTYPES for t in tensors):
            return None
        return self._comm()

    # ---------------------------------------------------------------- through shared memory where it applies
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        op = _op_of(opts) if opts is not None else "sum"
        comm = self._shm_for(tensors) if op is not None else None
        if comm is None:
            return self._gloo.allreduce(tensors, opts if opts is not None else dist.AllreduceOptions())
        for t in tensors:
            comm.all_reduce(t, op)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        op = _op_of(opts) if opts is not None else "sum"
        comm = self._shm_for(tensors) if op is not None else None
        if comm is None:
            return self._gloo.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())
        for t in tensors:
            comm.all_reduce(t, op)
        return _Done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        op = _op_of(opts) if opts is not None else "sum"
        comm = self._shm_for(tensors) if op is not None else None
        if comm is None:
            return self._gloo.reduce(tensors, opts or dist.ReduceOptions())
        for t in tensors:  # the communicator numbers its ranks as this group does
            comm.reduce(t, op, opts.rootRank)
        return _Done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist._Work:
        comm = self._shm_for(tensors)
        if comm is None:
            return self._gloo.broadcast(tensors, opts)
        for t in tensors:
            comm.broadcast(t, opts.rootRank)
        return _Done(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist._Work:
        comm = self._shm_for(inputs)
        if comm is None or any(len(o) != self.size() for o in output_lists):
            return self._gloo.allgather(output_lists, inputs, opts or dist.AllgatherOptions())
        for outs, t in zip(output_lists, inputs):
            whole = comm.all_gather(t.reshape(1, -1).contiguous())
            for r, o in enumerate(outs):
                o.copy_(whole[r].view(o.shape))
        return _Done(output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist._Work:  # noqa: A002
        comm = self._shm_for([input, output])
        if comm is None:
            return self._gloo._allgather_base(output, input, opts or dist.AllgatherOptions())
        comm.all_gather(input.reshape(1, -1).contiguous(), out=output.view(self.size(), -1))
        return _Done(output)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                             opts: Any = None) -> dist._Work:
        op = _op_of(opts) if opts is not None else "sum"
        comm = self._shm_for([input, output]) if op is not None else None
        if comm is None or not input.is_contiguous():
            return self._gloo._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        comm.reduce_scatter(input.view(self.size(), -1), op, out=output.view(1, -1))
        return _Done(output)

    # torch >= 2.12 names the tensor forms all_gather_single / reduce_scatter_single
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base

    # The coalesced tensor forms are what functional collectives (hence FSDP2 and DTensor) and _coalescing_manager
    # call. They must be defined here: torch's trampoline calls the base class (the registered gloo backend) while
    # it holds the GIL when Python defines no override, and gloo's worker thread frees a finished work's tensors
    # while it holds the queue's lock, which takes the GIL when such a tensor's Python object died first: a
    # deadlock (seen as FSDP2/DTensor hanging in ProcessGroupGloo::enqueue). From here gloo is entered through its
    # Python bindings, which release the GIL.
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist._Work:
        return _all_done([self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist._Work:
        return _all_done([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the names before torch 2.12
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def start_coalescing(self, device: torch.device) -> None:
        """Nothing to gather: this group runs every operation when it is called."""

    def end_coalescing(self, device: torch.device) -> dist._Work:
        return _Done(None)

    def barrier(self, opts: Any = None) -> dist._Work:
        comm = self._comm()
        if comm is None:
            return self._gloo.barrier(opts or dist.BarrierOptions())
        comm.barrier()
        return _Done(None)

    # ---------------------------------------------------------------- through the internal gloo group
    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._gloo.reduce_scatter(outputs, input_lists, opts or dist.ReduceScatterOptions())

    def gather(self, output_lists, inputs, opts=None):
        return self._gloo.gather(output_lists, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs, input_lists, opts=None):
        return self._gloo.scatter(outputs, input_lists, opts or dist.ScatterOptions())

    def alltoall(self, outputs, inputs, opts=None):
        return self._gloo.alltoall(outputs, inputs, opts or dist.AllToAllOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                        opts or dist.AllToAllOptions())

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._gloo.allgather_coalesced(output_lists, inputs, opts or dist.AllgatherOptions())

    def send(self, tensors, dst, tag=0):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._gloo.recv_anysource(tensors, tag)


def _members(store: dist.Store, rank: int, size: int) -> tuple[list[int] | None, bool]:
    """(the group's members as global ranks in group order, whether they span nodes), with members None when the
    group cannot use shared memory: it spans machines without being the whole job as torchrun described it (a
    hierarchical collective needs every node's full set of local ranks). Decided from what every rank publishes in
    the group's store (global rank, machine_id(), whether torchrun's environment describes it), so every rank
    decides alike, also where the environment says nothing or describes another job (mp.spawn, torch's own test
    harness: RANK unset in every process). A group made by new_group learns its members' global ranks this way."""
    env = topology_from_env()
    world = dist.get_world_size() if dist.is_initialized() else size
    me = dist.get_rank() if dist.is_initialized() else rank  # building the default group: its rank is global
    described = int(env.world_size == world and env.rank == me)
    store.set(f"member{rank}", f"{me} {described} {machine_id()}")
    info = [store.get(f"member{i}").decode().split(" ", 2) for i in range(size)]
    members = [int(g) for g, _, _ in info]
    if all(d == "1" for _, d, _ in info):  # torchrun's nodes (several may share a host when simulated)
        if {m // env.local_world_size for m in members} == {env.node}:
            return members, False
        return (members, True) if members == list(range(env.world_size)) else (None, False)
    if len({m for _, _, m in info}) == 1:
        return members, False  # one machine: shared memory among all of them
    return None, False


def _gloo_group(store: dist.Store, name: str, rank: int, size: int,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo process group on a prefix of `store` (collective over its members), usable with torch.distributed's
    functions (group_src / group_dst for roots: it is not registered in the world's group table)."""
    gloo = gloo_device.gloo_backend(dist.PrefixStore(f"cocosync/{name}", store), rank, size, timeout)
    pg = dist.ProcessGroup(rank, size)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> CocosyncProcessGroup:
    return CocosyncProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make `init_process_group("cocosync")` and `"gloo-shared"` available (done when cocosync is imported;
    idempotent)."""
    gloo_device.register()
    if BACKEND.upper() not in dist.Backend.backend_list and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
