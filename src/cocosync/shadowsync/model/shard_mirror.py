"""A copy of another machine's embedding shard, kept within a staleness bound (`--shard-mirror-interval`), so that
its rows can be restored a few seconds old if that machine is lost, where the last checkpoint's are minutes old.

Embedding server e of each of two machines runs a `ShardMirror` thread with server e of the other (a gloo group of
the two). Every `interval` seconds both send the rows of their own shard whose version (update count) changed since
they last sent them (the first round: every row; at most `max_rows` a round), as one all_gather of bytes, and write
the other's into this machine's mirror of its shard (shared memory, which every process here maps). `stamp` (in the
same shared memory) says when the mirror last took a round. A round carries a done flag (closing, and every changed
row sent): the thread stops once both sides are done, each mirror then equal to the shard it mirrors. A row a
trainer updates while it is copied is sent again in the next round (its version moved).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from cocosync.shadowsync.model.shard import Shard
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["ShardMirror", "MAX_ROWS"]

#: rows a round sends at most (a round's bytes stay bounded however large the shard: the first round sends all)
MAX_ROWS = 1 << 20


class ShardMirror:
    """This server's side of the mirroring with its peer on the other machine (see the module doc)."""

    def __init__(self, group: Any, mine: Shard, mirror: Shard, stamp: torch.Tensor, *, interval: float,
                 max_rows: int = MAX_ROWS):
        self.group, self.mine, self.mirror, self.stamp = group, mine, mirror, stamp
        self.interval, self.max_rows = float(interval), int(max_rows)
        self.dim = mine.weight.shape[1]
        self._sent = torch.full_like(mine.versions, -1)  # the versions last sent (-1: never)
        self.rounds, self.rows_sent, self.bytes_sent, self.cpu_s = 0, 0, 0, 0.0
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=in_role("shard-mirror", self._run), name="cocosync-shard-mirror",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop once the peer is done too (or the mirroring broke: `error`)."""
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                last = self._done.wait(self.interval)
                if self._round(done=last):
                    return
        except BaseException as e:  # noqa: BLE001 - read by the server at the end (a lost peer explains it)
            self.error = e

    @torch.no_grad()
    def _round(self, done: bool) -> bool:
        """One round; True once both sides said they are done."""
        cpu0 = time.thread_time()
        mine = self.mine
        changed = (mine.versions != self._sent).nonzero().view(-1)
        ids = changed[: self.max_rows]
        done = done and changed.numel() <= self.max_rows  # (done once the last changed rows go in this round)
        versions = mine.versions.index_select(0, ids)  # (before the rows: a row updated meanwhile is sent again)
        payload = torch.cat([torch.tensor([ids.numel(), int(done)], dtype=torch.int64).view(torch.uint8),
                             ids.view(torch.uint8), versions.view(torch.uint8),
                             mine.accumulator.index_select(0, ids).view(torch.uint8),
                             mine.weight.index_select(0, ids).contiguous().view(-1).view(torch.uint8)])
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([payload.numel()]), group=self.group)
        most = max(int(s) for s in sizes)
        got = [torch.empty(most, dtype=torch.uint8) for _ in range(2)]
        dist.all_gather(got, torch.cat([payload, payload.new_zeros(most - payload.numel())]), group=self.group)
        theirs = got[1 - dist.get_rank(self.group)]
        n, their_done = theirs[:16].view(torch.int64).tolist()
        at = 16
        their_ids = theirs[at:at + 8 * n].view(torch.int64)
        at += 8 * n
        their_versions = theirs[at:at + 8 * n].view(torch.int64)
        at += 8 * n
        their_acc = theirs[at:at + 4 * n].view(torch.float32)
        at += 4 * n
        their_rows = theirs[at:at + 4 * n * self.dim].view(torch.float32).view(n, self.dim)
        m = self.mirror
        m.weight.index_copy_(0, their_ids, their_rows)
        m.accumulator.index_copy_(0, their_ids, their_acc)
        m.versions.index_copy_(0, their_ids, their_versions)
        self.stamp.fill_(time.time())
        self._sent.index_copy_(0, ids, versions)
        self.rounds += 1
        self.rows_sent += ids.numel()
        self.bytes_sent += payload.numel()
        self.cpu_s += time.thread_time() - cpu0
        return done and bool(their_done)
