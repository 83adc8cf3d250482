"""A lost machine does not stop a job of two: node 1 of two loopback `cocosync train --nnodes` machines killed whole
(its launcher and every rank, kill -9) while the job trains; node 0 restores its shards, its trainers read the lost
ones' unread rows, and the job ends there with its summary and a checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from cocosync.runtime.comm.shm import SHM_DIR, SHM_PREFIX, create_named, leftover_segments
from cocosync.shadowsync.checkpoint import read_tensors
from cocosync.shadowsync.job.loss_across import remove_restored, restored_segment
from cocosync.testing.multinode import (
    NodeRun,
    check_node_1_joined,
    kill_machine,
    machines_ended,
    remove_semaphores_since,
    semaphores,
    start_nodes,
    twohosts_available,
    until_trained,
    wait_nodes,
)

EXAMPLES = 600_000


@pytest.mark.faults
def test_a_machine_killed_whole_leaves_the_job_to_finish_on_the_other(tmp_path):
    """kill -9 of node 1 (its command and every process under it) at ~40% of the run, as the second periodic
    checkpoint's save begins: node 0's launcher names the loss within seconds and the shard it restored (from the
    first checkpoint, with the rows' age: the one being saved is given up, its directory removed), exits 0, and the
    summary says it all: every example of the budget read (the lost trainers' before the loss, the rest by the
    trainers left), the machine's trainers and server lost, the shard's source, the sync re-formed. The last
    checkpoint holds every shard. On two simulated machines (own network namespace and /dev/shm each: node 0 never
    sees node 1's memory) where twohosts.sh works, else on loopback."""
    two_hosts = twohosts_available()
    out = tmp_path / "run"
    before = semaphores()
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "4000",
                         "--sync", "shadow-bmuf", "--checkpoint-every", "120000", "--out", str(out)],
                        nproc_per_node=3, two_hosts=two_hosts)
    with machines_ended(procs, before):
        deadline = time.monotonic() + 150
        # the second checkpoint's directory is made as its save begins (the ranks of both machines are in its
        # collectives then: the survivors must not wait there for ever)
        while len(list((out / "checkpoints").glob("seen-*"))) < 2:
            assert all(p.poll() is None for p in procs), "an agent exited before the kill"
            assert time.monotonic() < deadline, "the job did not reach its second checkpoint"
            time.sleep(0.005)
        kill_machine(procs[1].pid)
        killed = time.time()
        runs = wait_nodes(procs, timeout=150)
    remove_semaphores_since(before)
    node0 = runs[0]
    assert node0.returncode == 0, node0.output[-5000:]
    assert "node 1 was lost (no word from its launcher for" in node0.output, node0.output[-3000:]
    assert "embedding server 1's shard restored on node 0 from the checkpoint at" in node0.output, node0.output[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == EXAMPLES and s["short_by"] == 0 and not s["stopped"]
    assert s["trainers_left"] == 2 and sorted(x["trainer"] for x in s["lost"]) == [2, 3]
    assert all(x["node"] == 1 for x in s["lost"]) and [x["server"] for x in s["lost_servers"]] == [1]
    assert [(m["trainers"], m.get("node")) for m in s["membership"]] == [(4, None), (3, 1), (2, 1)]
    (node,) = s["lost_nodes"]
    assert node["node"] == 1 and 0 < node["time"] - killed < 15, node
    (shard,) = node["restored"]
    assert shard["server"] == 1 and "seen-" in shard["source"] and 0 < shard["examples"] < EXAMPLES
    assert shard["age_s"] > 0 and shard["rows"] > 0
    # no checkpoint cut short is left: each directory is whole (the one given up was removed)
    for ckpt in (out / "checkpoints").glob("seen-*"):
        assert (ckpt / "meta.json").exists(), sorted(p.name for p in (out / "checkpoints").iterdir())
    assert s["regrouped_at"] is not None and s["regrouped_at"] - killed < 20
    # the marks after the loss are not saved, and node 0's command says so once
    assert s["checkpoints_stopped_at"] in (360_000, 480_000), s["checkpoints_stopped_at"]
    assert node0.output.count("periodic checkpoints (every 120,000 examples) stop at") == 1, node0.output[-3000:]
    assert f"no periodic checkpoint was saved from {s['checkpoints_stopped_at']:,} examples on" in node0.output
    assert s["takeover_rows"] > 0  # the lost trainers' unread rows, read on node 0
    assert s["eval_ne"] < 0.8, s["eval_ne"]  # (it learned: ~0.70 here; quality against an uninterrupted run: bench)
    ckpt = Path(s["checkpoint"])
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["examples_seen"] == EXAMPLES and not meta["stopped"]
    tensors = read_tensors(ckpt)
    assert {"emb.0.weight", "emb.1.weight"} <= tensors.keys()
    assert torch.isfinite(tensors["emb.1.weight"]).all()
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_sync_server_killed_on_the_second_machine_takes_that_machine_out_and_the_job_finishes(tmp_path):
    """kill -9 of node 1's sync server (the OOM killer's way; a rank the job cannot lose alone, unlike a trainer):
    node 1's agent stops its other ranks, and its command, naming the killed rank, exits 1 and leaves the job to node
    0, which goes on as after the machine's loss. With
    --shard-mirror-interval, node 1's shard comes back from its mirror on node 0, a few seconds old. The job syncs
    with EASGD against a centre sharded over a sync server per machine: node 0's sync server adopts the lost range
    (from a trainer's replica), the trainers' exchanges go there, and the last checkpoint holds the whole centre."""
    from cocosync.testing.multinode import worker_pids

    out = tmp_path / "run"
    per_node = 4  # an embedding server, a sync server, 2 trainers
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "2000",
                         "--sync", "shadow-easgd", "--shard-mirror-interval", "200", "--out", str(out)],
                        nproc_per_node=per_node)
    with machines_ended(procs):
        until_trained(procs, out, 0.3 * EXAMPLES)
        ranks = worker_pids(procs[1].pid)
        victim = per_node + 1  # (node 1's ranks: its embedding server, then its sync server, then its trainers)
        os.kill(ranks[victim], signal.SIGKILL)
        runs = wait_nodes(procs, timeout=150)
    text = "\n--- next node ---\n".join(r.output[-3000:] for r in runs)
    assert [r.returncode for r in runs] == [0, 1], text
    assert f"sync server 1 (rank {victim}, node 1) was killed by SIGKILL: this machine leaves the job" in \
        runs[1].output, text
    assert "shard restored on node 0 from its mirror on this machine" in runs[0].output, text
    assert "range 1 of EASGD's centre adopted by sync0 from trainer 0's replica" in runs[0].output, text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == EXAMPLES and [x["node"] for x in s["lost_nodes"]] == [1]
    (shard,) = s["lost_nodes"][0]["restored"]
    assert shard["source"] == "mirror" and 0 < shard["age_s"] < 10, shard
    (centre,) = s["lost_nodes"][0]["centre"]
    assert (centre["range"], centre["server"]) == (1, "sync0"), centre
    assert s["eval_ne"] < 0.8, s["eval_ne"]  # (the final model is the centre: its adopted range trained on)
    tensors = read_tensors(Path(s["checkpoint"]))
    assert {"center.0", "center.1"} <= tensors.keys()
    assert torch.isfinite(tensors["center.1"]).all() and tensors["center.1"].abs().sum() > 0
    assert leftover_segments() == []


