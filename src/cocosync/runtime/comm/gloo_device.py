"""Gloo with one transport device per process: `init_process_group("gloo-shared")`, and every `new_group` after it.

torch.distributed gives every gloo group a transport device of its own, and every device runs an I/O thread
(`gloo_tcp_loop`) that wakes every 10 ms even when idle. A ShadowSync trainer on several nodes uses 8-9 groups
(the world, the trainers, the lookup exchange, the hot rows' sync, the dense sync's levels...), since every thread that
issues collectives needs groups of its own: 8-9 I/O threads per process, ~900 wake-ups a second doing nothing. On a
VM a wake-up costs tens of microseconds: ~1.3 ms of CPU a second per idle device here, ~1% of a core per trainer,
and on an oversubscribed machine those threads delay the ones that sync (BENCHMARKS.md). Gloo's device is built to
carry many contexts (every pair has its own connection, the device's one epoll loop serves them all), so this
backend builds every group on the process's one device. Collectives, their order and their results are gloo's;
a group's operations still run on its own worker threads.

`COCOSYNC_GLOO_DEVICE=per-group` makes the backend build a device per group again (torch's default), to compare.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch.distributed as dist

__all__ = ["BACKEND", "register", "process_devices", "gloo_backend", "shared"]

BACKEND = "gloo-shared"
_ENV = "COCOSYNC_GLOO_DEVICE"
_lock = threading.Lock()
_devices: list | None = None


def shared() -> bool:
    """Whether groups share the process's device (`COCOSYNC_GLOO_DEVICE`: `shared`, the default, or `per-group`)."""
    mode = os.environ.get(_ENV, "shared")
    if mode not in ("shared", "per-group"):
        raise ValueError(f"{_ENV}={mode!r}: expected 'shared' (one gloo device per process) or 'per-group'")
    return mode == "shared"


def process_devices() -> list:
    """The process's gloo devices, made on first use as torch makes a group's: one per interface GLOO_SOCKET_IFNAME
    names (comma-separated), else one on the host name's address."""
    global _devices
    with _lock:
        if _devices is None:
            names = os.environ.get("GLOO_SOCKET_IFNAME", "")
            if len(names) > 1:  # torch's own test of the variable
                _devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in names.split(",")]
            else:
                _devices = [dist.ProcessGroupGloo.create_default_device()]
        return _devices


def gloo_backend(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo backend on `store` (collective over its members), on the process's device unless `shared()` is off."""
    if not shared():
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = process_devices()
    return dist.ProcessGroupGloo(store, rank, size, opts)


def register() -> None:
    """Make `init_process_group("gloo-shared")` and `new_group(backend="gloo-shared")` available (idempotent)."""
    if BACKEND.upper() not in dist.Backend.backend_list and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, gloo_backend, devices=["cpu"])
