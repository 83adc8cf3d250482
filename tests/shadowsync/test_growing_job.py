"""A job of a range of machines (`cocosync train --nnodes MIN:MAX`): it starts once MIN have met, laid out for MAX; the
machines there hold the others' shards and read their rows, unless a machine started later joins in the place of
one (node_join.py), takes the dense model from a trainer in the job and reads that place's rows (as many as the
trainers there have left of theirs; the rest is shared out over every trainer at the end)."""

from __future__ import annotations

import datetime
import json
import os
import queue
import signal
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from cocosync.runtime.comm.shm import leftover_segments
from cocosync.shadowsync.job.membership import EPOCH
from cocosync.testing.launch import free_port
from cocosync.testing.multinode import (
    check_node_1_joined,
    kill_machine,
    machines_ended,
    semaphores,
    start_nodes,
    twohosts_available,
    until_trained,
    wait_nodes,
)
from cocosync.testing.sockets import process_tree


def _first_word(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """What a machine's command says first about the running job: its lines up to the one saying that it joins (the
    rest of its output stays in its pipe for `wait_nodes`), or all it said before it exited (refused: click's
    `Error: ...`). An AssertionError with what it said if it does neither within `timeout` s (it went to the
    rendezvous: killed)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
            if "this machine joins as" in line:
                return
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    said, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        said += line
        if not line or "this machine joins as" in line:
            return said
    kill_machine(proc.pid)
    raise AssertionError(f"the machine neither joined nor was refused within {timeout:g} s: {said[-2000:]}")


def _job(out, examples: int, sync: str = "shadow-ma") -> list[str]:
    """The job's command line (after `cocosync train`'s own options): `examples` examples, `sync`, into `out`."""
    return ["-m", "cocosync.shadowsync", "--examples", str(examples), "--eval-examples", "4000", "--sync", sync,
            "--out", str(out)]


def _told(runs: list) -> str:
    """What each machine said of the job (its lines but the progress lines, the first of an error's traceback
    first), for an assertion's message."""
    out = []
    for r in runs:
        lines = [x for x in r.output.splitlines() if " examples/s" not in x and not x.startswith("  ")]
        out.append(f"--- node {r.node} (status {r.returncode}) ---\n" + "\n".join(lines)[-3000:])
    return "\n".join(out)


def test_a_job_of_two_machines_started_with_one_reads_every_row_there(tmp_path):
    """`--nnodes 1:2` with node 0 alone: the rendezvous closes soon after it came; node 1's shard is made on node 0 from
    its initial rows, node 0's trainers read their own rows and then node 1's, and the job ends with its summary and
    a checkpoint whole, the absent machine named."""
    out = tmp_path / "run"
    examples = 200_000
    args = _job(out, examples, "shadow-bmuf")
    started = time.monotonic()
    procs = start_nodes(args, nnodes="1:2", nproc_per_node=3, only=[0])
    [node0] = wait_nodes(procs, timeout=150)
    assert node0.returncode == 0, node0.output[-5000:]
    assert time.monotonic() - started < 120
    assert "waiting for the 1 to 2 machines of the job" in node0.output, node0.output[-3000:]
    assert "node 1 has not joined: its trainers 2, 3 wait for a machine started with the same command and " \
        "--node-rank 1" in node0.output, node0.output[-3000:]
    assert "embedding server 1's shard (node 1's) held on node 0 until a machine joins" in node0.output
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and not s["stopped"]
    assert s["trainers_left"] == 2 and s["takeover_rows"] == examples // 2  # (node 1's rows, read on node 0)
    [lost] = s["lost_nodes"]
    assert lost["node"] == 1 and lost["awaited"] and [r["source"] for r in lost["restored"]] == ["initial rows"]
    assert s["joined_nodes"] == [] and s["membership"] == [{"time": s["membership"][0]["time"], "trainers": 2,
                                                           "awaited": [1]}]
    assert s["eval_ne"] < 0.9, s["eval_ne"]
    meta = json.loads((out / "checkpoints" / f"seen-{examples}" / "meta.json").read_text())
    assert meta["examples_seen"] == examples and meta["embedding_servers"] == 2
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_machine_started_after_the_job_joins_it_and_reads_its_places_rows(tmp_path):
    """`--nnodes 1:2`: node 0 starts alone and trains; node 1's command, started once the job has trained 200,000
    examples, joins the running job (no rendezvous, no restart of node 0's ranks): its trainers take the dense model
    from node 0's, read node 1's rows from their start, and train within 10 s of the command's start. The job ends
    with every example read once and the join in the summary. On two simulated machines where twohosts.sh works,
    else on loopback."""
    two_hosts = twohosts_available()
    out = tmp_path / "run"
    examples = 4_000_000  # (node 0 must still read its own rows when the machine joins: joins close after that)
    args = _job(out, examples, "shadow-bmuf")
    port = free_port()
    before = semaphores()
    procs = start_nodes(args, nnodes="1:2", nproc_per_node=3, two_hosts=two_hosts, port=port, only=[0])
    with machines_ended(procs, before):
        until_trained(procs, out, 200_000)
        started = time.time()
        procs += start_nodes(args, nnodes="1:2", nproc_per_node=3, two_hosts=two_hosts, port=port, only=[1])
        runs = wait_nodes(procs, timeout=200)
    node0, node1 = runs
    text = node0.output[-3000:] + "\n--- next node ---\n" + node1.output[-3000:]
    assert node0.returncode == 0 and node1.returncode == 0, text
    assert "has not joined: this machine joins as node 1 with trainers 2, 3" in node1.output, text
    assert "a machine (host " in node0.output and "joins the job as node 1 with trainers 2, 3" in node0.output, text
    assert "trainers 2, 3 joined as node 1" in node0.output, text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and not s["stopped"]
    # the joining trainers read node 1's rows up to about what node 0's had left of theirs; the rest is shared out over
    # the four at the first agreement (none idle at the end)
    assert s["trainers_left"] == 4 and 0 < s["takeover_rows"] < examples // 2
    assert [m["trainers"] for m in s["membership"]] == [2, 3, 4] and s["membership"][0]["awaited"] == [1]
    check_node_1_joined(s, started)  # (its trainers train within 10 s of the command's start)
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []


