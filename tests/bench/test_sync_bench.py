"""`cocosync bench sync`: one sync round of each algorithm, ours against the code it replaces."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_sync_times_every_algorithm_against_its_baseline(tmp_path):
    path = tmp_path / "sync.json"
    res = CliRunner().invoke(main, ["bench", "sync", "--params", "1000", "--repeats", "3", "--json", str(path)])
    assert res.exit_code == 0, res.output
    rows = json.loads(path.read_text())["rows"]
    assert {r["algorithm"] for r in rows} >= {"ma", "bmuf", "easgd"}
    assert all(r["params"] == 1000 and r["ours_s"] > 0 and r["baseline_s"] > 0 for r in rows)
