"""Every machine of a job must run the same job (job/same_job.py): what is compared, and how a difference reads.
End to end (two loopback machines started with other options): test_cluster.py."""

import dataclasses
import json

import pytest

from cocosync.shadowsync.config import ClusterConfig, ConfigError, SyncConfig, TrainConfig
from cocosync.shadowsync.job.same_job import PER_MACHINE, differences, job_options, job_topology


def _options(cfg=None, cluster=None, nproc=3):
    return job_options(cfg or TrainConfig(), cluster or ClusterConfig(), nproc)


def _checkpoint(path, seen=4000, crc="12345"):
    path.mkdir(parents=True)
    meta = {"config": {}, "trainers": 2, "embedding_servers": 1, "examples_seen": seen}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "crc-trainer0.json").write_text(json.dumps({"w": crc}))
    return str(path)


def test_what_each_machine_sets_for_itself_is_not_compared(tmp_path):
    (tmp_path / "a.tsv").write_text("1\t2\n" * 1000)
    (tmp_path / "b.tsv").write_text("1\t2\n" * 1000)  # a copy of the same rows at another path
    cfg = TrainConfig(data=str(tmp_path / "a.tsv"))
    local = TrainConfig(out_dir="/elsewhere", data=str(tmp_path / "b.tsv"), threads=8, timeout=60.0,
                        heartbeat_timeout=9.0, progress=False, log_every=2.0, window=7, plot=False)
    assert {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(local, f.name)} == PER_MACHINE
    assert _options(cfg) == _options(local)
    # the checkpoint to resume may sit at another path on each machine (two mounts: two copies here)
    a, b = _checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b")
    assert _options(cluster=ClusterConfig(resume=a)) == _options(cluster=ClusterConfig(resume=b))


def test_data_files_that_differ_past_their_first_rows_are_named(tmp_path):
    rows = [f"{i % 2}\t{i}\n" for i in range(200_000)]
    (tmp_path / "a.tsv").write_text("".join(rows))
    flipped = rows[:100_000] + [("0" if r[0] == "1" else "1") + r[1:] for r in rows[100_000:]]  # labels flipped
    (tmp_path / "b.tsv").write_text("".join(flipped))
    a = _options(TrainConfig(data=str(tmp_path / "a.tsv")))
    b = _options(TrainConfig(data=str(tmp_path / "b.tsv")))
    (line,) = differences({0: a, 1: b})
    assert line.startswith("data (its contents): '") and " on node 0, '" in line and line.endswith(" on node 1")


def test_a_resume_on_one_machine_only_or_from_another_checkpoint_is_named(tmp_path):
    same = _checkpoint(tmp_path / "same")
    later = _checkpoint(tmp_path / "later", seen=8000, crc="777")
    other = _checkpoint(tmp_path / "other", crc="999")  # another run's, at the same examples
    mine = _options(cluster=ClusterConfig(resume=same))
    for theirs in (_options(), _options(cluster=ClusterConfig(resume=later)),
                   _options(cluster=ClusterConfig(resume=other))):
        (line,) = differences({0: mine, 1: theirs})
        assert line.startswith("resume: 'the checkpoint at 4,000 examples, tensors ") and line.endswith(" on node 1")
    assert "None on node 1" in differences({0: mine, 1: _options()})[0]
    assert "'the checkpoint at 8,000 examples" in differences({0: mine, 1: _options(cluster=ClusterConfig(
        resume=later))})[0]


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