@pytest.mark.faults
def test_machines_started_one_after_another_join_a_job_of_three_that_started_with_one(tmp_path):
    """`--nnodes 1:3`: node 0 starts alone; node 1's command joins once the job has trained 100,000 examples, node 2's
    once node 1's trainers have joined (a command started while another machine joins is refused, saying so: it is
    started again). Every trainer of the layout reads its own rows, every example is read once, and the joins are in
    the summary in order."""
    out = tmp_path / "run"
    examples = 6_000_000
    args = _job(out, examples)
    port = free_port()
    before = semaphores()
    procs = start_nodes(args, nnodes="1:3", nproc_per_node=3, port=port, only=[0])
    refused = []
    with machines_ended(procs, before):
        until_trained(procs, out, 100_000)
        procs += start_nodes(args, nnodes="1:3", nproc_per_node=3, port=port, only=[1])
        said = _first_word(procs[-1])  # (node 1 claims its place first: a command claims the first place free)
        assert "this machine joins as node 1" in said, said
        for _ in range(20):  # node 2: refused while node 1 joins, then joins
            again = start_nodes(args, nnodes="1:3", nproc_per_node=3, port=port, only=[2])[0]
            said = _first_word(again)
            if "this machine joins as node 2" in said:
                procs.append(again)
                break
            refused.append(said)
            time.sleep(1.0)
        runs = wait_nodes(procs, timeout=240)
    text = _told(runs)
    assert len(runs) == 3 and all(r.returncode == 0 for r in runs), text
    assert all("another machine is joining it now" in x for x in refused), refused
    assert "trainers 2, 3 joined as node 1" in runs[0].output and "trainers 4, 5 joined as node 2" in runs[0].output
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and s["trainers_left"] == 6 and s["takeover_rows"] > 0
    assert [(j["node"], j["seq"]) for j in s["joined_nodes"]] == [(1, 1), (2, 2)]
    assert [m["trainers"] for m in s["membership"]] == [2, 3, 4, 5, 6]
    assert sorted(r["trainer"] for r in s["restarts"]) == [2, 3, 4, 5]
    assert all(r["read_own_rows"] and r["examples"] > 0 for r in s["restarts"]), s["restarts"]
    assert s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_claim_that_comes_as_the_trainers_finish_their_own_rows_gives_its_join_up(tmp_path):
    """`--nnodes 1:2`: node 1's command claims its place and is held there (SIGSTOP, with what it started) until node
    0's trainers have read their own rows (a claim holds their agreement for its trainers' joins). Let go, its trainers
    find that no machine took them in while the trainers still read their own rows: they give the join up, node 0
    reads node 1's rows and ends the job whole, and node 1's command ends saying why its trainers did not join."""
    out = tmp_path / "run"
    examples = 6_000_000  # (node 0's trainers read their own 3M while node 1's command starts and claims its place)
    args = _job(out, examples)
    port = free_port()
    before = semaphores()
    procs = start_nodes(args, nnodes="1:2", nproc_per_node=3, port=port, only=[0])
    with machines_ended(procs, before):
        until_trained(procs, out, 100_000)
        store = dist.PrefixStore("cocosync/", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                             timeout=datetime.timedelta(seconds=10)))
        procs += start_nodes(args, nnodes="1:2", nproc_per_node=3, port=port, only=[1])
        deadline = time.monotonic() + 60
        while not store.check(["node-join/1"]):  # held as soon as it claimed, before its trainers record their joins
            if procs[-1].poll() is not None:
                raise AssertionError(f"node 1 ended before it claimed its place: {procs[-1].stdout.read()[-2500:]}")
            assert time.monotonic() < deadline, "node 1 did not claim its place within 60 s"
        os.kill(procs[-1].pid, signal.SIGSTOP)  # (first: a launcher held starts no more trainers)
        for pid in process_tree(procs[-1].pid):
            os.kill(pid, signal.SIGSTOP)
        changes = [json.loads(store.get(f"change/{k}")) for k in range(1, int(store.add(EPOCH, 0)) + 1)
                   if store.check([f"change/{k}"])]
        assert not [x for x in changes if x["kind"] == "joined"], f"node 1's trainers joined before the hold: {changes}"
        deadline = time.monotonic() + 150
        while not store.check(["agree/phase1/any"]):  # node 0's trainers have read their own rows
            assert time.monotonic() < deadline and procs[0].poll() is None, "node 0 did not finish its own rows"
            time.sleep(0.1)
        for pid in [*process_tree(procs[-1].pid), procs[-1].pid]:
            os.kill(pid, signal.SIGCONT)
        runs = wait_nodes(procs, timeout=240)
    text = _told(runs)
    assert all(r.returncode == 0 for r in runs), text
    assert "this machine joins as node 1" in runs[1].output, runs[1].output[-2500:]
    assert "did not join: the trainers in the job had read their own rows" in runs[1].output, runs[1].output[-2500:]
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and s["trainers_left"] == 2, s
    assert s["joined_nodes"] == [] and [x["node"] for x in s["lost_nodes"]] == [1]
    assert s["membership"][-1]["trainers"] == 2 and s["eval_ne"] < 0.8, s["eval_ne"]
    assert leftover_segments() == []


