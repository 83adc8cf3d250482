"""The hottest embedding rows replicated on every node and synchronized in the background (multi-node jobs).

Row-hash sharding puts (N-1)/N of a batch's rows on other nodes, and each costs a lookup and a gradient push through
the lookup exchange (exchange.py) on both sides. Ids follow a power law: on the default synthetic data the hottest 2%
of rows serve 90% of a batch's distinct lookups (BENCHMARKS.md). Those rows are replicated instead: every node holds
them in its shared memory as one more shard (`HotRows`), read and updated in place by its trainers (Hogwild,
row-wise Adagrad, exactly as a local shard), and one thread per node (`HotSync`, on the node's first trainer)
all-reduces over the nodes, every interval, what each node changed since the last sync: the rows' deltas, their
Adagrad accumulators' and their update counts. Each node adds the others' changes, so every replica is the consensus
plus its own updates since (ShadowSync's shadow thread, on the sparse side: the sync never blocks a worker).
Replicating hot embeddings and synchronizing them by all-reduce is FAE's scheme (Adnan et al., VLDB 2022); HET
(Miao et al., VLDB 2022) caches them with bounded staleness.

The hot set is chosen before training from the first rows of the training data, the same on every rank (trainer 0
broadcasts it): the rows seen most often. While training, the owner's shard keeps its copy of a hot row untouched;
`settle` (every node, workers paused: checkpoints, the end) makes every replica the consensus and `write_back`
puts it into the owners' shards, so checkpoints hold the rows as one row-hash table, whatever the hot set.

Staleness: a hot row read at time t misses the other nodes' updates since the last sync. A sync reports, per row,
this node's updates u in the window and the others' o; assuming both spread evenly over it, the uses missed o / 2
updates each on average: u * o / 2 is added to the staleness sum (`take_stale`).

The interval that keeps it there: the missed updates grow with the interval and with how fast the other nodes train
(their trainers, their cores), so a fixed interval gives 2 updates per use on a slow machine and 20 on a fast one
(BENCHMARKS.md). With a bound B, every sync also all-reduces the previous sync's staleness sum and uses, and every
node sets the next interval from that same global mean s: interval x sqrt(B / s), between `MIN_INTERVAL` and the
configured interval (the longest). The same inputs on every node give the same interval everywhere; the all-reduce
keeps the nodes in step anyway (a node that syncs sooner waits in it for the others).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from cocosync.runtime.comm.native import one_shot as native_module
from cocosync.shadowsync.model.shard import Shard
from cocosync.shadowsync.thread_cpu import in_role

__all__ = ["HotRows", "HotSync", "choose_hot_rows", "pack_changes", "merge_changes", "HOT_SAMPLE_ROWS"]

#: training rows read to choose the hot set
HOT_SAMPLE_ROWS = 65536
#: the shortest interval a staleness bound may set (seconds): a sync costs ~0.6 ms of one thread's CPU on 2 nodes
MIN_INTERVAL = 0.002


def choose_hot_rows(sparse: torch.Tensor, offsets: torch.Tensor, k: int, *, min_count: int = 2) -> torch.Tensor:
    """The global rows (sorted) of the `k` ids seen most often in `sparse` [rows, tables] (at least `min_count`
    times; ties by row): a deterministic function of the sample."""
    if k <= 0 or sparse.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    rows, counts = torch.unique((sparse.to(torch.int64) + offsets).reshape(-1), return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)[:k]  # rows ascending: ties go to the lower row
    order = order[counts[order] >= min_count]
    return rows[order].sort().values


class HotRows:
    """A node's replica of the hot rows: `ids` (sorted global rows) and a `Shard` of them, slot i holding ids[i]
    (weight, row-wise Adagrad accumulator and versions in the node's shared memory)."""

    def __init__(self, ids: torch.Tensor, shard: Shard):
        self.ids, self.shard = ids.to(torch.int64).contiguous(), shard

    def __len__(self) -> int:
        return self.ids.numel()

    def locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in `rows` of its hot rows, their slots)."""
        if not len(self):
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        slot = torch.searchsorted(self.ids, rows).clamp_(max=len(self) - 1)
        at = (self.ids.index_select(0, slot) == rows).nonzero().view(-1)
        return at, slot.index_select(0, at)

    def owned(self, shards: Mapping[int, Shard], servers: int):
        """(shard, slots, local rows) for each of `shards` (server index -> shard) that owns hot rows."""
        owner = self.ids % servers
        for server, shard in shards.items():
            slots = (owner == server).nonzero().view(-1)
            if slots.numel():
                yield shard, slots, self.ids.index_select(0, slots) // servers

    @torch.no_grad()
    def write_back(self, shards: Mapping[int, Shard], servers: int) -> None:
        """Copy the replica's rows into the owners' shards among `shards` (this node's): after `HotSync.settle`."""
        rep = self.shard
        for shard, slots, local in self.owned(shards, servers):
            shard.weight[local] = rep.weight.index_select(0, slots)
            shard.accumulator[local] = rep.accumulator.index_select(0, slots)
            shard.versions[local] = rep.versions.index_select(0, slots)


def pack_changes(weight: torch.Tensor, acc: torch.Tensor, versions: torch.Tensor, base_w: torch.Tensor,
                 base_acc: torch.Tensor, base_v: torch.Tensor, out: torch.Tensor, *, native: Any = None) -> None:
    """Write what the replica (weight [H, dim], acc [H], versions [H]) changed since the consensus (base_*) into
    `out`: [weight deltas (H x dim) | accumulator deltas (H) | update counts (H)]. `native`: the C++ module (one pass,
    the same bits), else this torch path, its reference."""
    if native is not None:
        return native.pack_changes(weight, acc, versions, base_w, base_acc, base_v, out)
    H, dim = weight.shape
    torch.sub(weight, base_w, out=out[:H * dim].view(H, dim))
    torch.sub(acc, base_acc, out=out[H * dim:H * dim + H])
    out[H * dim + H:H * (dim + 2)].copy_(versions - base_v)


def merge_changes(weight: torch.Tensor, acc: torch.Tensor, versions: torch.Tensor, base_w: torch.Tensor,
                  base_acc: torch.Tensor, base_v: torch.Tensor, total: torch.Tensor, mine: torch.Tensor, *,
                  native: Any = None) -> float:
    """After the all-reduce: add the other nodes' changes (total - mine) to the replica and the sum of every node's
    to the consensus; returns the staleness estimate sum(mine's counts x the others') / 2 (module doc)."""
    if native is not None:
        return native.merge_changes(weight, acc, versions, base_w, base_acc, base_v, total, mine)
    H, dim = weight.shape
    n = H * dim
    others = total[:H * (dim + 2)] - mine[:H * (dim + 2)]
    weight.add_(others[:n].view(H, dim))
    base_w.add_(total[:n].view(H, dim))
    acc.add_(others[n:n + H])
    base_acc.add_(total[n:n + H])
    counts = others[n + H:]
    versions.add_(counts.round().to(torch.int64))
    base_v.add_(total[n + H:n + 2 * H].round().to(torch.int64))
    return float((mine[n + H:n + 2 * H].double() * counts.double()).sum()) / 2


def next_interval(interval: float, staleness: float, bound: float, longest: float) -> float:
    """The next sync's interval from the last one's and the staleness per use it gave: the missed updates grow with
    the interval, so scale it by sqrt(bound / staleness) (half the correction a sync: the measure is noisy), between
    MIN_INTERVAL and `longest`."""
    factor = (bound / staleness) ** 0.5 if staleness > 0 else 2.0
    return min(longest, max(MIN_INTERVAL, interval * factor))


class HotSync:
    """The node's thread that synchronizes its `HotRows` replica with the other nodes' (one per node; `group`: gloo,
    one process per node), every `interval` seconds. `fill` first (collective), then `start`; `settle` and `close`
    are collective too. `native`: pack and merge in C++ (runtime/comm/native, when built), else in torch."""

    def __init__(self, hot: HotRows, group: Any, *, interval: float, staleness: float = 0.0,
                 label: str = "the other nodes", native: bool = True):
        """`interval`: seconds between two syncs, the longest with a `staleness` bound (> 0: the hot rows' missed
        updates per use the interval aims at, module doc)."""
        self.hot, self.group, self.label = hot, group, label
        self.longest, self.bound = float(interval), float(staleness)
        self.interval = self.longest  # the next sync's (the same on every node)
        self.native = native_module() if native else None
        self.n = group.size()
        H, dim = len(hot), hot.shard.weight.shape[1]
        self.H, self.dim = H, dim
        # pack_changes' layout, then 2 flags (settle, close) and the previous sync's staleness sum and uses
        self._buf = torch.zeros(H * (dim + 2) + 4, dtype=torch.float32)
        self._mine = torch.zeros(H * (dim + 2))
        self._base_w, self._base_acc = torch.zeros(H, dim), torch.zeros(H)  # the consensus at the last sync
        self._base_v = torch.zeros(H, dtype=torch.int64)
        self.syncs, self.cpu_s, self.bytes_sent = 0, 0.0, 0
        self.interval_sum = 0.0  # the intervals set, summed over the syncs (their mean: interval_sum / syncs)
        self.longest_gap = 0.0  # seconds: the longest time between two syncs' ends (a stalled node shows here)
        self._ended: float | None = None
        self._stale = 0.0
        self._last = (0.0, 0.0)  # this node's staleness sum and hot-row uses at its last sync
        self._lock = threading.Condition()
        self._want = 0  # 1: settle requested; 2: close requested
        self._settled = 0  # syncs every node asked to settle
        self._error: BaseException | None = None
        self._abandoned = False  # the other nodes are lost: this replica is the only one (`abandon`)
        self._generation = 0  # the group's (`regroup`): a thread of an earlier group leaves no trace when it ends
        self._thread = threading.Thread(target=in_role("hot-sync", self._run), args=(0,), name="cocosync-hot-rows",
                                        daemon=True)

    @torch.no_grad()
    def fill(self, shards: Mapping[int, Shard], servers: int) -> None:
        """Collective: every node's replica (and the consensus) from the owners' shards, each node its own rows."""
        rep = self.hot.shard
        w, acc, ver = torch.zeros_like(rep.weight), torch.zeros_like(rep.accumulator), torch.zeros_like(rep.versions)
        for shard, slots, local in self.hot.owned(shards, servers):
            w[slots] = shard.weight.index_select(0, local)
            acc[slots] = shard.accumulator.index_select(0, local)
            ver[slots] = shard.versions.index_select(0, local)
        for t in (w, acc, ver):
            self.group.allreduce([t]).wait()
        for dst, src in ((rep.weight, w), (rep.accumulator, acc), (rep.versions, ver), (self._base_w, w),
                         (self._base_acc, acc), (self._base_v, ver)):
            dst.copy_(src)

    def start(self) -> None:
        self._thread.start()

    def take_stale(self) -> int:
        """The estimated staleness of the hot rows' uses (module doc), summed since the last call."""
        with self._lock:
            stale, self._stale = self._stale, 0.0
            return round(stale)

    def abandon(self) -> None:
        """The other nodes are lost: stop syncing (a sync under way fails on its dead peers), and this replica, the
        only one left, is the hot rows' truth; `settle` does nothing from now on."""
        with self._lock:
            self._abandoned = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def regroup(self, group: Any, label: str, *, joined: bool = False, root: int = 0) -> None:
        """Another node was lost and more than one is left: sync from now on with `group` (the first trainer of each
        node left, a gloo group made through the job's store). The replica and the consensus it last synced stay:
        every node left took the same syncs (the one that failed took no one's changes), so the changes made since
        are sent at the next sync. The old group's thread is not waited for: its sync may wait for a peer that left
        it until the group's timeout; it then ends, touching nothing (its buffers are its own).

        `joined`: a node joins (`group` holds it too, member `root` one of this group's): before the first sync,
        member `root` hands the joining nodes the consensus (`take`); a replica given up with `abandon` syncs
        again."""
        with self._lock:
            self._generation += 1
            self.group, self.n, self.label, self._error = group, group.size(), label, None
            self._buf, self._mine = torch.zeros_like(self._buf), torch.zeros_like(self._mine)
            self._thread = threading.Thread(target=in_role("hot-sync", self._run), args=(self._generation,),
                                            name="cocosync-hot-rows", daemon=True)
            if joined:
                self._abandoned = False
        if joined:
            self._broadcast_consensus(root)
        self._thread.start()

    @torch.no_grad()
    def take(self, root: int = 0, *, keep_replica: bool = False) -> None:
        """On a joining node (collective with the members' `regroup(..., joined=True, root=root)`): this replica and
        its consensus become member `root`'s consensus; the members' changes since come with the first sync. Then
        `start`. `keep_replica`: the node's replica stays as it is (a node whose syncing trainer was lost: its
        replica is the consensus of the last sync plus this node's updates since, sent at the next sync)."""
        self._broadcast_consensus(root)
        if keep_replica:
            return
        rep = self.hot.shard
        for dst, src in ((rep.weight, self._base_w), (rep.accumulator, self._base_acc), (rep.versions, self._base_v)):
            dst.copy_(src)

    def _broadcast_consensus(self, root: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        for t in (self._base_w, self._base_acc, self._base_v):
            self.group.broadcast([t], opts).wait()

    def settle(self, *, close: bool = False) -> None:
        """Collective over the nodes, with every trainer's workers paused: returns once a sync has taken every
        node's updates, so every replica is the consensus (then `HotRows.write_back`). `close`: and stop."""
        with self._lock:
            if self._abandoned or (not self._thread.is_alive() and self._error is None):
                return
            target = self._settled + 1
            self._want = 2 if close else 1
            self._lock.notify_all()
            while self._settled < target and self._error is None:
                self._lock.wait(1.0)
        if close:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the hot rows' sync with {self.label} broke: {self._error}") from None

    def close(self) -> None:
        """The final settle; the thread stops."""
        self.settle(close=True)

    def _run(self, generation: int) -> None:
        deadline = time.monotonic()
        try:
            while True:
                deadline = max(deadline + self.interval, time.monotonic())
                with self._lock:
                    while not self._want and not self._abandoned and (left := deadline - time.monotonic()) > 0:
                        self._lock.wait(left)
                    if self._abandoned or generation != self._generation:
                        return
                    want, group, buf, mine = self._want, self.group, self._buf, self._mine
                if self._sync(want, group, buf, mine):
                    return
        except BaseException as e:  # noqa: BLE001 - a waiting settle gets the reason
            with self._lock:
                if generation == self._generation:  # (an earlier group's failure: regroup replaced it)
                    self._error = e
                self._lock.notify_all()

    @torch.no_grad()
    def _sync(self, want: int, group: Any, buf: torch.Tensor, mine: torch.Tensor) -> bool:
        """One sync over `group`, in this thread's buffers; True once every node asked to close."""
        cpu0 = time.thread_time()
        rep, n = self.hot.shard, group.size()
        state = (rep.weight, rep.accumulator, rep.versions, self._base_w, self._base_acc, self._base_v)
        pack_changes(*state, buf, native=self.native)
        mine.copy_(buf[:-4])
        buf[-4:] = torch.tensor([float(want >= 1), float(want == 2), *self._last])
        group.allreduce([buf]).wait()  # (the group's own call: it may be made through the job's store)
        settles, closes, stale_sum, uses = buf[-4:].tolist()
        everyone_settles, everyone_closes = int(settles) == n, int(closes) == n
        stale = merge_changes(*state, buf, mine, native=self.native)
        H, dim = self.H, self.dim
        self._last = (stale, float(mine[H * (dim + 1):].sum()))
        now = time.monotonic()
        with self._lock:
            if self._ended is not None and not want:  # a settle's sync follows a pause: not a stall
                self.longest_gap = max(self.longest_gap, now - self._ended)
            self._ended = now
            self._stale += stale
            self.syncs += 1
            self.interval_sum += self.interval
            if self.bound > 0 and uses > 0:
                self.interval = next_interval(self.interval, stale_sum / uses, self.bound, self.longest)
            self.bytes_sent += 2 * (n - 1) * buf.numel() * 4 // n  # a ring all-reduce's share per node
            self.cpu_s += time.thread_time() - cpu0
            if everyone_settles:
                self._settled += 1
                self._want = 0
            self._lock.notify_all()
        return everyone_closes