@pytest.mark.faults
@pytest.mark.parametrize("sync,nproc,victim,lost,substitute", [
    ("shadow-bmuf", 3, 4, 2, 3),  # node 1's first trainer: its end of the exchange with trainer 0 and its hot rows
    ("shadow-easgd", 4, 7, 3, 2),  # node 1's second trainer (an embedding and a sync server first): its exchange
])
def test_a_trainer_killed_alone_leaves_its_machine_training_and_another_there_serves_its_part_of_the_exchange(
        tmp_path, sync, nproc, victim, lost, substitute):
    """kill -9 of one trainer of node 1 at ~30%: node 1 goes on with its other trainer, which serves the lost one's
    part of the lookup exchange (its machine's end of the exchange with the trainers of its local index), and, for a
    machine's first trainer, takes over the hot rows' sync; no machine is lost and no healthy trainer stops. Both
    launchers name the loss and exit 0; every example of the budget is read once (the lost trainer's unread rows by
    the three left, cut on node 1 from its exact positions). With BMUF the sync re-forms within seconds: a trainer
    waiting in a collective of the old sync across machines for a peer that left it gives up as it sees the loss, not
    at --heartbeat-timeout (30 s); with EASGD each trainer's exchanges with the centre go on."""
    from cocosync.testing.multinode import worker_pids

    out = tmp_path / "run"
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "4000",
                         "--sync", sync, "--out", str(out)], nproc_per_node=nproc)
    with machines_ended(procs):
        until_trained(procs, out, 0.3 * EXAMPLES)
        os.kill(worker_pids(procs[1].pid)[victim], signal.SIGKILL)
        killed = time.time()
        runs = wait_nodes(procs, timeout=150)
    text = "\n--- next node ---\n".join(r.output[-3000:] for r in runs)
    assert [r.returncode for r in runs] == [0, 0], text
    hot = " and syncs node 1's hot rows" if lost == 2 else ""
    for run in runs:
        assert f"trainer {lost} (pid" in run.output and "was lost (killed by SIGKILL)" in run.output, text
        said = f"node 1 goes on: trainer {substitute} serves trainer {lost}'s part of the lookup exchange{hot}\n"
        assert said in run.output, text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == EXAMPLES and s["short_by"] == 0 and not s["stopped"], s["examples"]
    assert s["trainers_left"] == 3
    assert [(x["trainer"], x["node"], x["served_by"]) for x in s["lost"]] == [(lost, None, substitute)]
    assert s["lost_nodes"] == [] and [m["trainers"] for m in s["membership"]] == [4, 3]
    if sync == "shadow-bmuf":  # (the slowest trainer's)
        assert s["regrouped_at"] is not None and 0 < s["regrouped_at"] - killed < 8
    assert s["takeover_rows"] > 0
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_loss_after_a_lone_trainers_stops_the_job_naming_both(tmp_path):
    """A job across machines goes on after its first loss only: trainer 3 killed alone, then trainer 2 (the last of
    node 1): its keeper does not record it, node 1 leaves the job naming it, and the job stops (node 0's trainers,
    whose exchange or sync with node 1 broke again, fail naming it): resume from the last checkpoint."""
    from cocosync.testing.multinode import worker_pids

    out = tmp_path / "run"
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "2000",
                         "--sync", "shadow-bmuf", "--out", str(out)], nproc_per_node=3)
    with machines_ended(procs):
        until_trained(procs, out, 0.2 * EXAMPLES)
        ranks = worker_pids(procs[1].pid)
        os.kill(ranks[5], signal.SIGKILL)
        time.sleep(2.0)
        os.kill(ranks[4], signal.SIGKILL)
        runs = wait_nodes(procs, timeout=150)
    text = "\n--- next node ---\n".join(r.output[-3000:] for r in runs)
    assert [r.returncode for r in runs] == [1, 1], text
    assert "trainer 3 (pid" in runs[0].output and "was lost (killed by SIGKILL)" in runs[0].output, text
    assert "node 1 goes on: trainer 2 serves trainer 3's part of the lookup exchange" in runs[0].output, text
    assert "trainer 2 (rank 4, node 1) was killed by SIGKILL: this machine leaves the job" in runs[1].output, text
    assert re.search(r"trainer\d \(rank \d, node 0\) failed", runs[0].output), text  # (its exchange or sync broke)
    assert not (out / "summary.json").exists()
    assert leftover_segments() == []


