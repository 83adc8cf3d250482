"""`cocosync bench faults`: a one-machine job with a trainer (lost, then started again), then an embedding server,
killed against the same job uninterrupted; a two-machine job with its second machine killed against that job
uninterrupted; and a job of `--nnodes 1:2` started on one machine, the other joining it."""

import json

import pytest
from click.testing import CliRunner

from cocosync.cli import main


@pytest.mark.faults
def test_bench_faults_kills_a_trainer_a_server_and_a_machine_and_compares_with_the_uninterrupted_runs(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--seeds", "1", "--trainers", "4", "--examples", "400000",
                                    "--at", "0.3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "a rank or machine killed at 30% of 400,000 examples, T=4" in res.output
    assert "checkpoint at " in res.output  # (where the lost machine's shard came from)
    found = json.loads((tmp_path / "faults.json").read_text())["by_kill"]
    assert set(found) == {"trainer", "restart", "server", "node"}
    for kind, f in found.items():
        assert f["examples_lost"] == [0], (kind, res.output)  # every row read: a lost trainer's by the others
        assert abs(f["ne_change"][0]) < 0.1, (kind, res.output)  # (the table: each run's eval NE and seconds)
        assert 0 < f["loss_recorded_s"][0] < (10 if kind == "node" else 5), (kind, res.output)
    assert 0 < found["trainer"]["sync_reformed_s"][0] < 10
    assert 0 < found["node"]["sync_reformed_s"][0] < 15


def test_bench_faults_refuses_an_unknown_kind_of_kill(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--kill", "trainer,machine", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "'machine'" in res.output, res.output
    assert "trainer, restart, server, node, rejoin" in res.output, res.output


@pytest.mark.parametrize("args,named", [
    (["--kill", "nodes", "--nodes", "2"], "--nodes"),  # (two machines lost: the job needs a third to go on)
    (["--kill", "nodes", "--nodes", "3", "--at", "0.5", "--second-at", "0.4"], "--second-at"),
])
def test_bench_faults_refuses_two_machines_lost_in_a_job_that_cannot_go_on(tmp_path, args, named):
    res = CliRunner().invoke(main, ["bench", "faults", *args, "--trainers", "6", "--out", str(tmp_path)])
    assert res.exit_code == 2 and named in res.output, res.output
    assert not (tmp_path / "faults.json").exists()


@pytest.mark.faults
def test_bench_faults_grows_a_job_started_on_one_machine_and_compares_with_both_from_the_start(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--kill", "grow", "--seeds", "1", "--trainers", "4",
                                    "--examples", "5000000", "--rejoin-at", "0.1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "node 1 started at 10%" in res.output and "(node 1 joined): every run finished" in res.output, res.output
    f = json.loads((tmp_path / "faults.json").read_text())["by_kill"]["grow"]
    assert f["examples_lost"] == [0] and abs(f["ne_change"][0]) < 0.1, res.output
    assert 0 < f["restart_trains_after_s"][0] < 15, res.output  # (from node 1's command's start)
