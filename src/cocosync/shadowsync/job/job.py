"""`Job`: what one rank of a ShadowSync job knows about the whole job once it is set up (job/rank.py builds it
once, collectively, and nobody changes it after): its settings, the roles of the ranks, this node's stores, the
process groups this rank takes part in, and how a resumed job's data is planned."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cocosync.shadowsync.config import ClusterConfig, DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.data.plan import DataPlan
from cocosync.shadowsync.data.sources import base_shard_rows
from cocosync.shadowsync.job.link import Link
from cocosync.shadowsync.job.membership import Membership
from cocosync.shadowsync.job.roles import Roles
from cocosync.shadowsync.job.survival import Survival
from cocosync.shadowsync.model.hot_rows import HotRows
from cocosync.shadowsync.model.node_relay import Mailbox
from cocosync.shadowsync.model.shard import RowHash, Shard
from cocosync.shadowsync.model.sharding import TablePlan
from cocosync.shadowsync.sync.base import HierarchicalGroup
from cocosync.shadowsync.sync.center import CenterShard

__all__ = ["Job", "ExchangeGroups", "ReleasableGroup"]


class ReleasableGroup:
    """A gloo group that this rank can leave while its peers wait in one of its collectives: `release` destroys it
    and drops the last reference to it, which closes its connections, so that a peer waiting for this rank there
    fails at once ("Connection closed by peer"). torch's `destroy_process_group` alone leaves the connections open
    while the group object lives, and abort() does not close them either: the peer would wait for its timeout."""

    def __init__(self, group: dist.ProcessGroup):
        self._group: dist.ProcessGroup | None = group

    @property
    def group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise RuntimeError("this process group was released (a machine of the job was lost)")
        return self._group

    def release(self) -> None:
        """Destroy the group, if not done yet. Call it outside any `except` block that a collective of the group
        raised into (the traceback's frames hold it), or after `traceback.clear_frames` on that traceback."""
        if self._group is not None:
            group, self._group = self._group, None
            dist.destroy_process_group(group)
            del group


@dataclass(frozen=True)
class ExchangeGroups:
    """The lookup exchange's process groups and shared memory on this rank (multi-node, with an exchange)."""

    group: dist.ProcessGroup | None = None
    """the exchange this rank runs: trainer i of every node, or (node-exchange) the nodes' first embedding servers."""
    mailboxes: tuple[Mailbox, ...] = ()
    """node-exchange: one per local trainer, in the node's shared memory."""
    machines: tuple[int, ...] = ()
    """the machines `group` spans, in node order, where they are not every machine of the job (a machine that joined
    in a lost one's place: job/node_join.py)."""
    owners: torch.Tensor | None = None
    """with `machines`: the member of `group` that holds each embedding server's shard."""


@dataclass(frozen=True)
class Job:
    """One rank's view of the job, typed and frozen."""

    cfg: TrainConfig
    cluster: ClusterConfig
    roles: Roles
    data: DataConfig
    model_cfg: ModelConfig
    tables: TablePlan
    """the model's tables as the job stores them (one row space, `tables.width` wide)."""
    rowhash: RowHash
    shards: dict[int, Shard]
    """this node's embedding shards (shared memory), by server index."""
    trainer_group: dist.ProcessGroup
    """gloo group of every trainer (results, commands)."""
    exchange: ExchangeGroups
    hot: HotRows | None
    """the node's replica of the hot rows (multi-node, with the exchange)."""
    hot_group: dist.ProcessGroup | None
    """on a node's first trainer: the first trainer of every node (the replicas' sync)."""
    dense_group: dist.ProcessGroup | HierarchicalGroup | None
    """the trainers' group for MA/BMUF/DS-Sync (HierarchicalGroup for the sync classes across nodes)."""
    center: CenterShard | None
    """a sync server's range of EASGD's centre."""
    init_dense: torch.Tensor
    """the dense parameters every replica (and EASGD's centre) starts from."""
    hosts: tuple[str, ...]
    """each rank's host name (for error messages)."""
    plan: DataPlan | None
    """the reader shards' rows when resumed on another trainer or worker count (data/plan.py)."""
    link: Link | None
    """the line to `cocosync train`'s monitor (launch.py), when it launched this job."""
    resumed_from: int
    """examples the checkpoint resumed from had seen (0: a fresh job)."""
    held_groups: tuple[dist.ProcessGroup, ...]
    """the process groups besides the default one that this rank is a member of (made by build_job)."""
    cross_groups: tuple[dist.ProcessGroup, ...]
    """those of them that a trainer holds with the trainers of other machines alone (its exchange's, its dense sync's
    between machines, the hot rows' sync): of no more use once a machine is lost."""
    membership: Membership | None
    """which trainers are left, where the job goes on without a lost one (one machine, launched by `cocosync
    train`, more trainers than --min-trainers) or without a lost machine (`survival`)."""
    positions: torch.Tensor
    """int64 [T, W]: every trainer's reader positions, in the node's shared memory (each trainer writes its row; a lost
    trainer's row says where it stopped)."""
    share_positions: torch.Tensor
    """int64 [T, 1 + W]: the share of lost trainers' rows each trainer reads (recovery.py): the agreement that gave
    it (0: none yet), then the reader positions in it; in the node's shared memory, as `positions`."""
    mirrors: dict[int, Shard]
    """the other machine's shards mirrored in this node's shared memory, by server index (--shard-mirror-interval;
    empty without)."""
    mirror_stamps: torch.Tensor | None
    """float64 [embedding servers per node], shared: when each mirror here last took a round (time.time())."""
    mirror_group: dist.ProcessGroup | None
    """on an embedding server with mirrors: it and the other machine's server of the same local index."""
    save_group: ReleasableGroup | None
    """every rank of a job across machines: the periodic checkpoints' collectives (None: the default group). A rank
    whose save failed releases it, so that its machine's ranks waiting for it in the save fail too; every rank
    releases it before the job's end."""
    fence_key: str | None = None
    """the store key whose presence tells this machine's trainers that the job went on without them (default:
    `lost-node/<node>`; a machine that joined in a lost one's place has its own)."""

    @property
    def survival(self) -> Survival:
        """What this job goes on without (survival.py)."""
        return Survival.of(self.cfg, self.cluster, self.roles.topo.nnodes, self.roles.trainers_per_node,
                           self.link is not None)

    @property
    def dense_params(self) -> int:
        return self.init_dense.numel()

    @property
    def examples_before(self) -> int:
        """Examples read before the data plan's shards started (0 without a plan)."""
        return self.plan.examples_before if self.plan is not None else 0

    def trainer_rows(self, t: int) -> int:
        """Rows trainer t's W reader shards hold (its share of the budget)."""
        W = self.cfg.workers
        if self.plan is not None:
            return sum(r for s in self.plan.shards[t * W:(t + 1) * W] for _, _, r in s)
        return W * (self.cfg.total_examples // (self.roles.trainers * W))

    def shard_rows(self, t: int) -> list[int]:
        """Rows each of trainer t's W reader shards holds: its reader positions at the end of its data."""
        W = self.cfg.workers
        if self.plan is not None:
            return [sum(r for _, _, r in s) for s in self.plan.shards[t * W:(t + 1) * W]]
        S = self.roles.trainers * W
        return [base_shard_rows(self.cfg, self.data, s, S) for s in range(t * W, (t + 1) * W)]
