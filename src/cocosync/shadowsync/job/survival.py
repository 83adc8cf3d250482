"""What a ShadowSync job goes on without: one rule, from the job's options and shape, which the launchers (what to
refuse, what to watch), the monitor and every rank (what to build, which ranks run under a keeper) read alike."""

from __future__ import annotations

from dataclasses import dataclass

from cocosync.shadowsync.config import ClusterConfig, TrainConfig

__all__ = ["Survival"]


@dataclass(frozen=True)
class Survival:
    """A job's shape and the options that decide what it survives."""

    nnodes: int
    trainers_per_node: int
    sync_method: str
    sync_servers: int  # per machine (EASGD's centre)
    lookup_transport: str
    min_trainers: int
    launched: bool  # by `cocosync train`: its store outlives every rank and records the losses

    @classmethod
    def of(cls, cfg: TrainConfig, cluster: ClusterConfig, nnodes: int, trainers_per_node: int,
           launched: bool) -> "Survival":
        return cls(nnodes, trainers_per_node, cfg.sync.method, cluster.sync_servers_for(cfg.sync.method, nodes=nnodes),
                   cluster.lookup_transport, cfg.min_trainers, launched)

    @property
    def trainers(self) -> int:
        return self.nnodes * self.trainers_per_node

    @property
    def losses(self) -> bool:
        """Whether a one-machine job goes on without a lost trainer or embedding server: launched by `cocosync train`,
        with more trainers than --min-trainers, and a sync that can re-form among the trainers left (not DS-Sync)."""
        return self.launched and self.nnodes == 1 and self.min_trainers < self.trainers and \
            self.sync_method != "dssync"

    @property
    def machine_loss(self) -> bool:
        """Whether a job across machines goes on without a lost machine (any but the one that hosts the job's store):
        launched by `cocosync train --nnodes`, rows between machines through the lookup exchange (the machines left
        restore the lost one's shards and re-form the exchange among them), a dense sync that goes on among the
        trainers left (MA or BMUF re-formed among them; EASGD with its centre's lost ranges adopted by the sync servers
        left), and at least --min-trainers on one machine."""
        dense = (self.sync_method in ("ma", "bmuf") and self.sync_servers == 0) or \
            (self.sync_method == "easgd" and self.sync_servers > 0)
        return self.launched and self.nnodes >= 2 and self.lookup_transport == "exchange" and dense and \
            self.trainers_per_node >= self.min_trainers

    @property
    def trainer_loss(self) -> bool:
        """Whether the job goes on without a lone lost trainer (its trainers run under keepers): on one machine as
        `losses` says; across machines wherever it survives a machine's loss, that machine's other trainers going on,
        one of them serving the lost one's part of the lookup exchange."""
        if self.nnodes == 1:
            return self.losses
        return self.machine_loss and self.min_trainers < self.trainers

    @property
    def restarts(self) -> bool:
        """Whether a lost trainer may be started again (--max-restarts): where the job goes on without it; across
        machines with MA or BMUF (EASGD's centre there is served by RPC, whose world a new process cannot join)."""
        return self.trainer_loss and (self.nnodes == 1 or self.sync_method in ("ma", "bmuf"))

    @property
    def servers_leave_at_end(self) -> bool:
        """Whether the embedding servers of a job that goes on without them take no part in its end: on one machine
        without RPC (EASGD's sync servers are RPC peers of every rank, and RPC's shutdown waits for them). Their shards
        are in the machine's shared memory, where the trainers save them, so a server lost while the job ends is lost
        as at any other time."""
        return self.nnodes == 1 and self.sync_method != "easgd"
