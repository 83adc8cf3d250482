"""`cocosync bench data-split`: both splits read every line once; a shard of the byte split reads its 1/S of the
file, a shard of the line split all of it."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_data_split_reports_each_splits_bytes_and_time(tmp_path):
    out = tmp_path / "d.json"
    res = CliRunner().invoke(main, ["bench", "data-split", "--rows", "3000", "--readers", "3", "--repeats", "1",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    by = {r["split"]: r for r in doc["rows"]}
    assert by["bytes"]["rows"] == by["lines"]["rows"] == 3000
    assert abs(by["bytes"]["amplification"] - 1.0) < 0.01 and abs(by["lines"]["amplification"] - 3.0) < 0.01
    assert doc["speedup"] == by["lines"]["shard_s"] / by["bytes"]["shard_s"] > 0