def test_the_shard_mirror_interval_is_checked():
    from cocosync.shadowsync.config import ClusterConfig, ConfigError

    for bad in (-0.001, 61.0, True):
        with pytest.raises(ConfigError, match=r"--shard-mirror-interval .* expected milliseconds in \[0, 60000\]"):
            ClusterConfig(shard_mirror_interval=bad)
    assert ClusterConfig(shard_mirror_interval=0.5).shard_mirror_interval == 0.5


@pytest.mark.faults
def test_a_machine_that_falls_silent_is_fenced_when_it_comes_back(tmp_path):
    """Node 1's command stopped (SIGSTOP: a machine that hangs, or a network cut off) past the silence the other
    machine tolerates: node 0 goes on without it; node 1, resumed, finds itself recorded as lost, stops its ranks and
    exits 1 naming why (it never trains beside a job that restored its shards elsewhere)."""
    out = tmp_path / "run"
    examples = 2 * EXAMPLES  # (the loss must be recorded before the trainers agree on the job's end)
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(examples), "--eval-examples", "2000",
                         "--sync", "shadow-bmuf", "--out", str(out)], nproc_per_node=3)
    with machines_ended(procs):
        until_trained(procs, out, 0.2 * examples)
        os.kill(procs[1].pid, signal.SIGSTOP)  # its command only: its ranks go on, unheard
        time.sleep(6)
        os.kill(procs[1].pid, signal.SIGCONT)
        runs = wait_nodes(procs, timeout=150)
    assert runs[0].returncode == 0, runs[0].output[-4000:]
    assert runs[1].returncode == 1, runs[1].output[-4000:]
    assert "this machine was recorded as lost by the machine that hosts the job's store" in runs[1].output
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and [x["node"] for x in s["lost_nodes"]] == [1]
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_machine_started_again_after_its_loss_joins_the_running_job_in_its_place(tmp_path):
    """kill -9 of node 1 early in the run; node 0 records the loss and goes on alone. Node 1's command, started again,
    joins the running job in the lost machine's place (no rendezvous, no restart of node 0's ranks): its trainers take
    the dense model from node 0's (live: no checkpoint read) and the rest of their own rows, and train within 10 s of
    the command's start. The job ends with every example read once, four trainers, and the join in the summary. On
    two simulated machines where twohosts.sh works (the joining machine maps none of node 0's memory), else on
    loopback."""
    from cocosync.testing.launch import free_port

    two_hosts = twohosts_available()
    out = tmp_path / "run"
    examples = 5_000_000  # (node 0 must still read its own rows when the machine joins, after two refused starts)
    args = ["-m", "cocosync.shadowsync", "--examples", str(examples), "--eval-examples", "4000", "--sync",
            "shadow-bmuf", "--out", str(out)]
    port = free_port()
    before = semaphores()
    procs = start_nodes(args, nproc_per_node=3, two_hosts=two_hosts, port=port)
    with machines_ended(procs, before):
        until_trained(procs, out, 200_000)
        # while every machine is in the job, node 1's command started again is refused (a rendezvous would restart
        # every rank of the job)
        extra = start_nodes(args, nproc_per_node=3, two_hosts=two_hosts, port=port, only=[1])[0]
        refused = wait_nodes([extra], timeout=60)[0]
        assert refused.returncode == 2 and "is running and this machine cannot join it: no machine of the job is " \
            "lost" in refused.output, refused.output[-2000:]
        kill_machine(procs[1].pid)
        time.sleep(4.0)  # (node 0 records the loss after 3 s of silence; a start before that is refused: again)
        # a machine started with other options than the job's is refused, naming them
        other = start_nodes([*args, "--seed", "7"], nproc_per_node=3, two_hosts=two_hosts, port=port, only=[1])[0]
        refused = wait_nodes([other], timeout=60)[0]
        assert refused.returncode == 2 and "runs with other options than this machine's" in refused.output and \
            "seed: 0 on node 0, 7 on node 1" in refused.output, refused.output[-2000:]
        for _ in range(10):
            started = time.time()
            again = start_nodes(args, nproc_per_node=3, two_hosts=two_hosts, port=port, only=[1])[0]
            procs.append(again)
            try:
                again.wait(timeout=1.5)
            except subprocess.TimeoutExpired:
                break
            time.sleep(1.0)
        runs = wait_nodes([procs[0], procs[-1]], timeout=200)
    remove_semaphores_since(before)
    node0, node1 = runs
    assert node0.returncode == 0, node0.output[-5000:]
    assert node1.returncode == 0, node1.output[-5000:]
    assert "node 1 of the job at" in node1.output and "this machine joins in its place with trainers 2, 3" in \
        node1.output, node1.output[-3000:]
    assert "joins the job in node 1's place with trainers 2, 3" in node0.output, node0.output[-3000:]
    assert "trainers 2, 3 joined in node 1's place" in node0.output, node0.output[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and not s["stopped"]
    # (the joining trainers read the rest of their own rows up to about what node 0's had left of theirs; what is past
    # that is shared out at the first agreement)
    assert s["trainers_left"] == 4 and s["takeover_rows"] < examples // 2
    assert [m["trainers"] for m in s["membership"]] == [4, 3, 2, 3, 4]
    check_node_1_joined(s, started)  # (its trainers train within 10 s of the command's start)
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_machine_cut_off_from_the_network_during_a_save_is_given_up_and_the_job_finishes(tmp_path):
    """Node 1's network link cut (two simulated machines: nothing resets node 0's connections to it, they fall
    silent) as the second periodic checkpoint's save begins: node 0 records it lost after its launcher's silence, its
    ranks give the save up after its bound (`save_timeout`: --heartbeat-timeout, 10 s here, plus the time to write
    the tables slowly), not the job's group timeout, then their collectives with it, and finish the job."""
    import subprocess

    from cocosync.testing.multinode import twohosts_script

    if not twohosts_available():
        pytest.skip("twohosts.sh check failed (needs root and iproute2): no simulated machines here")
    prefix = os.environ.get("TWOHOSTS_PREFIX", "cc")
    link = ["ip", "-n", f"{prefix}-hostB", "link", "set", f"{prefix}vB"]
    out = tmp_path / "run"
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "2000",
                         "--sync", "shadow-bmuf", "--heartbeat-timeout", "10", "--checkpoint-every", "120000",
                         "--out", str(out)], nproc_per_node=3, two_hosts=True)
    with machines_ended(procs):
        try:
            deadline = time.monotonic() + 150
            while len(list((out / "checkpoints").glob("seen-*"))) < 2:  # (made as the save begins)
                assert all(p.poll() is None for p in procs), "an agent exited before the cut"
                assert time.monotonic() < deadline, "the job did not reach its second checkpoint"
                time.sleep(0.005)
            subprocess.run([*link, "down"], check=True)
            cut = time.time()
            node0 = wait_nodes(procs[:1], timeout=150)[0]
        finally:
            subprocess.run([*link, "up"], check=False)
    assert twohosts_script() is not None
    assert node0.returncode == 0, node0.output[-5000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == EXAMPLES and [x["node"] for x in s["lost_nodes"]] == [1]
    assert s["regrouped_at"] - cut < 10 + 20, s["regrouped_at"] - cut
    for ckpt in (out / "checkpoints").glob("seen-*"):  # (the save given up left no directory cut short)
        assert (ckpt / "meta.json").exists(), sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.faults
def test_two_machines_of_four_lost_at_once_leave_the_other_two_to_finish(tmp_path):
    """kill -9 of nodes 1 and 2 of four loopback machines (an embedding server and a trainer each) at the same moment,
    at ~30%: both losses are recorded before the machines left re-form, the two lost shards are dealt out over them
    (one restored on node 0, one on node 3), the lookup exchange, the hot rows' sync and the dense sync re-form among
    nodes 0 and 3 (through the job's store), each reads the other's restored shard through the new exchange, and both
    end the job (exit 0); the last checkpoint holds every shard."""
    examples = 400_000
    out = tmp_path / "run"
    before = semaphores()
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(examples), "--eval-examples", "4000",
                         "--sync", "shadow-bmuf", "--checkpoint-every", "80000", "--heartbeat-timeout", "10",
                         "--out", str(out)], nnodes=4, nproc_per_node=2)
    with machines_ended(procs, before):
        until_trained(procs, out, 0.3 * examples, poll=0.05)
        kill_machine(procs[1].pid)
        kill_machine(procs[2].pid)
        runs = wait_nodes(procs, timeout=150)
    remove_semaphores_since(before)
    text = "\n--- next node ---\n".join(r.output[-3000:] for r in runs)
    assert runs[0].returncode == 0 and runs[3].returncode == 0, text
    assert "embedding server 1's shard restored on node 0 from the checkpoint at" in runs[0].output, text
    assert "embedding server 2's shard restored on node 3 from the checkpoint at" in runs[0].output, text
    assert "2 trainers go on" in runs[0].output, text
    assert "exit barrier" not in runs[3].output, runs[3].output[-3000:]  # (node 0, which hosts the store, left last)
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and s["trainers_left"] == 2
    assert sorted(x["trainer"] for x in s["lost"]) == [1, 2] and [x["node"] for x in s["lost_nodes"]] == [1, 2]
    restored = sorted((r["server"], r["node"]) for n in s["lost_nodes"] for r in n["restored"])
    assert restored == [(1, 0), (2, 3)], restored
    assert s["regrouped_at"] is not None and s["takeover_rows"] > 0
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    tensors = read_tensors(Path(s["checkpoint"]))
    for server in range(4):
        assert torch.isfinite(tensors[f"emb.{server}.weight"]).all(), server
    assert leftover_segments() == []


