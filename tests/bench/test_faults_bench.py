"""`cocosync bench faults`: a one-machine job with a trainer, then an embedding server, killed against the same job
uninterrupted."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_faults_kills_a_trainer_and_a_server_and_compares_with_the_uninterrupted_run(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--seeds", "1", "--trainers", "3", "--examples", "200000",
                                    "--at", "0.2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "a rank killed at 20% of 200,000 examples, T=3" in res.output
    found = json.loads((tmp_path / "faults.json").read_text())["by_kill"]
    assert set(found) == {"trainer", "server"}
    for kind, f in found.items():
        assert f["examples_lost"] == [0], kind  # every row read: a lost trainer's by the others
        assert abs(f["ne_change"][0]) < 0.1, kind
        assert 0 < f["loss_recorded_s"][0] < 5, kind
    assert 0 < found["trainer"]["sync_reformed_s"][0] < 10


def test_bench_faults_refuses_an_unknown_kind_of_kill(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--kill", "trainer,machine", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "'machine'" in res.output and "trainer, server" in res.output, res.output