@pytest.mark.faults
def test_a_machine_joins_a_job_of_three_that_started_with_two(tmp_path):
    """`--nnodes 2:3`: nodes 0 and 1 start (the rendezvous closes soon after they met), node 2's command joins once
    the job has trained 100,000 examples: both machines of the start take it in (their exchange, hot rows and dense
    sync re-formed with it at the same round), and every example is read once."""
    out = tmp_path / "run"
    examples = 3_000_000
    args = _job(out, examples, "shadow-bmuf")
    port = free_port()
    before = semaphores()
    procs = start_nodes(args, nnodes="2:3", nproc_per_node=3, port=port, only=[0, 1])
    with machines_ended(procs, before):
        until_trained(procs, out, 100_000)
        procs += start_nodes(args, nnodes="2:3", nproc_per_node=3, port=port, only=[2])
        said = _first_word(procs[-1])
        assert "this machine joins as node 2" in said, said
        runs = wait_nodes(procs, timeout=240)
    text = _told(runs)
    assert all(r.returncode == 0 for r in runs), text
    assert "trainers 4, 5 joined as node 2" in runs[0].output, text
    s = json.loads((out / "summary.json").read_text())
    assert s["examples"] == examples and s["short_by"] == 0 and s["trainers_left"] == 6
    assert [(j["node"], j["seq"]) for j in s["joined_nodes"]] == [(2, 1)]
    assert [m["trainers"] for m in s["membership"]] == [4, 5, 6] and s["membership"][0]["awaited"] == [2]
    assert all(r["read_own_rows"] and r["examples"] > 0 for r in s["restarts"]), s["restarts"]
    assert leftover_segments() == []
