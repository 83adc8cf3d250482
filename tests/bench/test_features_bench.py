"""`cocosync bench features`: the same DLRM on single-valued and list-valued copies of one data set."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_features_trains_both_files_and_relates_them(tmp_path):
    res = CliRunner().invoke(main, ["bench", "features", "--rows", "10000", "--max-values", "5", "--repeats", "1",
                                    "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "features.json").read_text())
    assert set(doc["median"]) == {"single", "list"} and all(v > 0 for v in doc["median"].values())
    assert doc["ratio"] == doc["median"]["list"] / doc["median"]["single"]
    assert "1 list of 1-5" in res.output and ("PASS" in res.output or "FAIL" in res.output)