@pytest.mark.faults
@pytest.mark.parametrize("sync,second", [("shadow-bmuf", "machine"), ("shadow-bmuf", "trainer"),
                                         ("shadow-easgd", "machine")])
def test_a_machine_lost_after_the_job_went_on_without_another_is_survived_in_turn(tmp_path, sync, second):
    """kill -9 of node 1 of four loopback machines (an embedding server and a trainer each) at ~20%, then at ~50%,
    once the job went on without node 1, of node 2 whole or of its trainer alone (which takes its machine out: its
    launcher says so and exits 1): each loss is handled as the first was. Node 1's shard is restored on node 0; after
    node 2's loss its shard goes to node 3 (holding fewer shards than node 0), the lookup exchange, the hot rows' sync
    and the dense sync re-form among nodes 0 and 3 (with EASGD, node 1's range of the centre is adopted by node 0's
    sync server, then node 2's by node 3's), both end the job (exit 0), every example of the budget is read, and the
    last checkpoint holds every shard."""
    from cocosync.testing.multinode import worker_pids

    examples = 400_000
    out = tmp_path / "run"
    before = semaphores()
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(examples), "--eval-examples", "4000",
                         "--sync", sync, "--checkpoint-every", "60000", "--heartbeat-timeout", "10",
                         "--out", str(out)], nnodes=4, nproc_per_node=2 if sync == "shadow-bmuf" else 3)
    said: list[str] = []  # node 0's output so far (the launcher that hosts the store says each loss)
    reader = threading.Thread(target=lambda: [said.append(line) for line in procs[0].stdout], daemon=True)
    reader.start()
    with machines_ended(procs, before):
        until_trained(procs, out, 0.2 * examples, poll=0.05)
        kill_machine(procs[1].pid)
        deadline = time.monotonic() + 60  # (node 1's loss handled: its shard restored, before node 2 is killed)
        while not any("embedding server 1's shard restored" in line for line in said):
            assert time.monotonic() < deadline and procs[0].poll() is None, "".join(said)[-3000:]
            time.sleep(0.1)
        try:
            until_trained([procs[0], procs[2], procs[3]], out, 0.5 * examples, poll=0.05)
        except AssertionError:  # (an agent ended after node 1's loss: what each said)
            ended = wait_nodes(procs[2:], timeout=5)
            procs[0].wait(timeout=30)
            reader.join(timeout=10)
            raise AssertionError("\n--- next node ---\n".join(
                ["".join(said)] + [f"(exit status {r.returncode}) {r.output[-4000:]}" for r in ended]))
        if second == "machine":
            kill_machine(procs[2].pid)
        else:
            os.kill(worker_pids(procs[2].pid)[5], signal.SIGKILL)
        runs = wait_nodes(procs[1:], timeout=150)
        procs[0].wait(timeout=30)
        reader.join(timeout=10)
    runs.insert(0, NodeRun(0, procs[0].returncode, "".join(said)))
    remove_semaphores_since(before)
    text = "\n--- next node ---\n".join(r.output[-4000:] for r in runs)
    assert runs[0].returncode == 0 and runs[3].returncode == 0, text
    if second == "trainer":
        assert "trainer 2 (rank 5, node 2) was killed by SIGKILL: this machine leaves the job" in runs[2].output, text
        assert runs[2].returncode == 1, text
    assert "embedding server 1's shard restored on node 0 from the checkpoint at" in runs[0].output, text
    assert "embedding server 2's shard restored on node 3 from the checkpoint at" in runs[0].output, text
    assert "node 2 was lost (no word from its launcher for" in runs[0].output, text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and s["trainers_left"] == 2, s
    assert sorted(x["trainer"] for x in s["lost"]) == [1, 2] and [x["node"] for x in s["lost_nodes"]] == [1, 2]
    restored = [[(r["server"], r["node"], r["batch"]) for r in n["restored"]] for n in s["lost_nodes"]]
    assert restored == [[(1, 0, 1)], [(2, 3, 2)]], restored
    assert [(m["trainers"], m.get("node")) for m in s["membership"]] == [(4, None), (3, 1), (2, 2)], s["membership"]
    assert s["takeover_rows"] > 0 and s["eval_ne"] < 0.8, s["eval_ne"]
    if sync == "shadow-easgd":
        adopted = [[(r["range"], r["server"], r["batch"]) for r in n["centre"]] for n in s["lost_nodes"]]
        assert adopted == [[(1, "sync0", 1)], [(2, "sync3", 2)]], adopted
        assert "range 2 of EASGD's centre adopted by sync3 from trainer 0's replica" in runs[0].output, text
    tensors = read_tensors(Path(s["checkpoint"]))
    for server in range(4):
        assert torch.isfinite(tensors[f"emb.{server}.weight"]).all(), server
    assert leftover_segments() == []


