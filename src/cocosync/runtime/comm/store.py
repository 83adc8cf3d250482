"""A torch.distributed TCPStore that listens on the loopback address only.

TCPStore's server binds every interface whatever host name it is given, and it is unauthenticated: a job on one
machine would accept connections from anywhere that can reach the machine. Here the socket is bound on 127.0.0.1
first and handed to the store (`master_listen_fd`). Local jobs (the ShadowSync launcher, RankPool) use it; jobs
across machines let torchrun own the store, bound where the user names.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["LoopbackStore", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


class LoopbackStore:
    """The server side of a TCPStore on 127.0.0.1:`port` (a free port). Clients connect with
    `dist.TCPStore("127.0.0.1", port, is_master=False)`, or through `init_process_group`'s env:// rendezvous with
    TORCHELASTIC_USE_AGENT_STORE=True (every rank a client, as under torchrun). Keep it alive while they use it."""

    def __init__(self, timeout: float = 120.0):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((LOOPBACK, 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        try:
            self.store = dist.TCPStore(LOOPBACK, self.port, None, True, timeout=datetime.timedelta(seconds=timeout),
                                       wait_for_workers=False, master_listen_fd=self._sock.fileno())
        except BaseException:
            self._sock.close()
            raise
        self._sock.detach()  # the store owns the listening socket now and closes it when it is dropped

    def close(self) -> None:
        """Stop serving: the store (and its listening socket) is dropped."""
        self.store = None  # type: ignore[assignment]

    def __enter__(self) -> "LoopbackStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
