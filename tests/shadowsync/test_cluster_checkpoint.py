"""DCP checkpoints of a multi-machine ShadowSync job: exact resume on the same topology, resharding to another number
of embedding servers, and refusals that name what differs."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cocosync.runtime.comm.shm import leftover_segments
from cocosync.shadowsync.model.shard import RowHash
from cocosync.testing.multinode import run_nodes, start_nodes, wait_nodes, worker_pids

BASE = ["-m", "cocosync.shadowsync", "--examples", "20000", "--eval-examples", "2000", "--prefetch", "0"]


def _run(out: Path, *extra: str, nnodes: int = 1, nproc: int = 2, ok: bool = True):
    runs = run_nodes([*BASE, "--out", str(out), *extra], nnodes=nnodes, nproc_per_node=nproc, timeout=240)
    if ok:
        for r in runs:
            assert r.returncode == 0, f"node {r.node} exited {r.returncode}:\n{r.output[-4000:]}"
    return runs


def _load(ckpt: Path, tmp: Path) -> dict:
    flat = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(flat))
    return torch.load(flat, weights_only=True)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _tables(state: dict, servers: int, total_rows: int) -> torch.Tensor:
    """The logical [rows, dim] table of a checkpoint from its row-hash shards."""
    rh = RowHash(total_rows, servers)
    dim = state["emb.0.weight"].shape[1]
    out = torch.empty(total_rows, dim)
    for s in range(servers):
        out[s + servers * torch.arange(rh.shard_rows(s))] = state[f"emb.{s}.weight"]
    return out


@pytest.mark.faults
def test_a_stopped_and_resumed_run_ends_equal_to_an_uninterrupted_one(tmp_path):
    """One trainer, one worker, no dense sync, no prefetch: the order is fixed, so the state is bit for bit equal,
    and every example is seen once."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _run(whole, "--sync", "none")
    _run(parts, "--sync", "none", "--stop-after", "10000")
    first = _summary(parts)
    assert first["stopped"] and 10000 <= first["examples"] < 20000
    _run(parts, "--sync", "none", "--resume", str(parts))
    second = _summary(parts)
    assert not second["stopped"] and second["resumed_from"] == first["examples"]
    assert first["examples"] + second["examples"] == 20000  # each example once
    a, b = _load(Path(_summary(whole)["checkpoint"]), tmp_path), _load(Path(second["checkpoint"]), tmp_path)
    assert a.keys() == b.keys() and any(k.startswith("emb.") for k in a) and any(k.startswith("trainer.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _summary(whole)["eval_ne"] == second["eval_ne"]


def test_resume_reshards_the_tables_onto_another_number_of_servers(tmp_path):
    """2 nodes x (1 server + 1 trainer), stopped; resumed on 1 node with 1 server + 2 trainers (T stays 2): the
    logical tables are the same rows, now on one server."""
    two = tmp_path / "two"
    _run(two, "--sync", "shadow-bmuf", "--stop-after", "8000", nnodes=2, nproc=2)
    ckpt = Path(_summary(two)["checkpoint"])
    seen = _summary(two)["examples"]
    one = tmp_path / "one"
    _run(one, "--sync", "shadow-bmuf", "--resume", str(ckpt), "--stop-after", "8000", nproc=3)
    assert _summary(one)["examples"] == 0 and _summary(one)["resumed_from"] == seen  # nothing left below 8000
    a, b = _load(ckpt, tmp_path), _load(Path(_summary(one)["checkpoint"]), tmp_path)
    rows = json.loads((ckpt / "meta.json").read_text())["table_rows"]
    assert torch.equal(_tables(a, 2, sum(rows)), _tables(b, 1, sum(rows)))
    for t in range(2):  # (BMUF's state moves: the closing sync rounds apply its block momentum once more)
        assert torch.equal(a[f"trainer.{t}.positions"], b[f"trainer.{t}.positions"])
        assert torch.equal(a[f"trainer.{t}.accumulator"], b[f"trainer.{t}.accumulator"])
        assert f"trainer.{t}.bmuf.delta" in b


def test_resume_on_another_trainer_and_worker_count_reads_every_example_once(tmp_path):
    """2 trainers x 2 workers stopped at 8,000 of 20,000 examples; resumed on 3 trainers x 1 worker (stopped at once:
    the new trainers start from the mean of the old replicas and accumulators); then finished on 1 trainer. The unread
    rows of the old reader shards are planned onto the new ones (data_plan.py), and the plan is planned again from,
    so the runs read the budget once."""
    out = tmp_path / "run"
    _run(out, "--sync", "none", "--workers", "2", "--stop-after", "8000", nproc=3)
    first = _summary(out)
    assert first["T"] == 2 and first["stopped"] and 8000 <= first["examples"] < 20000
    runs = _run(out, "--sync", "none", "--workers", "1", "--resume", str(out), "--stop-after", "8000", nproc=4)
    second = _summary(out)
    assert second["T"] == 3 and second["W"] == 1 and second["examples"] == 0
    assert second["resumed_from"] == first["examples"] and second["stopped"]
    assert "resuming 2 x 2 reader shards on 3 x 1" in runs[0].output
    old, new = _load(Path(first["checkpoint"]), tmp_path), _load(Path(second["checkpoint"]), tmp_path)
    for key in ("flat", "accumulator"):
        mean = (old[f"trainer.0.{key}"] + old[f"trainer.1.{key}"]) / 2
        for t in range(3):
            torch.testing.assert_close(new[f"trainer.{t}.{key}"], mean, rtol=0, atol=0)
    plan = json.loads((Path(second["checkpoint"]) / "meta.json").read_text())["data_plan"]
    assert plan["base_shards"] == 4 and len(plan["shards"]) == 3 and plan["examples_before"] == first["examples"]
    assert sum(r for s in plan["shards"] for *_, r in s) == 20000 - first["examples"]
    _run(out, "--sync", "none", "--resume", str(out), nproc=2)
    third = _summary(out)
    assert third["T"] == 1 and not third["stopped"] and third["resumed_from"] == first["examples"]
    assert first["examples"] + third["examples"] == 20000  # each example once
    assert math.isfinite(third["eval_ne"])


def test_resume_refuses_another_budget_or_seed_naming_it(tmp_path):
    """`cocosync train --nnodes` refuses the checkpoint itself, before the rendezvous (a usage error, one line)."""
    out = tmp_path / "run"
    _run(out, "--sync", "none", "--stop-after", "4000")
    runs = _run(tmp_path / "other", "--sync", "none", "--resume", str(out), "--examples", "30000", ok=False)
    assert all(r.returncode == 2 and "Traceback" not in r.output for r in runs), runs[0].output[-3000:]
    assert "it was trained with examples=20000, this job has examples=30000" in runs[0].output
    runs = _run(tmp_path / "other2", "--sync", "none", "--resume", str(out), "--seed", "5", ok=False)
    assert "it was trained with seed=0, this job has seed=5" in runs[0].output
    runs = _run(tmp_path / "other3", "--sync", "none", "--resume", str(tmp_path / "nothing"), ok=False)
    assert "no checkpoint there" in runs[0].output


@pytest.mark.faults
def test_periodic_checkpoints_survive_a_killed_trainer_and_the_job_resumes_from_the_last(tmp_path):
    """2 nodes x (1 server + 1 trainer), Shadow-BMUF, a checkpoint every 20k examples; the trainer of the machine that
    hosts the job's store is killed after the first one (a loss the job cannot go on from: test_lost_machine.py has
    the other machine's): the job stops, `latest` names an intact checkpoint, and resuming from it finishes the
    budget with every example seen once."""
    out = tmp_path / "run"
    args = ["-m", "cocosync.shadowsync", "--examples", "200000", "--eval-examples", "2000", "--sync", "shadow-bmuf",
            "--checkpoint-every", "20000", "--out", str(out)]
    procs = start_nodes(args, nproc_per_node=2)
    latest = out / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 120
        while not latest.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint was written"
            time.sleep(0.05)
        host = worker_pids(procs[0].pid)  # (the first command hosts the store: --node-rank 0)
        os.kill(host[max(host)], signal.SIGKILL)  # its trainer (servers first)
        runs = wait_nodes(procs, timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(r.returncode not in (0, None) for r in runs)
    ckpt = out / "checkpoints" / latest.read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["stopped"] and meta["examples_seen"] >= 20000
    state = _load(ckpt, tmp_path)  # every rank's part is there and readable
    assert {"emb.0.weight", "emb.1.weight", "trainer.0.flat", "trainer.1.bmuf.delta"} <= state.keys()
    resumed = tmp_path / "resumed"
    # prefetched (BASE's prefetch 0 would wait a 40 ms exchange round per batch)
    _run(resumed, "--sync", "shadow-bmuf", "--examples", "200000", "--resume", str(ckpt), "--prefetch", "40", nnodes=2,
         nproc=2)
    s = _summary(resumed)
    assert s["resumed_from"] == meta["examples_seen"] and s["resumed_from"] + s["examples"] == 200000
    assert leftover_segments() == []


def test_a_multi_machine_resume_takes_the_runs_config_repeating_nothing(tmp_path):
    """Two loopback machines stopped part-way; resumed with --resume alone (no --examples, --sync, --out): the run's
    own settings, written into its own directory, as on one machine (it took the defaults and was refused)."""
    out = tmp_path / "run"
    _run(out, "--sync", "none", "--batch-size", "128", "--stop-after", "8000", nnodes=2)
    first = _summary(out)
    runs = run_nodes(["-m", "cocosync.shadowsync", "--resume", str(out)], nnodes=2, nproc_per_node=2, timeout=240)
    for r in runs:
        assert r.returncode == 0, f"node {r.node} exited {r.returncode}:\n{r.output[-4000:]}"
    second = _summary(out)
    assert second["sync"] == "none" and second["resumed_from"] == first["examples"]
    assert first["examples"] + second["examples"] == 20000 and not second["stopped"]
