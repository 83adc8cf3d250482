"""`cocosync bench job-start`: every case trains its whole budget, warm and cold, and the table relates them."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_job_start_runs_warm_and_cold_jobs_and_relates_them(tmp_path):
    out = tmp_path / "s.json"
    res = CliRunner().invoke(main, ["bench", "job-start", "--examples", "2000", "--trainers", "1", "--repeats", "1",
                                    "--warmup", "0", "--how", "in-process", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    rows = {r["start"]: r for r in doc["rows"]}
    assert set(rows) == {"warm", "cold"} and all(r["how"] == "in-process" for r in doc["rows"])
    for r in rows.values():
        assert 0 < r["training_s"] < r["wall_s"]  # a job's wall time holds its training
        assert r["cpu_s"] is not None and r["cpu_s"] > 0
    assert rows["cold"]["wall_ratio"] == 1.0
    assert rows["warm"]["wall_ratio"] == rows["cold"]["wall_s"] / rows["warm"]["wall_s"]
    assert [len(v) for v in doc["samples"].values()] == [1, 1]
    assert "cold / warm wall time: in-process" in res.output
