"""`cocosync bench faults`: a one-machine job with a trainer killed against the same job uninterrupted."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_faults_kills_a_trainer_and_compares_with_the_uninterrupted_run(tmp_path):
    res = CliRunner().invoke(main, ["bench", "faults", "--seeds", "1", "--trainers", "3", "--examples", "200000",
                                    "--at", "0.2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "a trainer killed at 20% of 200,000 examples, T=3" in res.output
    found = json.loads((tmp_path / "faults.json").read_text())
    assert found["examples_lost"] == [0]  # every row read: the lost trainer's by the others
    assert abs(found["ne_change"][0]) < 0.1
    assert 0 < found["loss_recorded_s"][0] < 5 and 0 < found["sync_reformed_s"][0] < 10
