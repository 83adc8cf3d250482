"""`cocosync bench shadowsync`: the none run (no sync, no sync gap) and a shadow run, tabled side by side."""

import json

from click.testing import CliRunner

from cocosync.cli import main


def test_bench_shadowsync_tables_a_run_without_sync_next_to_a_shadow_run(tmp_path):
    out = tmp_path / "s.json"
    res = CliRunner().invoke(main, ["bench", "shadowsync", "--examples", "8000", "--eval-examples", "1000",
                                    "--repeats", "1", "--algorithms", "shadow-ma", "--trainers", "2", "--no-matched",
                                    "--out", str(tmp_path / "runs"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "gap -" in res.output  # the none run has no sync gap (formatting it crashed the suite)
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert {"none T=2 nodes=1", "shadow-ma T=2 nodes=1"} <= set(runs)
    assert runs["shadow-ma T=2 nodes=1"]["syncs"] > 0 and runs["none T=2 nodes=1"]["syncs"] == 0
