"""`cocosync bench backend` runs end to end on a tiny configuration and reports both implementations per case."""

import json

from click.testing import CliRunner

from cocosync.cli import main as cli


def test_bench_backend_reports_both_per_case(tmp_path):
    out = tmp_path / "b.json"
    res = CliRunner().invoke(cli, ["bench", "backend", "--sizes", "4K", "--repeats", "2", "--width", "16",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["case"], r["impl"]) for r in rows}
    assert cases == {("all_reduce", "cocosync"), ("all_reduce", "gloo"), ("ddp step", "cocosync"),
                     ("ddp step", "gloo")}
    assert all(r["median_s"] > 0 for r in rows)
    assert "gloo/cocosync" in res.output
