"""Every machine of a job must run the same job (job/same_job.py): what is compared, and how a difference reads.
End to end (two loopback machines started with other options): test_cluster.py."""

import dataclasses

import pytest

from cocosync.shadowsync.job.roles import ClusterConfig
from cocosync.shadowsync.job.same_job import PER_MACHINE, differences, job_options, job_topology
from cocosync.shadowsync.train_config import ConfigError, SyncConfig, TrainConfig


def _options(cfg=None, cluster=None, nproc=3):
    return job_options(cfg or TrainConfig(), cluster or ClusterConfig(), nproc)


def test_what_each_machine_sets_for_itself_is_not_compared():
    cfg = TrainConfig()
    local = TrainConfig(out_dir="/elsewhere", data="/mnt/b/train.tsv", threads=8, timeout=60.0, heartbeat_timeout=9.0,
                        progress=False, log_every=2.0, window=7, plot=False)
    assert {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(local, f.name)} == PER_MACHINE
    assert _options(cfg) == _options(local)
    # a checkpoint to resume may sit at another path on each machine; resuming on one machine only is a difference
    assert _options(cluster=ClusterConfig(resume="/a/ckpt")) == _options(cluster=ClusterConfig(resume="/b/ckpt"))
    assert _options(cluster=ClusterConfig(resume="/a/ckpt")) != _options()


@pytest.mark.parametrize(("change", "key"), [
    (dict(cfg=TrainConfig(examples=40_000)), "examples"),
    (dict(cfg=TrainConfig(seed=1)), "seed"),
    (dict(cfg=TrainConfig(sync=SyncConfig(algorithm="shadow-ma"))), "sync.algorithm"),
    (dict(cfg=TrainConfig(model={"table_size": 100})), "model.table_size"),
    (dict(cluster=ClusterConfig(lookup_transport="node-exchange")), "lookup_transport"),
    (dict(cluster=ClusterConfig(checkpoint_every=5000)), "checkpoint_every"),
    (dict(nproc=4), "nproc_per_node"),
])
def test_what_makes_the_job_is_compared_and_named(change, key):
    lines = differences({0: _options(), 1: _options(**change), 2: _options()})
    assert len(lines) == 1 and lines[0].startswith(f"{key}: ")
    assert " on nodes 0, 2, " in lines[0] and lines[0].endswith(" on node 1")


def test_the_same_job_has_no_difference():
    assert differences({0: _options(), 1: _options(), 2: _options()}) == []


def test_another_process_count_on_another_machine_is_named(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="5", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="0").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"must divide world_size=5: every machine .* \(--nproc-per-node 2 on this"):
        job_topology()
