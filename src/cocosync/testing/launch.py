"""Start P local ranks (real processes, gloo at 127.0.0.1) and run functions on all of them.

`RankPool` keeps the ranks alive between calls, so tests and benchmarks pay the process-group rendezvous once (and
no torch import: ranks fork from the warm server, runtime/warm_start.py); `spawn` is the one-shot form. Every call
has a deadline: a rank that hangs or dies makes the call raise (naming the ranks) and the pool is torn down, never a
stalled run.

The environment each rank sees is the one torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), so code under test is launched
exactly as in production. `nnodes > 1` simulates several nodes on this machine (GROUP_RANK differs).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
import uuid
from typing import Any, Callable, Sequence

from cocosync.runtime.comm.store import LoopbackStore
from cocosync.runtime.warm_start import adopt_environment, context, die_with, main_not_rerun

__all__ = ["RankPool", "RankFailure", "spawn", "free_port"]


class RankFailure(RuntimeError):
    """A function raised on some rank, or ranks did not answer before the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, env: dict, owner: int, threads: int, init_timeout: float, tasks, results) -> None:
    die_with(owner)  # the pool's process: the warm fork server, this rank's parent, may outlive it
    adopt_environment(env)  # (the warm fork server's own environment may be an earlier pool's)
    os.environ["RANK"] = str(rank)
    local = int(env["LOCAL_WORLD_SIZE"])
    os.environ["LOCAL_RANK"] = str(rank % local)
    os.environ["GROUP_RANK"] = os.environ["NODE_RANK"] = str(rank // local)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=init_timeout))
    except BaseException:
        results.put((rank, False, pickle.dumps(traceback.format_exc())))
        return
    results.put((rank, True, pickle.dumps("ready")))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = pickle.loads(task)
            try:
                out = (True, pickle.dumps(fn(*args, **kwargs)))
            except BaseException:
                out = (False, pickle.dumps(f"rank {rank}:\n{traceback.format_exc()}"))
            results.put((rank, *out))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class RankPool:
    """`world_size` live ranks on gloo; `pool.run(fn, *args)` runs `fn` on every rank, returns the list of results.

    fn must be importable by name (a module-level function of a module other than __main__: the ranks do not run
    the main module again).
    """

    def __init__(self, world_size: int, *, nnodes: int = 1, threads: int = 1, timeout: float = 120.0,
                 env: dict[str, str] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if nnodes < 1 or world_size % nnodes:
            raise ValueError(f"nnodes={nnodes} must divide world_size={world_size}")
        self.world_size, self.nnodes, self.timeout = world_size, nnodes, timeout
        ctx = context()  # ranks fork from the warm server: no import of torch per rank (runtime/warm_start.py)
        # the rendezvous store is ours, on loopback only (TCPStore's own server would listen on every interface);
        # every rank connects to it as a client, as under torchrun, and gloo stays on the loopback interface
        self._store = LoopbackStore(timeout=max(timeout, 60.0))
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self._store.port), "WORLD_SIZE": str(world_size),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "LOCAL_WORLD_SIZE": str(world_size // nnodes), "NNODES": str(nnodes),
            "TORCHELASTIC_RUN_ID": f"pool-{uuid.uuid4().hex[:10]}",
            "OMP_NUM_THREADS": str(threads), **(env or {}),
        }
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_rank_main, daemon=True, name=f"cocosync-rank{r}",
                        args=(r, rank_env, os.getpid(), threads, timeout, self._tasks[r], self._results))
            for r in range(world_size)
        ]
        with main_not_rerun():
            for p in self._procs:
                p.start()
        self.closed = False
        try:
            self._collect("start-up", timeout)
        except BaseException:
            self.close(force=True)
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; results in rank order. Raises RankFailure on error/timeout."""
        return self.run_per_rank(fn, [args] * self.world_size, timeout=timeout, **kwargs)

    def run_per_rank(self, fn: Callable, args_per_rank: Sequence[tuple], *, timeout: float | None = None,
                     **kwargs: Any) -> list[Any]:
        if self.closed:
            raise RankFailure("this RankPool is closed (an earlier call failed or close() was called)")
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"args_per_rank has {len(args_per_rank)} entries, expected world_size={self.world_size}")
        for r, q in enumerate(self._tasks):
            q.put(pickle.dumps((fn, tuple(args_per_rank[r]), kwargs)))
        try:
            return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout or self.timeout)
        except BaseException:
            self.close(force=True)
            raise

    def _collect(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        errors: list[str] = []
        while len(out) + len(errors) < self.world_size:
            # after a first error the others get a short grace period: they may be blocked on the failed rank
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead and not errors:
                    errors.append(f"rank(s) {dead} exited (exit codes "
                                  f"{[self._procs[r].exitcode for r in dead]}) during {what}")
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            if ok:
                out[rank] = pickle.loads(payload)
            else:
                errors.append(pickle.loads(payload))
                deadline = min(deadline, time.monotonic() + 5.0)
        if errors:
            raise RankFailure(f"{what} failed:\n" + "\n".join(errors))
        if len(out) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(out))
            raise RankFailure(f"{what}: rank(s) {missing} did not finish within {timeout:.0f}s")
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [self._results, *self._tasks]:
            q.close()
            q.cancel_join_thread()
        self._store.close()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(force=exc[0] is not None)


def spawn(fn: Callable, world_size: int, *args: Any, nnodes: int = 1, threads: int = 1,
          timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Start `world_size` ranks, run fn(*args, **kwargs) on each, shut them down; results in rank order."""
    with RankPool(world_size, nnodes=nnodes, threads=threads, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)