def test_the_segments_a_machines_ranks_restored_and_left_named_are_removed_once_they_are_gone(tmp_path):
    """A job that ends while a trainer restores a lost shard leaves its segment named (it is unnamed once every trainer
    of the machine mapped it): the machine's launcher removes those of its ranks that are gone, and no other."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    mine = [restored_segment(s, pid) for s, pid in ((0, gone.pid), (1, gone.pid), (0, os.getpid()))]
    for name in mine:
        create_named(name, 64)
    try:
        removed = remove_restored([gone.pid, os.getpid()])
        assert sorted(Path(p).name for p in removed) == sorted(f"{SHM_PREFIX}{n}" for n in mine[:2])
        assert not any(Path(p).exists() for p in removed)
        assert Path(f"{SHM_DIR}/{SHM_PREFIX}{mine[2]}").exists()  # (a rank still running keeps its segment)
    finally:
        for name in mine:
            Path(f"{SHM_DIR}/{SHM_PREFIX}{name}").unlink(missing_ok=True)


@pytest.mark.faults
@pytest.mark.parametrize("victim,lost,substitute", [
    (5, 3, 2),  # node 1's second trainer: its exchange with trainer 1
    (4, 2, 3),  # node 1's first: its exchange with trainer 0, and its hot rows (trainer 3 keeps syncing them)
])
def test_a_lone_trainer_started_again_takes_its_part_of_the_exchange_back(tmp_path, victim, lost, substitute):
    """--max-restarts 1 across machines: kill -9 of one trainer of node 1 at ~30%; another trainer of node 1 serves
    its part of the lookup exchange meanwhile; its keeper starts it again, and the new process joins the running job:
    a new exchange with the trainers of its local index on the other machine, the dense model from a peer (live: no
    checkpoint read), the rest of its own rows (mapped from its machine's shared memory, as its shards and hot rows).
    No healthy trainer stops; the job ends with four trainers, every example read once, the restart in the summary."""
    from cocosync.testing.multinode import worker_pids

    out = tmp_path / "run"
    before = semaphores()
    procs = start_nodes(["-m", "cocosync.shadowsync", "--examples", str(EXAMPLES), "--eval-examples", "4000",
                         "--sync", "shadow-bmuf", "--max-restarts", "1", "--out", str(out)], nproc_per_node=3)
    with machines_ended(procs, before):
        until_trained(procs, out, 0.3 * EXAMPLES)
        os.kill(worker_pids(procs[1].pid)[victim], signal.SIGKILL)
        killed = time.time()
        runs = wait_nodes(procs, timeout=150)
    remove_semaphores_since(before)
    text = "\n--- next node ---\n".join(r.output[-3000:] for r in runs)
    assert [r.returncode for r in runs] == [0, 0], text
    assert f"node 1 goes on: trainer {substitute} serves trainer {lost}'s part of the lookup exchange" in \
        runs[0].output, text
    assert f"starting trainer {lost} again (restart 1 of 1)" in runs[1].output, text
    assert re.search(rf"trainer {lost} \(pid \d+\) joined again \(restart 1", runs[0].output), text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == EXAMPLES and s["short_by"] == 0 and not s["stopped"], s["examples"]
    assert s["trainers_left"] == 4 and s["lost_nodes"] == []
    assert [(x["trainer"], x["served_by"]) for x in s["lost"]] == [(lost, substitute)]
    assert [m["trainers"] for m in s["membership"]] == [4, 3, 4]
    [r] = s["restarts"]
    assert (r["trainer"], r["node"], r["restart"]) == (lost, 1, 1) and r["examples"] > 0, r
    assert r["joined"] - killed < 15, r["joined"] - killed  # (its start, build and join)
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []
