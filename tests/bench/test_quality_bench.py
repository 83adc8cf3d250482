"""`cocosync bench quality`: real runs at two trainer counts, the table's numbers from the runs' own eval NE, the
target verdict, and the JSON and PNG it writes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cocosync.bench.quality import tolerance
from cocosync.cli import main as cli


def test_quality_bench_relates_each_run_to_one_trainer_of_the_same_seed(tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "2", "--algorithms", "shadow-ma",
                                   "--seeds", "2", "--examples", "20000", "--eval-examples", "2000",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "quality.json").read_text())
    runs = result["runs"]
    assert sorted((r["algorithm"], r["T"], r["seed"]) for r in runs) == sorted(
        [("none", 1, s) for s in (0, 1)] + [("shadow-ma", 2, s) for s in (0, 1)])
    ref = {r["seed"]: r["eval_ne"] for r in runs if r["algorithm"] == "none"}
    for row in result["rows"]:
        mine = [r for r in runs if r["algorithm"] == row["algorithm"] and r["T"] == row["T"]]
        change = sum(r["eval_ne"] / ref[r["seed"]] - 1 for r in mine) / len(mine)
        assert abs(row["change"] - change) < 1e-12
        assert row["pass"] == (change <= tolerance(2))
    assert (out / "quality.png").stat().st_size > 10_000
    assert len((out / "quality-runs.jsonl").read_text().splitlines()) == len(runs)  # written as each run ended
    assert "| shadow-ma | 2 |" in res.output  # the markdown row for BENCHMARKS.md


def test_quality_bench_names_bad_arguments():
    res = CliRunner().invoke(cli, ["bench", "quality", "--algorithms", "shadow-foo"])
    assert res.exit_code == 2 and "shadow-foo" in res.output
    res = CliRunner().invoke(cli, ["bench", "quality", "--trainers", "2,x"])
    assert res.exit_code == 2 and "2,x" in res.output
