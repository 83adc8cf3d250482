"""The strongest CPU peers of the shared-memory all_reduce, as baselines where they install (`pip install
cocosync[bench]`): DeepSpeed's shared-memory all_reduce (`deepspeed.comm.inference_all_reduce`, its C++ shm op
built at first use; it reads LOCAL_SIZE from the environment) and MPI through mpi4py when an MPI library is present.
Each returns None, with the reason, where it is missing."""

from __future__ import annotations

import os
from typing import Callable

import torch

__all__ = ["deepspeed_all_reduce", "deepspeed_cleanup", "mpi_all_reduce"]


def deepspeed_all_reduce() -> tuple[Callable[[torch.Tensor], object] | None, str]:
    """(x -> DeepSpeed's in-place all_reduce of x, "") or (None, why not). Collective: every rank calls it."""
    try:
        import deepspeed
        from deepspeed.comm import comm as dsc
    except Exception as e:  # noqa: BLE001 - not installed, or it fails to import here
        return None, f"deepspeed not importable ({type(e).__name__})"
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if dsc.cdb is None or getattr(dsc.cdb, "shm_comm_op", None) is None:
        return None, "deepspeed's shm op did not build"
    return (lambda x: dsc.inference_all_reduce(x)), ""


def deepspeed_cleanup() -> list[str]:
    """Remove the /dev/shm buffers DeepSpeed's shm op leaves behind for this job (named after MASTER_ADDR and
    MASTER_PORT; ~70 MB each, 1.1 GB after a few runs here). Call on every rank after the last use."""
    tag = f"_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_"
    removed = []
    shm = "/dev/shm"
    for name in os.listdir(shm) if os.path.isdir(shm) else ():
        if name.startswith("deepspeed_allreduce_buffer_") and tag in name:
            try:
                os.unlink(os.path.join(shm, name))
                removed.append(name)
            except FileNotFoundError:  # another rank removed it first
                pass
    return removed


def mpi_all_reduce() -> tuple[Callable[[torch.Tensor], object] | None, str]:
    """(x -> MPI_Allreduce of x in place, "") or (None, why not): mpi4py needs an MPI launcher (mpirun), so under
    torchrun it is reported as missing."""
    try:
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001
        return None, f"mpi4py not importable ({type(e).__name__})"
    if MPI.COMM_WORLD.Get_size() < 2:
        return None, "not launched by mpirun (MPI world of 1)"
    comm = MPI.COMM_WORLD
    return (lambda x: comm.Allreduce(MPI.IN_PLACE, x.numpy())), ""
